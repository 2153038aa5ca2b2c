"""Record a real game once: every coalition of a conversation scored by SmolLM2-135M-Instruct.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/record_real_game.py \
        [--input benchmarks/data/eiffel12.json] [--unit sentence] [--roles ROLES] \
        [--out benchmarks/data/eiffel12_exact.parquet] [--batch-size 16] [--model smollm2-135m]

Runs `coalescence explain INPUT --unit UNIT --method exact` (all 2^n coalitions) into a temporary
archive and keeps only what the accuracy benchmark needs: the packed mask, n_bits and utility (nats)
of every coalition, and `model_seconds`, the model time of the coalition (its batch's wall time
divided by the rows in the batch, from the archive's `elapsed_ms` / `batch_size`; 0 for a cache
hit). The zstd Parquet file carries key-value metadata: input, unit, roles, model, n_players,
n_coalitions, batch_size, total model seconds and the recording's wall seconds. It is shipped in
benchmarks/data/ so benchmarks/estimator_accuracy.py can use a real game without a model.

Without arguments it records benchmarks/data/eiffel12.json at the sentence unit as before (the
shipped eiffel12_exact.parquet was recorded by the earlier version of this script, with
`--batch-size 8` and only the mask, n_bits and utility columns; readers need only those).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coalescence.archive import read_rows
from coalescence.cli import main as cli


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", default="benchmarks/data/eiffel12.json", help="input JSON (coalescence's input format)")
    ap.add_argument("--unit", default="sentence", help="player unit (coalescence explain --unit)")
    ap.add_argument("--roles", default=None, help="attributable roles (coalescence explain --roles; default: all)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="output Parquet (default: benchmarks/data/<input stem>_exact.parquet)")
    ap.add_argument("--batch-size", default="16")
    ap.add_argument("--keep-json", default=None, help="also copy the explanation document (--out JSON) here")
    ap.add_argument("--archive", default=None,
                    help="run archive to keep (default: a temporary one); rerunning with the same one resumes")
    args = ap.parse_args()
    out = args.out or str(Path("benchmarks/data") / f"{Path(args.input).stem}_exact.parquet")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.archive) if args.archive else Path(tmp) / "run"
        doc_path = Path(tmp) / "out.json"
        argv = ["explain", args.input, "--model", args.model, "--unit", args.unit, "--method", "exact",
                "--batch-size", str(args.batch_size), "--archive", str(run), "--out", str(doc_path)]
        if args.roles:
            argv += ["--roles", args.roles]
        t0 = time.perf_counter()
        code = cli(argv)
        wall = time.perf_counter() - t0  # of this invocation (a resumed run: only its last part)
        if code:
            raise SystemExit(code)
        doc = json.loads(doc_path.read_text())
        if args.keep_json:
            Path(args.keep_json).write_text(doc_path.read_text())
        rows = read_rows(run)
        n = len(doc["players"])
        assert rows.num_rows == 2**n, f"{rows.num_rows} rows, expected 2^{n} = {2**n}"
        assert set(rows["n_bits"].to_pylist()) == {n}
        hit = rows["cache_hit"].to_numpy(zero_copy_only=False)
        size = rows["batch_size"].to_numpy().astype(np.float64)
        seconds = np.where(hit | (size == 0), 0.0, rows["elapsed_ms"].to_numpy() / 1000.0 / np.maximum(size, 1.0))
        table = rows.select(["mask", "n_bits", "utility"]).append_column("model_seconds", pa.array(seconds, pa.float64()))
        meta = {
            "input": Path(args.input).name,
            "unit": args.unit,
            "roles": args.roles or "all",
            "model": doc.get("model_id", args.model),
            "model_revision": str(doc.get("model_revision")),
            "utility": doc.get("utility", "logprob"),
            "n_players": str(n),
            "n_coalitions": str(rows.num_rows),
            "batch_size": str(args.batch_size),
            "model_seconds_total": f"{seconds.sum():.3f}",
            "wall_seconds": f"{wall:.1f}",
            "v_empty": repr(doc.get("v_empty")),
            "v_full": repr(doc.get("v_full")),
            "players": json.dumps([{"label": p["label"], "text": p["text"]} for p in doc["players"]], ensure_ascii=False),
        }
        merged = dict(table.schema.metadata or {})  # the archive's coalescence.schema_version
        merged.update({k.encode(): str(v).encode() for k, v in meta.items()})
        table = table.replace_schema_metadata(merged)
        pq.write_table(table, out, compression="zstd")
        print(f"wrote {out}: {table.num_rows} coalitions, n = {n}, model time {seconds.sum():.1f} s, wall {wall:.1f} s")


if __name__ == "__main__":
    main()
