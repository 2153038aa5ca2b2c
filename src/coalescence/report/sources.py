"""What a report is made from: an ``--out`` JSON document, or a run archive fitted with no model.

:func:`load_source` reads SOURCE and returns a :class:`ReportInput`: the explanation documents
(the ``--out`` schema of :meth:`~coalescence.attribution.explanation.Explanation.to_dict`) grouped
as the page shows them. A JSON document may be a single explanation, a JSONL batch
``{"archive", "explanations"}``, a hierarchy ``{"hierarchy", "coarse", "fine"}`` or a replay
``{"run_id", "run_dir", "explanations"}``. A run archive directory is fitted by the application
layer (:func:`coalescence.app.report.report_source`: the replay machinery, no model), which hands
the document it makes to :func:`from_document`; the report itself never fits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ..errors import ArchiveError, InputError

__all__ = ("Entry", "ReportInput", "from_document", "load_source", "read_document")

_FIELD = "SOURCE"
_FORMS = (
    "an --out JSON document (single, JSONL batch, hierarchy or replay) or a run archive directory"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One item of a report: an explanation document, or both levels of a hierarchical run.

    Attributes:
        document: the explanation (``--out`` schema); for a hierarchy, its coarse level.
        fine: the fine level of a hierarchy (``None`` when it refined no fine player, or for a
            plain explanation).
        hierarchy: the ``hierarchy`` object of a hierarchical run (units, top_k, refined,
            n_evaluations), ``None`` otherwise.
    """

    document: dict[str, Any]
    fine: dict[str, Any] | None = None
    hierarchy: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportInput:
    """The explanations of one report, in order.

    Attributes:
        kind: ``"single"``, ``"hierarchy"``, ``"batch"`` (a JSONL run's document), ``"replay"``
            (a replay document) or ``"archive"`` (fitted from a run archive).
        entries: the items shown (one for a single explanation or a hierarchy).
        source: the path the input came from (``""`` for a document given in memory).
        archive: the run archive the explanations came from, when known.
        extra: further facts of the source (``run_id`` of a replay document).
    """

    kind: str
    entries: tuple[Entry, ...]
    source: str = ""
    archive: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_source(source: str | Path) -> ReportInput:
    """Read a report's input from an ``--out`` JSON document (a run archive directory is fitted
    first by the application layer: :func:`coalescence.app.report.report_source`).

    Args:
        source: a JSON file written by ``explain --out`` or ``replay --out``.

    Returns:
        The explanations to show.

    Raises:
        InputError: no such file, a directory, not JSON, or not a document of the ``--out``
            schema (field ``SOURCE``, naming the field at fault).
    """
    path = Path(source)
    if path.is_dir():
        raise InputError(
            f"{str(path)!r} is a run directory; fit it first (coalescence.app.report.report_source, or "
            "`coalescence report RUN_DIR`)",
            field=_FIELD,
        )
    return from_document(read_document(path), str(path))


def read_document(path: str | Path) -> Any:
    """The parsed JSON of an ``--out`` document.

    Raises:
        InputError: the file is missing, unreadable or not JSON (field ``SOURCE``).
    """
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{str(path)!r} does not exist; give {_FORMS}", field=_FIELD) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {str(path)!r}: {_one_line(exc)}", field=_FIELD) from exc
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{str(path)!r} is not valid JSON ({_one_line(exc)}); give {_FORMS}", field=_FIELD) from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def from_document(doc: Any, source: str, *, kind: str | None = None) -> ReportInput:
    """A report's input from a parsed ``--out`` document (any of the forms in the module docs).

    Args:
        doc: the parsed JSON.
        source: where it came from (shown on the page; relative paths in it resolve from there).
        kind: the form to show it as (e.g. ``"archive"``), else guessed from its keys.

    Raises:
        InputError: not a document of the ``--out`` schema (field ``SOURCE``, naming the field at fault).
    """
    base = Path(source).parent if source else Path()
    if not isinstance(doc, Mapping):
        raise InputError(f"expected a JSON object, got {type(doc).__name__}; give {_FORMS}", field=_FIELD)
    if "explanations" in doc:
        items = doc["explanations"]
        if not isinstance(items, list) or not items:
            raise InputError("explanations must be a non-empty list of explanation documents", field=_FIELD)
        entries = tuple(_entry(item, f"explanations[{k}]", base) for k, item in enumerate(items))
        archive = doc.get("archive") or doc.get("run_dir")
        form = kind or ("replay" if "run_dir" in doc else "batch")
        extra = {"run_id": doc.get("run_id")} if doc.get("run_id") else {}
        return ReportInput(kind=form, entries=entries, source=source, archive=_str(archive), extra=extra)
    if "hierarchy" in doc or "players" in doc:
        entry = _entry(doc, "", base)
        archive = doc.get("archive") or entry.document.get("archive")
        return ReportInput(kind=kind or ("hierarchy" if entry.hierarchy else "single"), entries=(entry,), source=source, archive=_str(archive))
    raise InputError(
        f"the JSON object has none of the keys players, hierarchy, explanations; give {_FORMS}", field=_FIELD
    )


def _str(value: Any) -> str | None:
    return str(value) if value else None


def _entry(doc: Any, where: str, base: Path) -> Entry:
    if not isinstance(doc, Mapping):
        raise InputError(f"{where or 'the document'} must be an explanation object", field=_FIELD)
    prefix = f"{where}." if where else ""
    if "hierarchy" in doc:
        info = doc["hierarchy"]
        if not isinstance(info, Mapping):
            raise InputError(f"{prefix}hierarchy must be an object", field=_FIELD)
        archive = doc.get("archive")
        coarse = _explanation(doc.get("coarse"), f"{prefix}coarse", base, archive)
        fine_doc = doc.get("fine")
        fine = None if fine_doc is None else _explanation(fine_doc, f"{prefix}fine", base, archive or coarse.get("archive"))
        return Entry(document=coarse, fine=fine, hierarchy=dict(info))
    return Entry(document=_explanation(doc, where, base, None))


def _need(doc: Mapping[str, Any], key: str, check: Any, what: str, where: str) -> Any:
    value = doc.get(key)
    if not check(value):
        shown = json.dumps(value)[:40] if key in doc else "missing"
        raise InputError(f"{where}{key} must be {what}, got {shown}", field=_FIELD)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def _explanation(doc: Any, where: str, base: Path, archive: Any) -> dict[str, Any]:
    """Check one explanation document and return it with its messages (recovered from its archive
    for documents written before ``messages`` was recorded)."""
    prefix = f"{where}." if where else ""
    if not isinstance(doc, Mapping):
        raise InputError(f"{where or 'the document'} must be an explanation object", field=_FIELD)
    out = dict(doc)
    _need(out, "target", lambda v: isinstance(v, str), "a string", prefix)
    players = _need(out, "players", lambda v: isinstance(v, list) and bool(v), "a non-empty list", prefix)
    if "messages" not in out:
        out["messages"] = _messages_from_archive(out, base, archive, prefix)
    messages = _need(
        out,
        "messages",
        lambda v: isinstance(v, list) and all(isinstance(m, Mapping) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in v),
        'a list of {"role", "content"} strings',
        prefix,
    )
    for i, p in enumerate(players):
        at = f"{prefix}players[{i}]."
        if not isinstance(p, Mapping):
            raise InputError(f"{prefix}players[{i}] must be an object", field=_FIELD)
        _need(p, "label", lambda v: isinstance(v, str), "a string", at)
        _need(p, "value", _is_number, "a number or null", at)
        if "stderr" in p:
            _need(p, "stderr", _is_number, "a number or null", at)
        m = _need(p, "message_index", lambda v: _is_int(v) and 0 <= v < len(messages), f"a message index (0..{len(messages) - 1})", at)
        n = len(messages[m]["content"])
        start = _need(p, "start", lambda v: _is_int(v) and 0 <= v <= n, f"a character offset in message {m} (0..{n})", at)
        _need(p, "end", lambda v: _is_int(v) and start <= v <= n, f"an offset from start to {n}", at)
        if isinstance(p.get("text"), str) and messages[m]["content"][p["start"] : p["end"]] != p["text"]:
            raise InputError(f"{at}text does not match characters {p['start']}:{p['end']} of message {m}", field=_FIELD)
    tokens = out.get("answer_tokens")
    if tokens is not None and not (
        isinstance(tokens, list)
        and all(isinstance(t, Mapping) and isinstance(t.get("text"), str) and _is_number(t.get("logprob_full")) and _is_number(t.get("logprob_empty")) for t in tokens)
    ):
        raise InputError(f'{prefix}answer_tokens must be a list of {{"text", "logprob_full", "logprob_empty"}} or null', field=_FIELD)
    return out


def _messages_from_archive(doc: Mapping[str, Any], base: Path, archive: Any, prefix: str) -> list[dict[str, str]]:
    """The messages of a document written before ``messages`` was part of it, from its run archive."""
    from ..archive.manifest import read_manifest

    where = doc.get("archive") or archive
    fix = "make the report from its run archive instead (coalescence report RUN_DIR)"
    if not where:
        raise InputError(f"{prefix}messages is missing and the document names no archive; {fix}", field=_FIELD)
    for candidate in (Path(str(where)), base / str(where)):
        if (candidate / "manifest.json").is_file():
            try:
                manifest = read_manifest(candidate)
            except ArchiveError:
                continue
            for record in manifest["snapshots"]:
                if record.get("snapshot_id") == doc.get("snapshot_id") and isinstance(record.get("messages"), list):
                    return [dict(m) for m in record["messages"]]
    raise InputError(
        f"{prefix}messages is missing (a document written before they were recorded) and archive "
        f"{str(where)!r} does not hold snapshot {str(doc.get('snapshot_id'))[:12]}; {fix}",
        field=_FIELD,
    )
