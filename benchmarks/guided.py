"""Proxy-guided sampling of the exact coalitions for the cross-fitted two-fidelity Shapley estimate
(research code, used by ``benchmarks/proxy_game.py --guided``; moved out of the package in issue 48:
the engine never plays it; its tests are ``tests/benchmarks/test_guided.py``).

Names in ``:mod:`` and ``:func:`` references below are of :mod:`coalescence.attribution.estimators.proxy`.

:class:`.shapley.TwoFidelityShapley` draws its exact complement pairs from KernelSHAP's plan: a
size k with probability ``pi(k)`` proportional to ``1 / (k (n - k))``, then a uniform coalition
of that size, i.e. coalition S with probability ``q_kernel(S) = pi(|S|) / C(n, |S|)``. The
importance-sampled residual term of a pair is ``r(S) h(S) / (C(n, |S|) q(S))`` averaged with its
complement's (``r = v - f`` the control's residual, ``h`` the stratified Shapley weights of
:mod:`.shapley`), unbiased for ``sum_{0 < |S| < n} r(S) h(S) / C(n, |S|)`` for ANY ``q`` that is
positive on every proper coalition; its variance is smallest for ``q(S)`` proportional to
``|r(S) - r(N \\ S)| ||h(S)|| / C(n, |S|)`` (importance sampling's optimal density; Owen 2013,
"Monte Carlo theory, methods and examples", ch. 9), which needs the exact residual.

When the proxy game c is known on all 2^n coalitions before the exact ones are drawn (it costs
about 1/10-1/25 of an exact row on the recorded games), its own residual stands in for r: with
``r_c = c - (a + sum beta_i z_i)`` (c's weighted least-squares additive fit over all coalitions,
weights ``|S| (n - |S|) / n``) and ``d_c(S) = r_c(S) - r_c(N \\ S)``,

    q(S) = mix * q_kernel(S) + (1 - mix) * g(S),   g(S) proportional to |d_c(S)| ||h(S)|| / C(n, |S|)

(a defensive mixture, Hesterberg 1995, "Weighted average importance sampling and defensive
mixture distributions": ``q >= mix * q_kernel``, so each term's weight is at most ``1 / mix``
times KernelSHAP's and the variance at most ``1 / mix`` times). ``q(S) = q(N \\ S)``, so a pair
is one draw. Measured on the demo's proxy (``benchmarks/RESULTS.md``, "Proxy-guided exact
coalitions"): the proxy's residual alone is a poor guide (its |d_c| correlates 0.27 with the
exact residual's), catastrophic unmixed (the second moment of the residual term 129 times
KernelSHAP's), and 0.81 times KernelSHAP's mixed half and half.

The estimate is :func:`.shapley._cross_fit`'s, unchanged but for the importance weights: the
plan draws pairs i.i.d. from q (``numpy.random.default_rng(seed)``) until the next pair would push
the distinct coalitions (with the empty and grand coalitions) above the budget; each pair's
control is fitted without it (leave-one-out cross-fitting), so the estimate is unbiased for the
exact Shapley values whatever the proxy (given the number of draws, as :mod:`.shapley`'s). The
control's least squares weighs a coalition by its draws times ``||h(S) / (C(n, |S|) q(S))||^2``,
scaled to equal :func:`.shapley.fit_weights`' ``"variance"`` weights when ``q = q_kernel``.

**Where it stands.** The exact plan depends on the proxy's values, so the proxy must be played
FIRST, on every coalition (``proxy_budget = 2^n``); the engine plays the exact plan first
(``engine.explain``), so this is reachable through :func:`guided_plan` and :func:`guided_shapley`
on arrays (``benchmarks/proxy_game.py --guided``), not through ``--method proxy-shapley``. Nor
is it worth wiring: median error against exact Shapley at 32 exact coalitions, 0.57-0.61x
regression-msr's on the demo (200 seeds; the default plan 0.60x), no better on eiffel12 and
faq_chat14, worse on pythonlabs_multihop14 (0.42-0.48x against 0.37x) and where KernelSHAP's plan
enumerates sizes 1 and n - 1 (the demo at 64, the tests' game at 48). Even the optimal q, which
knows the exact residual, lowers the residual term's second moment only to 0.51-0.67 of
KernelSHAP's on the recorded games (``benchmarks/RESULTS.md``, "Proxy-guided exact coalitions").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coalescence.attribution.estimators.base import Estimate
from coalescence.attribution.estimators.kernel import jackknife_t_stderr, size_probabilities
from coalescence.attribution.estimators.pool import check_pool
from coalescence.attribution.estimators.proxy.shapley import _cross_fit, _exact_part_matrix, default_ridge
from coalescence.errors import ConfigError, EstimatorError

__all__ = ("GUIDE_MIX", "GuidedPlan", "guide_probabilities", "guided_plan", "guided_shapley")

GUIDE_MIX = 0.5
"""The default share of KernelSHAP's distribution in the guided one (module docs)."""

_MAX_PLAYERS = 20
_PAIR_CAP_FACTOR = 10


def _all_coalitions(masks: np.ndarray) -> np.ndarray:
    """``[2^n]`` int64 the row of each coalition by its integer code ``sum_i z_i 2^i``.

    Raises:
        EstimatorError: the pool is not every coalition exactly once.
    """
    n = masks.shape[1]
    if n > _MAX_PLAYERS:
        raise EstimatorError(f"a proxy-guided plan enumerates all 2^n coalitions; {n} players is above {_MAX_PLAYERS}")
    code = masks.astype(np.int64) @ (1 << np.arange(n, dtype=np.int64))
    where = np.full(1 << n, -1, dtype=np.int64)
    where[code] = np.arange(masks.shape[0])
    if masks.shape[0] != 1 << n or np.any(where < 0):
        raise EstimatorError(
            f"a proxy-guided plan needs the proxy game on all {1 << n} coalitions, got {masks.shape[0]} rows "
            f"covering {int(np.count_nonzero(where >= 0))}; set proxy_budget to 2^n"
        )
    return where


def guide_probabilities(masks: np.ndarray, proxy_utilities: np.ndarray, mix: float = GUIDE_MIX) -> np.ndarray:
    """The guided sampling distribution ``q`` over coalitions (module docs).

    Args:
        masks: ``[2^n, n]`` bool every coalition once, in any order.
        proxy_utilities: ``[2^n]`` float64 the proxy game on them (nats).
        mix: KernelSHAP's share in ``(0, 1]`` (1: KernelSHAP's distribution).

    Returns:
        ``[2^n]`` float64 ``q(S)`` per row, 0 for the empty and grand coalitions, summing to 1;
        ``q(S) = q(N minus S)``. Where the proxy is additive (no residual), KernelSHAP's.

    Raises:
        EstimatorError: the pool is not every coalition once, or n > 20 or n < 2.
        ConfigError: ``mix`` outside ``(0, 1]`` (``field="mix"``).
    """
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
        raise ConfigError(f"must be a number in (0, 1], got {mix!r}", field="mix")
    masks, c = check_pool(masks, proxy_utilities)
    n = masks.shape[1]
    if n < 2:
        raise EstimatorError("a proxy-guided plan needs at least 2 players")
    where = _all_coalitions(masks)
    z = masks.astype(np.float64)
    s = z.sum(axis=1).astype(np.int64)
    proper = (s > 0) & (s < n)
    comb = np.array([math.comb(n, int(k)) for k in s], dtype=np.float64)
    kernel = np.zeros(masks.shape[0])
    kernel[proper] = size_probabilities(n)[s[proper] - 1] / comb[proper]
    if mix == 1:
        return kernel
    w = np.sqrt(np.where(proper, s * (n - s) / n, 1.0))
    x = np.column_stack([np.ones(masks.shape[0]), z])
    residual = c - x @ np.linalg.lstsq(x * w[:, None], c * w, rcond=None)[0]
    code = masks.astype(np.int64) @ (1 << np.arange(n, dtype=np.int64))
    complement = where[((1 << n) - 1) ^ code]
    d = np.abs(residual - residual[complement])
    h_norm = np.zeros(masks.shape[0])
    h_norm[proper] = np.sqrt(n / (s[proper] * (n - s[proper])))
    guide = np.where(proper, d * h_norm / comb, 0.0)
    scale = max(float(np.max(np.abs(c))), 1e-300)
    if guide.sum() <= 1e3 * np.finfo(np.float64).eps * scale:  # an additive proxy: nothing to guide by
        return kernel
    return mix * kernel + (1.0 - mix) * guide / guide.sum()


@dataclass(frozen=True, slots=True)
class GuidedPlan:
    """The exact coalitions of a proxy-guided plan (:func:`guided_plan`).

    Attributes:
        rows: ``[m, n]`` bool distinct coalitions, row 0 empty, row 1 grand, then first drawn first.
        pairs: ``[P, 2]`` int64 the rows of each drawn coalition and its complement.
        probability: ``[m]`` float64 ``q(S)`` of each row (0 for rows 0 and 1).
    """

    rows: np.ndarray
    pairs: np.ndarray
    probability: np.ndarray


def guided_plan(
    proxy_masks: np.ndarray, proxy_utilities: np.ndarray, budget: int, seed: int, mix: float = GUIDE_MIX
) -> GuidedPlan:
    """Draw the exact coalitions from the proxy-guided distribution (module docs).

    Complement pairs are drawn i.i.d. from :func:`guide_probabilities`' ``q`` with
    ``numpy.random.default_rng(seed)`` until the next pair would push the distinct coalitions
    (with the empty and grand coalitions) above ``budget``, or ``10 * budget`` pairs.

    Args:
        proxy_masks, proxy_utilities, mix: as :func:`guide_probabilities`.
        budget: exact coalitions, ``4 <= budget < 2^n`` (at 2^n every coalition is known: use
            the exact Shapley values).
        seed: the plan's seed.

    Raises:
        ConfigError: ``budget`` out of range (``field="budget"``) or a bad ``mix``.
        EstimatorError: as :func:`guide_probabilities`.
    """
    q_all = guide_probabilities(proxy_masks, proxy_utilities, mix)
    masks = np.asarray(proxy_masks, dtype=bool)
    n = masks.shape[1]
    if isinstance(budget, bool) or not isinstance(budget, int) or not 4 <= budget < 1 << n:
        raise ConfigError(f"must be an integer in [4, 2^n) = [4, {1 << n}), got {budget!r}", field="budget")
    where = _all_coalitions(masks)
    code = masks.astype(np.int64) @ (1 << np.arange(n, dtype=np.int64))
    full = (1 << n) - 1
    rng = np.random.default_rng(seed)
    order = [int(where[0]), int(where[full])]
    position = {0: 0, full: 1}
    pairs: list[tuple[int, int]] = []
    done = False
    while not done:
        for row in rng.choice(masks.shape[0], size=256, p=q_all):
            a = int(code[row])
            b = full ^ a
            new = [k for k in (a, b) if k not in position]
            if len(position) + len(new) > budget or len(pairs) >= _PAIR_CAP_FACTOR * budget:
                done = True
                break
            for k in new:
                position[k] = len(order)
                order.append(int(where[k]))
            pairs.append((position[a], position[b]))
    index = np.array(order, dtype=np.int64)
    return GuidedPlan(rows=masks[index], pairs=np.array(pairs, dtype=np.int64).reshape(-1, 2), probability=q_all[index])


def guided_shapley(
    plan: GuidedPlan, utilities: np.ndarray, proxy_utilities: np.ndarray, phi_c: np.ndarray, *, ridge: float | None = None
) -> Estimate:
    """The cross-fitted two-fidelity Shapley estimate on a proxy-guided plan (module docs), with
    the control ``a + b c + sum beta_i z_i``, its linear terms ridged (:func:`.shapley.default_ridge`).

    Args:
        plan: the :class:`GuidedPlan`.
        utilities: ``[m]`` float64 the exact game on ``plan.rows`` (nats).
        proxy_utilities: ``[m]`` float64 the proxy game on ``plan.rows`` (nats).
        phi_c: ``[n]`` float64 the proxy game's Shapley values (exact: the proxy is known on every
            coalition).
        ridge: the penalty on the linear terms, or None for :func:`.shapley.default_ridge`.

    Returns:
        an :class:`Estimate` of the exact game: ``values`` ``[n]`` float64 nats, efficient to float
        precision when ``phi_c`` is; ``stderr`` the jackknife t standard errors of the mean of the
        draws' terms (as :class:`.shapley.TwoFidelityShapley`'s, NaN with fewer than 2 draws);
        ``diagnostics``: ``b`` and ``stderr_dof``.

    Raises:
        EstimatorError: the control cannot be fitted without some pair (too few coalitions).
    """
    rows = plan.rows
    m, n = rows.shape
    u = np.asarray(utilities, dtype=np.float64)
    c = np.asarray(proxy_utilities, dtype=np.float64)
    z = rows.astype(np.float64)
    s = z.sum(axis=1)
    proper = (s > 0) & (s < n)
    comb = np.array([math.comb(n, int(k)) for k in s], dtype=np.float64)
    imp = np.zeros((m, n))
    h = z[proper] / s[proper, None] - (1.0 - z[proper]) / (n - s[proper])[:, None]
    imp[proper] = h / (comb[proper] * plan.probability[proper])[:, None]
    draws = np.bincount(plan.pairs.ravel(), minlength=m).astype(np.float64)
    k_norm = 1.0 / float(np.sum(1.0 / (np.arange(1, n) * (n - np.arange(1, n)))))
    weights = np.where(proper, draws * (imp**2).sum(axis=1) * k_norm**2 / n**2, 1.0)  # = s (n - s) / n per draw at q_kernel
    per_draw = weights / np.maximum(draws, 1.0)
    e = _exact_part_matrix(rows, np.zeros(0, dtype=np.int64))
    distinct, multiplicity = np.unique(np.sort(plan.pairs, axis=1), axis=0, return_counts=True)
    lam = default_ridge(n, m) if ridge is None else float(ridge)
    fit = _cross_fit("c+linear", z, u, c, np.asarray(phi_c, dtype=np.float64), weights, e, imp, distinct, multiplicity, lam, per_draw)
    if fit is None:
        raise EstimatorError(f"the {m} exact coalitions do not identify the control without each pair; raise the budget")
    n_draws = int(multiplicity.sum())
    stderr = np.full(n, np.nan)
    if distinct.shape[0] >= 2:
        replicates = (n_draws * fit.values[None] - fit.psi) / (n_draws - 1)
        stderr = jackknife_t_stderr(replicates, multiplicity, n_draws, max(float(np.max(np.abs(u))), 1e-300))
    return Estimate.from_values(
        method="proxy-shapley (proxy-guided plan)", values=fit.values, stderr=stderr, v_empty=float(u[0]), v_full=float(u[1]),
        n_evaluations=m, diagnostics={"b": fit.b, "stderr_dof": float(n_draws - 1)},
    )
