"""Overhead of the Ray path (``--workers``) against the in-process path, at equal total threads.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_overhead.py [--model smollm2-135m] [--copies 3] [--repeats 2]

The dataset is generated from the shipped examples (``examples/*.json`` and the lines of
``examples/batch.jsonl``), each conversation ``--copies`` times with a distinct question suffix (so
no two share coalitions), explained with a leave-one-out plan over sentences. Three paths, each with
the machine's CPUs (default 2 threads in all):

- ``in-process``: the model in this process, ``torch.set_num_threads(T)``;
- ``ray 2x1``: two Ray workers with ``T / 2`` threads each (conversations routed whole, one call in
  flight per worker);
- ``ray 1xT``: one Ray worker with ``T`` threads (the Ray path's own cost: serialisation, the
  actor call, the driver's routing).

One local Ray cluster is started once (its start-up time is reported on its own line). The runs are
interleaved over repeats (in-process, ray 2x1, ray 1xT, then again), since the machine is shared.
Each row gives the evaluation wall time (the coalitions: plan, render, model calls, fit) and the
whole run's (model loading included: a Ray run loads the model in each worker, in parallel, while
the driver reads only the tokenizer and configuration), and the ratios to the in-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from coalescence.app.explain import ExplainRun
from coalescence.app.settings import RunSettings

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def dataset(path: Path, copies: int) -> int:
    inputs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(EXAMPLES.glob("*.json"))]
    inputs += [json.loads(line) for line in (EXAMPLES / "batch.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    lines = []
    for k in range(copies):
        for item in inputs:
            item = json.loads(json.dumps(item))
            if "question" in item:  # the RAG form
                item["question"] += f" (case {k})"
            else:
                last_user = max(i for i, m in enumerate(item["messages"]) if m["role"] == "user")
                item["messages"][last_user]["content"] += f" (case {k})"
            lines.append(json.dumps(item))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def one_run(source: Path, model: str, threads: int, workers: int | None) -> tuple[float, float, int, list[float]]:
    import torch

    torch.set_num_threads(threads if workers is None else 1)
    settings = RunSettings(
        model=model,
        unit="sentence",
        method="loo",
        batch_size=4,
        workers=workers,
        threads_per_worker=max(1, threads // workers) if workers else None,
        max_conversations_in_flight=8,
    )
    t0 = time.perf_counter()
    run = ExplainRun(source, settings)
    run.preflight()
    run.load()
    t1 = time.perf_counter()
    try:
        explanations = anyio.run(run.evaluate)
    finally:
        run.close("complete")
    t2 = time.perf_counter()
    values = [float(v) for e in explanations for v in e.values]
    n = sum(e.n_evaluations for e in explanations)
    return t2 - t1, t2 - t0, n, values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads in all (default: the CPUs)")
    ap.add_argument(
        "--paths",
        default="in-process,ray 2x,ray 1x",
        help="comma-separated: in-process (T threads), ray 2x (2 workers x T/2), ray 1x (1 worker x T); "
        "--threads 1 with in-process,ray 1x isolates the Ray path's own cost from threading effects",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's bars
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    t = args.threads
    tmp = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    source = tmp / "data.jsonl"
    n_conv = dataset(source, args.copies)
    src = str(Path(__file__).resolve().parents[1] / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    t0 = time.perf_counter()
    ray.init(num_cpus=t, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter() - t0
    known = {"in-process": ("in-process", None), "ray 2x": (f"ray 2x{max(1, t // 2)}", 2), "ray 1x": (f"ray 1x{t}", 1)}
    paths = [known[p.strip()] for p in args.paths.split(",")]
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in paths}
    reference: list[float] | None = None
    evaluations = 0
    for r in range(args.repeats):
        for name, workers in paths:
            ev, total, evaluations, values = one_run(source, args.model, t, workers)
            if reference is None:
                reference = values
            drift = max((abs(a - b) for a, b in zip(values, reference, strict=True)), default=0.0)
            rows[name].append((ev, total))
            print(f"repeat {r + 1} {name:12s} evaluation {ev:7.2f} s  total {total:7.2f} s  max |value diff| {drift:.2e}", flush=True)
    ray.shutdown()
    first = paths[0][0]  # the ratios are to the first path (in-process by default)
    base_ev = statistics.median(e for e, _ in rows[first])
    base_total = statistics.median(t_ for _, t_ in rows[first])
    print()
    print(f"{n_conv} conversations, {evaluations} model evaluations per run, {args.model}, {t} threads in all; "
          f"Ray cluster start {started:.1f} s (once)")
    print()
    print("| path | evaluation s (each repeat) | median | ratio | total s (median) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name, _ in paths:
        evs = [e for e, _ in rows[name]]
        totals = [t_ for _, t_ in rows[name]]
        med, med_total = statistics.median(evs), statistics.median(totals)
        print(f"| {name} | {', '.join(f'{e:.1f}' for e in evs)} | {med:.1f} | {med / base_ev:.2f} | {med_total:.1f} | {med_total / base_total:.2f} |")


if __name__ == "__main__":
    main()
