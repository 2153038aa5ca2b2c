"""Regression-adjusted Monte Carlo on KernelSHAP's coalitions: a linear proxy fitted to the
evaluated coalitions, its residuals corrected by size-stratified Monte Carlo on the same coalitions.

Witter, Liu & Musco (2025), "Regression-adjusted Monte Carlo estimators for Shapley values and
probabilistic values" (NeurIPS; shapiq's ``RegressionMSR``): fit a proxy ``f`` of the value function
on the sampled coalitions, take its Shapley values exactly, and estimate the Shapley values of the
residual ``r = v - f`` by Monte Carlo on the same samples; the Shapley value is linear, so
``phi(v) = phi(f) + phi(r)``, and the estimate is consistent whatever the proxy. Here:

- **the proxy** is the ordinary least-squares linear model ``f(S) = b0 + sum_{i in S} beta_i`` of
  the planned coalitions (the empty and grand coalitions and the enumerated sizes once each, a
  sampled coalition once per draw); its Shapley values are ``beta``. (Measured against
  KernelSHAP's kernel-weighted, efficiency-constrained fit as the proxy: 0.4x its error at 5n
  evaluations and 0.6x at 10n, the same from 40n on, on the recorded games below.)
- **the residual term** is the size-stratified form of the Shapley value (Castro et al. 2017;
  Kolpaczki et al. 2024, SVARM):

      phi_i(r) = 1/n * ( sum_{s=1}^{n} mean_{|S|=s, i in S} r(S) - sum_{s=0}^{n-1} mean_{|S|=s, i not in S} r(S) )

  each mean taken over the plan's coalitions of that size: exact over the empty and grand
  coalitions and the sizes KernelSHAP enumerates, the mean over the draws (a coalition counted as
  often as drawn) over the sampled sizes, and 0 (the proxy taken as right) where a size has no
  draw with, or without, player i.
- the values are shifted by ``(v(N) - v(empty) - sum phi) / n`` each, so that efficiency holds to
  float precision (``diagnostics["efficiency_shift"]``).

The plan is KernelSHAP's (:func:`.kernel._build_plan`, a pure function of ``(n, budget, seed)``): a
``kernelshap`` run's archive refits as ``regression-msr`` with no model, and the other way round.
``budget >= 2^n`` enumerates every coalition and gives the exact Shapley values.

Measured on three recorded SmolLM2 games of 12-14 players (``benchmarks/RESULTS.md``, "Estimator
leaderboard", 20 seeds): 0.3-0.5x KernelSHAP's median relative error from 5n to 80n evaluations.

Standard errors (sampled plans): the delete-one-pair jackknife of the whole estimator (proxy refit
and residual means without one draw; each complement pair is one i.i.d. draw), reported as Tukey's
jackknife t interval like :class:`.kernel.KernelSHAP`'s, and unknown (NaN) in the same cases: fewer
distinct pairs than :func:`.kernel._min_distinct_pairs`, a budget within 4n of 2^n, a singular
proxy fit (with or without some pair; ``diagnostics["stderr_singular"]``), or replicates that agree
to float rounding. The replicates come from per-size moments in O(n^3) each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .base import Estimate, budget_near_all, check_pool, gather, pool_lookup
from .kernel import KernelSHAP, _build_plan, _min_distinct_pairs, _Plan, jackknife_t_stderr

__all__ = ("RegressionMSR",)

logger = logging.getLogger(__name__)

_CHUNK = 256
"""Jackknife replicates corrected per batch (bounds memory at ``_CHUNK * n^2`` float64)."""


def _strata(plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes [n_distinct] int64, weights [n_distinct] float64)``: each planned coalition's size
    and how many times it counts, in the proxy's fit and in its size's mean: 1 for the empty and
    grand coalitions and an enumerated size, its draws for a sampled size."""
    sizes = plan.rows.sum(axis=1).astype(np.int64)
    weights = np.bincount(plan.pairs.ravel(), minlength=plan.rows.shape[0]).astype(np.float64)
    weights[plan.enumerated] = 1.0
    weights[:2] = 1.0  # rows 0 and 1 of a sampled plan: empty and grand coalition
    return sizes, weights


def _proxies(x: np.ndarray, y: np.ndarray, gram: np.ndarray, moment: np.ndarray) -> np.ndarray | None:
    """Least-squares coefficients ``[..., n + 1]`` (intercept first) from Gram matrices
    ``[..., n + 1, n + 1]`` and moments ``[..., n + 1]``; None when a Gram matrix is singular."""
    scale = np.abs(gram).max(axis=(-2, -1), keepdims=True)
    if np.any(np.linalg.matrix_rank(gram / scale) < gram.shape[-1]):
        return None
    return np.linalg.solve(gram, moment[..., None])[..., 0]


def _adjustment(z: np.ndarray, y: np.ndarray, sizes: np.ndarray, weights: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """The stratified residual term of the module docstring for one proxy.

    Args:
        z: ``[m, n]`` float64 0/1 rows.
        y: ``[m]`` float64 ``v(S) - v(empty)`` (nats).
        sizes: ``[m]`` int64 coalition sizes.
        weights: ``[m]`` float64 count of each row in its size's mean.
        coef: ``[n + 1]`` float64 the proxy: intercept, then the players' coefficients.

    Returns:
        ``[n]`` float64 ``phi(r)`` in nats.
    """
    n = z.shape[1]
    r = weights * (y - coef[0] - z @ coef[1:])  # [m]
    onehot = np.zeros((z.shape[0], n + 1))
    onehot[np.arange(z.shape[0]), sizes] = 1.0  # [m, n + 1]
    c_in = onehot.T @ (weights[:, None] * z)  # [n + 1, n]
    c_out = onehot.T @ weights[:, None] - c_in
    s_in = onehot.T @ (r[:, None] * z)
    s_out = onehot.T @ r[:, None] - s_in
    # size 0 has no coalition with i (c_in = 0) and size n none without it: both terms vanish there
    return (_ratio(s_in, c_in) - _ratio(s_out, c_out)).sum(axis=0) / n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` where ``den > 0``, else 0 (a size with no draw: the proxy is taken as right)."""
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _replicates(
    z: np.ndarray, y: np.ndarray, sizes: np.ndarray, weights: np.ndarray, distinct: np.ndarray
) -> np.ndarray | None:
    """The values of every delete-one-pair replicate before the efficiency shift: ``[D, n]``
    float64, or None when some replicate's proxy fit is singular.

    Replicate d counts one draw of pair ``distinct[d]`` less, in the proxy's fit and in the means.
    The proxy refit is a rank-2 change of one Gram matrix, and every sum over a size is linear in
    the proxy, so each replicate comes from per-size moments (``sum w z y``, ``sum w z z^T``) in
    O(n^3), whatever the number of coalitions.
    """
    m, n = z.shape
    x = np.hstack([np.ones((m, 1)), z])  # [m, n + 1]
    gram = x.T @ (weights[:, None] * x)
    moment = x.T @ (weights * y)
    onehot = np.zeros((m, n + 1))
    onehot[np.arange(m), sizes] = 1.0  # [m, n + 1] sizes
    wz = weights[:, None] * z
    c_in = onehot.T @ wz  # [n + 1, n]
    c_all = onehot.T @ weights  # [n + 1]
    a_in = onehot.T @ (wz * y[:, None])  # [n + 1, n]: sum w z_i y
    a_all = onehot.T @ (weights * y)  # [n + 1]
    b_in = np.einsum("ms,mi,mj->sij", onehot, wz, z)  # [n + 1, n, n]: sum w z_i z_j
    b_all = onehot.T @ wz  # [n + 1, n]: sum w z_j
    out = np.empty((distinct.shape[0], n))
    for lo in range(0, distinct.shape[0], _CHUNK):
        block = distinct[lo : lo + _CHUNK]
        count = block.shape[0]
        xa, xb = x[block[:, 0]], x[block[:, 1]]  # [B, n + 1]
        g = gram[None] - xa[:, :, None] * xa[:, None, :] - xb[:, :, None] * xb[:, None, :]
        h = moment[None] - xa * y[block[:, 0], None] - xb * y[block[:, 1], None]
        coef = _proxies(x, y, g, h)  # [B, n + 1]
        if coef is None:
            return None
        b0, beta = coef[:, 0], coef[:, 1:]
        s_in = a_in[None] - np.einsum("sij,bj->bsi", b_in, beta) - b0[:, None, None] * c_in[None]  # [B, n + 1, n]
        s_all = a_all[None] - beta @ b_all.T - b0[:, None] * c_all[None]  # [B, n + 1]
        cin = np.broadcast_to(c_in, (count, n + 1, n)).copy()
        call = np.broadcast_to(c_all, (count, n + 1)).copy()
        rows = np.arange(count)
        for side in (0, 1):  # one draw of each coalition of the pair leaves its size's mean
            j = block[:, side]
            zj = z[j]  # [B, n]
            rj = y[j] - b0 - np.einsum("bi,bi->b", zj, beta)  # [B]
            s_in[rows, sizes[j]] -= zj * rj[:, None]
            s_all[rows, sizes[j]] -= rj
            cin[rows, sizes[j]] -= zj
            call[rows, sizes[j]] -= 1.0
        s_out = s_all[:, :, None] - s_in
        cout = call[:, :, None] - cin
        out[lo : lo + count] = beta + (_ratio(s_in, cin) - _ratio(s_out, cout)).sum(axis=1) / n
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RegressionMSR(KernelSHAP):
    """Shapley values by regression-adjusted Monte Carlo (Witter, Liu & Musco 2025) on KernelSHAP's plan
    (module docstring: the linear proxy, the stratified residual term, the standard errors).

    Args:
        budget: maximum number of distinct coalitions (model evaluations), counting the empty and
            grand coalitions; at least ``min(4, 2^n)``. ``budget >= 2^n`` gives the exact values.
        seed: seed of ``numpy.random.default_rng``; the plan is KernelSHAP's for (n, budget, seed).
        paired: must be True (complement pairs, as KernelSHAP).

    Attributes:
        name: ``"regression-msr"``.

    Raises:
        ConfigError: as :class:`~coalescence.attribution.estimators.kernel.KernelSHAP`.
    """

    name: str = field(default="regression-msr", init=False)
    what: ClassVar[str] = "regression-msr"  # KernelSHAP's coalitions and minimum budget

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """The linear proxy's coefficients plus the stratified residual term, shifted to efficiency.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 nats (exact under full
            enumeration, ``stderr`` None); for sampled plans ``stderr`` ``[n_players]`` float64
            jackknife t standard errors in nats (NaN in the cases of the module docstring) and
            diagnostics ``stderr_dof``, ``stderr_unknown``, ``pairs_distinct``,
            ``stderr_min_pairs``, ``stderr_singular`` (as KernelSHAP's) and
            ``efficiency_shift`` (the shift per player, nats); ``efficiency_gap`` at float
            precision.

        Raises:
            EstimatorError: no players, or the pool misses planned coalitions (with the count).
            ConfigError: the budget is below the minimum.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        plan = _build_plan(n, self.budget, self.seed)
        if plan.full or n == 1:
            exact = KernelSHAP.fit(self, masks, utilities)
            return Estimate(
                method=self.name, values=exact.values, stderr=None, v_empty=exact.v_empty, v_full=exact.v_full,
                efficiency_gap=exact.efficiency_gap, n_evaluations=exact.n_evaluations,
            )
        u = gather(pool_lookup(masks, utilities), plan.keys, self.name)  # [n_distinct]
        v_empty, v_full = float(u[0]), float(u[1])
        total = v_full - v_empty
        z = plan.rows.astype(np.float64)
        y = u - v_empty
        sizes, weights = _strata(plan)
        x = np.hstack([np.ones((z.shape[0], 1)), z])
        coef = _proxies(x, y, x.T @ (weights[:, None] * x), x.T @ (weights * y))
        singular = coef is None
        if singular:  # fewer distinct coalitions than players + 1: the minimum-norm fit
            logger.warning("regression-msr: the %s coalitions do not identify a linear proxy of %s players; raise the budget", z.shape[0], n)
            coef = np.linalg.lstsq(np.sqrt(weights)[:, None] * x, np.sqrt(weights) * y, rcond=None)[0]
        values = coef[1:] + _adjustment(z, y, sizes, weights, coef)
        shift = (total - values.sum()) / n
        values = values + shift
        distinct, multiplicity = np.unique(np.sort(plan.pairs, axis=1), axis=0, return_counts=True)
        least = _min_distinct_pairs(n, bool(plan.enumerated.size))
        stderr = np.full(n, np.nan)
        if not singular and distinct.shape[0] >= least and not budget_near_all(n, self.budget):
            reps = _replicates(z, y, sizes, weights, distinct)
            if reps is None:
                singular = True
            else:
                reps += (total - reps.sum(axis=1, keepdims=True)) / n
                stderr = jackknife_t_stderr(reps, multiplicity, plan.pairs.shape[0], max(float(np.max(np.abs(y))), abs(total)))
        unknown = int(np.count_nonzero(np.isnan(stderr)))
        diagnostics = {
            "stderr_dof": float(plan.pairs.shape[0] - 1),
            "stderr_unknown": float(unknown),
            "pairs_distinct": float(distinct.shape[0]),
            "stderr_min_pairs": float(least),
            "stderr_singular": float(singular),
            "efficiency_shift": float(shift),
        }
        return Estimate.from_values(
            method=self.name,
            values=values,
            stderr=stderr,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=len(plan.keys),
            diagnostics=diagnostics,
        )
