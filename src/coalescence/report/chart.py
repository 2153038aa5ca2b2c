"""The ranked bar chart of the values, drawn by matplotlib: SVG markup to inline in the page, the
same chart as an image file (PNG or SVG), and the drawing itself for ``Explanation.plot()``.

matplotlib's SVG backend writes plain vector markup: no script, no external reference, no raster
image. Text is kept as ``<text>`` (``svg.fonttype: none``) rather than one path per glyph, which
keeps the chart of a 100-player run near 100 kB. The XML prolog, DOCTYPE, metadata block and
namespace declarations are dropped: inside HTML the parser puts ``<svg>`` in the SVG namespace by
itself, so the page holds no URL at all. ``svg.hashsalt`` makes the element ids depend on the chart
(two charts on one page never share a clip-path id) and the output deterministic. Labels are
plain text: matplotlib's mathtext (``$...$``) is off for every text of the chart. Each bar is one
group with the id ``bar-<player index>`` (scoped by the chart's id on a page).
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .colors import DivergingScale, _matplotlib

__all__ = ("IMAGE_FORMATS", "PNG_DPI", "BarChart", "bar_chart_svg", "chart_image", "draw_bars", "inline_svg", "ranked_order")

_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.S)
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.S)
_NAMESPACES = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')

IMAGE_FORMATS = ("png", "svg")
"""The image formats of :func:`chart_image` (``report --image``: by the file's suffix)."""
PNG_DPI = 150
"""The resolution of a PNG chart, in dots per inch (a 6.4-inch-wide chart is 960 pixels wide)."""
_WIDTH = 6.4  # inches: the page's chart and the image


@dataclass(frozen=True, slots=True, kw_only=True)
class BarChart:
    """One explanation's ranked bar chart, as drawn.

    Attributes:
        labels: ``[n]`` bar labels, in player order.
        values: ``[n]`` values in ``unit``, in player order (``None``: no bar).
        stderr: ``[n]`` standard errors (±1 standard error bars), or ``None`` for a method without.
        unit: the values' unit.
        scale: the colour scale of the bars.
        title: the panel's title in an image of several charts (``""``: none).
    """

    labels: tuple[str, ...]
    values: tuple[float | None, ...]
    stderr: tuple[float | None, ...] | None
    unit: str
    scale: DivergingScale
    title: str = ""


def _finite(v: float | None) -> float:
    return float(v) if v is not None and math.isfinite(float(v)) else math.nan


def ranked_order(values: Sequence[float | None]) -> list[int]:
    """Player indices by decreasing value (ties keep player order; missing values last)."""
    vals = [_finite(v) for v in values]
    return sorted(range(len(vals)), key=lambda i: (-vals[i] if not math.isnan(vals[i]) else math.inf, i))


def _rc(n: int, salt: str) -> dict[str, Any]:
    # labels are text: "text.parse_math" off for every Text made here (tick labels are made while the
    # figure is drawn, inside this context), so "lunch $5 vs taxi $60" is not drawn as mathtext and
    # "cost_$x^$" does not fail to parse
    return {
        "svg.fonttype": "none",
        "svg.hashsalt": salt,
        "font.size": 9 if n <= 40 else 7,
        "axes.titlesize": 10,
        "text.parse_math": False,
    }


def _height(n: int) -> float:
    """The chart's height in inches for ``n`` bars."""
    return 0.9 + (0.22 if n <= 40 else 0.16) * n


def draw_bars(
    ax: Any,
    labels: Sequence[str],
    values: Sequence[float | None],
    stderr: Sequence[float | None] | None,
    *,
    unit: str,
    scale: DivergingScale,
    order: Sequence[int] | None = None,
    xlim: tuple[float, float] | None = None,
) -> list[int]:
    """Draw the horizontal bar chart on a matplotlib Axes: one bar per player of ``order`` (default:
    every player, largest value first) from the top, coloured by ``scale``, ±1 standard error bars,
    a line at zero, labels as plain text. The page's chart, the image and ``Explanation.plot()``
    are all drawn here.

    Args:
        ax: the Axes.
        labels, values, stderr, unit, scale: as :class:`BarChart` (player order).
        order: the players drawn, top to bottom (default: :func:`ranked_order`).
        xlim: the value axis's limits (several charts on one scale), or ``None`` (matplotlib's).

    Returns:
        The players drawn, top to bottom.
    """
    order = list(ranked_order(values) if order is None else order)
    n = len(order)
    vals = [_finite(values[i]) for i in order]
    shown = [0.0 if math.isnan(v) else v for v in vals]
    errors = None
    if stderr is not None:
        errors = [0.0 if math.isnan(e := _finite(stderr[i])) else e for i in order]
    bars = ax.barh(
        range(n),
        shown,
        xerr=errors,
        color=[scale.color(v) for v in shown],
        edgecolor="#555555",
        linewidth=0.5,
        error_kw={"ecolor": "#000000", "elinewidth": 0.9, "capsize": 2},
    )
    for rect, i in zip(bars.patches, order, strict=True):
        rect.set_gid(f"bar-{i}")
    ax.set_yticks(range(n), [labels[i] for i in order], parse_math=False)
    ax.axvline(0.0, color="#000000", linewidth=0.8)
    ax.set_xlabel(f"value ({unit})" + ("\nerror bars: ±1 standard error" if errors is not None else ""), parse_math=False)
    ax.set_ylim(n - 0.5, -0.5)  # the first at the top
    if xlim is not None:
        ax.set_xlim(*xlim)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    return order


def bar_chart_svg(
    labels: Sequence[str],
    values: Sequence[float | None],
    stderr: Sequence[float | None] | None,
    *,
    unit: str,
    scale: DivergingScale,
    chart_id: str,
    title: str = "",
    order: Sequence[int] | None = None,
    xlim: tuple[float, float] | None = None,
    width: float = _WIDTH,
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
        order: the players drawn, top to bottom (default: largest value first).
        xlim: the value axis's limits (charts compared on one scale), or ``None``.
        width: the chart's width in inches (a small chart of several side by side: narrower).

    Returns:
        ``<svg ...>...</svg>`` markup with no URL, script or external reference.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    mpl = _matplotlib()
    from matplotlib.figure import Figure

    n = len(labels) if order is None else len(order)
    with mpl.rc_context(_rc(n, chart_id)):
        fig = Figure(figsize=(width, _height(n)), layout="constrained")
        draw_bars(fig.add_subplot(), labels, values, stderr, unit=unit, scale=scale, order=order, xlim=xlim)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    label = title or f"values of {n} players, largest first"
    return inline_svg(buf.getvalue(), chart_id, label)


def inline_svg(svg: str, prefix: str, label: str) -> str:
    """matplotlib's SVG document made an element to inline in HTML: no prolog, metadata or
    namespace declarations, every id prefixed by ``prefix``, ``role="img"`` named ``label``."""
    svg = _PROLOG.sub("", svg, count=1)
    svg = _METADATA.sub("", svg, count=1)
    svg = _NAMESPACES.sub("", svg.split(">", 1)[0]) + ">" + svg.split(">", 1)[1]
    svg = _scope_ids(svg, prefix)
    return svg.replace("<svg", f'<svg role="img" aria-label="{html.escape(label)}"', 1).strip()


def chart_image(charts: Sequence[BarChart], *, format: str) -> bytes:  # noqa: A002 (matplotlib's word)
    """The bar charts of ``charts`` as one image file: one panel each, stacked, titled when there
    are several (the same drawing as the page's charts, :func:`draw_bars`).

    Args:
        charts: the charts, top to bottom (at least one).
        format: ``png`` (at :data:`PNG_DPI` dots per inch) or ``svg`` (a standalone SVG document,
            text kept as text).

    Returns:
        The file's bytes.

    Raises:
        ValueError: an unknown format or no chart.
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    if format not in IMAGE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(IMAGE_FORMATS)}, got {format!r}")
    if not charts:
        raise ValueError("no chart to draw")
    mpl = _matplotlib()
    from matplotlib.figure import Figure

    sizes = [len(c.labels) for c in charts]
    titled = len(charts) > 1 or bool(charts[0].title)
    heights = [_height(n) + (0.3 if titled else 0.0) for n in sizes]
    with mpl.rc_context(_rc(max(sizes), "chart")):
        fig = Figure(figsize=(_WIDTH, sum(heights)), layout="constrained")
        axes = fig.subplots(len(charts), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
        for ax, chart in zip(axes, charts, strict=True):
            draw_bars(ax, chart.labels, chart.values, chart.stderr, unit=chart.unit, scale=chart.scale)
            if chart.title:
                ax.set_title(chart.title, loc="left", parse_math=False)
        buf = io.BytesIO()
        metadata = {"Date": None, "Creator": None, "Format": None, "Type": None} if format == "svg" else {"Software": None}
        fig.savefig(buf, format=format, dpi=PNG_DPI, metadata=metadata)
    return buf.getvalue()


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
