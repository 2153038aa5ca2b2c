"""Monte Carlo Shapley values from antithetic pairs of random permutations.

Permutation sampling (Castro, Gómez & Tejada 2009, "Polynomial calculation of the Shapley value
based on sampling"): for a uniformly random order pi of the players, the marginal contribution of
player pi[k] is ``v({pi[0..k]}) - v({pi[0..k-1]})``; its expectation over pi is the Shapley value.

Antithetic pairs (Mitchell, Cooper, Frank & Holmes 2022, "Sampling permutations for Shapley value
estimation", JMLR 23): each sampled pi is followed by its reverse, and the mean of the two
marginal-contribution vectors is one sample. The prefixes of pi and of its reverse are complements,
so one pair costs 2n distinct coalitions (the empty and grand coalitions are shared), and every
sample sums to ``v(N) - v(empty)`` exactly, so the estimate keeps efficiency to float precision.
A pair is also exact on every game whose Harsanyi dividends sit on sets of at most two players
(additive plus pairwise interactions): of i and j, each order credits the pair's dividend to the
later one, and the reverse order credits the other.

The budget counts distinct coalitions (model evaluations): pairs are drawn one at a time from
``numpy.random.default_rng(seed)``, and planning stops before the first pair whose new coalitions
would push the distinct count above the budget. Pairs that only revisit known coalitions are free,
so the number of pairs is also capped (at ``10 * budget`` and at :data:`MAX_PAIRS`).

Standard errors. The m pairs are i.i.d. samples of each player's pair-mean contribution, so the
value is a sample mean and ``s / sqrt(m)`` (``s`` the sample standard deviation, ddof = 1) is its
usual standard error. With few pairs, ``s`` is itself noisy and ``+- 1.96 s / sqrt(m)`` covers the
Shapley value far less often than 95% (about 70% of the time at m = 2 on a random 6-player game).
The reported standard error is therefore Student's (1908) small-sample interval expressed as a
standard error: ``stderr = t_{0.975, m-1} / 1.96 * s / sqrt(m)``
(:func:`~coalescence.attribution.estimators.base.student_t_factor`), so that
``value +- 1.96 * stderr`` is the t interval with m - 1 degrees of freedom (12.7 / 1.96 = 6.5
times the naive error at m = 2, 1.14 times at m = 11, 1.01 times at m = 200).

It is NaN (unknown), never zero, when the samples show no spread to scale:

- all players, with a single pair (m < 2: no degrees of freedom);
- all players, when the budget leaves fewer than 4n of the 2^n coalitions unplanned
  (:func:`~coalescence.attribution.estimators.base.budget_near_all`; every sampled budget for
  n <= 4): planning draws a pair, keeps it when its new coalitions fit the budget and stops at the
  first that does not, so this close to 2^n the last pairs are kept for reusing coalitions already
  planned (no longer uniform), and with so few players each pair sample takes a handful of values
  (a player first or last in pi always gives the same sample), too lumpy for a t interval:
  measured 70-77% coverage for n = 4 at budgets 10-15 even with the t quantile. A budget of 2^n or
  more (every pair fits) reports errors again, and ``--method exact`` costs 2^n evaluations;
- a player whose pair samples are all equal (standard deviation within float rounding of the
  utilities, :data:`ROUNDING_ULPS`): its contribution may still vary (a voter who swings the vote
  in a few orders only, none of them drawn), and a zero would claim an exact value. A dummy player
  (contribution always 0), or any player of an additive-plus-pairwise game (where every pair is
  exact), is reported this way too.

``Estimate.diagnostics`` holds ``stderr_dof`` (m - 1) and ``stderr_unknown`` (how many players
have a NaN standard error).
"""

from __future__ import annotations

from typing import ClassVar

import functools
import logging
from dataclasses import dataclass, field

import numpy as np

from .base import (
    Estimate,
    SampledEstimator,
    budget_near_all,
    check_pool,
    gather,
    pool_lookup,
    row_keys,
    student_t_factor,
)

__all__ = ("MAX_PAIRS", "PAIR_CAP_FACTOR", "ROUNDING_ULPS", "PermutationShapley")

logger = logging.getLogger(__name__)

PAIR_CAP_FACTOR = 10
"""At most ``PAIR_CAP_FACTOR * budget`` antithetic pairs are drawn (guards tiny games)."""

MAX_PAIRS = 200_000
"""Absolute cap on antithetic pairs, whatever the budget (only reached when coalitions repeat)."""


ROUNDING_ULPS = 64
"""A player's pair samples whose standard deviation is at most ``ROUNDING_ULPS * eps * max|v|``
(float rounding of the utilities) count as all equal: standard error unknown."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """The sampled pairs and their coalitions; a pure function of ``(n, budget, seed)``."""

    perms: np.ndarray  # [n_pairs, n] int64 forward permutations (the reverse is perms[:, ::-1])
    rows: np.ndarray  # [n_distinct, n] bool distinct coalitions, in first-seen order
    keys: tuple[bytes, ...]  # [n_distinct] packed masks of rows
    index: np.ndarray  # [n_pairs, 2, n + 1] int64 row of prefix k of pi (0) and of its reverse (1)


@functools.lru_cache(maxsize=16)
def _build_plan(n: int, budget: int, seed: int) -> _Plan:
    """Draw antithetic pairs until the next one would exceed ``budget`` distinct coalitions."""
    rng = np.random.default_rng(seed)
    max_pairs = min(PAIR_CAP_FACTOR * budget, MAX_PAIRS)
    steps = np.arange(n + 1)[:, None]  # [n + 1, 1]
    seen: dict[bytes, int] = {}
    rows: list[np.ndarray] = []
    perms: list[np.ndarray] = []
    index: list[list[int]] = []
    while len(perms) < max_pairs:
        perm = rng.permutation(n)
        ranks = np.empty(n, dtype=np.int64)
        ranks[perm] = np.arange(n)
        forward = ranks[None, :] < steps  # [n + 1, n]: prefix k of pi
        # prefix k of reversed(pi) = the last k players of pi = complement of pi's prefix n - k
        pair_rows = np.concatenate([forward, ~forward[::-1]])  # [2n + 2, n]
        keys = row_keys(pair_rows)
        new = {k for k in keys if k not in seen}
        if len(seen) + len(new) > budget:
            break
        for key, row in zip(keys, pair_rows, strict=True):
            if key not in seen:
                seen[key] = len(rows)
                rows.append(row)
        perms.append(perm)
        index.append([seen[k] for k in keys])
        if n == 1:  # one pair already gives the exact value
            break
    plan = _Plan(
        perms=np.array(perms, dtype=np.int64).reshape(len(perms), n),
        rows=np.array(rows, dtype=np.bool_).reshape(len(rows), n),
        keys=tuple(seen),
        index=np.array(index, dtype=np.int64).reshape(len(perms), 2, n + 1),
    )
    for arr in (plan.perms, plan.rows, plan.index):
        arr.setflags(write=False)
    logger.debug(
        "permutation plan: n=%s budget=%s seed=%s -> %s pairs, %s distinct coalitions",
        n, budget, seed, len(perms), len(rows),
    )
    return plan


@dataclass(frozen=True, slots=True, kw_only=True)
class PermutationShapley(SampledEstimator):
    """Shapley values from antithetic permutation pairs (Castro et al. 2009; Mitchell et al. 2022).

    Args:
        budget: maximum number of distinct coalitions (model evaluations); at least 2n.
        seed: seed of ``numpy.random.default_rng``; the plan is a pure function of
            (n, budget, seed).

    Attributes:
        name: ``"permutation"``.

    Raises:
        ConfigError: ``budget`` is not a positive int (``field="budget"``), or ``seed`` is not a
            non-negative int (``field="seed"``).
    """

    name: str = field(default="permutation", init=False)
    what: ClassVar[str] = "permutation sampling"
    minimum_why: ClassVar[str] = " (one antithetic pair)"

    def min_budget(self, n_players: int) -> int:
        """One antithetic pair: 2n coalitions."""
        return 2 * n_players

    def _minimum_text(self, n_players: int, minimum: int) -> str:
        return f"2n = {minimum}"

    def _plan_rows(self, n_players: int) -> np.ndarray:
        """The distinct coalitions of the sampled pairs, in first-seen order: the first is the
        empty coalition and the grand coalition is among the first n + 1."""
        return _build_plan(n_players, self.budget, self.seed).rows

    def n_pairs(self, n_players: int) -> int:
        """Number of antithetic pairs the plan for ``n_players`` uses (each pair is one sample)."""
        self.validate(n_players)
        return int(_build_plan(int(n_players), self.budget, self.seed).perms.shape[0])

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Average the pairs' marginal contributions.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 nats (mean over pairs);
            ``stderr`` ``[n_players]`` float64 nats = ``t_{0.975, m-1} / 1.96`` times the sample
            standard deviation over the m pairs (ddof=1) / sqrt(m), NaN with a single pair or
            with a budget within 4n of 2^n, or where a player's pair samples are all equal
            (module docstring);
            ``diagnostics`` ``{"stderr_dof": m - 1, "stderr_unknown": NaN count}``;
            ``n_evaluations`` = distinct planned coalitions.

        Raises:
            EstimatorError: no players, or the pool misses planned coalitions (with the count).
            ConfigError: the budget is below 2n.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        plan = _build_plan(n, self.budget, self.seed)
        u = gather(pool_lookup(masks, utilities), plan.keys, self.name)  # [n_distinct]
        prefix_u = u[plan.index]  # [n_pairs, 2, n + 1]
        marginal = np.diff(prefix_u, axis=2)  # [n_pairs, 2, n]: gain from the k-th player in order
        n_pairs = plan.perms.shape[0]
        pair_rows = np.arange(n_pairs)[:, None]
        forward = np.empty((n_pairs, n), dtype=np.float64)
        backward = np.empty((n_pairs, n), dtype=np.float64)
        forward[pair_rows, plan.perms] = marginal[:, 0]
        backward[pair_rows, plan.perms[:, ::-1]] = marginal[:, 1]
        samples = 0.5 * (forward + backward)  # [n_pairs, n]
        values = samples.mean(axis=0)
        if n_pairs >= 2 and not budget_near_all(n, self.budget):
            spread = samples.std(axis=0, ddof=1)  # [n]
            stderr = spread / np.sqrt(n_pairs) * student_t_factor(n_pairs - 1)
            # no spread beyond float rounding of the utilities: unknown, not exact (module docstring)
            rounding = ROUNDING_ULPS * np.finfo(np.float64).eps * float(np.max(np.abs(u)))
            stderr[spread <= rounding] = np.nan
        else:
            stderr = np.full(n, np.nan)
        unknown = int(np.count_nonzero(np.isnan(stderr)))
        if unknown:
            why = (
                "a single pair" if n_pairs < 2
                else f"budget {self.budget} within 4n of 2^n" if budget_near_all(n, self.budget)
                else "equal samples for those players"
            )
            logger.info(
                "permutation: %s of %s standard errors unknown (%s pairs: %s); raise the budget",
                unknown, n, n_pairs, why,
            )
        v_empty = float(u[plan.index[0, 0, 0]])
        v_full = float(u[plan.index[0, 0, n]])
        return Estimate.from_values(
            method=self.name,
            values=values,
            stderr=stderr,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=len(plan.keys),
            diagnostics={"stderr_dof": float(n_pairs - 1), "stderr_unknown": float(unknown)},
        )
