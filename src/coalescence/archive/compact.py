"""Compaction: every part of a run merged into one, switched in with one rename
(``coalescence archive compact``)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from .atomic import write_json_atomic, write_part
from .layout import fsync_dir, is_live, os_error, quarantine, recover, remove_tree, start_generation, switch
from .lock import RunLock
from .manifest import read_manifest
from .reader import dedupe_rows, load_rows, parts_of
from .schema import MANIFEST_NAME, PARTS_DIR, SCHEMA_VERSION

__all__ = ("compact",)


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
    lock = RunLock(path, field="RUN_DIR")
    try:
        manifest = read_manifest(path)
        parts = parts_of(path)
        loaded, bad = load_rows(path, skip_corrupt=skip_corrupt)
        table = dedupe_rows(loaded)
        current = os.path.islink(path / PARTS_DIR) and all(p.digest is not None for p in parts)
        if bad or manifest["schema_version"] < SCHEMA_VERSION:
            now = datetime.now(UTC).isoformat()
            if bad:
                manifest["quarantine"] = (manifest.get("quarantine") or []) + [b.quarantine_record(now, None) for b in bad]
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
                write_part(generation, max(p.index for p in parts) + 1, table, field="RUN_DIR")
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
