"""KernelSHAP: Shapley values as a constrained weighted least-squares fit over coalitions.

Lundberg & Lee (2017), "A unified approach to interpreting model predictions" (NeurIPS): the
Shapley values are the solution of

    minimize_beta  sum_{0 < |S| < n} w(S) * (v(S) - v(empty) - sum_{i in S} beta_i)^2
    subject to     sum_i beta_i = v(N) - v(empty)

with the Shapley kernel ``w(S) = (n - 1) / (C(n, |S|) * |S| * (n - |S|))``. With ``z`` the 0/1
row of S, ``A = sum_S w(S) z z^T`` and ``b = sum_S w(S) z (v(S) - v(empty))``, the solution solves
the KKT system ``[[A, 1], [1^T, 0]] [beta; lam] = [b; v(N) - v(empty)]``, so efficiency holds to
float precision; there is no regularisation.

Two plans, both pure functions of ``(n, budget, seed)``:

- **Full enumeration** when ``budget >= 2^n``: every coalition, each with its exact kernel weight,
  which gives the exact Shapley values.
- **Enumerated sizes plus paired sampling** otherwise. First, as shap's KernelExplainer does, the
  sizes with the most kernel weight per coalition (1 and n-1, then 2 and n-2, ...) are enumerated
  completely, each coalition at its exact kernel weight, while the budget would in expectation draw
  all of them anyway (:func:`_enumerated_sizes`). The remaining sizes are sampled (Covert & Lee
  2021, "Improving KernelSHAP: practical Shapley value estimation using linear regression",
  AISTATS), with the kernel mass of the sampled sizes spread over the samples: a size k is drawn with
  probability proportional to ``(n - 1) / (k (n - k))`` (the kernel's total mass on size k), then a
  uniform subset of that size, and its complement is added too. Each distinct coalition is weighted
  by how many times it was drawn (the usual KernelSHAP estimator with ``A`` and ``b`` replaced by
  their sample means). Pairs are drawn from ``numpy.random.default_rng(seed)`` until the next pair
  would push the distinct coalitions (with empty and full) above the budget; pairs that only revisit
  known coalitions are free, so the number of pairs is capped at ``PAIR_CAP_FACTOR * budget`` and at
  :data:`MAX_PAIRS`.

Standard errors (sampled plans). Each complement pair is one i.i.d. draw, and the values are a
smooth function of the draws, so the delete-one-pair jackknife (Quenouille 1956; Tukey 1958;
Efron & Stein 1981) estimates their variance: with ``beta_(p)`` the values refitted without draw
p (P draws in all),

    var_jack = (P - 1) / P * sum_p (beta_(p) - mean_p beta_(p))^2

which by the Efron-Stein inequality does not underestimate the variance in expectation. The
delta-method (sandwich) variance used before (Covert & Lee 2021, Section 4) uses the residuals of
the full fit, which the fit itself shrinks, and reported 0.215 where the real spread was 0.289
(n = 6, budget 24; the issue's game), covering the exact value 81% of the time. The reported
standard error is Tukey's jackknife t interval written as a standard error:
``stderr = t_{0.975, P-1} / 1.96 * sqrt(var_jack)``
(:func:`~coalescence.attribution.estimators.base.student_t_factor`), so that
``value +- 1.96 * stderr`` is that interval. The leave-one-out fits come from one inverse by the
Woodbury identity (leaving a pair out is a rank-2 change), O(n^2) each; repeated draws share one.

It is NaN (unknown), never zero, when the draws cannot say:

- fewer distinct pairs than :func:`_min_distinct_pairs`: ``2 (n - 1)``, or ``n`` when sizes 1 and
  n - 1 are enumerated (with as few pairs as free values a fit passes through them with zero
  residuals, and just above that the jackknife swings: 73-87% coverage at n = 6, budget 16);
- a budget that leaves fewer than 4n of the 2^n coalitions unplanned
  (:func:`~coalescence.attribution.estimators.base.budget_near_all`): the pairs are then a large
  share of all 2^(n-1) - 1 pairs, repeat, and the last ones are kept for repeating;
- a singular system, with or without one pair (``diagnostics["stderr_singular"]``);
- a player whose leave-one-out values agree to float rounding (:data:`ROUNDING_ULPS`).

Under full enumeration the values are exact and ``stderr`` is None. ``Estimate.diagnostics``
holds ``stderr_dof`` (P - 1), ``stderr_unknown`` (how many players have a NaN error),
``pairs_distinct`` and ``stderr_min_pairs`` (the distinct pairs drawn and the fewest needed) and
``stderr_singular``.
"""

from __future__ import annotations

from typing import ClassVar

import functools
import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError
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
from .exact import coalition_rows

__all__ = (
    "MAX_PAIRS",
    "PAIR_CAP_FACTOR",
    "ROUNDING_ULPS",
    "jackknife_t_stderr",
    "KernelSHAP",
    "size_probabilities",
)

logger = logging.getLogger(__name__)

PAIR_CAP_FACTOR = 10
"""At most ``PAIR_CAP_FACTOR * budget`` complement pairs are drawn (guards tiny games)."""

MAX_PAIRS = 200_000
"""Absolute cap on complement pairs, whatever the budget (only reached when coalitions repeat)."""

_CHUNK = 256
"""Pairs drawn per call to the generator; part of the plan's definition (changing it changes it)."""

ROUNDING_ULPS = 64
"""Leave-one-pair-out values that agree within ``ROUNDING_ULPS * eps * max|v - v(empty)|`` (float
rounding) show no spread: that player's standard error is unknown, not zero."""

_JACKKNIFE_CHUNK = 1024
"""Leave-one-pair-out replicates computed per batch (bounds memory at about 1024 * 4 (n+1) float64)."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """The planned coalitions and how the fit weighs them; a pure function of (n, budget, seed)."""

    full: bool  # True: all 2^n coalitions with exact kernel weights
    rows: np.ndarray  # [n_distinct, n] bool; row 0 empty, row 1 full (or integer-index order)
    keys: tuple[bytes, ...]  # [n_distinct] packed masks of rows
    pairs: np.ndarray  # [n_pairs, 2] int64 rows of each drawn coalition and its complement
    enumerated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [n_enumerated] int64 rows of the coalitions of fully enumerated sizes (exact kernel weights)
    sampled_mass: float = 1.0  # kernel mass of the sizes that are sampled (the rest is enumerated)


def _full_plan(n: int) -> _Plan:
    rows = coalition_rows(n)  # [2^n, n], row 0 empty, last row full
    rows.setflags(write=False)
    pairs = np.zeros((0, 2), dtype=np.int64)
    pairs.setflags(write=False)
    return _Plan(full=True, rows=rows, keys=tuple(row_keys(rows)), pairs=pairs)


def size_probabilities(n_players: int) -> np.ndarray:
    """Probability of each coalition size k = 1 .. n-1 under the Shapley kernel.

    ``p(k) proportional to (n - 1) / (k (n - k))``: the kernel weight of one coalition of size k
    times the C(n, k) coalitions of that size.

    Args:
        n_players: number of players n >= 2.

    Returns:
        ``[n_players - 1]`` float64 probabilities for sizes 1 .. n-1, summing to 1.
    """
    k = np.arange(1, n_players, dtype=np.float64)
    p = (n_players - 1) / (k * (n_players - k))
    return p / p.sum()


def _enumerated_sizes(n: int, budget_left: int) -> list[int]:
    """Coalition sizes to enumerate completely before sampling the rest (as shap's KernelExplainer).

    Sizes are taken in complement pairs (k, n - k) from the outside in (k = 1 first: the kernel puts
    the most weight per coalition there) while the budget left would, in expectation, draw every
    coalition of the pair anyway: ``budget_left * mass(k) / remaining_mass >= count(k)``.
    """
    probs = size_probabilities(n)  # [n - 1] sizes 1 .. n-1
    remaining = 1.0
    sizes: list[int] = []
    for k in range(1, n // 2 + 1):
        pair = [k] if 2 * k == n else [k, n - k]
        count = sum(math.comb(n, j) for j in pair)
        mass = sum(probs[j - 1] for j in pair)
        if count > budget_left or budget_left * mass / remaining < count - 1e-8:
            break
        sizes += pair
        budget_left -= count
        remaining -= mass
    return sizes


def _sampled_plan(n: int, budget: int, seed: int) -> _Plan:
    rng = np.random.default_rng(seed)
    base = np.stack([np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)])
    rows: list[np.ndarray] = list(base)
    seen: dict[bytes, int] = {key: i for i, key in enumerate(row_keys(base))}
    enumerated_sizes = _enumerated_sizes(n, budget - 2)
    enumerated: list[int] = []
    if enumerated_sizes:
        block = np.zeros((sum(math.comb(n, k) for k in enumerated_sizes), n), dtype=np.bool_)
        r = 0
        for k in sorted(enumerated_sizes):
            for members in itertools.combinations(range(n), k):
                block[r, list(members)] = True
                r += 1
        for key, row in zip(row_keys(block), block, strict=True):
            seen[key] = len(rows)
            enumerated.append(len(rows))
            rows.append(row)
    all_probs = size_probabilities(n)
    sizes = np.array([k for k in range(1, n) if k not in enumerated_sizes], dtype=np.int64)
    sampled_mass = float(all_probs[sizes - 1].sum()) if sizes.size else 0.0
    pairs: list[tuple[int, int]] = []
    if sizes.size:
        probs = all_probs[sizes - 1] / sampled_mass
        max_pairs = min(PAIR_CAP_FACTOR * budget, MAX_PAIRS)
        done = False
        while not done and len(pairs) < max_pairs:
            ks = rng.choice(sizes, size=_CHUNK, p=probs)  # [chunk]
            ranks = np.argsort(np.argsort(rng.random((_CHUNK, n)), axis=1), axis=1)  # [chunk, n]
            drawn = ranks < ks[:, None]  # [chunk, n] uniform subsets of size ks
            block = np.concatenate([drawn, ~drawn])  # [2 chunk, n]
            keys = row_keys(block)
            for p in range(_CHUNK):
                key_s, key_c = keys[p], keys[_CHUNK + p]
                new = (key_s not in seen) + (key_c not in seen)
                if len(seen) + new > budget or len(pairs) >= max_pairs:
                    done = True
                    break
                for key, row in ((key_s, drawn[p]), (key_c, ~drawn[p])):
                    if key not in seen:
                        seen[key] = len(rows)
                        rows.append(row)
                pairs.append((seen[key_s], seen[key_c]))
    out_rows = np.array(rows, dtype=np.bool_).reshape(len(rows), n)
    out_pairs = np.array(pairs, dtype=np.int64).reshape(len(pairs), 2)
    out_enum = np.array(enumerated, dtype=np.int64)
    for arr in (out_rows, out_pairs, out_enum):
        arr.setflags(write=False)
    return _Plan(
        full=False, rows=out_rows, keys=tuple(seen), pairs=out_pairs, enumerated=out_enum, sampled_mass=sampled_mass
    )


@functools.lru_cache(maxsize=16)
def _build_plan(n: int, budget: int, seed: int) -> _Plan:
    """Full enumeration when the budget covers 2^n coalitions, else paired sampling."""
    plan = _full_plan(n) if budget >= (1 << n) else _sampled_plan(n, budget, seed)
    logger.debug(
        "kernelshap plan: n=%s budget=%s seed=%s -> %s distinct coalitions (%s)",
        n, budget, seed, len(plan.keys),
        "full enumeration" if plan.full else f"{plan.pairs.shape[0]} pairs",
    )
    return plan


def _sampled_weights(plan: _Plan) -> np.ndarray:
    """``[n_distinct]`` float64 weights of a sampled plan's coalitions in the fit, summing to 1:
    the exact kernel weight for an enumerated size, the sampled sizes' kernel mass spread over the
    draws (a coalition drawn c times counts c times) otherwise, 0 for the empty and grand coalitions."""
    n = plan.rows.shape[1]
    w = np.zeros(plan.rows.shape[0], dtype=np.float64)
    if plan.enumerated.size:
        k = plan.rows[plan.enumerated].sum(axis=1)
        comb = np.array([math.comb(n, int(j)) for j in range(n + 1)], dtype=np.float64)
        w[plan.enumerated] = size_probabilities(n)[k - 1] / comb[k]  # exact kernel weight
    if plan.pairs.shape[0]:
        counts = np.bincount(plan.pairs.ravel(), minlength=w.shape[0]).astype(np.float64)
        w += plan.sampled_mass * counts / (2.0 * plan.pairs.shape[0])
    return w


def _min_distinct_pairs(n: int, enumerated: bool) -> int:
    """Fewest distinct complement pairs with which the standard errors are reported.

    ``2 (n - 1)`` when no size is enumerated (the pairs alone identify the n - 1 free values and
    must leave as many residual degrees of freedom), ``n`` when sizes 1 and n - 1 are enumerated
    (those identify the values; the pairs must still outnumber the players).
    """
    return n if enumerated else 2 * (n - 1)


def _jackknife_stderr(
    plan: _Plan,
    z: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    total: float,
    distinct: np.ndarray,
    multiplicity: np.ndarray,
) -> tuple[np.ndarray, bool]:
    """Delete-one-pair jackknife standard errors, widened to Student's t with P - 1 degrees of freedom.

    Args:
        plan: the sampled plan (P = ``plan.pairs.shape[0]`` pair draws).
        z: ``[n_distinct, n]`` float64 0/1 rows of the planned coalitions.
        y: ``[n_distinct]`` float64 ``v(S) - v(empty)``.
        w: ``[n_distinct]`` float64 weights of the full fit.
        total: ``v(N) - v(empty)``.
        distinct: ``[D, 2]`` int64 distinct pairs (rows of the coalition and its complement).
        multiplicity: ``[D]`` int64 how many of the P draws each distinct pair is.

    Returns:
        ``([n] float64 standard errors, singular)``: all NaN and ``singular=True`` when deleting
        some pair leaves a singular system (that pair alone tells two players apart, so its
        influence, and the variance, is unbounded).
    """
    replicates = _jackknife_replicates(plan, z, y, w, total, distinct)
    if replicates is None:
        return np.full(z.shape[1], np.nan), True
    return jackknife_t_stderr(replicates, multiplicity, plan.pairs.shape[0], max(float(np.max(np.abs(y))), abs(total))), False


def jackknife_t_stderr(replicates: np.ndarray, multiplicity: np.ndarray, n_draws: int, scale: float) -> np.ndarray:
    """Tukey's jackknife t standard errors from delete-one-draw replicates.

    ``var_jack = (P - 1) / P * sum_p (x_(p) - mean_p x_(p))^2`` over the P draws (each distinct
    replicate counted ``multiplicity`` times), reported as ``t_{0.975, P-1} / 1.96 * sqrt(var_jack)``
    (:func:`~coalescence.attribution.estimators.base.student_t_factor`).

    Args:
        replicates: ``[D, n]`` float64 values refitted without one draw of each distinct draw.
        multiplicity: ``[D]`` int64 how many of the P draws each distinct one is.
        n_draws: P, the number of draws (``multiplicity.sum()``).
        scale: the largest magnitude of the utilities (nats), for the rounding floor.

    Returns:
        ``[n]`` float64 standard errors in the values' unit; NaN for a player whose replicates agree
        to float rounding (``ROUNDING_ULPS * eps * scale``): the samples show no spread.
    """
    weights = multiplicity.astype(np.float64)  # each draw is one replicate
    centre = weights @ replicates / n_draws
    spread = weights @ (replicates - centre) ** 2  # [n]
    stderr = np.sqrt((n_draws - 1) / n_draws * spread) * student_t_factor(n_draws - 1)
    rounding = ROUNDING_ULPS * np.finfo(np.float64).eps * max(scale, 1e-300)
    stderr[np.sqrt(spread) <= rounding] = np.nan
    return stderr


def _jackknife_replicates(
    plan: _Plan, z: np.ndarray, y: np.ndarray, w: np.ndarray, total: float, distinct: np.ndarray
) -> np.ndarray | None:
    """``[D, n]`` float64 KernelSHAP values refitted without one draw of each distinct pair, or
    None when deleting some pair leaves a singular system (arguments as :func:`_jackknife_stderr`)."""
    n = z.shape[1]
    n_pairs = plan.pairs.shape[0]
    counts = np.bincount(plan.pairs.ravel(), minlength=z.shape[0]).astype(np.float64)
    per_draw = plan.sampled_mass / (2.0 * n_pairs)
    w_fixed = w - per_draw * counts  # the enumerated sizes' exact weights (0 elsewhere)
    a_fixed = z.T @ (w_fixed[:, None] * z)
    b_fixed = z.T @ (w_fixed * y)
    a_draws = z.T @ (counts[:, None] * z)  # sums over all P draws, unscaled
    b_draws = z.T @ (counts * y)
    scale = plan.sampled_mass / (2.0 * (n_pairs - 1))  # per-draw weight with one draw left out
    # KKT matrix with every draw at the leave-one-out weight; leaving draw p out subtracts the
    # rank-2 term scale * U_p U_p^T (U_p = [z_S, z_complement], zero in the constraint row), so each
    # replicate follows from one inverse by the Woodbury identity (Sherman & Morrison 1950;
    # Woodbury 1950) in O(n^2) instead of a fresh O(n^3) solve
    kkt = np.zeros((n + 1, n + 1), dtype=np.float64)
    kkt[:n, :n] = a_fixed + scale * a_draws
    kkt[:n, n] = 1.0
    kkt[n, :n] = 1.0
    rhs = np.append(b_fixed + scale * b_draws, total)
    if np.linalg.matrix_rank(kkt) < n + 1:
        return None
    g = np.linalg.inv(kkt)  # [n + 1, n + 1]
    x_all = g @ rhs  # [n + 1]
    replicates = np.empty((distinct.shape[0], n), dtype=np.float64)  # [D, n]
    for lo in range(0, distinct.shape[0], _JACKKNIFE_CHUNK):
        block = distinct[lo : lo + _JACKKNIFE_CHUNK]
        u_pair = np.stack([z[block[:, 0]], z[block[:, 1]]], axis=2)  # [B, n, 2]
        y_pair = np.stack([y[block[:, 0]], y[block[:, 1]]], axis=1)  # [B, 2]
        gu = np.einsum("ij,bjk->bik", g[:, :n], u_pair)  # [B, n + 1, 2]: G U
        ugu = np.einsum("bji,bjk->bik", u_pair, gu[:, :n])  # [B, 2, 2]: U^T G U
        k = np.eye(2) / scale - ugu  # [B, 2, 2]
        det = k[:, 0, 0] * k[:, 1, 1] - k[:, 0, 1] * k[:, 1, 0]
        size = np.maximum(np.abs(k[:, 0, 0] * k[:, 1, 1]), np.abs(k[:, 0, 1] * k[:, 1, 0]))
        if np.any(np.abs(det) <= 1e-9 * size):
            return None  # one pair alone tells two players apart: no jackknife
        k_inv = np.stack([np.stack([k[:, 1, 1], -k[:, 0, 1]], 1), np.stack([-k[:, 1, 0], k[:, 0, 0]], 1)], 1)
        k_inv /= det[:, None, None]
        # x_(p) = (G + GU K^-1 U^T G)(rhs - scale U y_p)
        u_x = np.einsum("bji,j->bi", u_pair, x_all[:n])  # [B, 2]: U^T x
        ugu_y = np.einsum("bij,bj->bi", ugu, y_pair)  # [B, 2]
        inner = np.einsum("bij,bj->bi", k_inv, u_x - scale * ugu_y)  # [B, 2]
        x_del = x_all[None, :] - scale * np.einsum("bij,bj->bi", gu, y_pair) + np.einsum("bij,bj->bi", gu, inner)
        replicates[lo : lo + block.shape[0]] = x_del[:, :n]
    return replicates


def _kkt(a: np.ndarray, b: np.ndarray, total: float) -> tuple[np.ndarray, np.ndarray | None]:
    """Solve the efficiency-constrained normal equations.

    Args:
        a: ``[n, n]`` float64 weighted Gram matrix A.
        b: ``[n]`` float64 weighted moments b.
        total: ``v(N) - v(empty)``.

    Returns:
        ``(beta [n] float64, C [n, n] float64 or None when the KKT matrix is singular)``.
    """
    n = a.shape[0]
    kkt = np.zeros((n + 1, n + 1), dtype=np.float64)
    kkt[:n, :n] = a
    kkt[:n, n] = 1.0
    kkt[n, :n] = 1.0
    rhs = np.append(b, total)
    solution, _, rank, _ = np.linalg.lstsq(kkt, rhs, rcond=None)
    if rank < n + 1:
        logger.warning(
            "kernelshap: the sampled coalitions do not identify all %s values (rank %s of %s); "
            "returning the minimum-norm solution without standard errors; raise the budget",
            n, rank, n + 1,
        )
        return solution[:n], None
    return solution[:n], np.linalg.inv(kkt)[:n, :n]


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSHAP(SampledEstimator):
    """Shapley values by KernelSHAP with paired sampling (Lundberg & Lee 2017; Covert & Lee 2021).

    Args:
        budget: maximum number of distinct coalitions (model evaluations), counting the empty and
            grand coalitions; at least ``min(4, 2^n)`` (empty, full and one complement pair).
            ``budget >= 2^n`` enumerates every coalition and returns the exact Shapley values.
        seed: seed of ``numpy.random.default_rng``; the plan is a pure function of
            (n, budget, seed).
        paired: must be True: complement pairs are always sampled (the standard errors treat each
            pair as one sample). Kept as a field so that configurations state it.

    Attributes:
        name: ``"kernelshap"``.

    Raises:
        ConfigError: ``budget`` is not a positive int (``field="budget"``), ``seed`` is not a
            non-negative int (``field="seed"``), or ``paired`` is not True (``field="paired"``).
    """

    paired: bool = True
    name: str = field(default="kernelshap", init=False)
    what: ClassVar[str] = "KernelSHAP"
    minimum_why: ClassVar[str] = " (the empty and grand coalitions and one complement pair)"

    def __post_init__(self) -> None:
        SampledEstimator.__post_init__(self)
        if self.paired is not True:
            raise ConfigError(
                f"paired must be True (only paired sampling is implemented), got {self.paired!r}",
                field="paired",
            )

    def min_budget(self, n_players: int) -> int:
        """Smallest budget for ``n_players``: ``min(4, 2^n)`` (empty, full, one complement pair)."""
        return min(4, 1 << n_players)

    def _plan_rows(self, n_players: int) -> np.ndarray:
        """All 2^n coalitions in integer-index order when ``budget >= 2^n``, else the empty and
        grand coalitions followed by the sampled coalitions and complements in first-seen order."""
        return _build_plan(n_players, self.budget, self.seed).rows

    def n_pairs(self, n_players: int) -> int:
        """Number of complement pairs drawn for ``n_players`` (0 under full enumeration)."""
        self.validate(n_players)
        return int(_build_plan(int(n_players), self.budget, self.seed).pairs.shape[0])

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Solve the efficiency-constrained weighted least squares on the planned coalitions.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 nats; ``stderr`` None under
            full enumeration (exact), else ``[n_players]`` float64 jackknife t standard errors in
            nats (NaN in the cases of the module docstring); ``diagnostics``
            ``{"stderr_dof": P - 1, "stderr_unknown": NaN count}`` for sampled plans (empty under
            full enumeration); ``efficiency_gap`` at float precision;
            ``n_evaluations`` = distinct planned coalitions.

        Raises:
            EstimatorError: no players, or the pool misses planned coalitions (with the count).
            ConfigError: the budget is below the minimum.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        plan = _build_plan(n, self.budget, self.seed)
        u = gather(pool_lookup(masks, utilities), plan.keys, self.name)  # [n_distinct]
        if plan.full:
            v_empty, v_full = float(u[0]), float(u[-1])
        else:
            v_empty, v_full = float(u[0]), float(u[1])
        total = v_full - v_empty
        stderr: np.ndarray | None = None
        diagnostics: dict[str, float] = {}
        if n == 1:
            values = np.array([total])
        elif plan.full:
            z = plan.rows.astype(np.float64)  # [2^n, n]
            sizes = plan.rows.sum(axis=1)
            proper = (sizes > 0) & (sizes < n)
            k = sizes[proper]
            comb = np.array([math.comb(n, int(s)) for s in range(n + 1)], dtype=np.float64)
            w = (n - 1) / (comb[k] * k * (n - k))  # [2^n - 2] Shapley kernel weights
            w = w / w.sum()
            zp = z[proper]
            a = zp.T @ (w[:, None] * zp)
            b = zp.T @ (w * (u[proper] - v_empty))
            values, _ = _kkt(a, b, total)
        else:
            values, stderr, diagnostics = self._fit_sampled(plan, u, v_empty, total, self.budget)
        estimate = Estimate.from_values(
            method=self.name,
            values=values,
            stderr=stderr,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=len(plan.keys),
            diagnostics=diagnostics,
        )
        logger.debug("kernelshap over %s players: efficiency gap %.3g", n, estimate.efficiency_gap)
        return estimate

    @staticmethod
    def _fit_sampled(
        plan: _Plan, u: np.ndarray, v_empty: float, total: float, budget: int
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """Enumerated sizes at exact kernel weights plus count-weighted samples; jackknife standard errors.

        Returns:
            ``(values [n], stderr [n], diagnostics)`` with diagnostics ``stderr_dof`` (P - 1),
            ``stderr_unknown`` (NaN count), ``pairs_distinct``, ``stderr_min_pairs`` (the
            fewest distinct pairs with which errors are reported, :func:`_min_distinct_pairs`)
            and ``stderr_singular`` (1.0 when the fit, or the fit without some pair, is singular).
        """
        n = plan.rows.shape[1]
        n_pairs = plan.pairs.shape[0]
        z = plan.rows.astype(np.float64)  # [n_distinct, n]
        y = u - v_empty  # [n_distinct]
        w = _sampled_weights(plan)  # [n_distinct], sums to 1 over proper coalitions
        a = z.T @ (w[:, None] * z)
        b = z.T @ (w * y)
        values, c = _kkt(a, b, total)
        # a pair drawn as (S, complement) or as (complement, S) is the same sample
        distinct, multiplicity = np.unique(np.sort(plan.pairs, axis=1), axis=0, return_counts=True)  # [D, 2], [D]
        least = _min_distinct_pairs(n, bool(plan.enumerated.size))
        singular = c is None
        if singular or distinct.shape[0] < least or budget_near_all(n, budget):
            # too few distinct pairs for the n - 1 free values, or nearly every coalition planned
            # (pairs repeat and are kept for repeating): unknown, not small (module docstring)
            stderr = np.full(n, np.nan)
        else:
            stderr, singular = _jackknife_stderr(plan, z, y, w, total, distinct, multiplicity)
        unknown = int(np.count_nonzero(np.isnan(stderr)))
        if unknown:
            logger.info(
                "kernelshap: %s of %s standard errors unknown (%s distinct pairs, %s needed; budget %s "
                "of 2^n = %s); raise the budget", unknown, n, distinct.shape[0], least, budget, 1 << n,
            )
        diagnostics = {
            "stderr_dof": float(n_pairs - 1),
            "stderr_unknown": float(unknown),
            "pairs_distinct": float(distinct.shape[0]),
            "stderr_min_pairs": float(least),
            "stderr_singular": float(singular),
        }
        return values, stderr, diagnostics
