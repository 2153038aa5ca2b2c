"""Regression-adjusted KernelSHAP: a KernelSHAP fit as the proxy, its residuals corrected by
stratified Monte Carlo on the same coalitions.

Witter, Liu & Musco (2025), "Regression-adjusted Monte Carlo estimators for Shapley values and
probabilistic values" (NeurIPS; shapiq's ``RegressionMSR``): fit a proxy ``f`` of the value function
on the sampled coalitions, take its Shapley values exactly, and estimate the Shapley values of the
residual ``r = v - f`` by Monte Carlo on the same samples; the Shapley value is linear, so
``phi(v) = phi(f) + phi(r)``. Here the proxy is the efficiency-constrained KernelSHAP fit of
:mod:`.kernel` (a linear model ``f(S) = v(empty) + sum_{i in S} beta_i``, whose Shapley values are
``beta``; it passes through ``v(empty)`` and ``v(N)``, so ``r(empty) = r(N) = 0``), and the residual
term is the size-stratified form of the Shapley value (Castro et al. 2017; Kolpaczki et al. 2024,
SVARM):

    phi_i(r) = 1/n * sum_{s=1}^{n-1} ( mean_{|S|=s, i in S} r(S) - mean_{|S|=s, i not in S} r(S) )

with each mean taken over the plan's coalitions of that size: exact over the sizes KernelSHAP
enumerates, the sample mean of the draws (each drawn coalition counted as often as drawn) over the
sampled sizes, and 0 (the proxy taken as right) where a size has no draw with, or without, player i.
The values are shifted by ``(v(N) - v(empty) - sum phi) / n`` each so that efficiency holds to float
precision.

The plan is KernelSHAP's (:func:`.kernel._build_plan`, a pure function of ``(n, budget, seed)``): a
``kernelshap`` run's archive refits as ``regression-msr`` with no model, and the other way round.
``budget >= 2^n`` enumerates every coalition and gives the exact Shapley values (the residual term
is then exact too).

Measured on three recorded SmolLM2 games of 12-14 players (``benchmarks/RESULTS.md``, "Estimator
leaderboard"): 0.6-0.7x KernelSHAP's relative error at 10n evaluations and 0.4-0.5x from about 40n.

Standard errors (sampled plans): the delete-one-pair jackknife of the whole estimator (proxy refit
and residual means without one draw; each complement pair is one i.i.d. draw), reported as Tukey's
jackknife t interval, exactly as :class:`.kernel.KernelSHAP` reports its own, with the same rules for
unknown (NaN) errors: too few distinct pairs, a budget within 4n of 2^n, a singular fit, or replicates
that agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .base import Capabilities, Estimate, budget_near_all, check_pool, gather, pool_lookup
from .kernel import (
    KernelSHAP,
    _build_plan,
    _jackknife_replicates,
    _min_distinct_pairs,
    _Plan,
    _sampled_weights,
    jackknife_t_stderr,
)

__all__ = ("RegressionMSR",)

_CHUNK = 256
"""Jackknife replicates corrected per batch (bounds memory at ``_CHUNK * n^2`` float64)."""


def _strata(plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes [n_distinct] int64, weights [n_distinct] float64)``: each planned coalition's size
    and how many times it counts in its size's mean (1 when its size is enumerated, its draws
    otherwise, 0 for the empty and grand coalitions)."""
    n = plan.rows.shape[1]
    sizes = plan.rows.sum(axis=1).astype(np.int64)
    weights = np.bincount(plan.pairs.ravel(), minlength=plan.rows.shape[0]).astype(np.float64)
    weights[plan.enumerated] = 1.0
    weights[(sizes == 0) | (sizes == n)] = 0.0
    return sizes, weights


def _adjustment(
    z: np.ndarray, y: np.ndarray, sizes: np.ndarray, weights: np.ndarray, beta: np.ndarray
) -> np.ndarray:
    """The stratified residual term of the module docstring for one proxy.

    Args:
        z: ``[m, n]`` float64 0/1 rows.
        y: ``[m]`` float64 ``v(S) - v(empty)`` (nats).
        sizes: ``[m]`` int64 coalition sizes.
        weights: ``[m]`` float64 count of each row in its size's mean.
        beta: ``[n]`` float64 the proxy's values.

    Returns:
        ``[n]`` float64 ``phi(r)`` in nats.
    """
    n = z.shape[1]
    r = weights * (y - z @ beta)  # [m]
    onehot = np.zeros((z.shape[0], n + 1))
    onehot[np.arange(z.shape[0]), sizes] = 1.0  # [m, n + 1]
    c_in = onehot.T @ (weights[:, None] * z)  # [n + 1, n]
    c_out = onehot.T @ weights[:, None] - c_in
    s_in = onehot.T @ (r[:, None] * z)
    s_out = onehot.T @ r[:, None] - s_in
    return (_ratio(s_in, c_in) - _ratio(s_out, c_out)).sum(axis=0) / n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` where ``den > 0``, else 0 (a size with no draw: the proxy is taken as right)."""
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _replicate_adjustments(
    z: np.ndarray,
    y: np.ndarray,
    sizes: np.ndarray,
    weights: np.ndarray,
    betas: np.ndarray,
    distinct: np.ndarray,
) -> np.ndarray:
    """The residual term of every delete-one-pair replicate: ``[D, n]`` float64.

    Replicate d uses its own proxy ``betas[d]`` and the plan's counts less one draw of pair
    ``distinct[d]``. Sums over a size are linear in the proxy, so they come from per-size moments
    (``sum w z y`` and ``sum w z z^T``) in O(n^3) a replicate, whatever the number of coalitions.
    """
    n = z.shape[1]
    onehot = np.zeros((z.shape[0], n + 1))
    onehot[np.arange(z.shape[0]), sizes] = 1.0  # [m, n + 1]
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
        beta = betas[lo : lo + _CHUNK]  # [B, n]
        count = block.shape[0]
        s_in = a_in[None] - np.einsum("sij,bj->bsi", b_in, beta)  # [B, n + 1, n]
        s_all = a_all[None] - beta @ b_all.T  # [B, n + 1]
        cin = np.broadcast_to(c_in, (count, n + 1, n)).copy()
        call = np.broadcast_to(c_all, (count, n + 1)).copy()
        rows = np.arange(count)
        for side in (0, 1):  # one draw of each coalition of the pair leaves its size's mean
            j = block[:, side]
            zj = z[j]  # [B, n]
            rj = y[j] - np.einsum("bi,bi->b", zj, beta)  # [B]
            s_in[rows, sizes[j]] -= zj * rj[:, None]
            s_all[rows, sizes[j]] -= rj
            cin[rows, sizes[j]] -= zj
            call[rows, sizes[j]] -= 1.0
        s_out = s_all[:, :, None] - s_in
        cout = call[:, :, None] - cin
        out[lo : lo + count] = (_ratio(s_in, cin) - _ratio(s_out, cout)).sum(axis=1) / n
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RegressionMSR(KernelSHAP):
    """Shapley values by regression-adjusted KernelSHAP (Witter, Liu & Musco 2025), on KernelSHAP's plan.

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
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=True)

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """KernelSHAP's planned coalitions (:meth:`KernelSHAP.plan`)."""
        return KernelSHAP.plan(self, n_players)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """The KernelSHAP fit plus the stratified residual term, shifted to efficiency.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 nats (exact under full
            enumeration, ``stderr`` None); for sampled plans ``stderr`` ``[n_players]`` float64
            jackknife t standard errors in nats (NaN where KernelSHAP's are unknown, and for a
            player whose replicates agree to float rounding) and KernelSHAP's diagnostics plus
            ``proxy_efficiency_shift`` (the shift per player, nats); ``efficiency_gap`` at float
            precision.

        Raises:
            EstimatorError: no players, or the pool misses planned coalitions (with the count).
            ConfigError: the budget is below the minimum.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        proxy = KernelSHAP.fit(self, masks, utilities)
        n = proxy.n_players
        plan = _build_plan(n, self.budget, self.seed)
        if plan.full or n == 1:
            return Estimate(
                method=self.name, values=proxy.values, stderr=None, v_empty=proxy.v_empty, v_full=proxy.v_full,
                efficiency_gap=proxy.efficiency_gap, n_evaluations=proxy.n_evaluations,
            )
        masks, utilities = check_pool(masks, utilities)
        u = gather(pool_lookup(masks, utilities), plan.keys, self.name)  # [n_distinct]
        total = proxy.v_full - proxy.v_empty
        z = plan.rows.astype(np.float64)
        y = u - proxy.v_empty
        sizes, weights = _strata(plan)
        values = proxy.values + _adjustment(z, y, sizes, weights, proxy.values)
        shift = (total - values.sum()) / n
        values = values + shift
        diagnostics = dict(proxy.diagnostics)
        diagnostics["proxy_efficiency_shift"] = shift
        stderr = np.full(n, np.nan)
        distinct, multiplicity = np.unique(np.sort(plan.pairs, axis=1), axis=0, return_counts=True)
        known = (
            not np.isnan(proxy.stderr).all()
            and distinct.shape[0] >= _min_distinct_pairs(n, bool(plan.enumerated.size))
            and not budget_near_all(n, self.budget)
        )
        if known:
            betas = _jackknife_replicates(plan, z, y, _sampled_weights(plan), total, distinct)
            if betas is not None:
                reps = betas + _replicate_adjustments(z, y, sizes, weights, betas, distinct)
                reps += (total - reps.sum(axis=1, keepdims=True)) / n
                stderr = jackknife_t_stderr(reps, multiplicity, plan.pairs.shape[0], max(float(np.max(np.abs(y))), abs(total)))
            else:
                diagnostics["stderr_singular"] = 1.0
        diagnostics["stderr_unknown"] = float(np.count_nonzero(np.isnan(stderr)))
        return Estimate(
            method=self.name,
            values=values,
            stderr=stderr,
            v_empty=proxy.v_empty,
            v_full=proxy.v_full,
            efficiency_gap=float(values.sum() - total),
            n_evaluations=proxy.n_evaluations,
            diagnostics=diagnostics,
        )

