"""The manifest: reading it back, with every field the code uses checked for presence and type.

A manifest that is valid JSON but lacks a field or holds one of the wrong type (an edit, a foreign
file, damage that kept the JSON well formed) is refused with one line naming the file and the
field, before anything is written, instead of failing somewhere later with a ``KeyError``.

Snapshot records carry ``digests``: a SHA-256 of every field of the record (a list of objects, such
as ``players``, one digest per field of its objects: ``players[].label``, ``players[].start``...),
written with the record and checked on every read, so that an edit of any field (a player's label or
role, which the snapshot id does not cover) is refused naming the field. A record without
``digests`` (written before they existed) is accepted as it is: its content is still checked
through its snapshot id, its labels and roles cannot be.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ArchiveError
from .layout import one_line
from .schema import MANIFEST_NAME, SCHEMA_VERSION

__all__ = ("check_replayable", "read_manifest", "record_digests", "with_digests")

_FIX = "the manifest was edited or damaged: restore it, or choose another archive"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _is_map_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())


def _is_offset(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)


# (field, check, what it must be, required); None is accepted for optional fields
_TOP = (
    ("schema_version", _is_int, "an integer", True),
    ("runs", _is_list_of(_is_object), "a list of objects", True),
    ("snapshots", _is_list_of(_is_object), "a list of objects", True),
    ("package_version", _is_str, "a string", False),
    ("created_at", _is_str, "a string", False),
    ("updated_at", _is_str, "a string", False),
    ("rows", lambda v: _is_int(v) and v >= 0, "a count (integer >= 0)", False),
    ("quarantine", _is_list_of(_is_object), "a list of objects", False),
)
_RUN = (
    ("run_id", _is_str, "a string", True),
    ("status", _is_str, "a string", True),
    ("started_at", _is_str, "a string", False),
    ("resumed_at", _is_str, "a string", False),
    ("error", _is_str, "a string", False),
    ("statistics", _is_object, "an object", False),
)
"""What the archive itself uses of a run; the rest of a run's description is the caller's (any JSON
through the Python API), checked by :func:`check_replayable` where replay needs it."""
_REPLAYED = (
    ("snapshot_ids", _is_list_of(_is_str), "a list of strings", True),
    ("model", _is_object, "an object", True),
    ("utility", _is_object, "an object", True),
    ("absence_policy", _is_object, "an object", True),
    ("target_token_ids", _is_map_of(_is_list_of(_is_int)), "an object of integer lists", False),
    ("target_token_offsets", _is_map_of(_is_list_of(_is_offset)), "an object of [start, end] lists", False),
)
_SNAPSHOT = (("snapshot_id", _is_str, "a string", True),)
_QUARANTINED = (("part", _is_str, "a string", True), ("reason", _is_str, "a string", False))
_POLICY = (("id", _is_str, "a string", True), ("params", _is_object, "an object", True))
_MODEL = (("id", _is_str, "a string", True), ("revision", _is_str, "a string", True), ("dtype", _is_str, "a string", True))


def _check(path: Path, where: str, data: dict[str, Any], fields: tuple[Any, ...]) -> None:
    for name, check, what, required in fields:
        if name not in data or data[name] is None:
            if required:
                raise ArchiveError(f"{path}: {where}{name} is missing; {_FIX}", field="RUN_DIR")
            continue
        if not check(data[name]):
            shown = one_line(json.dumps(data[name]))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ArchiveError(f"{path}: {where}{name} must be {what}, got {shown}; {_FIX}", field="RUN_DIR")


DIGESTS = "digests"
"""The key of a snapshot record's field digests (see :func:`record_digests`)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("ascii")).hexdigest()


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    """The record's fields by path: ``name`` for a value, ``name[].key`` for a key of a list of
    objects (the values of that key in every object, ``None`` where one lacks it)."""
    out: dict[str, Any] = {}
    for name, value in record.items():
        if name == DIGESTS:
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[f"{name}[]"] = len(value)
            for key in sorted({k for v in value for k in v}):
                out[f"{name}[].{key}"] = [v.get(key) for v in value]
        else:
            out[name] = value
    return out


def record_digests(record: dict[str, Any]) -> dict[str, str]:
    """The digest of every field of a snapshot record (what a writer stores under ``digests``).

    Args:
        record: a JSON-ready snapshot record (``ConversationSnapshot.to_dict()`` and whatever the
            run adds to it); a ``digests`` entry in it is ignored.

    Returns:
        ``{field path: SHA-256 hex}``: one entry per top-level field; a list of objects gets one
        entry for its length (``players[]``) and one per key of its objects (``players[].label``:
        the labels of all players in order), so that an edit is named by field.
    """
    return {name: _digest(value) for name, value in _fields(record).items()}


def with_digests(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its ``digests`` (computed afresh) added."""
    return {**{k: v for k, v in record.items() if k != DIGESTS}, DIGESTS: record_digests(record)}


def _check_digests(path: Path, i: int, record: dict[str, Any]) -> None:
    recorded = record.get(DIGESTS)
    if recorded is None:
        return  # written before digests: accepted as it is
    if not _is_map_of(_is_str)(recorded):
        raise ArchiveError(f"{path}: snapshots[{i}].{DIGESTS} must be an object of strings; {_FIX}", field="RUN_DIR")
    actual = record_digests(record)
    for name in list(actual) + [n for n in recorded if n not in actual]:
        if name not in recorded:
            problem = "is not covered by the record's digests (a field was added)"
        elif name not in actual:
            problem = "is missing (its digest is recorded)"
        elif recorded[name] != actual[name]:
            problem = "was edited (it does not match its recorded digest)"
        else:
            continue
        raise ArchiveError(f"{path}: snapshots[{i}].{name} {problem}; {_FIX}", field="RUN_DIR")


def _check_snapshot(path: Path, i: int, record: dict[str, Any]) -> None:
    """A snapshot record matches its digests, and rebuilds into its snapshot, whose id is the
    recorded one (an edited message, target or player list changes the id; a missing field
    breaks the rebuild)."""
    _check_digests(path, i, record)
    if "messages" not in record:
        return  # a record of the Python API's own making, with the id alone
    from ..snapshot import ConversationSnapshot
    from ..errors import InputError

    try:
        ConversationSnapshot.from_dict(record)
    except InputError as exc:
        raise ArchiveError(f"{path}: snapshots[{i}]: {one_line(exc.message)}; {_FIX}", field="RUN_DIR") from None


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's manifest, its structure checked.

    Args:
        run_dir: the run directory.

    Returns:
        The manifest as a dict (top level: ``schema_version``, ``runs``, ``snapshots``, ...).

    Raises:
        ArchiveError: no manifest, an unreadable one, a schema version newer than this package's,
            or a field the code uses that is missing or of the wrong type (naming it), all with
            field ``RUN_DIR``.
    """
    path = Path(run_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArchiveError(f"{str(run_dir)!r} is not a run directory (no {MANIFEST_NAME})", field="RUN_DIR") from None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, huge integers
        raise ArchiveError(f"cannot read {path}: {one_line(exc)}", field="RUN_DIR") from exc
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if not _is_int(version) or version < 1:
        raise ArchiveError(f"{path} has no valid schema_version ({version!r})", field="RUN_DIR")
    if version > SCHEMA_VERSION:
        raise ArchiveError(
            f"archive schema version {version} is newer than this coalescence understands "
            f"({SCHEMA_VERSION}); upgrade coalescence to read it",
            field="RUN_DIR",
        )
    _check(path, "", manifest, _TOP)
    for i, snapshot in enumerate(manifest["snapshots"]):
        _check(path, f"snapshots[{i}].", snapshot, _SNAPSHOT)
        _check_snapshot(path, i, snapshot)
    seen = set()
    for i, run in enumerate(manifest["runs"]):
        _check(path, f"runs[{i}].", run, _RUN)
        if run["run_id"] in seen:
            raise ArchiveError(f"{path}: runs[{i}].run_id {run['run_id']!r} appears twice; {_FIX}", field="RUN_DIR")
        seen.add(run["run_id"])
    for i, entry in enumerate(manifest.get("quarantine") or []):
        _check(path, f"quarantine[{i}].", entry, _QUARANTINED)
    return manifest


def check_replayable(run_dir: str | Path, manifest: dict[str, Any], run: dict[str, Any]) -> None:
    """Check that ``run`` (an entry of ``manifest["runs"]``) records what a replay needs.

    That is its snapshot ids, a snapshot record for each, its model, utility and absence policy
    (objects), and the target tokens' ids and offsets when recorded; a run recorded through the
    Python API may lack them or hold other shapes. The model's ``id``, ``revision``
    and ``dtype`` enter the coalition keys replay recomputes.

    Raises:
        ArchiveError: naming the missing field (field ``RUN_DIR``).
    """
    path = Path(run_dir) / MANIFEST_NAME
    where = f"{path}: run {run.get('run_id')}"
    for name in ("snapshot_ids", "model", "utility", "absence_policy"):
        if not run.get(name):
            raise ArchiveError(
                f"{where} does not record its {name}, so it cannot be replayed (it was not written by "
                "coalescence explain)",
                field="RUN_DIR",
            )
    _check(path, f"run {run['run_id']}: ", run, _REPLAYED)
    _check(path, f"run {run['run_id']}: model.", run["model"], _MODEL)
    _check(path, f"run {run['run_id']}: absence_policy.", run["absence_policy"], _POLICY)
    known = {s["snapshot_id"] for s in manifest["snapshots"]}
    missing = [i for i in run["snapshot_ids"] if i not in known]
    if missing:
        raise ArchiveError(f"{where}: snapshot {missing[0][:16]} has no record in snapshots; {_FIX}", field="RUN_DIR")
