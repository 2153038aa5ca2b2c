"""The pairwise interaction heatmap: an explanation's order-2 interaction terms as an n x n matrix,
drawn by matplotlib as SVG markup to inline in the page (as :mod:`.chart`: no script, no URL,
deterministic ids).

Rows and columns are the players in player order; cell (a, b) and cell (b, a) both hold the term of
the pair {a, b} (the matrix is symmetric), coloured on the page's diverging scale
(:class:`~.colors.DivergingScale` of the pair terms); the diagonal is blank (a player's own value is
in the bar chart). Every cell is one group with the id ``cell-<a>-<b>`` (player indices) and a
``<title>`` ("A × B: +x nats") that a browser shows on hover. Pairs with no term are blank.

The indices (what a term means) are shapiq's: SII (Grabisch & Roubens 1999), k-SII (Bordt & von
Luxburg 2023), FSII (Tsai et al. 2023), STII (Sundararajan et al. 2020); for pairs SII and k-SII
coincide.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .chart import inline_svg
from .colors import DivergingScale, _matplotlib

__all__ = ("MAX_PLAYERS", "PairTerms", "heatmap_svg", "pair_terms")

MAX_PLAYERS = 40
"""The most players a heatmap shows; a run with more shows the players of its largest pair terms."""

TIMES = " \u00d7 "


@dataclass(frozen=True, slots=True, kw_only=True)
class PairTerms:
    """The order-2 interaction terms of an explanation, and the players the heatmap shows.

    Attributes:
        pairs: ``{(a, b): value}`` with ``a < b`` player indices (positions in ``players``), in
            the document's unit; only finite terms.
        shown: the players drawn, in player order (all of them when there are at most
            :data:`MAX_PLAYERS`, else those of the largest terms by |value|).
        n_players: the explanation's players.
        n_top: with a selection, how many of the largest terms chose ``shown`` (else 0).
    """

    pairs: dict[tuple[int, int], float]
    shown: tuple[int, ...]
    n_players: int
    n_top: int = 0


def pair_terms(doc: Mapping[str, Any], max_players: int = MAX_PLAYERS) -> PairTerms | None:
    """The order-2 terms of a document's ``interactions`` (``None`` when it has none).

    A term names its players by ``player_indices`` (their ``index``), or else by their labels.
    """
    players = doc["players"]
    position = {int(p.get("index", k)): k for k, p in enumerate(players)}
    by_label = {p["label"]: k for k, p in enumerate(players)}
    pairs: dict[tuple[int, int], float] = {}
    for term in doc.get("interactions") or ():
        if not isinstance(term, Mapping):
            continue
        value = term.get("value")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if isinstance(term.get("player_indices"), list):
            members = [position.get(i) for i in term["player_indices"] if isinstance(i, int)]
        else:
            members = [by_label.get(label) for label in term.get("players") or ()]
        if len(members) != 2 or None in members or members[0] == members[1]:
            continue  # not a pair (orders 3.. are listed in the run's facts)
        a, b = sorted(m for m in members if m is not None)
        pairs[(a, b)] = float(value)
    if not pairs:
        return None
    n = len(players)
    if n <= max_players:
        return PairTerms(pairs=pairs, shown=tuple(range(n)), n_players=n)
    chosen: set[int] = set()
    used = 0
    for a, b in sorted(pairs, key=lambda ab: (-abs(pairs[ab]), ab)):
        new = {a, b} - chosen
        if len(chosen) + len(new) > max_players:
            break
        chosen |= new
        used += 1
    return PairTerms(pairs=pairs, shown=tuple(sorted(chosen)), n_players=n, n_top=used)


def heatmap_svg(
    terms: PairTerms,
    labels: Sequence[str],
    names: Sequence[str],
    *,
    unit: str,
    scale: DivergingScale,
    chart_id: str,
    title: str,
    fmt: Any,
) -> str:
    """The heatmap of ``terms`` as inline SVG markup.

    Args:
        terms: the pair terms and the players shown (:func:`pair_terms`).
        labels: ``[n_players]`` tick labels (the bar chart's: label and the start of the text).
        names: ``[n_players]`` the players' labels, for the cells' tooltips.
        unit: the terms' unit.
        scale: the colour scale of the cells.
        chart_id: a string unique on the page (prefixes the element ids).
        title: the heatmap's title (drawn above it and its accessible name).
        fmt: formats a value for a tooltip (the page's signed number format).

    Returns:
        ``<svg ...>...</svg>`` markup with no URL, script or external reference.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    mpl = _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    shown = list(terms.shown)
    m = len(shown)
    cell = 0.24 if m <= 20 else 0.18
    side = 2.6 + cell * m
    tips: dict[str, str] = {}
    rc = {"svg.fonttype": "none", "svg.hashsalt": chart_id, "font.size": 8 if m <= 20 else 7, "axes.titlesize": 10, "text.parse_math": False}
    with mpl.rc_context(rc):
        fig = Figure(figsize=(side + 0.6, side), layout="constrained")
        ax = fig.add_subplot()
        for row, a in enumerate(shown):
            for col, b in enumerate(shown):
                value = terms.pairs.get((min(a, b), max(a, b))) if a != b else None
                if value is None:
                    continue
                gid = f"cell-{a}-{b}"
                tips[gid] = f"{names[a]}{TIMES}{names[b]}: {fmt(value, sign=True)} {unit}"
                # a white gap between cells instead of an edge: no stroke to write for each cell
                ax.add_patch(Rectangle((col - 0.46, row - 0.46), 0.92, 0.92, facecolor=scale.color(value), edgecolor="none", linewidth=0, gid=gid, clip_on=False))
        ax.set_xlim(-0.5, m - 0.5)
        ax.set_ylim(m - 0.5, -0.5)  # the first player at the top
        ax.set_aspect("equal")
        ax.set_xticks(range(m), [labels[i] for i in shown], rotation=90, parse_math=False)
        ax.set_yticks(range(m), [labels[i] for i in shown], parse_math=False)
        ax.tick_params(length=2)
        for spine in ax.spines.values():
            spine.set_color("#bbbbbb")
        ax.set_title(title, loc="left", parse_math=False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = _add_titles(buf.getvalue(), tips)
    return inline_svg(svg, chart_id, title)


_CELL = re.compile(r'<g id="([^"]+)">\s*<path d="([^"]*)"')
_DECIMALS = re.compile(r"(\.\d\d)\d+")


def _add_titles(svg: str, tips: Mapping[str, str]) -> str:
    """A ``<title>`` as the first child of each cell's group (its tooltip), and the cell's path
    written compactly (one line, coordinates to 1/100 point): a 40-player matrix has 1560 cells."""

    def add(match: re.Match[str]) -> str:
        tip = tips.get(match.group(1))
        if tip is None:
            return match.group(0)
        path = _DECIMALS.sub(r"\1", " ".join(match.group(2).split()))
        return f'<g id="{match.group(1)}"><title>{html.escape(tip, quote=False)}</title><path d="{path}"'

    return _CELL.sub(add, svg)
