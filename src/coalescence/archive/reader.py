"""Reading a run archive back: manifest, rows, pools for the estimators, and a summary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ArchiveError
from ..masking.codec import PackedMask
from .schema import MANIFEST_NAME, PARTS_DIR, REQUIRED_COLUMNS, ROW_SCHEMA, SCHEMA_VERSION, part_index

__all__ = ("archive_info", "corrupt_parts", "dedupe_rows", "list_parts", "read_manifest", "read_pool", "read_rows")

logger = logging.getLogger(__name__)


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's manifest.

    Raises:
        ArchiveError: missing or unreadable manifest, or a schema version newer than this package's
            (field ``RUN_DIR``).
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
            f"archive schema version {version} is newer than this coalescence understands "
            f"({SCHEMA_VERSION}); upgrade coalescence to read it",
            field="RUN_DIR",
        )
    return manifest


def list_parts(run_dir: str | Path) -> list[Path]:
    """The complete parts of a run, in index order.

    Only regular files named ``part-NNNNNN.parquet`` directly under ``parts/`` count; symbolic
    links and anything resolving outside the run directory are ignored (paths stay confined).
    """
    parts_dir = Path(run_dir) / PARTS_DIR
    if not parts_dir.is_dir():
        return []
    root = parts_dir.resolve()
    found = []
    for path in parts_dir.iterdir():
        index = part_index(path.name)
        if index is None or path.is_symlink() or not path.is_file() or path.resolve().parent != root:
            continue
        found.append((index, path))
    return [p for _, p in sorted(found)]


def corrupt_parts(run_dir: str | Path) -> list[str]:
    """Names of the parts whose Parquet footer or schema cannot be read (a cheap check: footers only)."""
    bad = []
    for part in list_parts(run_dir):
        try:
            schema = pq.read_schema(part)
        except (OSError, pa.ArrowException):
            bad.append(part.name)
            continue
        if not REQUIRED_COLUMNS <= set(schema.names):
            bad.append(part.name)
    return bad


def dedupe_rows(table: pa.Table) -> pa.Table:
    """Keep the first row of each coalition key, in the original order."""
    if table.num_rows == 0 or pc.count_distinct(table["coalition_key"]).as_py() == table.num_rows:
        return table
    indexed = table.select(["coalition_key"]).append_column("_row", pa.array(np.arange(table.num_rows)))
    first = indexed.group_by("coalition_key", use_threads=False).aggregate([("_row", "min")])
    keep = np.sort(first["_row_min"].to_numpy())
    return table.take(pa.array(keep))


def read_rows(run_dir: str | Path, *, skip_corrupt: bool = False, dedupe: bool = True) -> pa.Table:
    """Every row of every complete part, in part order, each coalition key once.

    Args:
        run_dir: the run directory.
        skip_corrupt: skip (with a warning) a part that cannot be read instead of failing.
        dedupe: drop repeated coalition keys (first occurrence wins).

    Returns:
        A table with :data:`~coalescence.archive.schema.ROW_SCHEMA` (columns a part of an older
        schema version lacks are null).

    Raises:
        ArchiveError: a part is corrupt or truncated (named, with the ``--skip-corrupt`` hint).
    """
    tables = []
    for part in list_parts(run_dir):
        try:
            tables.append(pq.read_table(part, schema=ROW_SCHEMA))
        except (OSError, pa.ArrowException) as exc:
            if skip_corrupt:
                logger.warning("skipping corrupt part %s: %s", part.name, exc)
                continue
            raise ArchiveError(
                f"part {part.name} is corrupt or truncated ({exc}); rerun with --skip-corrupt to skip "
                "it (its coalitions are then evaluated again)",
                field="RUN_DIR",
            ) from exc
    if not tables:
        return ROW_SCHEMA.empty_table()
    table = pa.concat_tables(tables)
    return dedupe_rows(table) if dedupe else table


def read_pool(
    run_dir: str | Path, snapshot_id: str, *, skip_corrupt: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The evaluated coalitions of one snapshot as an estimator pool.

    Returns:
        ``masks`` ``[m, n_players]`` bool and ``utilities`` ``[m]`` float64 (nats), one row per
        distinct coalition key.

    Raises:
        ArchiveError: a corrupt part (unless ``skip_corrupt``).
    """
    table = read_rows(run_dir, skip_corrupt=skip_corrupt)
    rows = table.filter(pc.equal(table["snapshot_id"], snapshot_id))
    if rows.num_rows == 0:
        return np.zeros((0, 0), dtype=bool), np.zeros(0, dtype=np.float64)
    masks = np.stack([PackedMask(w, n).to_bools() for w, n in zip(
        rows["mask"].to_pylist(), rows["n_bits"].to_pylist(), strict=True
    )])
    return masks, rows["utility"].to_numpy().astype(np.float64)


def archive_info(run_dir: str | Path, *, skip_corrupt: bool = False) -> dict[str, Any]:
    """A summary of a run directory (what ``coalescence archive info`` prints).

    Returns:
        A JSON-ready dict: schema version, runs, snapshots (id, rows), coalitions, cache-hit rate,
        tokens computed and reused, model time (seconds), first/last write (UTC ISO), parts and bytes.

    Raises:
        ArchiveError: no manifest, a newer schema, or a corrupt part (unless ``skip_corrupt``).
    """
    manifest = read_manifest(run_dir)
    parts = list_parts(run_dir)
    table = read_rows(run_dir, skip_corrupt=skip_corrupt)
    n = table.num_rows
    per_snapshot: dict[str, int] = {}
    if n:
        counts = table.group_by("snapshot_id").aggregate([("coalition_key", "count")])
        per_snapshot = dict(
            zip(counts["snapshot_id"].to_pylist(), counts["coalition_key_count"].to_pylist(), strict=True)
        )
    # model time: one elapsed_ms per model call (batch), not per row
    model_seconds = 0.0
    if n:
        calls = table.filter(pc.invert(table["cache_hit"])).select(["run_id", "batch_id", "elapsed_ms", "batch_size"])
        if calls.num_rows:
            elapsed = calls["elapsed_ms"].to_numpy()
            sizes = np.maximum(calls["batch_size"].to_numpy(), 1)
            model_seconds = float((elapsed / sizes).sum() / 1e3)
    created = table["created_at"] if n else None
    return {
        "run_dir": str(run_dir),
        "schema_version": manifest["schema_version"],
        "package_version": manifest.get("package_version"),
        "runs": [
            {k: r.get(k) for k in ("run_id", "started_at", "model", "absence_policy", "utility", "status")}
            for r in manifest.get("runs", [])
        ],
        "snapshots": [{"snapshot_id": sid, "coalitions": c} for sid, c in sorted(per_snapshot.items())],
        "coalitions": n,
        "cache_hit_rate": float(pc.mean(table["cache_hit"].cast(pa.float64())).as_py()) if n else 0.0,
        "tokens_computed": int(pc.sum(table["tokens_computed"]).as_py() or 0) if n else 0,
        "tokens_reused": int(pc.sum(table["tokens_reused"]).as_py() or 0) if n else 0,
        "model_seconds": model_seconds,
        "first_write": pc.min(created).as_py().isoformat() if n else None,
        "last_write": pc.max(created).as_py().isoformat() if n else None,
        "parts": len(parts),
        "bytes": sum(p.stat().st_size for p in parts),
    }
