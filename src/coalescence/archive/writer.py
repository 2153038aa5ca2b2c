"""Writing a run archive: one locked writer, atomic parts, resume after a crash, compaction.

Crash safety rests on three rules: a part is written to a temporary name, fsynced and renamed
into place (a reader never sees half a part); the manifest is replaced the same way; on resume,
the complete parts are loaded (their coalitions are served without a model call), leftover
temporary files are discarded, and rows whose coalition key is already in the archive are not
written again. A crash therefore loses at most the rows not yet flushed, which a resume recomputes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import operator
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ArchiveError, ConfigError
from .reader import list_parts, read_manifest, read_rows
from .schema import LOCK_NAME, MANIFEST_NAME, PARTS_DIR, ROW_SCHEMA, SCHEMA_VERSION, part_index, part_name

__all__ = ("IDENTITY_FIELDS", "RunArchive", "compact", "write_json_atomic")

logger = logging.getLogger(__name__)

IDENTITY_FIELDS = ("snapshot_ids", "model", "utility", "absence_policy")
_COLUMNS = frozenset(ROW_SCHEMA.names)
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_REQUIRED = frozenset(f.name for f in ROW_SCHEMA if not f.nullable)
_get_required = operator.itemgetter(*sorted(_REQUIRED))
"""The run fields that must match for a resume (anything else may differ, e.g. batch size)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_part(parts_dir: Path, index: int, table: pa.Table) -> Path:
    """Write ``table`` as part ``index``: temporary name, fsync, rename. Returns the final path."""
    final = parts_dir / part_name(index)
    tmp = parts_dir / f".{final.name}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(parts_dir)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArchiveError(f"cannot write {final}: {exc}", field="--archive") from exc
    return final


class _Lock:
    """An exclusive OS lock (``flock``) on ``RUN_DIR/.lock``, holding the holder's pid/host/time."""

    def __init__(self, run_dir: Path) -> None:
        path = run_dir / LOCK_NAME
        self._fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run's lifetime
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.seek(0)
            holder = self._fh.read().strip() or "another process"
            self._fh.close()
            raise ArchiveError(
                f"{str(run_dir)!r} is being written by {holder}; wait for it to finish or use another --archive",
                field="--archive",
            ) from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {datetime.now(UTC).isoformat()}\n")
        self._fh.flush()

    def release(self) -> None:
        if not self._fh.closed:
            self._fh.seek(0)
            self._fh.truncate()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()


def _identity(run: Mapping[str, Any]) -> dict[str, Any]:
    return {k: run.get(k) for k in IDENTITY_FIELDS}


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [
        f"{k}: archive has {json.dumps(old.get(k), sort_keys=True)}, this run has {json.dumps(new.get(k), sort_keys=True)}"
        for k in IDENTITY_FIELDS
        if old.get(k) != new.get(k)
    ]


class RunArchive:
    """Appends evaluated coalitions to a run directory (see :mod:`coalescence.archive.schema`).

    Use :meth:`open` (create or resume) or :meth:`create` (new directory only). Rows are buffered and
    written as a part every ``flush_rows`` rows or when ``flush_seconds`` have passed since the last
    part (checked on append; no timer thread), and on :meth:`close`. A row whose coalition key the
    archive already holds is not written again.

    Attributes:
        run_dir: the run directory.
        run_id: this run's id (a resumed run keeps its id).
        manifest: the manifest as last written.
        loaded: the rows found on disk when the archive was opened (empty for a new run).
        rows_written: rows written by this process.
        resumed: whether an existing run was resumed.
    """

    def __init__(
        self,
        run_dir: Path,
        manifest: dict[str, Any],
        *,
        run_id: str,
        lock: _Lock,
        loaded: pa.Table,
        next_part: int,
        flush_rows: int,
        flush_seconds: float,
        resumed: bool,
    ) -> None:
        self.run_dir = run_dir
        self.manifest = manifest
        self.run_id = run_id
        self.loaded = loaded
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.resumed = resumed
        self.rows_written = 0
        self.closed = False
        self._lock = lock
        self._next_part = next_part
        self._keys: set[str] = set(loaded["coalition_key"].to_pylist()) if loaded.num_rows else set()
        self._rows: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def create(cls, run_dir: str | Path, run: Mapping[str, Any], **options: Any) -> RunArchive:
        """Create a new run directory (it must not exist or be empty); see :meth:`open`.

        Raises:
            ArchiveError: the directory already holds files.
        """
        path = Path(run_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ArchiveError(
                f"{str(path)!r} already exists and is not empty; choose a new --archive path or delete it",
                field="--archive",
            )
        return cls.open(path, run, **options)

    @classmethod
    def open(
        cls,
        run_dir: str | Path,
        run: Mapping[str, Any],
        *,
        new_run: bool = False,
        skip_corrupt: bool = False,
        flush_rows: int = 4096,
        flush_seconds: float = 30.0,
    ) -> RunArchive:
        """Create a run directory, or resume the run it holds.

        Args:
            run_dir: the run directory (created if missing).
            run: the run description, JSON-ready; its :data:`IDENTITY_FIELDS` (``snapshot_ids``,
                ``model``, ``utility``, ``absence_policy``) identify the run, and ``snapshots`` (a
                list of snapshot dicts with ``snapshot_id``) are merged into the manifest.
            new_run: if no run in the archive matches ``run``'s identity, start a new run in the
                same directory instead of refusing.
            skip_corrupt: skip unreadable parts (with a warning) instead of refusing.
            flush_rows: rows per part (>= 1).
            flush_seconds: the longest time rows wait in memory (> 0), checked on append.

        Raises:
            ArchiveError: the directory is locked by another writer (naming the holder), holds files
                but no manifest, has a newer schema, holds a corrupt part, or holds a run whose
                identity differs (listing the differences) without ``new_run``.
            ConfigError: bad ``flush_rows``/``flush_seconds``.
        """
        if not isinstance(flush_rows, int) or flush_rows < 1:
            raise ConfigError(f"must be a positive integer, got {flush_rows!r}", field="--flush-rows")
        if not flush_seconds > 0:
            raise ConfigError(f"must be > 0, got {flush_seconds!r}", field="--flush-seconds")
        path = Path(run_dir)
        fresh = not path.exists() or (path.is_dir() and not any(path.iterdir()))
        if not fresh and not (path / MANIFEST_NAME).is_file():
            raise ArchiveError(
                f"{str(path)!r} exists but is not a run directory (no {MANIFEST_NAME}); choose another --archive",
                field="--archive",
            )
        if not fresh:
            read_manifest(path)  # schema check before taking the lock or touching anything
        try:
            (path / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArchiveError(f"cannot create run directory {str(path)!r}: {exc}", field="--archive") from exc
        lock = _Lock(path)
        try:
            return cls._open_locked(path, dict(run), lock, fresh, new_run, skip_corrupt, flush_rows, flush_seconds)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        run: dict[str, Any],
        lock: _Lock,
        fresh: bool,
        new_run: bool,
        skip_corrupt: bool,
        flush_rows: int,
        flush_seconds: float,
    ) -> RunArchive:
        now = datetime.now(UTC).isoformat()
        snapshots = run.pop("snapshots", [])
        if fresh:
            manifest: dict[str, Any] = {
                "schema_version": SCHEMA_VERSION,
                "package_version": run.get("package_version"),
                "created_at": now,
                "updated_at": now,
                "rows": 0,
                "snapshots": [],
                "runs": [],
            }
            loaded = ROW_SCHEMA.empty_table()
        else:
            manifest = read_manifest(path)
            loaded = read_rows(path, skip_corrupt=skip_corrupt)
        match = next((r for r in manifest["runs"] if _identity(r) == _identity(run)), None)
        if match is None and manifest["runs"] and not new_run:
            diffs = _differences(manifest["runs"][-1], run)
            raise ArchiveError(
                "the archive holds a different run (" + "; ".join(diffs) + "); use the same settings to "
                "resume it, --new-run to add this run to the archive, or another --archive",
                field="--archive",
            )
        resumed = match is not None
        if match is None:
            match = {"run_id": uuid.uuid4().hex[:16], "started_at": now, **run, "status": "running"}
            manifest["runs"].append(match)
        else:
            match.update({**run, "run_id": match["run_id"], "status": "running", "resumed_at": now})
        known = {s.get("snapshot_id") for s in manifest["snapshots"]}
        manifest["snapshots"].extend(s for s in snapshots if s.get("snapshot_id") not in known)
        for leftover in sorted((path / PARTS_DIR).glob(".part-*.tmp")):
            logger.warning("discarding %s, a part left half-written by a crash; its rows are recomputed", leftover.name)
            leftover.unlink()
        parts = list_parts(path)
        next_part = (part_index(parts[-1].name) + 1) if parts else 0
        manifest["updated_at"] = now
        manifest["schema_version"] = SCHEMA_VERSION  # older parts stay readable (new columns null)
        write_json_atomic(path / MANIFEST_NAME, manifest)
        if resumed:
            logger.info("resuming run %s in %s: %d coalitions on disk", match["run_id"], path, loaded.num_rows)
        return cls(
            path,
            manifest,
            run_id=match["run_id"],
            lock=lock,
            loaded=loaded,
            next_part=next_part,
            flush_rows=flush_rows,
            flush_seconds=flush_seconds,
            resumed=resumed,
        )

    # -- writing -----------------------------------------------------------------------------
    def __contains__(self, coalition_key: object) -> bool:
        return coalition_key in self._keys

    def append(self, row: Mapping[str, Any]) -> bool:
        """Buffer one row (keys of :data:`ROW_SCHEMA`; ``created_at`` defaults to now, UTC).

        Returns:
            ``False`` when the archive already holds the row's coalition key (nothing written).

        Raises:
            ArchiveError: the archive is closed, or the row lacks a required column.
        """
        if self.closed:
            raise ArchiveError("the run archive is closed", field="--archive")
        record = dict(row)
        if "created_at" not in record:
            record["created_at"] = datetime.now(UTC)
        if "run_id" not in record:
            record["run_id"] = self.run_id
        try:
            required = _get_required(record)  # C-level lookups: a KeyError names a missing column
        except KeyError:
            required = (None,)
        if None in required or not record.keys() <= _COLUMNS:
            missing = sorted(k for k in _REQUIRED if record.get(k) is None)
            extra = sorted(record.keys() - _COLUMNS)
            raise ArchiveError(f"bad archive row: missing {missing}, unknown {extra}", field="row")
        key = record["coalition_key"]
        if key in self._keys:
            return False
        self._keys.add(key)
        self._rows.append(record)
        if len(self._rows) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()
        return True

    def flush(self) -> None:
        """Write the buffered rows as one part (temporary name, fsync, rename). No-op when empty.

        Raises:
            ArchiveError: the part cannot be written (the rows stay buffered).
        """
        self._last_flush = time.monotonic()
        if not self._rows:
            return
        try:
            table = pa.Table.from_pylist(self._rows, schema=ROW_SCHEMA)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ArchiveError(f"rows do not fit the archive schema: {exc}", field="row") from exc
        _write_part(self.run_dir / PARTS_DIR, self._next_part, table)
        self._next_part += 1
        self.rows_written += len(self._rows)
        self._rows.clear()

    def close(self, *, status: str = "complete", **run_updates: Any) -> None:
        """Flush the rest, update the manifest (run status, counters) and release the lock."""
        if self.closed:
            return
        try:
            self.flush()
            run = next(r for r in self.manifest["runs"] if r["run_id"] == self.run_id)
            run.update(run_updates)
            run["status"] = status
            self.manifest["updated_at"] = datetime.now(UTC).isoformat()
            self.manifest["rows"] = len(self._keys)
            write_json_atomic(self.run_dir / MANIFEST_NAME, self.manifest)
        finally:
            self.closed = True
            self._lock.release()


def compact(run_dir: str | Path, *, skip_corrupt: bool = False) -> tuple[int, int]:
    """Merge every part of a run into one, atomically (``coalescence archive compact``).

    The merged part is written under the next free index (temporary name, fsync, rename) before the
    old parts are removed; a crash in between leaves duplicates that readers drop, never a loss.

    Returns:
        ``(parts_before, rows)``.

    Raises:
        ArchiveError: the run is being written, or a part is corrupt (unless ``skip_corrupt``).
    """
    path = Path(run_dir)
    read_manifest(path)
    lock = _Lock(path)
    try:
        parts = list_parts(path)
        if len(parts) <= 1:
            return len(parts), read_rows(path).num_rows
        table = read_rows(path, skip_corrupt=skip_corrupt)
        _write_part(path / PARTS_DIR, part_index(parts[-1].name) + 1, table)
        for part in parts:
            part.unlink()
        _fsync_dir(path / PARTS_DIR)
        return len(parts), table.num_rows
    finally:
        lock.release()
