"""One explanation's view on the report page: its players on the colour scale, the conversation
as chat turns, the answer's tokens, the ranked chart, the interactions, the reading guide and the
run's facts, as the plain data the templates lay out (:mod:`.page`).

Ranks come with the range their 95% intervals allow (:func:`rank_ranges`), and the bar chart of an
explanation document is built here once for the page and the image file (:func:`explanation_chart`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

from .chart import BarChart, bar_chart_svg
from .colors import DivergingScale, neutral_color
from .heatmap import TIMES, heatmap_svg, pair_terms

__all__ = ("diagnostic_value", "explanation_chart", "explanation_view", "proxy_line", "rank_ranges")


def _fmt(x: Any, *, sign: bool = False) -> str:
    """Four decimals, or four significant digits below 1e-3; ``n/a`` for a missing number."""
    if x is None or not isinstance(x, int | float) or not math.isfinite(float(x)):
        return "n/a"
    x = float(x)
    if x != 0 and abs(x) < 1e-3:
        return f"{x:+.3e}" if sign else f"{x:.3e}"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def diagnostic_value(x: Any) -> str:
    """An estimate's diagnostic as the printout and the page show it: a whole number (a count:
    ``proxy_evaluations``, ``n_train``) as an integer, any other number to 4 significant digits,
    ``n/a`` for NaN or a missing one (e.g. ``lds`` where nothing was held out)."""
    if x is None or isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(float(x)):
        return "n/a"
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:.4g}"


def _exact(text: str) -> Markup:
    """``text`` HTML-escaped for element content, every character kept (``\\r`` as ``&#13;``)."""
    return Markup(str(escape(text)).replace("\r", "&#13;"))


def _snippet(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _ranks(values: Sequence[float | None]) -> list[int]:
    """1-based rank of each player by decreasing value (ties keep player order; missing values last)."""
    key = [(-v if v is not None and math.isfinite(v) else math.inf, i) for i, v in enumerate(values)]
    ranks = [0] * len(values)
    for r, (_, i) in enumerate(sorted(key), start=1):
        ranks[i] = r
    return ranks


def rank_ranges(values: Sequence[float | None], stderr: Sequence[float | None] | None, z: float = 1.96) -> list[tuple[int, int]]:
    """Each player's rank as a range ``(best, worst)`` its 95% interval allows: ``best`` is 1 plus
    the players whose interval lies wholly above its own, ``worst`` the players whose interval
    reaches its own or above (itself included). Without standard errors (or a missing one), the
    range is the point rank. Intervals are ``value +- z * stderr``.

    Returns:
        ``[(best, worst)]`` in player order, 1-based, ``best <= rank <= worst``.
    """
    ranks = _ranks(values)
    if stderr is None:
        return [(r, r) for r in ranks]
    known = [
        (float(v) - z * float(e), float(v) + z * float(e))
        if v is not None and e is not None and math.isfinite(float(v)) and math.isfinite(float(e))
        else None
        for v, e in zip(values, stderr, strict=True)
    ]
    out = []
    for i, own in enumerate(known):
        if own is None:
            out.append((ranks[i], ranks[i]))
            continue
        above = sum(1 for j, other in enumerate(known) if j != i and other is not None and other[0] > own[1])
        reach = sum(1 for j, other in enumerate(known) if other is not None and other[1] >= own[0])
        best, worst = min(1 + above, ranks[i]), max(reach, ranks[i])
        out.append((best, worst))
    return out


def _rank_text(best: int, worst: int) -> str:
    return str(best) if best == worst else f"{best}\u2013{worst}"


def _players(doc: Mapping[str, Any], section: str, unit: str, scale_name: str = "robust") -> tuple[list[dict[str, Any]], DivergingScale]:
    players = doc["players"]
    values = [p.get("value") for p in players]
    scale = DivergingScale.for_values(values, scale_name)
    ranks = _ranks(values)
    has_se = any(p.get("stderr") is not None for p in players)
    ranges = rank_ranges(values, [p.get("stderr") for p in players] if has_se else None)
    n = len(players)
    out = []
    for i, p in enumerate(players):
        value, stderr = p.get("value"), p.get("stderr")
        shown = f"{_fmt(value, sign=True)}" + (f" \u00b1 {_fmt(stderr)}" if stderr is not None else "")
        rank_text = _rank_text(*ranges[i])
        text = doc["messages"][p["message_index"]]["content"][p["start"] : p["end"]]
        sign = "zero" if not value else ("pos" if value > 0 else "neg")
        out.append(
            {
                "index": i,
                "id": f"{section}-p{i}",
                "label": p["label"],
                "role": p.get("role", ""),
                "message_index": p["message_index"],
                "start": p["start"],
                "end": p["end"],
                "extra": [tuple(e) for e in p.get("extra") or ()],
                "value": value,
                "stderr": stderr,
                "rank": ranks[i],
                "rank_text": rank_text,
                "tied": ranges[i][0] != ranges[i][1],
                "color": scale.color(value),
                "text_color": scale.text_color(value),
                "sign": sign,
                "tip": f"{p['label']} \u201c{_snippet(text, 40)}\u201d: {shown} {unit} \u00b7 rank {rank_text} of {n}",
                "text": text,
                "short": _short_label(p["label"], text),
            }
        )
    return out, scale


def _messages(doc: Mapping[str, Any], players: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each prompt message as segments: plain text, or a player's span (``extra``: a later span of it)."""
    pieces: dict[int, list[tuple[int, int, dict[str, Any], bool]]] = {}
    for p in players:
        pieces.setdefault(p["message_index"], []).append((p["start"], p["end"], p, False))
        for m, start, end in p["extra"]:
            pieces.setdefault(int(m), []).append((int(start), int(end), p, True))
    out = []
    for k, message in enumerate(doc["messages"]):
        content = message["content"]
        segments, at = [], 0
        for start, end, p, extra in sorted(pieces.get(k, []), key=lambda t: (t[0], t[1])):
            if start < at or end > len(content):
                continue  # overlapping or outside: the checked documents hold none
            if start > at:
                segments.append({"text": content[at:start], "player": None})
            segments.append({"text": content[start:end], "player": p, "extra": extra})
            at = end
        if at < len(content) or not segments:
            segments.append({"text": content[at:], "player": None})
        out.append({"index": k, "role": message["role"], "segments": segments, "has_players": k in pieces})
    return out


def _answer(doc: Mapping[str, Any], section: str, scale_name: str = "robust") -> dict[str, Any]:
    """The answer's tokens shaded by ``logprob_full - logprob_empty``, or why there are none."""
    from ..utility import DEFAULT_UTILITY

    target = doc["target"]
    utility = doc.get("utility") or (doc.get("utility_detail") or {}).get("kind") or DEFAULT_UTILITY
    detail = doc.get("utility_detail") or {}
    span = detail.get("target_tokens")
    tokens = doc.get("answer_tokens")
    view: dict[str, Any] = {"target": target, "tokens": None, "note": "", "span": None, "scale": None}
    if isinstance(detail.get("char_span"), list) and detail.get("span_text") is not None:
        lo, hi = detail["char_span"]
        view["span"] = {
            "chars": f"{lo}:{hi}",
            "text": detail["span_text"],
            "cuts": bool(detail.get("span_cuts_token")),
            "tokens": f"{span[0]}:{span[1]}" if isinstance(span, list) else "",
        }
    from ..utility import UTILITIES

    if utility not in UTILITIES or not UTILITIES[utility].teacher_forced:  # a registered kind included
        view["note"] = (
            f"The {utility} utility regenerates answers and compares them with this one; it has no "
            "per-token scores, so the answer is shown as text."
        )
        return view
    if not tokens or not any(t.get("text") for t in tokens):
        view["note"] = (
            "This document carries no per-token scores of the answer (answer_tokens; documents written "
            "before they were recorded). Make the report from the run archive to see them: "
            "coalescence report RUN_DIR."
        )
        return view
    deltas = [
        (t["logprob_full"] - t["logprob_empty"]) if t.get("logprob_full") is not None and t.get("logprob_empty") is not None else None
        for t in tokens
    ]
    scale = DivergingScale.for_values(deltas, scale_name)
    lo, hi = (span if isinstance(span, list) and len(span) == 2 else (0, len(tokens)))
    n_answer = len(target)
    rows = []
    for k, (t, d) in enumerate(zip(tokens, deltas, strict=True)):
        rows.append(
            {
                "id": f"{section}-t{k}",
                "text": t["text"],
                "color": scale.color(d),
                "text_color": scale.text_color(d),
                "in_span": view["span"] is not None and lo <= k < hi,
                "special": isinstance(t.get("start"), int) and t["start"] >= n_answer,
                "tip": (
                    f"token {k} {t['text']!r}: log p {_fmt(t.get('logprob_full'))} with every player, "
                    f"{_fmt(t.get('logprob_empty'))} with none, change {_fmt(d, sign=True)} nats"
                ),
                "delta": d,
            }
        )
    view["tokens"] = rows
    view["scale"] = _legend(scale, "nats", scale_name, what="|change| of the tokens")
    return view


def _reading(doc: Mapping[str, Any], unit: str, has_se: bool) -> list[str]:
    """How to read the values, in a few sentences fitted to the run's utility and method."""
    from ..utility import DEFAULT_UTILITY

    utility = str(doc.get("utility") or DEFAULT_UTILITY)
    v_empty, v_full = doc.get("v_empty"), doc.get("v_full")
    total = v_full - v_empty if isinstance(v_full, int | float) and isinstance(v_empty, int | float) else None
    what = {
        "logprob": "the log-probability of the answer, in nats: +1 nat makes the answer e \u2248 2.7 times as likely",
        "mean_logprob": "the mean log-probability of the answer's tokens, in nats per token",
        "logit_prob": "the log-odds of the answer's probability (as ContextCite), in nats",
        "prob": "the probability of the answer",
    }.get(utility, f"the {utility} similarity of regenerated answers to this one ({unit})")
    method = str(doc.get("method") or "")
    family = method.split(":")[-1]
    how = {
        "loo": "what the answer loses when that player alone is removed (leave-one-out)",
        "banzhaf": "its average effect over coalitions of the others, each equally likely (the Banzhaf value)",
        "lasso": "its weight in a sparse linear model of the game fitted on the sampled coalitions (as ContextCite)",
    }.get(family, "its average effect when it joins the others, over every order of adding players (the Shapley value)")
    lines = [
        f"The utility is {what}. A player's value is {how}. Positive values (blue) support the answer, "
        "negative ones (red) work against it; the colour scale is described under each legend."
    ]
    gap = doc.get("efficiency_gap")
    if total is not None:
        if isinstance(gap, int | float) and abs(gap) <= 1e-3 * max(1.0, abs(total)):
            lines.append(f"The values add up to v(full) \u2212 v(empty) = {total:+.3g} {unit}: the whole conversation's effect, shared out (efficiency).")
        else:
            lines.append(f"v(full) \u2212 v(empty) = {total:+.3g} {unit}; this method's values need not add up to it (the efficiency gap is under \u201cThe run\u201d).")
    if has_se:
        lines.append(
            "\u00b1 is one standard error of the sampling: ranks whose 95% intervals (\u00b11.96 standard errors) "
            "overlap are shown as a range (\u201c4\u20137\u201d), since the samples cannot order them."
        )
    return lines


def _legend(scale: DivergingScale, unit: str, requested: str = "robust", what: str = "|value|") -> dict[str, Any]:
    stops = scale.stops(17)
    return {
        "gradient": ", ".join(f"{c} {100 * k / (len(stops) - 1):g}%" for k, (_, c) in enumerate(stops)),
        "ticks": [
            {"label": ("0" if v == 0 else f"{v:+.3g}".replace("-", "\u2212")) if labelled else "", "left": f"{100 * pos:.1f}%", "mark": not labelled}
            for v, pos, labelled in scale.ticks()
        ],
        "unit": unit,
        "neutral": neutral_color(),
        "scale": (
            f"robust, {scale.describe(unit, what)}"
            if scale.knee is not None
            else scale.describe(unit, what) + (" (robust: no value dwarfs the rest, so linear)" if requested == "robust" else "")
        ),
    }


def _stopping(stopping: Any) -> str:
    if not isinstance(stopping, Mapping):
        return "not a --target-stderr run (the plan ran whole)"
    target = stopping.get("target_stderr")
    what = {
        "target": f"every standard error is below {target}",
        "exact": "the budget covered every coalition, so the values are exact",
        "budget": f"the budget of {stopping.get('budget')} evaluations was spent before every standard error got below {target}",
    }.get(stopping.get("reason"), str(stopping.get("reason")))
    worst = stopping.get("max_stderr")
    unknown = stopping.get("unknown_stderr")
    return (
        f"after {stopping.get('rounds')} round{'' if stopping.get('rounds') == 1 else 's'}: {what}"
        + (f"; largest standard error {_fmt(worst)}" if worst is not None else "")
        + (f"; {unknown} standard errors unknown (too few samples to say)" if unknown else "")
    )


def _interactions(doc: Mapping[str, Any], unit: str) -> list[tuple[str, str]]:
    """The interactions fact (index, orders, the five largest by |value|), or none."""
    from ..attribution.estimators import is_exact

    terms = doc.get("interactions") or []
    if not terms:
        return []
    index, order = doc.get("interaction_index", "?"), doc.get("interaction_order", "?")
    times = " \u00d7 "
    top = "; ".join(f"{times.join(t['players'])} {_fmt(t['value'], sign=True)}" for t in terms[:5])
    what = (
        "the values are Shapley values"
        if is_exact(doc.get("method"))
        else f"sampled; the values are {index}'s order-1 terms" + (" (Shapley values)" if index == "SII" else "")
    )
    return [("interactions", f"{index}, orders 2..{order}, {len(terms)} sets, in {unit} ({what}); largest: {top}")]


def _interaction_view(doc: Mapping[str, Any], players: list[dict[str, Any]], unit: str, section: str, scale_name: str = "robust", top: int = 20) -> dict[str, Any] | None:
    """The heatmap of the order-2 interaction terms, its legend and a table of the largest terms;
    ``None`` when the document has no pair terms."""
    terms = pair_terms(doc)
    if terms is None:
        return None
    index = str(doc.get("interaction_index") or "interaction")
    scale = DivergingScale.for_values(terms.pairs.values(), scale_name)
    title = f"{index} pair interactions, in {unit}"
    svg = heatmap_svg(
        terms,
        [p["short"] for p in players],
        [p["label"] for p in players],
        unit=unit,
        scale=scale,
        chart_id=f"{section}-pairs",
        title=title,
        fmt=_fmt,
    )
    largest = sorted(terms.pairs.items(), key=lambda t: (-abs(t[1]), t[0]))[:top]
    order = doc.get("interaction_order")
    higher = isinstance(order, int) and order > 2
    return {
        "index": index,
        "title": title,
        "svg": Markup(svg),
        "legend": _legend(scale, unit, scale_name),
        "n_shown": len(terms.shown),
        "n_pairs": len(terms.pairs),
        "selection": (
            f"Only the {len(terms.shown)} players of the {terms.n_top} largest pair terms by |value| are shown "
            f"(of {terms.n_players} players): a {terms.n_players} \u00d7 {terms.n_players} matrix would be too large to read."
            if len(terms.shown) < terms.n_players
            else ""
        ),
        "higher": f"Terms of orders 3..{order} are not drawn; the largest are listed under \u201cThe run\u201d." if higher else "",
        "rows": [
            {
                "pair": f"{players[a]['label']}{TIMES}{players[b]['label']}",
                "texts": f"\u201c{_snippet(players[a]['text'], 36)}\u201d{TIMES}\u201c{_snippet(players[b]['text'], 36)}\u201d",
                "value": v,
                "color": scale.color(v),
                "text_color": scale.text_color(v),
            }
            for (a, b), v in largest
        ],
    }


def proxy_line(proxy: Any, *, used: bool = True) -> str:
    """The table's line on a two-fidelity fit's proxy game (an explanation's ``proxy`` field, where
    it has one): the rows of each game and how well they agree.

    Args:
        proxy: ``{"game", "coalitions", "evaluations", "shared", "pearson", "spearman"}``.
        used: False where the estimator computed the proxy rows but fitted the exact rows alone
            (its ``diagnostics["proxy_used"]`` is 0, e.g. the control-variate LASSO on a game of
            a few coalitions): the line says so instead of "a control variate".

    Returns:
        One line.
    """
    r, rho = proxy.get("pearson"), proxy.get("spearman")
    agreement = (
        f"correlation with the exact rows r = {r:.3f}, Spearman {rho:.3f} over {proxy.get('shared', 0)} coalitions"
        if r is not None and rho is not None
        else f"no correlation with the exact rows defined over {proxy.get('shared', 0)} coalitions"
    )
    return (
        f"proxy game {proxy['game']}: {proxy['coalitions']} coalitions (its plan's and the exact ones, where the control "
        f"variate needs c(S); {proxy.get('evaluations', 0)} computed in this session), {agreement}; "
        + ("a control variate only: the values are the exact game's" if used else "not used: the values are of the exact rows alone")
    )


def _facts(doc: Mapping[str, Any], unit: str, archive: str | None) -> list[tuple[str, str]]:
    values = [p.get("value") for p in doc["players"] if p.get("value") is not None]
    v_empty, v_full, gap = doc.get("v_empty"), doc.get("v_full"), doc.get("efficiency_gap")
    span = v_full - v_empty if isinstance(v_full, int | float) and isinstance(v_empty, int | float) else None
    detail = doc.get("utility_detail") or {}
    wall = doc.get("wall_seconds")
    evals, used = doc.get("n_evaluations"), doc.get("n_coalitions")
    rate = f" ({evals / wall:.2g} evaluations/s)" if isinstance(evals, int) and evals and isinstance(wall, int | float) and wall > 0 else ""
    params = doc.get("absence_params") or {}
    diagnostics = doc.get("diagnostics") or {}
    return [
        ("target", doc["target"]),
        ("target source", str(doc.get("target_source", "n/a")).replace("_", " ")),
        ("model", f"{doc.get('model_id', 'n/a')}" + (f" (revision {doc['model_revision']})" if doc.get("model_revision") else "")),
        ("unit", f"{doc.get('unit', 'n/a')} ({len(doc['players'])} players)"),
        ("method", str(doc.get("method", "n/a"))),
        ("utility", f"{doc.get('utility', detail.get('kind', 'n/a'))}: {detail['description']}" if detail.get("description") else f"{doc.get('utility', detail.get('kind', 'n/a'))}, in {unit}"),
        ("absence policy", str(doc.get("absence_policy", "n/a")) + (f" {params}" if params else "")),
        ("v(empty)", f"{_fmt(v_empty)} {unit}"),
        ("v(full)", f"{_fmt(v_full)} {unit}"),
        ("v(full) \u2212 v(empty)", f"{_fmt(span)} {unit}"),
        ("sum of values", f"{_fmt(sum(values)) if values else 'n/a'} {unit}"),
        ("efficiency gap", f"{_fmt(gap)} {unit}" + (f" ({abs(gap) / abs(span):.2g} of |v(full) \u2212 v(empty)|)" if isinstance(gap, int | float) and span else "")),
        ("evaluations", f"{evals if evals is not None else 'n/a'} model evaluations in this run; {used if used is not None else 'n/a'} coalitions used"),
        ("wall time", (f"{wall:.1f} s" if isinstance(wall, int | float) else "n/a") + rate),
        ("stopping", _stopping(doc.get("stopping"))),
        *([("proxy game", proxy_line(doc["proxy"], used=diagnostics.get("proxy_used", 1.0) != 0.0))] if doc.get("proxy") else []),
        ("diagnostics", ", ".join(f"{k} = {diagnostic_value(v)}" for k, v in diagnostics.items()) or "none"),
        *_interactions(doc, unit),
        ("snapshot", str(doc.get("snapshot_id", "n/a"))),
        ("archive", str(doc.get("archive") or archive or "n/a")),
    ]


def _unit(doc: Mapping[str, Any]) -> str:
    return str(doc.get("value_unit") or (doc.get("utility_detail") or {}).get("unit") or "nats")


def _short_label(label: str, text: str) -> str:
    """A bar's label: the player's label and the start of its text."""
    return f"{label} {_snippet(text, 28)}"


def explanation_chart(doc: Mapping[str, Any], *, scale: str = "robust", title: str = "") -> BarChart:
    """The ranked bar chart of one explanation document, as the page draws it (labels, colour
    scale, standard errors).

    Args:
        doc: an explanation document (``--out`` schema, checked by :func:`~.sources.load_source`).
        scale: the colour scale, ``robust`` or ``linear`` (:mod:`.colors`).
        title: the chart's title in an image of several.

    Returns:
        The chart's data (:class:`~.chart.BarChart`).
    """
    players = doc["players"]
    texts = [doc["messages"][p["message_index"]]["content"][p["start"] : p["end"]] for p in players]
    values = tuple(p.get("value") for p in players)
    has_se = any(p.get("stderr") is not None for p in players)
    return BarChart(
        labels=tuple(_short_label(p["label"], t) for p, t in zip(players, texts, strict=True)),
        values=values,
        stderr=tuple(p.get("stderr") for p in players) if has_se else None,
        unit=_unit(doc),
        scale=DivergingScale.for_values(values, scale),
        title=title,
    )


def explanation_view(doc: Mapping[str, Any], section: str, heading: str, archive: str | None, scale_name: str = "robust") -> dict[str, Any]:
    """One explanation document as the templates' data (``macros.html.j2``'s ``explanation``).

    Args:
        doc: an explanation document (``--out`` schema, checked by :func:`~.sources.load_source`).
        section: the section's anchor, prefix of every element id in it (``ex0``).
        heading: the section's heading (``""`` on a page of one).
        archive: the run archive the document was fitted from, for the facts; ``None`` if none.
        scale_name: the colour scale, ``robust`` or ``linear`` (:mod:`.colors`).

    Returns:
        ``{"id", "heading", "unit", "method", "messages", "players", "ranked", "has_se", "legend",
        "answer", "chart", "facts", "interactions", "notes", "reading", "summary"}``.

    Raises:
        BackendUnavailable: matplotlib is not installed (with the install command).
    """
    unit = _unit(doc)
    players, scale = _players(doc, section, unit, scale_name)
    has_se = any(p.get("stderr") is not None for p in doc["players"])
    bars = explanation_chart(doc, scale=scale_name)
    chart = bar_chart_svg(
        bars.labels,
        bars.values,
        bars.stderr,
        unit=unit,
        scale=bars.scale,
        chart_id=f"{section}-chart",
        title=f"{heading}: values of {len(players)} players, largest first",
    )
    ranked = sorted(players, key=lambda p: p["rank"])
    top = ranked[0]
    return {
        "id": section,
        "heading": heading,
        "unit": unit,
        "method": doc.get("method", ""),
        "messages": _messages(doc, players),
        "players": players,
        "ranked": ranked,
        "has_se": has_se,
        "legend": _legend(scale, unit, scale_name),
        "answer": _answer(doc, section, scale_name),
        "chart": Markup(chart),
        "facts": _facts(doc, unit, archive),
        "interactions": _interaction_view(doc, players, unit, section, scale_name),
        "notes": [str(n) for n in doc.get("notes") or ()],
        "reading": _reading(doc, unit, has_se),
        "summary": {
            "target": _snippet(doc["target"]),
            "top": f"{top['label']} \u201c{_snippet(top['text'], 48)}\u201d ({_fmt(top['value'], sign=True)} {unit})",
            "n_players": len(players),
            "method": doc.get("method", ""),
            "snapshot": str(doc.get("snapshot_id", ""))[:12],
        },
    }
