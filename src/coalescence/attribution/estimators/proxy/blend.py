"""The shrunk two-fidelity Shapley estimate (``proxy-shapley-shrunk``): the unbiased cross-fitted
estimate blended, player by player, toward the control game's own Shapley values, with weights
from the jackknife.

Two estimates of ``phi(v)`` come out of the same exact coalitions (:mod:`.shapley`):

- ``u_hat``, the cross-fitted regression-adjusted estimate: unbiased, its variance the importance
  sampling's over the P complement pairs;
- ``t_hat = phi(f)`` of the control ``f(S) = a + b c(S) + sum_i beta_i z_i`` fitted **in sample**
  by the weighted ridge least squares of :func:`.shapley.cross_fitted_shapley` (all the planned
  coalitions, the penalty :func:`.shapley.default_ridge`), ``phi(f) = b phi(c) + beta``, shifted
  by a constant so that it sums to ``v(N) - v(empty)``: a low-variance, biased estimate (the
  control is linear in the players and in the proxy; what of v is neither is missing from it).

For a weight ``lambda_i`` the blend ``u_hat_i - lambda_i (u_hat_i - t_hat_i)`` has mean squared
error ``Var(u_i) - 2 lambda_i Cov(u_i, d_i) + lambda_i^2 E[d_i^2]`` with ``d = u_hat - t_hat``, least at

    lambda_i = Cov(u_hat_i, d_i) / (Var(d_i) + delta^2),   clipped to [0, 1],

the bias ``E[d_i]^2`` pooled over players as ``delta^2 = max(0, mean_i (d_i^2 - Var(d_i)))``
(the empirical Bayes moment estimate of the spread of the control's bias; Efron & Morris 1973,
"Stein's estimation rule and its competitors"). ``Cov`` and ``Var`` are the delete-one-pair
jackknife's (Efron & Stein 1981): both estimates refitted without each pair, so the correlation
of the two (they share their coalitions) is in the weights. Where the control's bias is large
against the sampling noise (many exact coalitions) ``lambda -> 0`` and the blend is the unbiased
estimate; where the noise dominates (few coalitions) it leans on the control. The blend is biased
toward the control's values and consistent: as the exact budget grows the jackknife variances
vanish, ``lambda`` with them (and with every coalition evaluated the values are exact, as
``proxy-shapley``'s). Its efficiency gap stays at float precision: the blend's sum is restored
by spreading its gap over the players in proportion to ``lambda_i Var(d_i)``.

Measured on the recorded games (``benchmarks/RESULTS.md``, "The shrunk two-fidelity estimate";
200 seeds, median relative error against exact Shapley, ratio to regression-msr's at the same
exact budget): demo (n = 10) 0.19x / 0.48x / 0.88x at 16 / 32 / 64 against the unbiased
estimate's 0.30x / 0.60x / 0.86x; eiffel12 and the 14-player games 0.23-0.43x at 16, 0.22-0.31x
at 32, 0.63-0.81x at 64.

Standard errors: the jackknife of the blend with its weights held fixed (``u_hat_(p) -
lambda (u_hat_(p) - t_hat_(p))`` over the pairs p), a bound on its bias toward the control,
``lambda_i max(|d_i|, delta)`` (the two estimates' disagreement, or the pooled bias where that is
larger: with very few pairs the moment estimate of delta is often 0 while the weights are near 1),
and the proxy's part ``b se(phi(c))``, added in quadrature: a root mean squared error rather than a
sampling interval (the coverage is measured in ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .shapley import CrossFit, Shrunk, TwoFidelityShapley, _design, default_ridge, fit_weights

__all__ = ("Blend", "ShrunkTwoFidelityShapley", "shrunk_shapley")

_CHUNK = 256


@dataclass(frozen=True, slots=True)
class Blend:
    """The shrunk estimate (:func:`shrunk_shapley`).

    Attributes:
        values: ``[n]`` float64 the blend (nats), summing to the unbiased estimate's total.
        weights: ``[n]`` float64 each player's ``lambda_i`` in [0, 1] (0: the unbiased estimate).
        control: ``[n]`` float64 ``t_hat``, the in-sample control's Shapley values, efficient.
        replicates: ``[D, n]`` float64 the blend refitted without one draw of each distinct pair
            (its weights held fixed), for the jackknife's standard errors.
        delta2: the pooled squared bias of the control, ``delta^2`` (nats^2).
        disagreement: ``[n]`` float64 ``d = u_hat - t_hat`` (nats).
    """

    values: np.ndarray
    weights: np.ndarray
    control: np.ndarray
    replicates: np.ndarray
    delta2: float
    disagreement: np.ndarray


def shrunk_shapley(
    fit: CrossFit,
    rows: np.ndarray,
    pairs: np.ndarray,
    enumerated: np.ndarray,
    u: np.ndarray,
    c: np.ndarray,
    phi_c: np.ndarray,
    *,
    weighting: str = "variance",
) -> Blend:
    """The blend of the module docs from a cross-fitted estimate and its plan's arrays.

    Args:
        fit: the unbiased estimate (:func:`.shapley.cross_fitted_shapley` on the same arguments).
        rows, pairs, enumerated: the KernelSHAP plan's distinct coalitions ``[m, n]`` bool (row 0
            empty, row 1 grand), drawn pairs ``[P, 2]`` int64 and enumerated rows ``[k]`` int64.
        u: ``[m]`` float64 exact utilities of ``rows`` (nats).
        c: ``[m]`` float64 proxy utilities of ``rows`` (nats).
        phi_c: ``[n]`` float64 Shapley values of the proxy game.
        weighting: the control's least-squares weights (:data:`.shapley.WEIGHTINGS`).

    Returns:
        The :class:`Blend`; with fewer than two distinct pairs, or a singular control fit, the
        unbiased estimate itself (all weights 0).
    """
    m, n = rows.shape
    distinct, multiplicity = np.unique(np.sort(pairs, axis=1), axis=0, return_counts=True)
    total = float(fit.values.sum())
    d_count = distinct.shape[0]
    n_draws = int(multiplicity.sum())
    unbiased = Blend(
        values=fit.values, weights=np.zeros(n), control=fit.values,
        replicates=(n_draws * fit.values[None] - fit.psi) / max(n_draws - 1, 1), delta2=0.0, disagreement=np.zeros(n),
    )
    if d_count < 2 or n_draws < 2:
        return unbiased
    z = rows.astype(np.float64)
    x, phi, linear = _design("c+linear", z, c, phi_c)  # [m, n + 2], [n, n + 2]
    weights = fit_weights(rows, pairs, enumerated, weighting)
    draws = np.bincount(pairs.ravel(), minlength=m).astype(np.float64)
    per_draw = weights / np.maximum(draws, 1.0)
    gram = x.T @ (weights[:, None] * x) + np.diag(default_ridge(n, m) * linear.astype(np.float64))
    moment = x.T @ (weights * u)
    try:
        coef = np.linalg.solve(gram, moment)
    except np.linalg.LinAlgError:
        return unbiased

    def efficient(t: np.ndarray) -> np.ndarray:  # [..., n]: shifted to sum to the unbiased total
        return t + (total - t.sum(axis=-1, keepdims=True)) / n

    control = efficient(phi @ coef)
    rep_t = np.empty((d_count, n))
    for lo in range(0, d_count, _CHUNK):
        block = distinct[lo : lo + _CHUNK]
        xa, xb = x[block[:, 0]], x[block[:, 1]]
        wa, wb = per_draw[block[:, 0], None], per_draw[block[:, 1], None]
        g = gram[None] - wa[:, :, None] * xa[:, :, None] * xa[:, None, :] - wb[:, :, None] * xb[:, :, None] * xb[:, None, :]
        h = moment[None] - wa * xa * u[block[:, 0], None] - wb * xb * u[block[:, 1], None]
        try:
            sol = np.linalg.solve(g, h[..., None])[..., 0]  # [B, n + 2]
        except np.linalg.LinAlgError:
            return unbiased
        rep_t[lo : lo + block.shape[0]] = efficient(sol @ phi.T)
    rep_u = unbiased.replicates
    rep_d = rep_u - rep_t
    share = multiplicity.astype(np.float64) / n_draws

    def centred(r: np.ndarray) -> np.ndarray:
        return r - share @ r

    factor = float(n_draws - 1)  # the jackknife's (P - 1) / P times P draws' shares
    var_d = factor * (share @ centred(rep_d) ** 2)
    cov_ud = factor * (share @ (centred(rep_u) * centred(rep_d)))
    d = fit.values - control
    delta2 = max(0.0, float(np.mean(d**2 - var_d)))
    lam = np.clip(cov_ud / np.maximum(var_d + delta2, 1e-300), 0.0, 1.0)
    values = fit.values - lam * d
    spread = lam * var_d
    gap = total - float(values.sum())
    values = values + gap * (spread / spread.sum() if spread.sum() > 0 else np.full(n, 1.0 / n))
    replicates = rep_u - lam * rep_d
    return Blend(values=values, weights=lam, control=control, replicates=replicates, delta2=delta2, disagreement=d)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShrunkTwoFidelityShapley(TwoFidelityShapley):
    """``proxy-shapley-shrunk``: :class:`.shapley.TwoFidelityShapley`'s cross-fitted estimate
    blended player by player toward the in-sample control's Shapley values (module docs): lower
    error on few exact coalitions, biased toward the control, consistent. With ``cross_fit=False``
    it is :class:`.shapley.TwoFidelityShapley`'s in-sample form (no blend). Args, Raises: as
    :class:`.shapley.TwoFidelityShapley`; :meth:`fit_two_fidelity`'s ``diagnostics`` add
    ``shrink_weight`` (the mean of the weights lambda_i) and ``shrink_delta2`` (nats^2).

    Attributes:
        name: ``"proxy-shapley-shrunk"``.
    """

    name: str = field(default="proxy-shapley-shrunk", init=False)
    what: ClassVar[str] = "proxy-shapley-shrunk"

    def _shrink(self, fit: CrossFit, plan: object, u: np.ndarray, c: np.ndarray, phi_c: np.ndarray) -> Shrunk | None:
        blend = shrunk_shapley(
            fit, plan.rows, plan.pairs, plan.enumerated, u, c, phi_c, weighting=self.weighting  # type: ignore[attr-defined]
        )
        if not np.any(blend.weights > 0):
            return None  # too few pairs, or nothing to gain: the unbiased estimate, said as such
        diagnostics = {"shrink_weight": float(np.mean(blend.weights)), "shrink_delta2": blend.delta2}
        note = (
            f", blended toward the control's own Shapley values (mean weight {diagnostics['shrink_weight']:.2f}; biased "
            "toward the control, consistent: the weights vanish as the exact budget grows)"
        )
        bias = blend.weights * np.maximum(np.abs(blend.disagreement), np.sqrt(blend.delta2))  # [n] nats
        return Shrunk(values=blend.values, replicates=blend.replicates, bias=bias, diagnostics=diagnostics, note=note)
