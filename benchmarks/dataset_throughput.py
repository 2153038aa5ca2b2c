"""Many conversations at once: a dataset run with its conversations in flight together against the
same run one conversation after another (issue 16, part 2).

The dataset: 64 conversations of the shipped example kinds (``examples/*.json`` and the lines of
``examples/batch.jsonl``: plain chat, declared players, RAG documents, tool calls, a multi-turn trip),
made distinct by a session number in the system prompt (the RAG form: in the question), so no two
conversations share a coalition key. Leave-one-out at the default unit (turns, documents or
declared players: 2 to 6 players, so each plan is 4 to 8 coalitions), the default batch size,
SmolLM2-135M-Instruct loaded once for every variant, a fresh archive per run, variants interleaved.
Each variant's values are compared with the one-after-another run's.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/dataset_throughput.py [--conversations 64] [--repeats 2]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/dataset_throughput.py --backend vllm --batch-size 64

With ``--backend vllm`` (``make vllm``) the model runs in vLLM's engine processes, whose busy time
this process cannot see: that column is left empty.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import coalescence
from coalescence.archive import read_rows

ROOT = Path(__file__).resolve().parent.parent


def shipped_inputs() -> list[dict]:
    inputs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "examples").glob("*.json"))]
    inputs += [json.loads(line) for line in (ROOT / "examples" / "batch.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return inputs


def distinct(source: dict, k: int) -> dict:
    """``source`` with a session number the model reads, so each conversation is its own game."""
    item = copy.deepcopy(source)
    if "documents" in item:
        item["question"] = f"{item['question']} (Session {k}.)"
        return item
    messages = item["messages"]
    if messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']} Session {k}."
    else:
        messages.insert(0, {"role": "system", "content": f"Session {k}."})
        for player in item.get("players", []):
            player["message"] += 1
    return item


def dataset(n: int, path: Path) -> Path:
    inputs = shipped_inputs()
    path.write_text("".join(json.dumps(distinct(inputs[k % len(inputs)], k)) + "\n" for k in range(n)), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--in-flight", default="1,8,16", help="comma-separated --max-conversations-in-flight values")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the CLI's")
    parser.add_argument("--backend", default="hf", help="hf (default) or vllm")
    args = parser.parse_args()
    widths = [int(w) for w in args.in_flight.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="coalescence-dataset-"))
    source = dataset(args.conversations, tmp / "data.jsonl")
    options = {} if args.batch_size is None else {"batch_size": args.batch_size}
    explainer = coalescence.Explainer("smollm2-135m", backend=args.backend, **options)
    busy = [0.0]
    model = getattr(explainer.backend, "model", None)
    if model is not None:
        inner = model.forward

        def forward(*a, **k):  # the model's busy time: the share of the wall the forwards take
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t

        model.forward = forward
    explainer.explain(source, method="loo", max_conversations_in_flight=8)  # warm-up (first-call costs)
    times: dict[int, list[float]] = {w: [] for w in widths}
    busy_share: dict[int, list[float]] = {w: [] for w in widths}
    values: dict[int, list[list[float]]] = {}
    calls: dict[int, int] = {}
    for rep in range(args.repeats):
        for w in widths:
            archive = tmp / f"run-{w}-{rep}"
            t0, b0 = time.perf_counter(), busy[0]
            result = explainer.explain(source, method="loo", archive=archive, max_conversations_in_flight=w)
            times[w].append(time.perf_counter() - t0)
            busy_share[w].append((busy[0] - b0) / times[w][-1])
            values[w] = [[float(v) for v in e.estimate.values] for e in result]
            calls[w] = len(set(read_rows(archive)["batch_id"].to_pylist()))
    evaluations = sum(len(v) + 2 for v in values[widths[0]])
    base = statistics.median(times[widths[0]])
    print(
        f"{args.conversations} conversations, leave-one-out, {evaluations} evaluations, backend {args.backend}, "
        f"batch size {explainer.backend_options['batch_size']}"
    )
    print("| in flight | wall s (median) | evaluations/s | model calls | model busy | speed-up | max \\|dv\\| vs 1 (nats) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for w in widths:
        wall = statistics.median(times[w])
        dv = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(values[w], values[widths[0]], strict=True))
        share = f"{statistics.median(busy_share[w]):.0%}" if model is not None else ""
        print(f"| {w} | {wall:.1f} | {evaluations / wall:.2f} | {calls[w]} | {share} | {base / wall:.2f} | {dv:.1e} |")


if __name__ == "__main__":
    main()
