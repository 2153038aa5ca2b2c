"""Reading a run archive back: manifest, rows, and utility pools for the estimators."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ArchiveError
from ..masking.codec import PackedMask
from .schema import MANIFEST_NAME, PARTS_DIR, ROW_SCHEMA, SCHEMA_VERSION

__all__ = ("read_manifest", "read_pool", "read_rows")


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's manifest.

    Raises:
        ArchiveError: missing or unreadable manifest, or a schema version newer than this package's.
    """
    path = Path(run_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArchiveError(f"{str(run_dir)!r} is not a run directory (no {MANIFEST_NAME})", field="RUN_DIR") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"cannot read {path}: {exc}", field="RUN_DIR") from exc
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArchiveError(f"{path} has no valid schema_version ({version!r})", field="RUN_DIR")
    if version > SCHEMA_VERSION:
        raise ArchiveError(
            f"archive schema version {version!r} is newer than this coalescence ({SCHEMA_VERSION}); upgrade",
            field="RUN_DIR",
        )
    return manifest


def read_rows(run_dir: str | Path) -> pa.Table:
    """Every row of every complete part, in part order (temporary files are ignored).

    Returns:
        A table with :data:`~coalescence.archive.schema.ROW_SCHEMA`.

    Raises:
        ArchiveError: a part cannot be read.
    """
    parts = sorted((Path(run_dir) / PARTS_DIR).glob("part-*.parquet"))
    tables = []
    for part in parts:
        try:
            tables.append(pq.read_table(part, schema=ROW_SCHEMA))
        except (OSError, pa.ArrowException) as exc:
            raise ArchiveError(f"cannot read part {part.name}: {exc}", field="RUN_DIR") from exc
    if not tables:
        return ROW_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def read_pool(run_dir: str | Path, snapshot_id: str) -> tuple[np.ndarray, np.ndarray]:
    """The evaluated coalitions of one snapshot as an estimator pool.

    Returns:
        ``masks`` ``[m, n_players]`` bool and ``utilities`` ``[m]`` float64 (nats), one row per
        distinct coalition key (the first occurrence wins).
    """
    table = read_rows(run_dir)
    rows = table.filter(pc.equal(table["snapshot_id"], snapshot_id)).to_pydict()
    seen: set[str] = set()
    masks, utilities = [], []
    for key, words, n_bits, utility in zip(
        rows["coalition_key"], rows["mask"], rows["n_bits"], rows["utility"], strict=True
    ):
        if key in seen:
            continue
        seen.add(key)
        masks.append(PackedMask(words, n_bits).to_bools())
        utilities.append(utility)
    if not masks:
        return np.zeros((0, 0), dtype=bool), np.zeros(0, dtype=np.float64)
    return np.stack(masks), np.asarray(utilities, dtype=np.float64)
