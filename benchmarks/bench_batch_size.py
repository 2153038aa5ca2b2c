"""Throughput of teacher-forced scoring by batch size, on the real model and the demo's coalitions.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_batch_size.py [--coalitions 64] [--sizes 1,4,8,16,32]

Scores the same random sample of examples/eiffel.json sentence coalitions (drop policy) at each
batch size, in one process, interleaving repeats so machine noise hits every variant alike, and
prints evaluations/s and the ratio to batch size 1. Also checks that every batch size gives the
same utilities (max abs difference, nats).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.backends.base import ScoreRequest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coalitions", type=int, default=64)
    ap.add_argument("--sizes", default="1,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    backend = load_backend(args.model)
    engine = Engine(backend)
    snap = engine.prepare(load_conversation("examples/eiffel.json"), unit="sentence")
    target = engine.target_tokens(snap).ids
    policy = get_policy("drop")
    rng = np.random.default_rng(0)
    masks = rng.random((args.coalitions, snap.n_players)) < 0.5
    requests = [
        ScoreRequest(prompt_ids=tuple(engine.renderer.coalition_prompt(snap, policy, m)), target_ids=target)
        for m in masks
    ]
    tokens = sum(r.n_tokens for r in requests)
    backend.max_batch_size = sizes[0]
    backend.score(requests[: sizes[0]])  # warm-up
    seconds = {b: 0.0 for b in sizes}
    values: dict[int, np.ndarray] = {}
    for _ in range(args.repeats):
        for b in sizes:
            backend.max_batch_size = b
            t0 = time.perf_counter()
            res = backend.score(requests)
            seconds[b] += time.perf_counter() - t0
            values[b] = np.array([r.utility for r in res])
    base = seconds[sizes[0]]
    print(f"{args.coalitions} coalitions of examples/eiffel.json, {tokens / len(requests):.0f} tokens each on average")
    print(f"{'batch':>5}  {'eval/s':>7}  {'tokens/s':>8}  {'speed vs ' + str(sizes[0]):>11}  {'max |du| nats':>13}")
    for b in sizes:
        rate = args.repeats * len(requests) / seconds[b]
        diff = float(np.abs(values[b] - values[sizes[0]]).max())
        print(f"{b:>5}  {rate:>7.2f}  {rate * tokens / len(requests):>8.0f}  {base / seconds[b]:>11.2f}  {diff:>13.2e}")


if __name__ == "__main__":
    main()
