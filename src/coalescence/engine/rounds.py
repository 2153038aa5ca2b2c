"""Rounds of a target standard error: each round's budget, kept within the whole budget."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..attribution.estimators.base import Estimate, Estimator
from ..errors import ConfigError

__all__ = ("sample_until",)


def _fitting_round(
    estimator_for: Callable[[int], Estimator],
    n_players: int,
    planned: set[bytes],
    *,
    budget: int,
    low: int,
    high: int,
) -> tuple[int, Estimator, list[np.ndarray], set[bytes]] | None:
    """The round of a target standard error that keeps the distinct coalitions within ``budget``.

    ``high``'s plan when, with the coalitions ``planned`` by earlier rounds, it stays within
    ``budget``; otherwise the largest round budget in ``(low, high)`` whose plan does (bisection:
    ``low``'s plan, all in ``planned``, fits; ``high``'s does not), or ``None`` when none above
    ``low`` fits.

    Args:
        estimator_for: ``budget -> estimator``, each plan a pure function of its budget.
        n_players: the game's n.
        planned: the packed masks (little-endian bytes) of the earlier rounds' coalitions.
        budget: the most distinct coalitions over all rounds.
        low, high: the last round's budget (0: none) and this round's.

    Returns:
        ``(round budget, estimator, its plan's rows, their packed masks)``, or ``None``.
    """

    def plan(b: int) -> tuple[int, Estimator, list[np.ndarray], set[bytes]]:
        estimator = estimator_for(b)
        rows = list(estimator.plan(n_players))
        return b, estimator, rows, {np.packbits(r, bitorder="little").tobytes() for r in rows}

    best = plan(high)
    if len(planned | best[3]) <= budget:
        return best
    found = None
    while high - low > 1:
        mid = (low + high) // 2
        candidate = plan(mid)
        if len(planned | candidate[3]) <= budget:
            low, found = mid, candidate
        else:
            high = mid
    return found


async def sample_until(
    estimator_for: Callable[[int], Estimator],
    n_players: int,
    evaluate: Callable[[list[np.ndarray]], Awaitable[tuple[np.ndarray, np.ndarray]]],
    *,
    budget: int,
    target_stderr: float,
    first_budget: int | None = None,
) -> tuple[Estimate, dict[str, Any]]:
    """Fit rounds of doubling budgets until every player's standard error is below ``target_stderr``.

    Round k fits ``estimator_for(first_budget * 2**k)`` (capped at ``budget``) on the pool that
    ``evaluate`` returns for its plan; ``budget`` caps the distinct coalitions of all rounds
    together (:func:`_fitting_round`). See :meth:`~coalescence.engine.Engine.explain_until`.

    Args:
        estimator_for: ``budget -> estimator``, each plan a pure function of its budget.
        n_players: the game's n.
        evaluate: a plan's rows ``[n_players]`` bool -> ``(masks [m, n] bool, utilities [m] float64)``.
        budget: the most distinct coalitions over all rounds.
        target_stderr: the standard error every player must get below (the utility's unit, > 0).
        first_budget: the first round's budget (default ``max(16, 4 n)``, at most ``budget``).

    Returns:
        The last round's estimate and the stopping record (``reason``: ``"target"``, ``"exact"``
        or ``"budget"``; ``max_stderr``, ``unknown_stderr``, ``rounds``, ``budget``,
        ``last_round_budget``).
    """
    n = n_players
    planned: set[bytes] = set()  # the distinct coalitions of the rounds so far: at most ``budget``
    round_budget = min(budget, first_budget or max(16, 4 * n))
    previous = 0  # the last round's budget (0: none yet)
    rounds = 0
    while True:
        estimator = estimator_for(round_budget)
        try:
            estimator.validate(n)
        except ConfigError:
            round_budget = budget  # the first round would be below the method's minimum
            continue
        fitted = _fitting_round(estimator_for, n, planned, budget=budget, low=previous, high=round_budget)
        if fitted is None:  # no budget above the last round's fits: stop with its estimate
            reason = "budget"
            break
        capped = fitted[0] < round_budget
        round_budget, estimator, rows, keys = fitted
        planned |= keys
        masks, utilities = await evaluate(rows)
        estimate = estimator.fit(masks, utilities)
        rounds += 1
        previous = round_budget
        if estimate.stderr is None:
            reason, worst, unknown = "exact", 0.0, 0
            break
        se = np.asarray(estimate.stderr, dtype=np.float64)
        # a NaN error is unknown (too few samples to say), never small: only stop when
        # every player's error is known and below the target
        unknown = int(np.count_nonzero(~np.isfinite(se)))
        worst = float(np.max(se)) if unknown == 0 else float("inf")
        if worst < target_stderr:
            reason = "target"
            break
        if capped or round_budget >= budget:
            reason = "budget"
            break
        round_budget = min(budget, 2 * round_budget)
    stopping = {
        "reason": reason,
        "target_stderr": target_stderr,
        "max_stderr": worst if np.isfinite(worst) else None,
        "unknown_stderr": unknown,
        "rounds": rounds,
        "budget": budget,
        "last_round_budget": previous,
    }
    return estimate, stopping
