"""The ranked bar chart of the values, drawn by matplotlib as SVG markup to inline in the page.

matplotlib's SVG backend writes plain vector markup: no script, no external reference, no raster
image. Text is kept as ``<text>`` (``svg.fonttype: none``) rather than one path per glyph, which
keeps the chart of a 100-player run near 100 kB. The XML prolog, DOCTYPE, metadata block and
namespace declarations are dropped: inside HTML the parser puts ``<svg>`` in the SVG namespace by
itself, so the page holds no URL at all. ``svg.hashsalt`` makes the element ids depend on the chart
(two charts on one page never share a clip-path id) and the output deterministic. Labels are
plain text: matplotlib's mathtext (``$...$``) is off for every text of the chart.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence

from .colors import DivergingScale, _matplotlib

__all__ = ("bar_chart_svg",)

_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.S)
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.S)
_NAMESPACES = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def bar_chart_svg(
    labels: Sequence[str],
    values: Sequence[float | None],
    stderr: Sequence[float | None] | None,
    *,
    unit: str,
    scale: DivergingScale,
    chart_id: str,
    title: str = "",
) -> str:
    """A horizontal bar chart of ``values``, largest first, as inline SVG markup.

    Args:
        labels: ``[n]`` player labels, in player order.
        values: ``[n]`` values (in ``unit``), in player order; ``None`` draws no bar.
        stderr: ``[n]`` standard errors drawn as error bars (±1 standard error), or ``None`` for
            a method without them; ``None`` entries draw none.
        unit: the values' unit, for the axis label.
        scale: the colour scale of the bars (the page's highlight scale).
        chart_id: a string unique on the page (salts the SVG's element ids).
        title: the chart's accessible name (``aria-label``).

    Returns:
        ``<svg ...>...</svg>`` markup with no URL, script or external reference.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    mpl = _matplotlib()
    from matplotlib.figure import Figure

    n = len(labels)
    vals = [float(v) if v is not None and math.isfinite(float(v)) else math.nan for v in values]
    order = sorted(range(n), key=lambda i: (-vals[i] if not math.isnan(vals[i]) else math.inf, i))
    shown = [0.0 if math.isnan(vals[i]) else vals[i] for i in order]
    errors = None
    if stderr is not None:
        errors = [float(s) if s is not None and math.isfinite(float(s)) else 0.0 for s in (stderr[i] for i in order)]
    row = 0.22 if n <= 40 else 0.16
    # labels are text: "text.parse_math" off for every Text made here (tick labels are made while the
    # figure is drawn, inside this context), so "lunch $5 vs taxi $60" is not drawn as mathtext and
    # "cost_$x^$" does not fail to parse
    rc = {
        "svg.fonttype": "none",
        "svg.hashsalt": chart_id,
        "font.size": 9 if n <= 40 else 7,
        "axes.titlesize": 10,
        "text.parse_math": False,
    }
    with mpl.rc_context(rc):
        fig = Figure(figsize=(6.4, 0.9 + row * n), layout="constrained")
        ax = fig.add_subplot()
        ax.barh(
            range(n),
            shown,
            xerr=errors,
            color=[scale.color(v) for v in shown],
            edgecolor="#555555",
            linewidth=0.5,
            error_kw={"ecolor": "#000000", "elinewidth": 0.9, "capsize": 2},
        )
        ax.set_yticks(range(n), [labels[i] for i in order], parse_math=False)
        ax.invert_yaxis()
        ax.axvline(0.0, color="#000000", linewidth=0.8)
        ax.set_xlabel(f"value ({unit})" + ("; bars: ±1 standard error" if errors is not None else ""), parse_math=False)
        ax.set_ylim(n - 0.5, -0.5)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = _PROLOG.sub("", buf.getvalue(), count=1)
    svg = _METADATA.sub("", svg, count=1)
    svg = _NAMESPACES.sub("", svg.split(">", 1)[0]) + ">" + svg.split(">", 1)[1]
    svg = _scope_ids(svg, chart_id)
    label = title or f"values of {n} players, largest first"
    return svg.replace("<svg", f'<svg role="img" aria-label="{_attr(label)}"', 1).strip()


def _scope_ids(svg: str, prefix: str) -> str:
    """Prefix every element id of ``svg`` and every reference to one (``href="#id"``, ``url(#id)``),
    so that several charts on one page never share an id (matplotlib names groups ``figure_1``,
    ``axes_1``, ... in every chart)."""
    ids = set(re.findall(r'\bid="([^"]+)"', svg))

    def ref(match: re.Match[str]) -> str:
        name = match.group(2)
        return f"{match.group(1)}{prefix}-{name}" if name in ids else match.group(0)

    svg = re.sub(r'(\bid=")([^"]+)', ref, svg)
    svg = re.sub(r'(href="#)([^"]+)', ref, svg)
    return re.sub(r"(url\(#)([^)]+)", ref, svg)


def _attr(text: str) -> str:
    """``text`` escaped for a double-quoted attribute."""
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")
