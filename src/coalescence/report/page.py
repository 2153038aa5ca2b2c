"""The report page: explanation documents laid out by a Jinja2 template into one HTML file.

The page is self-contained: its style is inline, its charts are inline SVG (matplotlib), it holds
no script and no URL, so it opens from disk offline and requests nothing. Each explanation is a
section: the conversation as chat turns in its original text (``white-space: pre-wrap``, escaped,
never normalised; a carriage return is written ``&#13;`` because HTML parsers turn a literal one into
a line feed), every player highlighted on the diverging scale of :mod:`.colors` and reachable by
keyboard (``tabindex``; focus or hover shows its label, value, standard error and rank in a visible
tooltip, also in ``title``), the answer's tokens shaded by the change of their log-probability
between the full and the empty coalition, the ranked bar chart, a ranked table with the numbers,
and the run's facts. Several explanations (a JSONL batch, a replay) share one file: an index at the
top links each section by its anchor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from .._version import __version__
from .chart import chart_image
from .sources import Entry, ReportInput
from .views import _exact, _fmt, _snippet, explanation_chart, explanation_view

__all__ = ("chart_images", "explanation_fragment", "render_page")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("coalescence.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["exact"] = _exact
    env.filters["fmt"] = _fmt
    return env


def chart_images(report: ReportInput, *, scale: str = "robust", format: str = "png") -> bytes:  # noqa: A002
    """The ranked bar charts of a report as one image file: the page's charts (same labels,
    colours and error bars), one panel per explanation (both levels of a hierarchy), titled by the
    page's headings when there are several.

    Args:
        report: the explanations (:func:`~coalescence.report.load_source`).
        scale: the colour scale, ``robust`` or ``linear``.
        format: ``png`` or ``svg`` (:data:`~.chart.IMAGE_FORMATS`).

    Returns:
        The image file's bytes.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    charts = []
    for entry, heading in zip(report.entries, _headings(report), strict=True):
        if entry.hierarchy is None:
            charts.append(explanation_chart(entry.document, scale=scale, title=heading))
            continue
        units = entry.hierarchy.get("units") or ["coarse", "fine"]
        prefix = f"{heading} \u00b7 " if heading else ""
        charts.append(explanation_chart(entry.document, scale=scale, title=f"{prefix}coarse level: {units[0]}"))
        if entry.fine is not None:
            charts.append(explanation_chart(entry.fine, scale=scale, title=f"{prefix}fine level: {units[1]}"))
    return chart_image(charts, format=format)


def _entry_view(entry: Entry, section: str, heading: str, archive: str | None, scale: str = "robust") -> dict[str, Any]:
    if entry.hierarchy is None:
        return {"kind": "explanation", "id": section, "heading": heading, "main": explanation_view(entry.document, section, heading, archive, scale)}
    info = entry.hierarchy
    units = info.get("units") or ["coarse", "fine"]
    evals = info.get("n_evaluations") or {}
    refined = ", ".join(str(r) for r in info.get("refined") or ())
    coarse = explanation_view(entry.document, f"{section}-coarse", f"{heading} \u00b7 coarse level: {units[0]}", archive, scale)
    fine = None
    if entry.fine is not None:
        fine = explanation_view(entry.fine, f"{section}-fine", f"{heading} \u00b7 fine level: {units[1]} inside the top {info.get('top_k')}", archive, scale)
    facts = [
        ("units", f"{units[0]}, then {units[1]}"),
        ("refined", f"top {info.get('top_k')} coarse players by |value|: {refined or 'none'}"),
        ("evaluations", f"coarse {evals.get('coarse', 'n/a')} + fine {evals.get('fine', 'n/a')} = {evals.get('total', 'n/a')}"),
        ("method", str(info.get("method", "hierarchical"))),
    ]
    return {
        "kind": "hierarchy",
        "id": section,
        "heading": heading,
        "facts": facts,
        "main": coarse,
        "fine": fine,
        "fine_missing": fine is None,
    }


def _dataset_summary(views: Sequence[dict[str, Any]], top: int = 10) -> dict[str, Any] | None:
    """A batch's summary: the values by role and by message position (players, mean, standard
    deviation, mean |value|), and the largest |values| across the conversations, linked to them;
    ``None`` for fewer than two explanations, mixed units, or anything but one method's explanation
    of each of several conversations (several methods of one conversation pool no conversations:
    their values would count each player once per method)."""
    mains = [v["main"] for v in views if v.get("kind") == "explanation"]
    if len(mains) < 2 or len({m["unit"] for m in mains}) != 1 or len({m["method"] for m in mains}) != 1:
        return None
    snapshots = [m["summary"]["snapshot"] for m in mains]
    if len(set(snapshots)) != len(snapshots):
        return None

    def stats(values: list[float]) -> dict[str, Any]:
        n = len(values)
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
        return {"n": n, "mean": mean, "sd": sd, "mean_abs": sum(abs(v) for v in values) / n}

    by_role: dict[str, list[float]] = {}
    by_position: dict[int, list[float]] = {}
    everyone = []
    for k, main in enumerate(mains):
        for p in main["players"]:
            value = p["value"]
            if value is None or not math.isfinite(value):
                continue
            by_role.setdefault(p["role"] or "?", []).append(value)
            by_position.setdefault(int(p["message_index"]), []).append(value)
            everyone.append((abs(value), k, p, main))
    everyone.sort(key=lambda t: (-t[0], t[1], t[2]["index"]))
    return {
        "unit": mains[0]["unit"],
        "n": len(mains),
        "roles": [{"name": role} | stats(vals) for role, vals in sorted(by_role.items())],
        "positions": [{"name": f"message {m}"} | stats(vals) for m, vals in sorted(by_position.items())],
        "top": [
            {"value": p["value"], "label": p["label"], "text": _snippet(p["text"], 70), "href": f"#{p['id']}", "heading": main["heading"]}
            for _, _, p, main in everyone[:top]
        ],
    }


def render_page(report: ReportInput, *, scale: str = "robust") -> str:
    """The report of ``report`` as one self-contained HTML page.

    Args:
        report: the explanations (see :func:`~coalescence.report.load_source`).
        scale: the colour scale, ``robust`` or ``linear`` (:mod:`.colors`).

    Returns:
        The HTML text (UTF-8 when written): no script, no external resource, no URL.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    many = len(report.entries) > 1
    views = [
        _entry_view(entry, f"ex{k}", heading or "Explanation", report.archive, scale)
        for k, (entry, heading) in enumerate(zip(report.entries, _headings(report), strict=True))
    ]
    first = report.entries[0].document
    title = (
        f"coalescence report: {len(report.entries)} explanations"
        if many
        else f"coalescence report: {_snippet(first['target'], 60)}"
    )
    return _environment().get_template("report.html.j2").render(
        title=title,
        entries=views,
        summary=_dataset_summary(views) if many else None,
        many=many,
        kind=report.kind,
        source=report.source,
        archive=report.archive,
        run_id=report.extra.get("run_id"),
        version=__version__,
    )


def _headings(report: ReportInput) -> list[str]:
    """Each entry's heading on a page of several (``""`` for a page of one): a batch's inputs by
    number; a replay's or an archive's explanations by method, conversation (when there are
    several) and run, never by a hash."""
    entries = report.entries
    if len(entries) < 2:
        return [""] * len(entries)
    if report.kind == "batch":
        return [f"Input {k + 1}" for k in range(len(entries))]
    ids = list(dict.fromkeys(str(e.document.get("snapshot_id")) for e in entries))
    run = report.extra.get("run_id")
    names = []
    for entry in entries:
        doc = entry.document
        parts = [str(doc.get("method") or (entry.hierarchy or {}).get("method") or "explanation")]
        if len(ids) > 1:
            parts.append(f"conversation {ids.index(str(doc.get('snapshot_id'))) + 1} of {len(ids)}")
        if run:
            parts.append(f"run {run}")
        names.append(" \u00b7 ".join(parts))
    return [name if names.count(name) == 1 else f"{name} (#{names[:k + 1].count(name)})" for k, name in enumerate(names)]


def explanation_fragment(document: Mapping[str, Any], *, compact: bool = True, top: int = 5, scale: str = "robust") -> str:
    """One explanation's view as an HTML fragment (its style scoped to it), e.g. for a notebook.

    Args:
        document: an explanation document (:meth:`Explanation.to_dict`), or a hierarchy document.
        compact: the highlighted conversation, the ``top`` players and the legend only (about the
            size of shap's text plot); ``False``: the whole report's view (chart, table, facts).
        top: the players listed in the compact view.
        scale: the colour scale, ``robust`` or ``linear`` (:mod:`.colors`).

    Returns:
        A ``<div class="coalescence-report">`` element with its ``<style>``: no script, no URL.

    Raises:
        InputError: not an explanation document.
    """
    from .sources import from_document

    report = from_document(document, "")
    views = [_entry_view(entry, f"ex{k}", "Explanation", report.archive, scale) for k, entry in enumerate(report.entries)]
    return _environment().get_template("fragment.html.j2").render(entries=views, version=__version__, compact=compact, top=top)
