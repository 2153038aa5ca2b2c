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

import logging
import operator
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import ArchiveError, ArchiveWriteError, ConfigError
from .atomic import write_json_atomic, write_part
from .compact import compact
from .identity import IDENTITY_FIELDS, join_run
from .layout import fsync_dir, is_fresh, live_generation, one_line, os_error, part_files, quarantine, remove_created
from .lock import RunLock
from .manifest import read_manifest, with_digests
from .reader import BadPart, dedupe_rows, load_rows
from .results import append_results, read_results, result_line
from .schema import LOCK_NAME, MANIFEST_NAME, RESULTS_NAME, ROW_SCHEMA, SCHEMA_VERSION

__all__ = ("IDENTITY_FIELDS", "RunArchive", "compact", "write_json_atomic")

logger = logging.getLogger(__name__)

_COLUMNS = frozenset(ROW_SCHEMA.names)
_REQUIRED = frozenset(f.name for f in ROW_SCHEMA if not f.nullable)
_get_required = operator.itemgetter(*sorted(_REQUIRED))


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
        lock: RunLock,
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
        self.results: dict[str, dict[str, Any]] = read_results(run_dir / RESULTS_NAME, run_id)
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
            lock = RunLock(path)
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
        lock: RunLock,
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
        match, resumed = join_run(manifest, run, now=now, new_run=new_run)
        known = {s.get("snapshot_id") for s in manifest["snapshots"]}
        manifest["snapshots"].extend(with_digests(s) for s in snapshots if s.get("snapshot_id") not in known)
        if bad:
            manifest["quarantine"] = (manifest.get("quarantine") or []) + [b.quarantine_record(now, match["run_id"]) for b in bad]
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
            write_part(self._directory, self._next_part, table)
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
        self._pending_results.append(result_line(self.run_id, key, document))
        self.results[key] = dict(document)
        if not self._rows:
            self._write_results()

    def _write_results(self) -> None:
        if not self._pending_results:
            return
        try:
            append_results(self.run_dir / RESULTS_NAME, self._pending_results)
        except ArchiveError as exc:
            self.write_error = exc.message
            raise
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
