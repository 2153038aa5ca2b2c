"""The comparison page: several explanations of one conversation side by side, as one
self-contained HTML file (``coalescence compare ... --html PATH``).

It shows what :meth:`coalescence.app.compare.Comparison.format` prints, laid out: a table of each
explanation's value and rank for every player (rows in the first explanation's rank order, numbers
rounded as the printed table: four decimals), the agreement of each with the first (Spearman's
rank correlation, the top-k overlap) and, where an ``exact`` explanation is among them, each one's
largest and root-mean-square error against it; then one small bar chart per explanation, every
chart on the same colour scale and the same value axis, the players in the same order (the
first's ranking), so the charts can be read against each other. Like the report: no script, no
URL (matplotlib's SVG inlined, :mod:`.chart`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup

from .._version import __version__
from .chart import bar_chart_svg, ranked_order
from .colors import DivergingScale
from .page import _environment
from .views import _legend, _ranks, _short_label

__all__ = ("render_comparison",)


def _num(x: Any, spec: str = "+.4f") -> str:
    """A number as the printed comparison writes it; ``n/a`` when missing."""
    if x is None or not isinstance(x, int | float) or not math.isfinite(float(x)):
        return "n/a"
    return format(float(x), spec)


def _xlim(columns: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """One value axis for every chart: the values and their ±1 standard error bars, with 5% room."""
    lo, hi = 0.0, 0.0
    for c in columns:
        errors = c.get("stderr") or [None] * len(c["values"])
        for v, e in zip(c["values"], errors, strict=True):
            if v is None or not math.isfinite(v):
                continue
            e = e if e is not None and math.isfinite(e) else 0.0
            lo, hi = min(lo, v - e), max(hi, v + e)
    pad = 0.05 * (hi - lo) if hi > lo else 1.0
    return lo - pad, hi + pad


def render_comparison(comparison: Mapping[str, Any], *, scale: str = "robust", title: str = "") -> str:
    """The page of a comparison.

    Args:
        comparison: :meth:`Comparison.to_dict() <coalescence.app.compare.Comparison.to_dict>`
            (``players``, ``unit``, ``top_k``, ``columns``).
        scale: the colour scale of the bars, ``robust`` or ``linear`` (:mod:`.colors`), over every
            explanation's values together.
        title: the page's title (default: the number of explanations compared).

    Returns:
        The HTML text: no script, no external resource, no URL.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    from ..attribution.estimators import is_exact

    players = comparison["players"]
    columns = comparison["columns"]
    unit = str(comparison.get("value_unit") or "nats")
    labels = [_short_label(p["label"], p["text"]) for p in players]
    order = ranked_order(columns[0]["values"])
    colour = DivergingScale.for_values([v for c in columns for v in c["values"]], scale)
    xlim = _xlim(columns)
    ranks = [_ranks(c["values"]) for c in columns]
    has_exact = any(c.get("max_error") is not None for c in columns)
    rows = [
        {
            "label": players[i]["label"],
            "text": players[i]["text"],
            "cells": [
                {"value": _num(c["values"][i]), "rank": ranks[k][i], "color": colour.color(c["values"][i]), "text_color": colour.text_color(c["values"][i])}
                for k, c in enumerate(columns)
            ],
        }
        for i in order
    ]
    charts = []
    ids: list[str] = []
    for k, c in enumerate(columns):
        slug = "cmp-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", str(c["name"])).strip("-") or str(k))
        ids.append(slug if slug not in ids else f"{slug}-{k}")
        stderr = c.get("stderr")
        svg = bar_chart_svg(
            labels,
            c["values"],
            stderr,
            unit=unit,
            scale=colour,
            chart_id=f"{ids[k]}-chart",
            title=f"{c['name']}: values of {len(players)} players, in the order of {columns[0]['name']}",
            order=order,
            xlim=xlim,
            width=4.8,
        )
        charts.append({"id": ids[k], "name": c["name"], "method": c.get("method", ""), "svg": Markup(svg), "has_se": stderr is not None})
    agreement = [
        {
            "name": c["name"],
            "reference": k == 0,
            "spearman": _num(c.get("spearman"), "+.3f") if c.get("spearman") is not None or not c.get("spearman_undefined") else f"none: {c['spearman_undefined']}",
            "overlap": _num(c.get("top_overlap"), ".2f"),
            "max_error": _num(c.get("max_error"), ".4f") if c.get("max_error") is not None else "",
            "rmse": _num(c.get("rmse"), ".4f") if c.get("rmse") is not None else "",
            "is_exact": is_exact(c.get("method")),
        }
        for k, c in enumerate(columns)
    ]
    return _environment().get_template("compare.html.j2").render(
        title=title or f"coalescence compare: {len(columns)} explanations of one conversation",
        unit=unit,
        top_k=comparison.get("top_k"),
        columns=columns,
        reference=columns[0]["name"],
        rows=rows,
        agreement=agreement,
        has_exact=has_exact,
        charts=charts,
        legend=_legend(colour, unit, scale),
        version=__version__,
    )
