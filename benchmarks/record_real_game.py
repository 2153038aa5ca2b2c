"""Record a real game once: every coalition of a 12-sentence conversation on SmolLM2-135M-Instruct.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/record_real_game.py [--out benchmarks/data/eiffel12_exact.parquet]

Runs `coalescence explain benchmarks/data/eiffel12.json --unit sentence --method exact` (4,096
coalitions) into a temporary archive and keeps only what the accuracy benchmark needs: the packed
mask, n_bits and utility (nats) of every coalition, a ~60 KB zstd Parquet file shipped in
benchmarks/data/ so benchmarks/estimator_accuracy.py can use a real game without a model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from coalescence.archive import read_rows
from coalescence.cli import main as cli


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/data/eiffel12_exact.parquet")
    ap.add_argument("--batch-size", default="8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        code = cli(["explain", "benchmarks/data/eiffel12.json", "--unit", "sentence", "--method", "exact",
                    "--batch-size", args.batch_size, "--archive", str(run), "--out", str(Path(tmp) / "out.json")])
        if code:
            raise SystemExit(code)
        table = read_rows(run).select(["mask", "n_bits", "utility"])
        assert table.num_rows == 4096
        pq.write_table(table, args.out, compression="zstd")
        print(f"wrote {args.out}: {table.num_rows} coalitions")


if __name__ == "__main__":
    main()
