"""Finished explanations of a run: ``RUN_DIR/results.jsonl``, one JSON line per result.

A result is appended (and fsynced) only once every row it was fitted from is flushed, so a
restored result never stands for rows the archive lacks; a line a crash tore is skipped on reading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ArchiveError
from .layout import one_line, os_error

__all__ = ("append_results", "read_results", "result_line")


def result_line(run_id: str, key: str, document: Any) -> bytes:
    """One line of ``results.jsonl``: the result ``document`` of ``run_id`` fitted as ``key``.

    Raises:
        ValueError: the document holds a NaN or an infinity (JSON has neither).
    """
    line = json.dumps({"run_id": run_id, "key": key, "document": document}, ensure_ascii=False, allow_nan=False)
    return line.encode("utf-8") + b"\n"


def append_results(path: Path, lines: list[bytes]) -> None:
    """Append ``lines`` to ``path`` and fsync it.

    Raises:
        ArchiveError, ArchiveWriteError: the file cannot be written (disk full, I/O error,
            permission); a torn last line is skipped by :func:`read_results`.
    """
    try:
        with open(path, "ab") as fh:
            fh.write(b"".join(lines))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise os_error(exc, f"cannot write {path}") from exc



def read_results(path: Path, run_id: str) -> dict[str, dict[str, Any]]:
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
