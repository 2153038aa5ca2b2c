"""The result of a run: player values with their context, as data and a stable JSON document.

Presentation (the terminal table, charts, the report and the notebook view) is not here: the
display methods of :class:`Explanation` delegate to the formatter installed by
:func:`set_formatter` (the report's :class:`~coalescence.report.formatter.ExplanationFormatter`,
installed by ``import coalescence``), so this package never imports the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..snapshot import ConversationSnapshot
from ..utility import DEFAULT_UTILITY
from .estimators.base import Estimate

__all__ = ("EXPLANATION_SCHEMA", "AnswerToken", "Explanation", "ExplanationFormatter", "answer_tokens", "formatter", "set_formatter")

EXPLANATION_SCHEMA = 1
"""Version of the ``--out`` JSON document (:meth:`Explanation.to_dict`)."""


_EXTRA_HINT = "pip install -c constraints.txt -e '.[notebook]' (pandas and matplotlib)"


def _optional(module: str) -> Any:
    """Import an optional package of the ``notebook`` extra, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        from ..errors import BackendUnavailable

        raise BackendUnavailable(f"{module.split('.')[0]} is not installed; {_EXTRA_HINT}", field="notebook") from exc


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class ExplanationFormatter(Protocol):
    """What presents an :class:`Explanation`: its display methods call these with the explanation
    first (the methods' docstrings say what each returns and raises)."""

    def format_table(self, explanation: Explanation, *, snippet: int) -> str: ...

    def plot(self, explanation: Explanation, ax: Any, *, top: int | None, scale: str) -> Any: ...

    def save_chart(self, explanation: Explanation, path: str | Path, *, scale: str) -> Path: ...

    def report(self, explanation: Explanation, path: str | Path | None, *, scale: str) -> Any: ...

    def notebook_html(self, explanation: Explanation) -> str | None: ...


_formatter: ExplanationFormatter | None = None


def set_formatter(presenter: ExplanationFormatter | None) -> ExplanationFormatter | None:
    """Install what the explanations' display methods delegate to (``import coalescence`` installs
    :class:`coalescence.report.formatter.ExplanationFormatter`).

    Args:
        presenter: the formatter, or ``None`` to remove it.

    Returns:
        The formatter installed before (to restore it).
    """
    global _formatter
    previous, _formatter = _formatter, presenter
    return previous


def formatter() -> ExplanationFormatter:
    """The installed formatter.

    Raises:
        BackendUnavailable: none is installed (``import coalescence`` installs the report's).
    """
    if _formatter is None:
        from ..errors import BackendUnavailable

        raise BackendUnavailable(
            "no formatter presents explanations; import coalescence (it installs the report's), or call "
            "coalescence.attribution.explanation.set_formatter",
            field="formatter",
        )
    return _formatter


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerToken:
    """One scored token of the answer, with its log-probability in the full and the empty coalition.

    Attributes:
        text: the characters the token covers (the end-of-turn token's text, e.g. ``<|im_end|>``,
            for the last one; a first token that starts with template text includes it).
        start: first character, relative to the start of the answer (below 0 when the token starts
            with template text; ``len(answer)`` or later for the end-of-turn token).
        end: end of the token's characters (exclusive), same origin.
        logprob_full: log p of the token in the full coalition (the original conversation), nats.
        logprob_empty: log p of the token in the empty coalition (every player absent), nats.
    """

    text: str
    start: int
    end: int
    logprob_full: float
    logprob_empty: float

    @property
    def delta(self) -> float:
        """``logprob_full - logprob_empty``: how much the players together raise the token's log p (nats)."""
        return self.logprob_full - self.logprob_empty

    def to_dict(self) -> dict[str, Any]:
        """``{"text", "start", "end", "logprob_full", "logprob_empty"}`` (non-finite numbers as ``None``)."""
        return {
            "text": self.text,
            "start": self.start,
            "end": self.end,
            "logprob_full": _num(self.logprob_full),
            "logprob_empty": _num(self.logprob_empty),
        }


def answer_tokens(
    answer: str,
    offsets: Sequence[tuple[int, int]],
    full: Sequence[float],
    empty: Sequence[float],
    *,
    lead: str = "",
    tail: str = "",
) -> tuple[AnswerToken, ...]:
    """The scored answer tokens with their log-probabilities in the full and the empty coalition.

    Args:
        answer: the answer's content (the snapshot's target).
        offsets: ``[n_target]`` character ``(start, end)`` of each scored token, relative to the
            start of the answer (see :class:`~coalescence.masking.render.TargetTokens`).
        full: ``[n_target]`` per-token log-probabilities of the full coalition (nats).
        empty: ``[n_target]`` per-token log-probabilities of the empty coalition (nats).
        lead: template text inside the first token, before the answer (usually empty).
        tail: the template text after the answer (it holds the end-of-turn token's text).

    Returns:
        One :class:`AnswerToken` per scored token, in order; a token's text is the characters of
        ``lead + answer + tail`` it covers.

    Raises:
        ValueError: ``offsets``, ``full`` and ``empty`` differ in length.
    """
    if not len(offsets) == len(full) == len(empty):
        raise ValueError(f"{len(offsets)} offsets, {len(full)} and {len(empty)} log-probabilities: they must match")
    text = lead + answer + tail
    shift = len(lead)
    return tuple(
        AnswerToken(
            text=text[max(0, s + shift) : max(0, e + shift)],
            start=int(s),
            end=int(e),
            logprob_full=float(f),
            logprob_empty=float(z),
        )
        for (s, e), f, z in zip(offsets, full, empty, strict=True)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Explanation:
    """Attribution values of one snapshot's players.

    Attributes:
        snapshot: the conversation, target and players.
        estimate: the estimator's values (``[n_players]`` float64, in ``utility_unit``), standard errors,
            v(empty), v(full) and efficiency gap.
        model_id: the model that scored the coalitions.
        model_revision: its revision string.
        absence_policy: the absence policy id.
        absence_params: the policy parameters.
        utility: the utility kind (``"logprob"``: sum of target-token log-probabilities, nats;
            see :mod:`coalescence.utility`).
        utility_unit: the unit of the utility, hence of the values (e.g. ``"nats"``).
        utility_detail: the utility spec as recorded (kind, unit, answer sub-span and the target
            tokens it selects, generation config), for the JSON document.
        utility_description: one line naming what is measured, for the table.
        target_token_count: number of target tokens (the whole answer, end-of-turn included).
        n_evaluations: coalitions evaluated by the model in this run (cache hits excluded).
        wall_seconds: wall time of the run (seconds), model loading excluded.
        notes: remarks the user should see (e.g. a template that injects a default system prompt).
        stopping: for ``--target-stderr`` runs, why sampling stopped: ``{"reason": "target" |
            "exact" | "budget", "target_stderr", "max_stderr", "rounds", "budget",
            "last_round_budget", "unknown_stderr"}`` (``max_stderr`` None and ``unknown_stderr`` > 0
            when some errors of the last round are unknown); ``None`` otherwise.
        answer_tokens: for teacher-forced utilities, every scored answer token with its
            log-probability in the full and the empty coalition of the game (from the evaluations'
            per-token measurements); ``None`` for regenerate utilities or when unknown.
        proxy: for a two-fidelity fit, the shared-KV proxy game that reduced its variance:
            ``{"game": name, "coalitions": distinct proxy rows used, "evaluations": proxy rows
            the model computed in this run, "shared": coalitions scored in both games,
            "pearson", "spearman": the proxy's correlation with the exact game on those}``
            (the values are always the exact game's); ``None`` otherwise.
    """

    snapshot: ConversationSnapshot
    estimate: Estimate
    model_id: str
    model_revision: str = ""
    absence_policy: str
    absence_params: dict[str, Any] = field(default_factory=dict)
    utility: str = DEFAULT_UTILITY
    utility_unit: str = "nats"
    utility_detail: dict[str, Any] = field(default_factory=dict)
    utility_description: str = ""
    target_token_count: int = 0
    n_evaluations: int
    wall_seconds: float
    notes: tuple[str, ...] = ()
    stopping: dict[str, Any] | None = None
    answer_tokens: tuple[AnswerToken, ...] | None = None
    proxy: dict[str, Any] | None = None

    @property
    def values(self) -> Any:
        """``[n_players]`` float64 values, in :attr:`utility_unit`."""
        return self.estimate.values

    def ranking(self) -> list[int]:
        """Player indices by decreasing value (ties keep player order)."""
        vals = self.estimate.values
        return sorted(range(len(vals)), key=lambda i: (-vals[i], i))

    def to_dict(self) -> dict[str, Any]:
        """The ``--out`` JSON document (schema in docs/output.md, version :data:`EXPLANATION_SCHEMA`).

        Non-finite numbers (e.g. a standard error from a single sample) become ``null``.
        """
        est = self.estimate
        players = []
        for p in self.snapshot.players:
            stderr = None if est.stderr is None else _num(est.stderr[p.index])
            players.append(
                {
                    "index": p.index,
                    "label": p.label,
                    "role": p.role,
                    "message_index": p.message_index,
                    "start": p.start,
                    "end": p.end,
                    "text": p.text,
                    "value": _num(est.values[p.index]),
                    "stderr": stderr,
                }
                | ({"extra": [list(e) for e in p.extra]} if p.extra else {})
            )
        return {
            "schema_version": EXPLANATION_SCHEMA,
            "method": est.method,
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "snapshot_id": self.snapshot.snapshot_id,
            "unit": self.snapshot.unit,
            "absence_policy": self.absence_policy,
            "absence_params": dict(self.absence_params),
            "utility": self.utility,
            "value_unit": self.utility_unit,
            "utility_detail": dict(self.utility_detail) or {"kind": self.utility, "unit": self.utility_unit},
            "target": self.snapshot.target,
            "target_source": self.snapshot.conversation.target_source,
            "target_token_count": self.target_token_count,
            "v_empty": _num(est.v_empty),
            "v_full": _num(est.v_full),
            "efficiency_gap": _num(est.efficiency_gap),
            "n_coalitions": est.n_evaluations,
            "n_evaluations": self.n_evaluations,
            "wall_seconds": _num(self.wall_seconds),
            "diagnostics": {k: _num(v) for k, v in est.diagnostics.items()},
            "stopping": self.stopping,
            "notes": list(self.notes),
            "messages": [m.as_dict() for m in self.snapshot.conversation.messages],
            "players": players,
            "answer_tokens": None if self.answer_tokens is None else [t.to_dict() for t in self.answer_tokens],
            "proxy": None if self.proxy is None else {k: (_num(v) if isinstance(v, float) else v) for k, v in self.proxy.items()},
        } | self._interactions_dict()

    def top_interactions(self, k: int | None = None) -> list[tuple[tuple[int, ...], float]]:
        """The interaction terms by decreasing absolute value (ties by players), the first ``k``.

        Returns:
            ``[(players, value), ...]``: ascending player indices, value in :attr:`utility_unit`;
            empty without interactions.
        """
        terms = sorted(self.estimate.interactions, key=lambda t: (-abs(t[1]), t[0]))
        return terms if k is None else terms[:k]

    def _interactions_dict(self) -> dict[str, Any]:
        est = self.estimate
        if not est.interactions:
            return {}
        labels = [p.label for p in self.snapshot.players]
        return {
            "interaction_index": est.interaction_index,
            "interaction_order": max(len(p) for p, _ in est.interactions),
            "interactions": [
                {"players": [labels[i] for i in players], "player_indices": list(players), "value": _num(value), "unit": self.utility_unit}
                for players, value in self.top_interactions()
            ],
        }

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], snapshot: ConversationSnapshot, *, notes: tuple[str, ...] = ()) -> Explanation:
        """An explanation back from its ``--out`` document (:meth:`to_dict`) and its snapshot (a
        finished conversation of a resumed dataset run). ``null`` numbers come back as NaN.

        Args:
            document: the document.
            snapshot: the snapshot it explains (its id must match).
            notes: notes to add to the document's.

        Raises:
            InputError: the document is for another snapshot, or malformed.
        """
        from ..errors import InputError

        def num(x: Any) -> float:
            return float("nan") if x is None else float(x)

        try:
            if document["snapshot_id"] != snapshot.snapshot_id:
                raise InputError(f"the document explains snapshot {str(document['snapshot_id'])[:12]}", field="document")
            players = sorted(document["players"], key=lambda p: p["index"])
            has_se = any(p.get("stderr") is not None for p in players)
            estimate = Estimate(
                method=document["method"],
                values=[num(p["value"]) for p in players],
                stderr=[num(p.get("stderr")) for p in players] if has_se else None,
                v_empty=num(document["v_empty"]),
                v_full=num(document["v_full"]),
                efficiency_gap=num(document["efficiency_gap"]),
                n_evaluations=int(document["n_coalitions"]),
                diagnostics={k: num(v) for k, v in (document.get("diagnostics") or {}).items()},
                interactions=tuple((tuple(t["player_indices"]), num(t["value"])) for t in document.get("interactions") or ()),
                interaction_index=document.get("interaction_index"),
            )
            tokens = document.get("answer_tokens")
            return cls(
                snapshot=snapshot,
                estimate=estimate,
                model_id=document["model_id"],
                model_revision=document.get("model_revision", ""),
                absence_policy=document["absence_policy"],
                absence_params=dict(document.get("absence_params") or {}),
                utility=document.get("utility", DEFAULT_UTILITY),
                utility_unit=document.get("value_unit", "nats"),
                utility_detail=dict(document.get("utility_detail") or {}),
                utility_description=str((document.get("utility_detail") or {}).get("description", "")),
                target_token_count=int(document.get("target_token_count", 0)),
                n_evaluations=0,
                wall_seconds=0.0,
                notes=tuple(document.get("notes") or ()) + notes,
                stopping=document.get("stopping"),
                proxy=document.get("proxy"),
                answer_tokens=None
                if tokens is None
                else tuple(
                    AnswerToken(text=t["text"], start=t["start"], end=t["end"], logprob_full=num(t["logprob_full"]), logprob_empty=num(t["logprob_empty"]))
                    for t in tokens
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"malformed explanation document: {exc!r}", field="document") from exc

    def __repr__(self) -> str:
        """One line: the method, the players, the top player and the total effect."""
        est = self.estimate
        n = len(est.values)
        order = self.ranking()
        top = ""
        if order:
            p = self.snapshot.players[order[0]]
            text = " ".join(p.text.split())
            text = text if len(text) <= 30 else text[:29] + "\u2026"
            top = f", top {p.label} {text!r} {est.values[order[0]]:+.4g}"
        return (
            f"<Explanation {est.method}: {n} players, v(full) \u2212 v(empty) = {est.v_full - est.v_empty:+.4g} "
            f"{self.utility_unit}{top}>"
        )

    def to_pandas(self) -> Any:
        """One row per player, in player order.

        Returns:
            A ``pandas.DataFrame`` with columns ``label``, ``role``, ``message_index``, ``start``,
            ``end`` (character offsets in the message), ``text``, ``value`` (float64, in
            :attr:`utility_unit`), ``stderr`` (float64, NaN where the method has none) and ``rank``
            (1 = largest value; ties by player order).

        Raises:
            BackendUnavailable: pandas is not installed (with the install command).
        """
        pd = _optional("pandas")
        est = self.estimate
        rank = {i: r for r, i in enumerate(self.ranking(), start=1)}
        rows = [
            {
                "label": p.label,
                "role": p.role,
                "message_index": p.message_index,
                "start": p.start,
                "end": p.end,
                "text": p.text,
                "value": float(est.values[p.index]),
                "stderr": float("nan") if est.stderr is None else float(est.stderr[p.index]),
                "rank": rank[p.index],
            }
            for p in self.snapshot.players
        ]
        columns = ["label", "role", "message_index", "start", "end", "text", "value", "stderr", "rank"]
        return pd.DataFrame(rows, columns=columns)

    # -- presented (by the installed formatter, :func:`set_formatter`) ---------------------------
    def format_table(self, *, snippet: int = 60) -> str:
        """A ranked plain-text table and a summary, for a terminal.

        Args:
            snippet: the most characters of each player's text shown.

        Raises:
            BackendUnavailable: no formatter is installed (:func:`set_formatter`).
        """
        return formatter().format_table(self, snippet=snippet)

    def plot(self, ax: Any = None, *, top: int | None = None, scale: str = "robust") -> Any:
        """The ranked bar chart of the values (largest at the top), with standard errors as error
        bars where the method has them, on a matplotlib Axes: the HTML report's chart, drawn by the
        same code (:func:`coalescence.report.chart.draw_bars`: each bar labelled by the player's
        label and the start of its text, coloured by the report's colour scale). Labels are drawn
        as plain text (``parse_math=False``: a ``$`` in a label is a dollar sign, not mathtext).
        :meth:`save_chart` writes the chart as an image file.

        Args:
            ax: the Axes to draw on (default: a new figure's).
            top: draw only the ``top`` players by value.
            scale: the colour scale, ``robust`` or ``linear`` (over every player's value).

        Returns:
            The ``matplotlib.axes.Axes``.

        Raises:
            BackendUnavailable: matplotlib is not installed (with the install command), or no
                formatter is installed.
        """
        return formatter().plot(self, ax, top=top, scale=scale)

    def save_chart(self, path: str | Path, *, scale: str = "robust") -> Path:
        """Write the ranked bar chart as an image file, PNG or SVG by the suffix of ``path``: the
        chart of the HTML report and of ``coalescence report SOURCE --image PATH`` (same labels,
        colours, error bars), drawn by matplotlib, written through a temporary file and a rename.

        Args:
            path: the image file, ``.png`` (150 dpi) or ``.svg``.
            scale: the colour scale, ``robust`` or ``linear``.

        Returns:
            ``path``.

        Raises:
            ConfigError: another suffix (nothing is written).
            BackendUnavailable: matplotlib is not installed (with the install command), or no
                formatter is installed.
            ArchiveError, ArchiveWriteError: the file cannot be written; ``path`` is as it was.
        """
        return formatter().save_chart(self, path, scale=scale)

    def report(self, path: str | Path | None = None, *, scale: str = "robust") -> Any:
        """The whole report of this explanation (conversation, answer tokens, chart, every player,
        the run's facts): shown in Jupyter, and written as one self-contained page to ``path``.

        Returns:
            A :class:`~coalescence.report.ReportView` (``.html``: the page's text; ``.save(path)``).

        Raises:
            BackendUnavailable: the report's packages (matplotlib, jinja2) are missing, or no
                formatter is installed.
        """
        return formatter().report(self, path, scale=scale)

    def _repr_html_(self) -> str | None:
        """The compact view for Jupyter: the conversation highlighted by value, the top players and
        the legend (:meth:`report` for the whole report); ``None`` (the plain repr) without the
        report's packages or a formatter."""
        return None if _formatter is None else _formatter.notebook_html(self)
