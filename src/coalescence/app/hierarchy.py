"""Hierarchical attribution: a coarse answer first, detail where it matters.

Method (hierarchical attribution as in AttriBoT, Liu et al. 2024, "AttriBoT: A Bag of Tricks for
Efficiently Approximating Leave-One-Out Context Attribution", which does it for leave-one-out;
here with any estimator):

1. Attribute the answer to the *coarse* players (e.g. documents or turns) with the estimator.
2. Take the K coarse players with the largest absolute value (ties: player order).
3. Split the text of those K players into *fine* players (e.g. sentences) and attribute the
   answer to them, every other fine player (all the text of the other coarse players) held
   present: the fine game is the full fine segmentation with the bits of the players outside the
   top K fixed to 1, so its coalitions are coalitions of the full fine snapshot (one snapshot,
   known before the run, recorded in the archive).

Cost: the coarse estimator's evaluations on n_coarse players plus the fine estimator's on the
fine players of the top K alone (exact: ``2**n_coarse + 2**n_fine_refined``), instead of a fine
run on every fine player. The fine values explain the top K's share given the rest of the context;
they do not add up to the coarse values. The principled two-level variant that does is the Owen
value (Owen 1977; the Shapley value of a game with a coalition structure: coarse players as
unions), which needs coalitions that mix partial unions and therefore more evaluations; it is not
implemented here.

With K equal to the number of coarse players, the fine level is exactly a direct fine run on the
same conversation (same snapshot, same coalitions).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..conversation import Player
from ..snapshot import ConversationSnapshot
from ..errors import ConfigError
from ..attribution.explanation import Explanation

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..masking.policies import AbsencePolicy
    from ..attribution.estimators.base import Estimator

__all__ = ("HierarchicalExplanation", "explain_hierarchical", "parse_hierarchy")


def parse_hierarchy(text: str) -> tuple[str, str]:
    """``"document,sentence"`` -> ``("document", "sentence")``.

    Raises:
        ConfigError: not two known, different units (field ``--hierarchy``).
    """
    from ..conversation import UNITS

    units = tuple(u.strip() for u in text.split(","))
    if len(units) != 2 or units[0] == units[1] or any(u not in UNITS for u in units):
        raise ConfigError(
            f"expected two different units COARSE,FINE from {', '.join(UNITS)}, got {text!r} "
            "(e.g. --hierarchy document,sentence)",
            field="hierarchy",
        )
    if units[1] in ("turn", "tool", "document"):
        raise ConfigError(
            f"the fine unit must split text (paragraph, sentence, word), got {units[1]!r}", field="hierarchy"
        )
    return units[0], units[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class HierarchicalExplanation:
    """Both levels of a hierarchical attribution (see the module docs for the method).

    Attributes:
        coarse: the coarse explanation (every coarse player).
        fine: the fine explanation of the refined players only (its snapshot is a view: the
            refined fine players, re-indexed from 0), or ``None`` when they hold no fine player.
        fine_snapshot: the full fine snapshot whose coalitions were evaluated (archived).
        refined: indices of the refined coarse players, by decreasing absolute value.
        top_k: the K asked for.
    """

    coarse: Explanation
    fine: Explanation | None
    fine_snapshot: ConversationSnapshot
    refined: tuple[int, ...]
    top_k: int

    @property
    def n_evaluations(self) -> int:
        """Model evaluations of both levels together."""
        return self.coarse.n_evaluations + (self.fine.n_evaluations if self.fine else 0)

    def to_dict(self) -> dict[str, Any]:
        """``{"hierarchy": {...}, "coarse": <document>, "fine": <document or null>}``."""
        fine = None
        if self.fine is not None:
            fine = self.fine.to_dict() | {"coalitions_snapshot_id": self.fine_snapshot.snapshot_id}
        return {
            "hierarchy": {
                "units": [self.coarse.snapshot.unit, self.fine_snapshot.unit],
                "top_k": self.top_k,
                "refined": [self.coarse.snapshot.players[i].label for i in self.refined],
                "method": "hierarchical (AttriBoT-style): coarse attribution, then the top-k coarse "
                "players refined with the other fine players held present",
                "n_evaluations": {
                    "coarse": self.coarse.n_evaluations,
                    "fine": self.fine.n_evaluations if self.fine else 0,
                    "total": self.n_evaluations,
                },
            },
            "coarse": self.coarse.to_dict(),
            "fine": fine,
        }

    def format_table(self) -> str:
        """Both tables, each with its evaluation count."""
        parts = [f"== coarse level: {self.coarse.snapshot.unit} ==", self.coarse.format_table()]
        labels = ", ".join(self.coarse.snapshot.players[i].label for i in self.refined)
        parts.append(f"\n== fine level: {self.fine_snapshot.unit} inside the top {self.top_k}: {labels} ==")
        parts.append(self.fine.format_table() if self.fine else "(no fine players inside them)")
        parts.append(
            f"\nmodel evaluations: coarse {self.coarse.n_evaluations} + fine "
            f"{self.fine.n_evaluations if self.fine else 0} = {self.n_evaluations}"
        )
        return "\n".join(parts)


async def explain_hierarchical(
    engine: Engine,
    coarse: ConversationSnapshot,
    fine: ConversationSnapshot,
    parents: tuple[int, ...],
    *,
    estimator_for: Callable[[int], Estimator],
    policy: AbsencePolicy,
    top_k: int,
) -> HierarchicalExplanation:
    """Attribute at the coarse level, then refine the top ``top_k`` coarse players.

    Args:
        engine: the engine (its store and archive serve both levels).
        coarse: the coarse snapshot.
        fine: the fine snapshot and ``parents`` from :func:`~coalescence.snapshot.fine_snapshot`.
        parents: ``[n_fine]`` coarse parent index of each fine player.
        estimator_for: the estimator for a game of n players (called with n_coarse, then with the
            number of refined fine players).
        policy: the absence policy of both levels.
        top_k: how many coarse players to refine (at most the number of coarse players).

    Returns:
        Both levels, each with the model evaluations it cost.

    Raises:
        ConfigError: ``top_k`` < 1; EstimatorError: an estimator that cannot run on a level's
            player count (checked for the coarse level before any model call).
    """
    if top_k < 1:
        raise ConfigError(f"must be >= 1, got {top_k}", field="top_k")
    coarse_explanation = await engine.explain(coarse, estimator_for(coarse.n_players), policy)
    values = coarse_explanation.values
    order = sorted(range(coarse.n_players), key=lambda i: (-abs(float(values[i])), i))
    refined = tuple(order[: min(top_k, coarse.n_players)])
    chosen = set(refined)
    sel = np.array([k for k, parent in enumerate(parents) if parent in chosen], dtype=np.intp)
    if sel.size == 0:
        return HierarchicalExplanation(coarse=coarse_explanation, fine=None, fine_snapshot=fine, refined=refined, top_k=top_k)
    from ..engine.two_fidelity import play

    t0 = time.perf_counter()
    played = await play(engine, fine, estimator_for(int(sel.size)), policy, select=sel)
    estimate = played.estimate
    view_players: list[Player] = [replace(fine.players[int(k)], index=j) for j, k in enumerate(sel)]
    view = ConversationSnapshot(conversation=fine.conversation, unit=fine.unit, players=tuple(view_players))
    fine_explanation = Explanation(
        snapshot=view,
        estimate=estimate,
        model_id=coarse_explanation.model_id,
        model_revision=coarse_explanation.model_revision,
        absence_policy=policy.id,
        absence_params=policy.params(),
        utility=coarse_explanation.utility,
        utility_unit=coarse_explanation.utility_unit,
        utility_detail=dict(coarse_explanation.utility_detail),
        utility_description=coarse_explanation.utility_description,
        target_token_count=coarse_explanation.target_token_count,
        n_evaluations=played.executed,
        wall_seconds=time.perf_counter() - t0,
        answer_tokens=engine.answer_tokens(fine, policy, empty=_lifted_empty(fine.n_players, sel)),
        proxy=played.proxy,
        notes=engine.conversation_notes(fine, policy, empty=_lifted_empty(fine.n_players, sel))
        + tuple(estimate.notes)
        + (
            f"fine level: {int(sel.size)} of {fine.n_players} fine players refined; "
            f"{_others(fine.n_players - int(sel.size))} held present (coalitions of snapshot "
            f"{fine.snapshot_id[:12]})",
        ),
    )
    return HierarchicalExplanation(
        coarse=coarse_explanation, fine=fine_explanation, fine_snapshot=fine, refined=refined, top_k=top_k
    )


def _lifted_empty(n: int, sel: np.ndarray) -> np.ndarray:
    """``[n]`` bool: the refined game's empty coalition (the refined players absent, the rest present)."""
    row = np.ones(n, dtype=bool)
    row[sel] = False
    return row


def _others(n: int) -> str:
    return "no other is" if n == 0 else "the other one is" if n == 1 else f"the other {n} are"
