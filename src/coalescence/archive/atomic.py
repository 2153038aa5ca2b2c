"""Atomic writes: a JSON file and a Parquet part appear whole or not at all.

Each is serialised in memory, written under a hidden temporary name, fsynced and renamed into
place (:mod:`.layout` holds the file-level steps); a part's name carries the SHA-256 of its bytes,
so a reader verifies every byte of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .layout import discard, os_error, temporary_name, write_file, write_output
from .schema import part_name

__all__ = ("write_json_atomic", "write_part")


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


def write_part(directory: Path, index: int, table: pa.Table, *, field: str = "archive") -> Path:
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
