#!/usr/bin/env bash
# The demo and a long game on --backend hf --device cuda and (when vLLM's CUDA build imports)
# --backend vllm, one table (benchmarks/gpu.py). Runs the project from source; installs and
# fetches nothing.
#
#   benchmarks/gpu.sh [--gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf] [--games demo,long_design]
#   COALESCENCE_GGUF=PATH benchmarks/gpu.sh
#   benchmarks/gpu.sh --check      # the modules this machine lacks
#
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
# the forcing logits processor is a V1-interface one (vLLM 0.32's V2 model runner refuses it)
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0}
exec timeout 470 "${PYTHON:-python3}" benchmarks/gpu.py "$@"
