"""Run archive throughput: rows written per second, rows loaded per second on resume, bytes per row.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/archive_throughput.py [--sizes 10000,100000,1000000]

Write: ``RunArchive.append`` row by row (the engine's path: one dict per evaluated coalition, with
validation, dedupe against the keys already archived, and a zstd part every 65,536 rows written to a
temporary name, fsynced and renamed). Load: what a resume does before any model call: open the run
(manifest check, lock, read every part, drop repeated keys, build the set of archived keys) and fill
the hot result store. Realistic rows: 64-hex coalition keys, 2-byte masks (12 players), float64
utilities.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from coalescence.archive import RunArchive, list_parts
from coalescence.engine import fill_store
from coalescence.scheduler import ResultStore

RUN = {"snapshot_ids": ["s" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}


def rows(n: int):
    rng = np.random.default_rng(0)
    utilities = rng.normal(-20, 5, n)
    now = datetime.now(UTC)
    for i in range(n):
        yield {
            "snapshot_id": "s" * 64,
            "coalition_key": hashlib.sha256(i.to_bytes(8, "little")).hexdigest(),
            "mask": (i % 4096).to_bytes(2, "little"),
            "n_bits": 12,
            "absence_policy": "drop",
            "model_id": "m",
            "utility": float(utilities[i]),
            "elapsed_ms": 12.5,
            "cache_hit": False,
            "batch_size": 8,
            "created_at": now,
            "tokens_computed": 180,
            "tokens_reused": 0,
            "batch_id": i // 8,
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    args = ap.parse_args()
    print(f"{'rows':>9}  {'write rows/s':>12}  {'load rows/s':>12}  {'bytes/row':>9}  {'parts':>5}")
    for n in (int(s) for s in args.sizes.split(",")):
        data = list(rows(n))  # generated up front: not timed
        tmp = Path(tempfile.mkdtemp())
        try:
            t0 = time.perf_counter()
            archive = RunArchive.open(tmp / "run", RUN, flush_rows=65536)
            for row in data:
                archive.append(row)
            archive.close()
            write = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in list_parts(tmp / "run"))
            t0 = time.perf_counter()
            resumed = RunArchive.open(tmp / "run", RUN)
            store = ResultStore()
            fill_store(store, resumed.loaded)
            load = time.perf_counter() - t0
            assert resumed.resumed and len(store) == n
            resumed.close()
            print(f"{n:>9}  {n / write:>12.0f}  {n / load:>12.0f}  {size / n:>9.1f}  {len(list_parts(tmp / 'run')):>5}")
        finally:
            shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
