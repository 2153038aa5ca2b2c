#!/usr/bin/env bash
# The demo (exact Shapley, SmolLM2, examples/eiffel.json, sentences) under two source trees, run
# alternately on one machine, one process at a time: before/after comparisons of a change.
#   benchmarks/demo_ab.sh BEFORE_SRC AFTER_SRC [ROUNDS]
# e.g. git worktree add /tmp/base e836cd8 && benchmarks/demo_ab.sh /tmp/base/src src 2
set -euo pipefail
before=$1; after=$2; rounds=${3:-2}
export HF_HUB_OFFLINE=1 TQDM_DISABLE=1
py=${PYTHON:-.venv/bin/python}
printf '| round | side | total s | evaluation s | evaluations/s |\n|---|---|---:|---:|---:|\n'
for round in $(seq "$rounds"); do
  for side in before after; do
    src=$before; [ "$side" = after ] && src=$after
    dir=$(mktemp -d)
    start=$(date +%s.%N)
    PYTHONPATH=$src "$py" -m coalescence explain examples/eiffel.json --model smollm2-135m --unit sentence \
      --method exact --archive "$dir/run" --out "$dir/out.json" --no-progress > "$dir/table.txt" 2>&1
    end=$(date +%s.%N)
    wall=$(grep -o 'wall time = [0-9.]* s' "$dir/table.txt" | grep -o '[0-9.]*')
    rate=$(grep -o '([0-9.]* evaluations/s)' "$dir/table.txt" | grep -o '[0-9.]*')
    printf '| %s | %s | %.1f | %s | %s |\n' "$round" "$side" "$(echo "$end - $start" | bc)" "$wall" "$rate"
    rm -rf "$dir"
  done
done
