"""Explanations presented: the ranked table for a terminal, the bar chart on a matplotlib Axes or
in an image file, the whole report and the compact notebook view.

:class:`~coalescence.attribution.explanation.Explanation` holds data only; its display methods
(``format_table``, ``plot``, ``save_chart``, ``report``, ``_repr_html_``) delegate to the formatter
installed with :func:`~coalescence.attribution.explanation.set_formatter`, an
:class:`ExplanationFormatter` of this module unless replaced (``import coalescence`` installs it).
So the attribution package never imports the report; the report reads the result.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..attribution.explanation import _num, _optional
from ..attribution.interactions import EFFICIENT_INDICES
from ..attribution.estimators.registry import is_exact
from .views import diagnostic_value, proxy_line

if TYPE_CHECKING:
    from ..attribution.explanation import Explanation
    from . import ReportView

__all__ = ("ExplanationFormatter", "format_table", "proxy_line")


def _fmt(x: float, *, sign: bool = False) -> str:
    """Four decimals, or four significant digits in scientific notation below 1e-3 (e.g. ``prob``)."""
    x = float(x)
    if x != 0 and math.isfinite(x) and abs(x) < 1e-3:
        return f"{x:+.3e}" if sign else f"{x:.3e}"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def _snip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _bar_label(player: Any, n: int = 28) -> str:
    """A chart's bar label: the player's label and the start of its text (as the HTML chart)."""
    text = " ".join(player.text.split())
    if len(text) > n:
        text = text[: n - 1] + "\u2026"
    return f"{player.label} {text}"


def format_table(explanation: Explanation, *, snippet: int = 60) -> str:
    """A ranked plain-text table and a summary, for a terminal: rank, value (in the explanation's
    unit, four decimals), standard error where the method has them, label and text of each player;
    then the target, the run, v(empty), v(full), the efficiency gap, the evaluations, the proxy
    game where there is one, why sampling stopped, the diagnostics, the top interactions and the
    notes.

    Args:
        explanation: the explanation.
        snippet: the most characters of each player's text shown.

    Returns:
        The lines joined by ``\\n`` (no final newline).
    """
    est = explanation.estimate
    has_se = est.stderr is not None
    rows = []
    for rank, i in enumerate(explanation.ranking(), start=1):
        p = explanation.snapshot.players[i]
        text = " ".join(p.text.split())
        if len(text) > snippet:
            text = text[: snippet - 1] + "\u2026"
        se = ""
        if has_se:
            s = _num(est.stderr[i])
            se = "-" if s is None else _fmt(s)
        rows.append((str(rank), _fmt(est.values[i], sign=True), se, p.label, text))
    head = ("rank", f"value ({explanation.utility_unit})", "stderr" if has_se else "", "player", "text")
    cols = [head, *rows]
    widths = [max(len(r[c]) for r in cols) for c in range(4)]
    lines = []
    for r in cols:
        cells = [r[0].rjust(widths[0]), r[1].rjust(widths[1])]
        if has_se:
            cells.append(r[2].rjust(widths[2]))
        cells += [r[3].ljust(widths[3]), r[4]]
        lines.append("  ".join(cells).rstrip())
    span = est.v_full - est.v_empty
    gap = est.efficiency_gap
    if abs(gap) <= 1e-12 * max(1.0, abs(span)):  # an efficient method's sum, off by float rounding alone: the 0 it is
        gap = 0.0
    rel = abs(gap) / abs(span) if span else float("nan")
    proxied = int((explanation.proxy or {}).get("evaluations") or 0)  # the proxy game's rows computed in this session
    rate = explanation.n_evaluations / explanation.wall_seconds if explanation.n_evaluations and explanation.wall_seconds > 0 else float("nan")
    target = " ".join(explanation.snapshot.target.split())
    if len(target) > 100:
        target = target[:99] + "\u2026"
    lines += [
        "",
        f"target ({explanation.snapshot.conversation.target_source.replace('_', ' ')}): {target}",
        f"method {est.method}, model {explanation.model_id}, unit {explanation.snapshot.unit}, "
        f"absence policy {explanation.absence_policy}, utility {explanation.utility} "
        f"({explanation.utility_description or f'log p of {explanation.target_token_count} target tokens, nats'})",
        f"v(empty) = {_fmt(est.v_empty)}   v(full) = {_fmt(est.v_full)}   "
        f"v(full) - v(empty) = {_fmt(span)}",
        f"sum of values = {_fmt(float(est.values.sum()))}"
        + (
            f" (+ interactions {_fmt(sum(v for _, v in est.interactions), sign=True)}: {est.interaction_index} is efficient over all its orders)"
            if est.interactions and not is_exact(est.method) and est.interaction_index in EFFICIENT_INDICES
            else ""
        )
        + f"   efficiency gap = {gap:.3g}"
        + (f" ({rel:.2g} of |v(full) - v(empty)|)" if math.isfinite(rel) else " (v(full) = v(empty))"),
        f"model evaluations = {explanation.n_evaluations}"
        + (f" exact + {proxied} proxy rows" if proxied else "")
        + f" (coalitions used: {est.n_evaluations})   wall time = {explanation.wall_seconds:.1f} s"
        + (
            f"   ({rate:.2g} evaluations/s)" if math.isfinite(rate)
            else "" if proxied else "   (no model evaluations in this session)"
        ),
    ]
    proxy = explanation.proxy  # a two-fidelity fit's proxy game
    if proxy is not None:
        lines.append(proxy_line(proxy, used=est.diagnostics.get("proxy_used", 1.0) != 0.0))
    if explanation.stopping is not None:
        st = explanation.stopping
        what = {
            "target": f"every standard error is below {st['target_stderr']:g}",
            "exact": "the budget covered every coalition, so the values are exact",
            "budget": f"the budget of {st['budget']} evaluations was spent before every standard "
            f"error got below {st['target_stderr']:g}",
        }[st["reason"]]
        worst = "" if st["max_stderr"] is None else f"; largest standard error {st['max_stderr']:.4g}"
        if st.get("unknown_stderr"):
            worst += f"; {st['unknown_stderr']} standard errors unknown (too few samples to say)"
        lines.append(f"stopped after {st['rounds']} round{'' if st['rounds'] == 1 else 's'}: {what}{worst}")
    if est.diagnostics:
        lines.append("diagnostics: " + "   ".join(f"{k} = {diagnostic_value(v)}" for k, v in est.diagnostics.items()))
    if est.interactions:
        top = explanation.top_interactions(5)
        order = max(len(p) for p, _ in est.interactions)
        lines.append(
            f"top {len(top)} of {len(est.interactions)} interactions ({est.interaction_index}, orders 2..{order}, "
            f"{explanation.utility_unit}), largest |value| first:"
        )
        for players, value in top:
            who = " x ".join(explanation.snapshot.players[i].label for i in players)
            texts = " | ".join(_snip(explanation.snapshot.players[i].text, 28) for i in players)
            lines.append(f"  {_fmt(value, sign=True)}  {who}  ({texts})")
        if is_exact(est.method):
            lines.append("  (exact, from every coalition; the values above are Shapley values)")
        else:
            if est.interaction_index in EFFICIENT_INDICES:
                lines.append(
                    f"  (the values above are {est.interaction_index}'s order-1 terms; with the interactions "
                    "they sum to v(full) - v(empty))"
                )
            lines.append(
                f"  (sampled from {est.n_evaluations} coalitions: interactions need far more evaluations than values; "
                "on real games they were off by 0.5-3x their size at 1024 (docs/methods.md: Which estimator). "
                "Use --method exact --interactions 2 where 2^n evaluations are affordable)"
            )
    lines += [f"note: {n}" for n in explanation.notes]
    return "\n".join(lines)


class ExplanationFormatter:
    """The report's presentation of an :class:`~coalescence.attribution.explanation.Explanation`:
    what its display methods call (the methods' docstrings there say what each returns and raises).
    Stateless; subclass it and install the subclass with
    :func:`~coalescence.attribution.explanation.set_formatter` to present explanations otherwise.
    """

    __slots__ = ()

    def format_table(self, explanation: Explanation, *, snippet: int = 60) -> str:
        """A ranked plain-text table and a summary, for a terminal (:func:`format_table`)."""
        return format_table(explanation, snippet=snippet)

    def plot(self, explanation: Explanation, ax: Any = None, *, top: int | None = None, scale: str = "robust") -> Any:
        """The ranked bar chart of the values on a matplotlib Axes, drawn by the HTML report's code
        (:func:`coalescence.report.chart.draw_bars`); labels as plain text (``parse_math=False``).

        Returns:
            The ``matplotlib.axes.Axes``.

        Raises:
            BackendUnavailable: matplotlib is not installed (with the install command).
        """
        plt = _optional("matplotlib.pyplot")
        from .chart import draw_bars
        from .colors import DivergingScale

        order = explanation.ranking()[: top if top is not None else None]
        est = explanation.estimate
        labels = [_bar_label(p) for p in explanation.snapshot.players]
        values = [float(v) for v in est.values]
        errors = None if est.stderr is None else [float(s) for s in est.stderr]
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.35 * len(order) + 1.2), layout="constrained")
        # labels are text, never mathtext: "lunch $5 vs taxi $60" stays as written
        scale_ = DivergingScale.for_values(values, scale)
        draw_bars(ax, labels, values, errors, unit=explanation.utility_unit, scale=scale_, order=order)
        title = (
            f"{est.method}: {explanation.utility_description or explanation.utility}, "
            f"v(full) - v(empty) = {est.v_full - est.v_empty:+.3f}"
        )
        ax.set_title(title, parse_math=False)
        return ax

    def save_chart(self, explanation: Explanation, path: str | Path, *, scale: str = "robust") -> Path:
        """Write the ranked bar chart as a PNG or SVG file (:func:`~coalescence.report.write_chart_image`)."""
        from . import write_chart_image

        return write_chart_image(path, explanation.to_dict(), scale=scale, field="path")

    def report(self, explanation: Explanation, path: str | Path | None = None, *, scale: str = "robust") -> ReportView:
        """The whole report as a :class:`~coalescence.report.ReportView`, written to ``path`` if given."""
        from . import ReportView

        view = ReportView(explanation.to_dict(), scale=scale)
        if path is not None:
            view.save(path)
        return view

    def notebook_html(self, explanation: Explanation) -> str | None:
        """The compact view for Jupyter (:func:`~coalescence.report.explanation_fragment`); ``None``
        without the report's packages."""
        try:
            from .page import explanation_fragment

            return explanation_fragment(explanation.to_dict(), compact=True)
        except ImportError:
            return None
