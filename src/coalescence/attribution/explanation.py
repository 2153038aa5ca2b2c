"""The result of a run: player values with their context, as a table or a stable JSON document."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..conversation import ConversationSnapshot
from .estimators.base import Estimate

__all__ = ("EXPLANATION_SCHEMA", "Explanation")

EXPLANATION_SCHEMA = 1
"""Version of the ``--out`` JSON document (:meth:`Explanation.to_dict`)."""


def _fmt(x: float, *, sign: bool = False) -> str:
    """Four decimals, or four significant digits in scientific notation below 1e-3 (e.g. ``prob``)."""
    x = float(x)
    if x != 0 and math.isfinite(x) and abs(x) < 1e-3:
        return f"{x:+.3e}" if sign else f"{x:.3e}"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def _num(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


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
            "last_round_budget"}``; ``None`` otherwise.
    """

    snapshot: ConversationSnapshot
    estimate: Estimate
    model_id: str
    model_revision: str = ""
    absence_policy: str
    absence_params: dict[str, Any] = field(default_factory=dict)
    utility: str = "logprob"
    utility_unit: str = "nats"
    utility_detail: dict[str, Any] = field(default_factory=dict)
    utility_description: str = ""
    target_token_count: int = 0
    n_evaluations: int
    wall_seconds: float
    notes: tuple[str, ...] = ()
    stopping: dict[str, Any] | None = None

    @property
    def values(self) -> Any:
        """``[n_players]`` float64 values, in :attr:`utility_unit`."""
        return self.estimate.values

    def ranking(self) -> list[int]:
        """Player indices by decreasing value (ties keep player order)."""
        vals = self.estimate.values
        return sorted(range(len(vals)), key=lambda i: (-vals[i], i))

    def to_dict(self) -> dict[str, Any]:
        """The ``--out`` JSON document (schema in the README, version :data:`EXPLANATION_SCHEMA`).

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
            "players": players,
        }

    def format_table(self, *, snippet: int = 60) -> str:
        """A ranked plain-text table and a summary, for a terminal.

        Args:
            snippet: the most characters of each player's text shown.
        """
        est = self.estimate
        has_se = est.stderr is not None
        rows = []
        for rank, i in enumerate(self.ranking(), start=1):
            p = self.snapshot.players[i]
            text = " ".join(p.text.split())
            if len(text) > snippet:
                text = text[: snippet - 1] + "\u2026"
            se = ""
            if has_se:
                s = _num(est.stderr[i])
                se = "-" if s is None else _fmt(s)
            rows.append((str(rank), _fmt(est.values[i], sign=True), se, p.label, text))
        head = ("rank", f"value ({self.utility_unit})", "stderr" if has_se else "", "player", "text")
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
        rel = abs(est.efficiency_gap) / abs(span) if span else float("nan")
        rate = self.n_evaluations / self.wall_seconds if self.wall_seconds > 0 else float("nan")
        target = " ".join(self.snapshot.target.split())
        if len(target) > 100:
            target = target[:99] + "\u2026"
        lines += [
            "",
            f"target ({self.snapshot.conversation.target_source.replace('_', ' ')}): {target}",
            f"method {est.method}, model {self.model_id}, unit {self.snapshot.unit}, "
            f"absence policy {self.absence_policy}, utility {self.utility} "
            f"({self.utility_description or f'log p of {self.target_token_count} target tokens, nats'})",
            f"v(empty) = {_fmt(est.v_empty)}   v(full) = {_fmt(est.v_full)}   "
            f"v(full) - v(empty) = {_fmt(span)}",
            f"sum of values = {_fmt(float(est.values.sum()))}   efficiency gap = {est.efficiency_gap:.3g}"
            + (f" ({rel:.2g} of |v(full) - v(empty)|)" if math.isfinite(rel) else " (v(full) = v(empty))"),
            f"model evaluations = {self.n_evaluations} (coalitions used: {est.n_evaluations})   "
            f"wall time = {self.wall_seconds:.1f} s   ({rate:.1f} evaluations/s)",
        ]
        if self.stopping is not None:
            st = self.stopping
            what = {
                "target": f"every standard error is below {st['target_stderr']:g}",
                "exact": "the budget covered every coalition, so the values are exact",
                "budget": f"the budget of {st['budget']} evaluations was spent before every standard "
                f"error got below {st['target_stderr']:g}",
            }[st["reason"]]
            worst = "" if st["max_stderr"] is None else f"; largest standard error {st['max_stderr']:.4g}"
            lines.append(f"stopped after {st['rounds']} rounds: {what}{worst}")
        if est.diagnostics:
            lines.append("diagnostics: " + "   ".join(f"{k} = {v:.4g}" for k, v in est.diagnostics.items()))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
