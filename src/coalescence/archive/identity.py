"""Which run of an archive a new session is: the resume identity.

A run is identified by :data:`IDENTITY_FIELDS`; a session whose fields match a run of the
manifest resumes it (keeping its id), one that matches none starts a new run when asked
(``new_run``) and is refused otherwise, listing the differences.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ArchiveError, CoalescenceError

__all__ = ("IDENTITY_FIELDS", "differences", "identity", "join_run", "same_measurement")

IDENTITY_FIELDS = ("snapshot_ids", "model", "utility", "absence_policy")
"""The run fields that must match for a resume (anything else may differ, e.g. batch size)."""


def identity(run: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`IDENTITY_FIELDS` of a run record (a missing one is ``None``)."""
    return {k: run.get(k) for k in IDENTITY_FIELDS}


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One line per identity field on which two run records differ, quoting both values."""
    return [
        f"{k}: archive has {json.dumps(old.get(k), sort_keys=True)}, this run has {json.dumps(new.get(k), sort_keys=True)}"
        for k in IDENTITY_FIELDS
        if old.get(k) != new.get(k)
    ]


def join_run(manifest: dict[str, Any], run: dict[str, Any], *, now: str, new_run: bool) -> tuple[dict[str, Any], bool]:
    """The manifest's run that ``run`` resumes, updated and marked running, or a new run
    appended to ``manifest["runs"]`` (changed in place).

    Args:
        manifest: the manifest (``runs`` a list of run records).
        run: the new session's run description.
        now: the time recorded (ISO 8601, UTC).
        new_run: start a new run when none matches instead of refusing.

    Returns:
        ``(record, resumed)``: the run record in the manifest, and whether it was there.

    Raises:
        ArchiveError: the archive holds runs, none with ``run``'s identity, and ``new_run`` is
            false (the message lists the differences from the last run).
    """
    match = next((r for r in manifest["runs"] if identity(r) == identity(run)), None)
    if match is None and manifest["runs"] and not new_run:
        diffs = differences(manifest["runs"][-1], run)
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
    return match, resumed


def same_measurement(run_dir: Path, utility: Any) -> bool:
    """Whether the last run of the archive at ``run_dir`` measured what ``utility`` (a
    :class:`~coalescence.utility.UtilitySpec`) needs: the same teacher forcing and generation, so
    that a replay can score its archived measurements with ``utility`` instead of a new run.
    ``False`` where the manifest or its utility cannot be read."""
    from ..utility import UtilitySpec
    from .reader import read_manifest

    try:
        last = UtilitySpec.from_dict(read_manifest(run_dir)["runs"][-1].get("utility") or {})
    except (CoalescenceError, KeyError, IndexError, TypeError, ValueError):
        return False
    return last.teacher_forced == utility.teacher_forced and last.generation == utility.generation
