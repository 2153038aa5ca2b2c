"""Writing a run archive: an atomic manifest and atomically renamed Parquet parts."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ArchiveError, ConfigError
from .schema import MANIFEST_NAME, PARTS_DIR, ROW_SCHEMA, SCHEMA_VERSION, part_name

__all__ = ("RunArchive", "write_json_atomic")

logger = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename (all or nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunArchive:
    """Appends evaluated coalitions to a run directory (see :mod:`coalescence.archive.schema`).

    Rows are buffered and written as a part every ``flush_rows`` rows and on :meth:`close`. Use
    :meth:`create` to start a run; it refuses a directory that already holds a run.

    Args:
        run_dir: the run directory (created by :meth:`create`).
        manifest: the manifest written at creation (updated on close).
        flush_rows: rows per part (>= 1).
    """

    def __init__(self, run_dir: Path, manifest: dict[str, Any], *, flush_rows: int = 4096) -> None:
        if flush_rows < 1:
            raise ConfigError(f"must be >= 1, got {flush_rows}", field="--flush-rows")
        self.run_dir = run_dir
        self.manifest = manifest
        self.flush_rows = flush_rows
        self._rows: list[dict[str, Any]] = []
        self._next_part = 0
        self.rows_written = 0
        self.closed = False

    @classmethod
    def create(cls, run_dir: str | Path, manifest: Mapping[str, Any], *, flush_rows: int = 4096) -> RunArchive:
        """Create a run directory and write its manifest.

        Args:
            run_dir: a path that does not exist yet or is an empty directory.
            manifest: JSON-ready run description; ``schema_version`` and times are added.

        Raises:
            ArchiveError: the directory already holds files, or cannot be created.
        """
        path = Path(run_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ArchiveError(
                f"{str(path)!r} already exists and is not empty; choose a new --archive path or delete it",
                field="--archive",
            )
        now = datetime.now(UTC).isoformat()
        full = {"schema_version": SCHEMA_VERSION, **manifest, "created_at": now, "updated_at": now}
        try:
            (path / PARTS_DIR).mkdir(parents=True, exist_ok=True)
            write_json_atomic(path / MANIFEST_NAME, full)
        except OSError as exc:
            raise ArchiveError(f"cannot create run directory {str(path)!r}: {exc}", field="--archive") from exc
        return cls(path, full, flush_rows=flush_rows)

    def append(self, row: Mapping[str, Any]) -> None:
        """Buffer one row (keys of :data:`ROW_SCHEMA`; ``created_at`` defaults to now, UTC).

        Raises:
            ArchiveError: the archive is closed.
        """
        if self.closed:
            raise ArchiveError("the run archive is closed", field="--archive")
        record = dict(row)
        record.setdefault("created_at", datetime.now(UTC))
        record.setdefault("generation_text", None)
        missing = [f.name for f in ROW_SCHEMA if not f.nullable and record.get(f.name) is None]
        extra = sorted(set(record) - set(ROW_SCHEMA.names))
        if missing or extra:
            raise ArchiveError(f"bad archive row: missing {missing}, unknown {extra}", field="row")
        self._rows.append(record)
        if len(self._rows) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one part (temporary name, fsync, rename). No-op when empty.

        Raises:
            ArchiveError: the part cannot be written.
        """
        if not self._rows:
            return
        try:
            table = pa.Table.from_pylist(self._rows, schema=ROW_SCHEMA)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ArchiveError(f"rows do not fit the archive schema: {exc}", field="row") from exc
        parts = self.run_dir / PARTS_DIR
        final = parts / part_name(self._next_part)
        tmp = parts / f".{final.name}.tmp"
        try:
            pq.write_table(table, tmp, compression="zstd")
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ArchiveError(f"cannot write {final}: {exc}", field="--archive") from exc
        self._next_part += 1
        self.rows_written += len(self._rows)
        self._rows.clear()

    def close(self, **manifest_updates: Any) -> None:
        """Flush the rest and update the manifest (``updated_at``, row count, any given fields)."""
        if self.closed:
            return
        self.flush()
        self.manifest.update(manifest_updates)
        self.manifest["updated_at"] = datetime.now(UTC).isoformat()
        self.manifest["rows"] = self.rows_written
        write_json_atomic(self.run_dir / MANIFEST_NAME, self.manifest)
        self.closed = True
