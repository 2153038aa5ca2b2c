"""Archive rows for the archive tests: one row per coalition of a 10-player game, with keys written
here (sha256 of the snapshot id and the packed mask), and an archive rewritten in an older layout."""

from __future__ import annotations

import hashlib
import json
import math
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from coalescence.masking.codec import PackedMask

N_BITS = 10  # two mask bytes, six pad bits


T0 = datetime(2024, 5, 17, 8, 30, 15, 123456, tzinfo=UTC)


def coalition_key(snapshot_id: str, words: bytes) -> str:
    return hashlib.sha256(snapshot_id.encode() + b"|" + words).hexdigest()


def make_row(
    present: list[int],
    *,
    utility: float,
    snapshot_id: str = "a" * 64,
    n_bits: int = N_BITS,
    key: str | None = None,
    created_at: datetime | None = T0,
) -> dict:
    """One archive row for the coalition of the ``present`` player indices."""
    words = PackedMask.from_indices(present, n_bits).words
    row = {
        "snapshot_id": snapshot_id,
        "coalition_key": key if key is not None else coalition_key(snapshot_id, words),
        "mask": words,
        "n_bits": n_bits,
        "absence_policy": "drop",
        "model_id": "tiny-llama",
        "utility": utility,
        "elapsed_ms": 1.5,
        "cache_hit": False,
        "batch_size": 3,
    }
    if created_at is not None:
        row["created_at"] = created_at
    return row


def make_legacy(run_dir: Path, tables: dict[int, pa.Table], *, schema_version: int = 2) -> None:
    """Rewrite ``run_dir`` in the layout of schema version ``schema_version`` (<= 2): a real
    ``parts/`` directory of ``part-NNNNNN.parquet`` files with no digest, as older versions wrote."""
    import shutil

    for name in os.listdir(run_dir):
        if name.startswith(".parts") or name == "parts":
            path = run_dir / name
            path.unlink() if path.is_symlink() else shutil.rmtree(path)
    (run_dir / "parts").mkdir()
    for index, table in tables.items():
        pq.write_table(table, run_dir / "parts" / f"part-{index:06d}.parquet", compression="zstd")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps(manifest | {"schema_version": schema_version}))


def seven_rows() -> list[dict]:
    """Seven distinct coalitions with utilities that are not short decimals."""
    coalitions = [[], [0], [1, 9], [2, 3, 4], [9], [0, 5, 8], list(range(N_BITS))]
    utilities = [-12.345678901234567, 0.1 + 0.2, -1e-300, -math.pi, 1e308, -0.0, -7.000000000000001]
    return [
        make_row(c, utility=u, created_at=T0 + timedelta(microseconds=i))
        for i, (c, u) in enumerate(zip(coalitions, utilities, strict=True))
    ]
