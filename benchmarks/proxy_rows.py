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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default="long_design")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from proxy_batching import proxy_rows

    from coalescence import load_backend

    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    backend = load_backend(args.model, dtype="float32", device="cpu")
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


if __name__ == "__main__":
    main()
