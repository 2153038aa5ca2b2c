"""Writing a run archive: one locked writer, verified atomic parts, resume after a crash, compaction.

Crash safety rests on these rules: a part is serialised in memory, written under a hidden temporary
name, fsynced and renamed to a name that carries its SHA-256 (a reader never sees half a part, and
verifies every byte of it); the manifest is replaced the same way; parts live in a generation
directory that ``parts`` links to, and compaction switches that link with one rename (see
:mod:`.layout`); on resume the verified parts are loaded (their coalitions are served without a
model call), crash debris is cleared, and rows whose coalition key the archive holds are not written
again. A crash therefore loses at most the rows not yet flushed, which a resume recomputes.

Faults: a write that fails (disk full, I/O error) raises one line
(:class:`~coalescence.errors.ArchiveWriteError`), keeps the rows buffered and leaves every part
already flushed as it was; :meth:`RunArchive.close` then records ``status: "failed"`` and the
``error`` in the manifest, when the manifest can be written at all. Under ``skip_corrupt`` a part
that fails verification is moved to ``RUN_DIR/quarantine/`` and listed in the manifest's
``quarantine``, so later commands do not trip on it again.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import operator
import os
import socket
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ArchiveError, ArchiveWriteError, ConfigError
from .layout import (
    discard,
    fsync_dir,
    is_fresh,
    is_live,
    live_generation,
    one_line,
    os_error,
    part_files,
    quarantine,
    recover,
    remove_created,
    remove_tree,
    start_generation,
    switch,
    temporary_name,
    write_file,
    write_output,
)
from .manifest import read_manifest, with_digests
from .reader import BadPart, dedupe_rows, load_rows, parts_of
from .schema import LOCK_NAME, MANIFEST_NAME, PARTS_DIR, RESULTS_NAME, ROW_SCHEMA, SCHEMA_VERSION, part_name

__all__ = ("IDENTITY_FIELDS", "RunArchive", "compact", "write_json_atomic")

logger = logging.getLogger(__name__)

IDENTITY_FIELDS = ("snapshot_ids", "model", "utility", "absence_policy")
"""The run fields that must match for a resume (anything else may differ, e.g. batch size)."""
_COLUMNS = frozenset(ROW_SCHEMA.names)
_REQUIRED = frozenset(f.name for f in ROW_SCHEMA if not f.nullable)
_get_required = operator.itemgetter(*sorted(_REQUIRED))


def write_json_atomic(path: Path, data: Any, *, field: str | None = None) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename (all or nothing); a
    symbolic link is followed, a stream (``/dev/stdout``) written directly
    (:func:`~coalescence.archive.layout.write_output`).

    Args:
        path: the file written (its parent is created if missing).
        data: JSON-ready data (lone surrogates in strings are written as ``\\u`` escapes).
        field: the option named in an error (e.g. ``"out"``).

    Raises:
        ArchiveError: the place cannot be written (permission, not a directory).
        ArchiveWriteError: the write failed (disk full, I/O error); ``path`` is as it was.
    """
    try:
        text = (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        text = (json.dumps(data, indent=2) + "\n").encode("ascii")
    write_output(Path(path), text, field=field)


def _read_results(path: Path, run_id: str) -> dict[str, dict[str, Any]]:
    """The finished explanations of ``run_id`` in ``results.jsonl`` (complete lines only)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ArchiveError(f"cannot read {path}: {one_line(exc)}", field="archive") from exc
    out: dict[str, dict[str, Any]] = {}
    for line in data.split(b"\n")[:-1]:  # the last piece is empty, or a line a crash tore
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("run_id") == run_id and isinstance(record.get("key"), str):
            if isinstance(record.get("document"), dict):
                out[record["key"]] = record["document"]
    return out


def _write_part(directory: Path, index: int, table: pa.Table, *, field: str = "archive") -> Path:
    """Write ``table`` as part ``index`` in ``directory``: serialised in memory, hashed, written
    under a temporary name, fsynced, renamed to ``part-NNNNNN-<sha256>.parquet``.

    Returns:
        The part's path.

    Raises:
        ArchiveError, ArchiveWriteError: nothing new is visible (the temporary file is removed).
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    data = sink.getvalue()
    final = directory / part_name(index, hashlib.sha256(data).hexdigest())
    tmp = temporary_name(final)
    try:
        write_file(tmp, data)
        os.replace(tmp, final)
    except OSError as exc:
        discard(tmp)
        raise os_error(exc, f"cannot write {final}", field) from exc
    return final


class _Lock:
    """An exclusive OS lock (``flock``) on ``RUN_DIR/.lock``, holding the holder's pid/host/time."""

    def __init__(self, run_dir: Path, field: str = "archive") -> None:
        path = run_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise os_error(exc, f"cannot open the lock file {path}", field) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ArchiveError(
                    f"{str(run_dir)!r} is being written by {holder or 'another process'}; wait for it to "
                    "finish or use another archive",
                    field=field,
                ) from None
            raise os_error(exc, f"cannot lock {path}", field) from exc
        self._fd: int | None = fd
        note = f"pid {os.getpid()} on {socket.gethostname()} since {datetime.now(UTC).isoformat()}\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        except OSError:  # the holder's name only helps the next writer's message; the lock holds without it
            pass

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _identity(run: Mapping[str, Any]) -> dict[str, Any]:
    return {k: run.get(k) for k in IDENTITY_FIELDS}


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [
        f"{k}: archive has {json.dumps(old.get(k), sort_keys=True)}, this run has {json.dumps(new.get(k), sort_keys=True)}"
        for k in IDENTITY_FIELDS
        if old.get(k) != new.get(k)
    ]



def _quarantine_records(bad: list[BadPart], now: str, run_id: str | None) -> list[dict[str, Any]]:
    return [
        {"part": b.part.path.name, "reason": b.reason, "quarantined_at": now, "run_id": run_id} for b in bad
    ]


def _row_seconds(elapsed_ms: float, batch_size: int, cache_hit: bool) -> float:
    """A row's share of its model call's time, seconds (0 with no model call)."""
    return 0.0 if cache_hit or not batch_size else float(elapsed_ms) / 1000.0 / int(batch_size)


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
        loaded: the rows found on disk when the archive was opened (empty for a new run), each key once.
        quarantined: names of the parts moved to ``quarantine/`` when the archive was opened.
        rows_written: rows written by this process.
        resumed: whether an existing run was resumed.
        write_error: the message of the last failed write, or ``None``.
    """

    def __init__(
        self,
        run_dir: Path,
        manifest: dict[str, Any],
        *,
        run_id: str,
        lock: _Lock,
        loaded: pa.Table,
        directory: Path,
        next_part: int,
        flush_rows: int,
        flush_seconds: float,
        resumed: bool,
        quarantined: tuple[str, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        self.manifest = manifest
        self.run_id = run_id
        self.loaded = loaded
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.resumed = resumed
        self.quarantined = quarantined
        self.rows_written = 0
        self.closed = False
        self.write_error: str | None = None
        self._lock = lock
        self._directory = directory
        self._next_part = next_part
        self._keys: set[str] = set(loaded["coalition_key"].to_pylist()) if loaded.num_rows else set()
        self._rows: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self.results: dict[str, dict[str, Any]] = _read_results(run_dir / RESULTS_NAME, run_id)
        self._pending_results: list[bytes] = []
        self._written_seconds: dict[str, float] = {}  # model time of the rows this process appended
        self._loaded_seconds: dict[str, float] | None = None  # of the loaded rows, made when first asked

    def model_seconds(self, coalition_key: str) -> float | None:
        """The model time of the coalition's first evaluation, from its archive row: the row's
        batch time shared among the batch's rows (``elapsed_ms / batch_size``, seconds); 0 for a
        row served with no model call (``cache_hit``). A later session serving the coalition from
        the archive writes no row, so the time stays that of the first evaluation.

        Returns:
            Seconds, or ``None`` when the archive holds no row for the key.
        """
        if self._loaded_seconds is None:
            self._loaded_seconds = {}
            if self.loaded.num_rows:
                table = self.loaded.select(["coalition_key", "elapsed_ms", "batch_size", "cache_hit"]).to_pydict()
                columns = (table["coalition_key"], table["elapsed_ms"], table["batch_size"], table["cache_hit"])
                for key, ms, size, hit in zip(*columns, strict=True):
                    self._loaded_seconds[key] = _row_seconds(ms, size, hit)
        found = self._loaded_seconds.get(coalition_key)
        return found if found is not None else self._written_seconds.get(coalition_key)

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def create(cls, run_dir: str | Path, run: Mapping[str, Any], **options: Any) -> RunArchive:
        """Create a new run directory (it must not exist or be empty); see :meth:`open`.

        Raises:
            ArchiveError: the directory already holds files.
        """
        path = Path(run_dir)
        if not is_fresh(path):
            raise ArchiveError(
                f"{str(path)!r} already exists and is not empty; choose a new --archive path or delete it",
                field="archive",
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

        Everything is checked (manifest, layout, every part's digest and schema, the run's
        identity) before anything is changed; the first change is the manifest saying the run is
        running, then crash debris is cleared and, under ``skip_corrupt``, parts that failed are
        moved to ``quarantine/``.

        Args:
            run_dir: the run directory (created if missing).
            run: the run description, JSON-ready; its :data:`IDENTITY_FIELDS` (``snapshot_ids``,
                ``model``, ``utility``, ``absence_policy``) identify the run, and ``snapshots`` (a
                list of snapshot dicts with ``snapshot_id``) are merged into the manifest.
            new_run: if no run in the archive matches ``run``'s identity, start a new run in the
                same directory instead of refusing.
            skip_corrupt: move parts that fail verification to ``quarantine/`` (with a warning; their
                coalitions are then evaluated again) instead of refusing.
            flush_rows: rows per part (>= 1).
            flush_seconds: the longest time rows wait in memory (> 0), checked on append.

        Raises:
            ArchiveError: the directory is locked by another writer (naming the holder), holds files
                but no manifest, has a damaged manifest or a newer schema, holds foreign files where
                parts live, holds a part that fails verification (without ``skip_corrupt``), holds
                a run whose identity differs (listing the differences) without ``new_run``, or
                cannot be written (permission): nothing is changed.
            ArchiveWriteError: a write failed (disk full, I/O error).
            ConfigError: bad ``flush_rows``/``flush_seconds``.
        """
        if not isinstance(flush_rows, int) or flush_rows < 1:
            raise ConfigError(f"must be a positive integer, got {flush_rows!r}", field="flush_rows")
        if not flush_seconds > 0:
            raise ConfigError(f"must be > 0, got {flush_seconds!r}", field="flush_seconds")
        path = Path(run_dir)
        fresh = is_fresh(path)
        if not fresh and not (path / MANIFEST_NAME).is_file():
            raise ArchiveError(
                f"{str(path)!r} exists but is not a run directory (no {MANIFEST_NAME}); choose another --archive",
                field="archive",
            )
        if not fresh:
            read_manifest(path)  # structure and schema version before taking the lock or touching anything
        created = []
        ancestor = path
        while not os.path.lexists(ancestor):
            created.append(ancestor)
            ancestor = ancestor.parent
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, f"cannot create run directory {str(path)!r}") from exc
        try:
            lock = _Lock(path)
        except BaseException:
            remove_created(created, lock_file=None)
            raise
        try:
            return cls._open_locked(path, dict(run), lock, new_run, skip_corrupt, flush_rows, flush_seconds)
        except BaseException:
            lock.release()
            if not (path / MANIFEST_NAME).exists():  # a creation that failed leaves nothing behind
                remove_created(created, lock_file=path / LOCK_NAME)
            raise

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        run: dict[str, Any],
        lock: _Lock,
        new_run: bool,
        skip_corrupt: bool,
        flush_rows: int,
        flush_seconds: float,
    ) -> RunArchive:
        now = datetime.now(UTC).isoformat()
        snapshots = run.pop("snapshots", [])
        bad: list[BadPart] = []
        if not (path / MANIFEST_NAME).is_file():  # checked again under the lock
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
            table, bad = load_rows(path, skip_corrupt=skip_corrupt)
            loaded = dedupe_rows(table)
        match = next((r for r in manifest["runs"] if _identity(r) == _identity(run)), None)
        if match is None and manifest["runs"] and not new_run:
            diffs = _differences(manifest["runs"][-1], run)
            raise ArchiveError(
                "the archive holds a different run (" + "; ".join(diffs) + "); use the same settings to "
                "resume it, --new-run to add this run to the archive, or another --archive",
                field="archive",
            )
        resumed = match is not None
        if match is None:
            match = {"run_id": uuid.uuid4().hex[:16], "started_at": now, **run, "status": "running"}
            manifest["runs"].append(match)
        else:
            match.update({**run, "run_id": match["run_id"], "status": "running", "resumed_at": now})
            match.pop("error", None)
        known = {s.get("snapshot_id") for s in manifest["snapshots"]}
        manifest["snapshots"].extend(with_digests(s) for s in snapshots if s.get("snapshot_id") not in known)
        if bad:
            manifest["quarantine"] = (manifest.get("quarantine") or []) + _quarantine_records(bad, now, match["run_id"])
        manifest["updated_at"] = now
        manifest["rows"] = loaded.num_rows
        manifest["schema_version"] = SCHEMA_VERSION  # older parts stay readable (new columns null)
        archive = cls(
            path,
            manifest,
            run_id=match["run_id"],
            lock=lock,
            loaded=loaded,
            directory=path,
            next_part=0,
            flush_rows=flush_rows,
            flush_seconds=flush_seconds,
            resumed=resumed,
            quarantined=tuple(b.part.path.name for b in bad),
        )
        changed = False
        try:
            write_json_atomic(path / MANIFEST_NAME, manifest, field="archive")  # the first change
            changed = True
            quarantine(path, [b.part.path for b in bad])
            archive._directory = live_generation(path)
            indices = [p.index for p in part_files(archive._directory)]
        except (OSError, ArchiveError) as exc:
            error = exc if isinstance(exc, ArchiveError) else os_error(exc, f"cannot prepare the parts of {path}")
            if changed or isinstance(error, ArchiveWriteError):  # a refusal (exit 2) changes nothing
                archive._record_failure(error.message)
            if error is exc:
                raise
            raise error from exc
        archive._next_part = max(indices, default=-1) + 1
        if resumed:
            logger.info("resuming run %s in %s: %d coalitions on disk", match["run_id"], path, loaded.num_rows)
        return archive

    def _record_failure(self, message: str) -> None:
        """Best effort: mark this run ``failed`` with ``message`` in the manifest."""
        self.write_error = message
        run = next(r for r in self.manifest["runs"] if r["run_id"] == self.run_id)
        run.update(status="failed", error=message)
        self.manifest["updated_at"] = datetime.now(UTC).isoformat()
        try:
            write_json_atomic(self.run_dir / MANIFEST_NAME, self.manifest)
        except ArchiveError as exc:
            # the failure itself is what the caller raises and the CLI prints (one line); that the
            # manifest could not say so too is a detail (the run reads as unfinished: it resumes)
            logger.info("the manifest could not record the failure either: %s", exc.message)

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
            raise ArchiveError("the run archive is closed", field="archive")
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
        self._written_seconds[key] = _row_seconds(record["elapsed_ms"], record["batch_size"], record["cache_hit"])
        if len(self._rows) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()
        return True


    def flush(self) -> None:
        """Write the buffered rows as one part (temporary name, fsync, rename). No-op when empty.

        Raises:
            ArchiveError: the rows do not fit the schema, or the place cannot be written.
            ArchiveWriteError: the part cannot be written (disk full, I/O error); the rows stay
                buffered (a later flush or :meth:`close` tries again) and no part is changed.
        """
        self._last_flush = time.monotonic()
        if not self._rows:
            self._write_results()
            return
        try:
            table = pa.Table.from_pylist(self._rows, schema=ROW_SCHEMA)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ArchiveError(f"rows do not fit the archive schema: {one_line(exc)}", field="row") from exc
        try:
            _write_part(self._directory, self._next_part, table)
        except ArchiveError as exc:
            self.write_error = exc.message
            raise
        # the part is in place: its rows are on disk whatever happens next
        self._next_part += 1
        self.rows_written += len(self._rows)
        self._rows.clear()
        try:
            fsync_dir(self._directory)
        except OSError as exc:
            error = os_error(exc, f"cannot sync {self._directory}")
            self.write_error = error.message
            raise error from exc
        self._write_results()

    def record_result(self, key: str, document: Mapping[str, Any]) -> None:
        """Record a finished explanation (``key``: what it was fitted with, e.g. snapshot and
        method); it is written to ``results.jsonl`` once every row buffered now is flushed, so a
        restored result never stands for rows the archive lacks.

        Raises:
            ArchiveError: the archive is closed.
        """
        if self.closed:
            raise ArchiveError("the run archive is closed", field="archive")
        line = json.dumps({"run_id": self.run_id, "key": key, "document": document}, ensure_ascii=False, allow_nan=False)
        self._pending_results.append(line.encode("utf-8") + b"\n")
        self.results[key] = dict(document)
        if not self._rows:
            self._write_results()

    def _write_results(self) -> None:
        if not self._pending_results:
            return
        path = self.run_dir / RESULTS_NAME
        try:
            with open(path, "ab") as fh:
                fh.write(b"".join(self._pending_results))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            error = os_error(exc, f"cannot write {path}")
            self.write_error = error.message
            raise error from exc
        self._pending_results.clear()

    def close(self, *, status: str = "complete", **run_updates: Any) -> None:
        """Flush the rest, update the manifest (run status, counters) and release the lock.

        The run's status is ``status``, or ``"failed"`` with an ``error`` message when a write
        failed (then or before); a manifest that cannot be written keeps its previous content.

        Raises:
            ArchiveError, ArchiveWriteError: the last flush or the manifest could not be written
                (the lock is released all the same).
        """
        if self.closed:
            return
        error: ArchiveError | None = None
        try:
            try:
                self.flush()
            except ArchiveError as exc:
                error = exc
                self.write_error = exc.message
            run = next(r for r in self.manifest["runs"] if r["run_id"] == self.run_id)
            run.update(run_updates)
            run["status"] = status
            if self.write_error is not None:
                run.update(status="failed", error=self.write_error)
            self.manifest["updated_at"] = datetime.now(UTC).isoformat()
            self.manifest["rows"] = len(self._keys) - len(self._rows)  # unflushed rows are not in it
            try:
                write_json_atomic(self.run_dir / MANIFEST_NAME, self.manifest, field="archive")
            except ArchiveError as exc:
                error = error or exc
                self._record_failure(exc.message)  # once more, saying why (a transient fault may let it through)
        finally:
            self.closed = True
            self._lock.release()
        if error is not None:
            raise error


def compact(run_dir: str | Path, *, skip_corrupt: bool = False) -> tuple[int, int]:
    """Merge every part of a run into one, switched in atomically (``coalescence archive compact``).

    The merged part is written into a new generation directory, which then replaces the live one
    with one rename of the ``parts`` link: a reader sees the old parts or the merged one, never both.
    An archive of schema version 2 or older is moved to the current layout on the way.

    Args:
        run_dir: the run directory.
        skip_corrupt: move parts that fail verification to ``quarantine/`` (recorded in the
            manifest) and merge the rest, instead of refusing.

    Returns:
        ``(parts_before, rows)``.

    Raises:
        ArchiveError: not a run directory, a damaged manifest, foreign files where parts live, a
            writer holds the run, a part fails verification (without ``skip_corrupt``), or the
            place cannot be written: nothing is changed.
        ArchiveWriteError: a write failed (disk full, I/O error): the live parts are as they were.
    """
    path = Path(run_dir)
    read_manifest(path)
    lock = _Lock(path, field="RUN_DIR")
    try:
        manifest = read_manifest(path)
        parts = parts_of(path)
        loaded, bad = load_rows(path, skip_corrupt=skip_corrupt)
        table = dedupe_rows(loaded)
        current = os.path.islink(path / PARTS_DIR) and all(p.digest is not None for p in parts)
        if bad or manifest["schema_version"] < SCHEMA_VERSION:
            now = datetime.now(UTC).isoformat()
            if bad:
                manifest["quarantine"] = (manifest.get("quarantine") or []) + _quarantine_records(bad, now, None)
            manifest.update(schema_version=SCHEMA_VERSION, updated_at=now, rows=table.num_rows)
            write_json_atomic(path / MANIFEST_NAME, manifest, field="RUN_DIR")
        generation = None
        try:
            quarantine(path, [b.part.path for b in bad])
            recover(path)
            if current and len(parts) - len(bad) <= 1 and table.num_rows == loaded.num_rows:
                return len(parts), table.num_rows  # nothing to merge
            generation = start_generation(path)
            if table.num_rows:
                _write_part(generation, max(p.index for p in parts) + 1, table, field="RUN_DIR")
            fsync_dir(generation)
            switch(path, generation)
        except BaseException as exc:
            if generation is not None and not is_live(path, generation):
                remove_tree(generation)  # no reader has seen it
            if isinstance(exc, OSError):
                raise os_error(exc, f"cannot compact {path}", "RUN_DIR") from exc
            raise
        return len(parts), table.num_rows
    finally:
        lock.release()
