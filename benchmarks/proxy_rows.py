"""Proxy rows' cost per row on the CPU, by rows per call (issue 37).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_rows.py [--games long_design] [--rows 128] \\
        [--batch-sizes 16,32,64] [--repeats 2] [--threads 2] [--model smollm2-135m]

The compacted proxy game's rows (``docs/proxy.md``) of one call run side by side on the CPU, each
row's queries reading the shared prefix keys rotated to its own positions inside the prefix-split
attention (``backends/hf/proxy.py``). For each game the first ``--rows`` coalitions of its recorded
pool (``benchmarks/proxy_batching.py``'s rows, tail rule ``after-last-player``) go straight to
``backend.score_proxy`` in calls of each ``--batch-sizes`` size, the shared KV cached before the
clock starts, the sizes in turn ``--repeats`` times; printed: ms per row (best repeat) and the
ratio to the first size. Also what ``benchmarks/RESULTS.md`` compares a change of the proxy
forward with: run at each commit, alternately.

``--compare`` instead times the ways of running a row's prefix (:data:`VARIANTS`) side by side in
one process on the same rows, alternating (the order turned each round) for ``--repeats`` rounds
at the first ``--batch-sizes`` size: each row's own rotated copy of the prefix keys per layer
(``HFBackend.rotated_key_rows = True``, the method at 679dc52, with its in-place rotation since);
the row-wise prefix on the shared keys (``backends/row_prefix.py``) in one forward of the call's
rows (its rows' calls in Python threads, ``PARALLEL_ROWS``); and the same rows split into one
forward per thread, the forwards side by side (``parallel_forwards``, the default). (The
forward's gather rows as one padded batch, one index_select, turn and flash call per layer, was
tried on 2026-12-06 and measured slower at one thread: 115-135 against 98 CPU ms a row on the
default plan's rows, its strided gather and the padded turn outside the cache.) Printed per game: the median wall and CPU (process) ms per row
of each, the median (and range) of the rounds' wall ratios to the first, and the largest
|difference| of a row's utility from the first's (nats); the load average before and after on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def table_row(
    game: str,
    requests: list,
    size: int,
    names: list[str],
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
    values: dict[str, Any],
) -> str:
    """One game's row of the table: its prefix and tail tokens, rows, rows a call, each variant's
    median ms a row (wall, cpu), each variant's wall speedup over the first (median, range) and the
    largest value difference from the first (nats)."""
    import numpy as np

    n = len(requests)
    r0 = requests[0]

    def ms(x: list[float]) -> str:
        return f"{1000 * statistics.median(x) / n:.1f}"

    def speedup(v: str) -> str:
        ratios = [a / b for a, b in zip(wall[names[0]], wall[v])]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    diff = max(float(np.abs(values[names[0]] - values[v]).max()) for v in names[1:])
    return (
        f"| {game} | {r0.shared_tokens} | {r0.n_tokens - 1 - r0.shared_tokens} | {n} | {size} | "
        + " | ".join(f"{ms(wall[v])} ({ms(cpu[v])})" for v in names)
        + " | " + " | ".join(speedup(v) for v in names[1:])
        + f" | {diff:.1e} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default="long_design")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--plan", choices=("pool", "default"), default="pool",
        help="the rows: the game's recorded pool (leave-one-out first) or the proxy plan the default plan plays (seed 0)",
    )
    ap.add_argument("--compare", action="store_true", help="the ways of running a row's prefix (VARIANTS) on the same rows, alternating")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from proxy_batching import proxy_rows

    from coalescence import load_backend

    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    backend = load_backend(args.model, dtype="float32", device="cpu")
    if args.compare:
        compare(backend, args, sizes[0], proxy_rows)
        return
    print("| game | n | shared KV | tail | rows | rows per call | ms / row | vs first |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [g for g in args.games.split(",") if g]:
        n, requests = proxy_rows(name, args.rows, backend)
        backend.score_proxy(requests[:1])  # the shared KV into the prefix cache
        best: dict[int, float] = {}
        for _ in range(args.repeats):
            for size in sizes:
                t0 = time.perf_counter()
                for at in range(0, len(requests), size):
                    backend.score_proxy(requests[at : at + size])
                best[size] = min(best.get(size, float("inf")), time.perf_counter() - t0)
        r0 = requests[0]
        for size in sizes:
            print(
                f"| {name} | {n} | {r0.shared_tokens} | {r0.n_tokens - 1 - r0.shared_tokens} | {len(requests)} | {size} | "
                f"{1000 * best[size] / len(requests):.1f} | {best[size] / best[sizes[0]]:.2f} |"
            )


VARIANTS = {
    "rotated keys": {"rotated_key_rows": True, "parallel_forwards": False},
    "row-wise, one forward": {"rotated_key_rows": False, "parallel_forwards": False},
    "row-wise, forwards side by side": {"rotated_key_rows": False, "parallel_forwards": True},
}
"""The ways of running a row's prefix that ``--compare`` times (``HFBackend`` attributes); the
first is the baseline of the ratios (679dc52's method), the last the default."""


def compare(backend, args, size: int, proxy_rows) -> None:
    """The :data:`VARIANTS` on the same rows, alternating, the order turned each round (module docs)."""
    import numpy as np

    names = list(VARIANTS)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    print(
        "| game | shared KV | tail | rows | rows per call | "
        + " | ".join(f"{v} ms / row (CPU)" for v in names)
        + " | " + " | ".join(f"{v}: speed-up (median of rounds, range)" for v in names[1:])
        + " | max abs diff (nats) |"
    )
    print("|---" * (6 + 2 * len(names) - 1) + "|")
    for name in [g for g in args.games.split(",") if g]:
        _, requests = proxy_rows(name, args.rows, backend, args.plan)
        backend.score_proxy(requests[:1])  # the shared KV into the prefix cache
        wall: dict[str, list[float]] = {v: [] for v in names}
        cpu: dict[str, list[float]] = {v: [] for v in names}
        values: dict[str, np.ndarray] = {}
        for i in range(args.repeats):
            for v in names[i % len(names) :] + names[: i % len(names)]:
                for attr, value in VARIANTS[v].items():
                    setattr(backend, attr, value)
                t0, c0 = time.perf_counter(), time.process_time()
                got = []
                for at in range(0, len(requests), size):
                    got += backend.score_proxy(requests[at : at + size])
                wall[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
                values[v] = np.array([g.utility for g in got])
        for attr, value in VARIANTS[names[-1]].items():
            setattr(backend, attr, value)
        print(table_row(name, requests, size, names, wall, cpu, values))
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
