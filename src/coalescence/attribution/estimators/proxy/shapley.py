"""The cross-fitted two-fidelity Shapley estimator (``proxy-shapley``).

**The regression-adjusted Shapley estimator** (:class:`TwoFidelityShapley`, ``proxy-shapley``).
The Shapley value is linear, so for any control game ``f``, ``phi(v) = phi(f) + phi(v - f)``. The
control is ``f(S) = a + b c(S) [+ sum_{i in S} beta_i]`` with ``phi(f) = b phi(c) [+ beta]``;
``phi(c)`` is the regression-adjusted Monte Carlo estimate of the proxy game on ``proxy_budget``
coalitions of KernelSHAP's plan with an independent seed (:class:`.msr.RegressionMSR`; exact when
the proxy budget covers 2^n). The residual ``phi(v - f)`` is estimated on the exact coalitions of
KernelSHAP's plan at ``budget``: exactly over the empty and grand coalitions and the enumerated
sizes, and by importance sampling over the sampled sizes. By the stratified form of the Shapley
value (Castro et al. 2017), for ``h_i(S) = z_i / |S| - (1 - z_i) / (n - |S|)``:

    phi_i(r) = (r(N) - r(empty)) / n + sum_{s=1}^{n-1} E_{S uniform of size s} [ r(S) h_i(S) ]

and each complement pair (S, N minus S) of the plan, its size drawn with KernelSHAP's probability
``pi(s)`` over the sampled sizes, gives the unbiased term ``(r(S) h(S) / pi(|S|) + r(S') h(S') /
pi(|S'|)) / 2`` for those sizes (``sum_i h_i(S) = 0``: every term keeps efficiency exactly).

The control is fitted by (weighted, partly ridged; below) least squares on the plan's coalitions
**without the pair it corrects**: with ``f_(p)`` fitted on every draw but draw p,

    psi_p = phi(f_(p)) + exact part of (v - f_(p)) + pair-p term of (v - f_(p))

and the estimate is the mean of ``psi_p`` over the P draws. Since draw p is independent of the
other draws, ``E[psi_p | f_(p)] = phi(f_(p)) + phi(v - f_(p)) = phi(v)``: the estimate is unbiased
whatever the fit (leave-one-out cross-fitting; Chernozhukov et al. 2018, "Double/debiased machine
learning", for the principle), where fitting b on the same draws (RegressionMSR's in-sample
proxy) carries a bias of order 1/m: ``b phi(c) + RegressionMSR(v - b c)`` with b fitted in-sample
is off by 4.1 standard errors of its mean at 48 exact coalitions on the tests' analytic game (200
seeds) and by 5.8-6.2 on the demo at 64 (40 seeds), as regression-msr alone is; this estimator by
at most 1.7 on the analytic game and 3.4 on the real ones (eiffel12 at 32: with 40 seeds, the
largest of 12 players' t statistics exceeds 3.4 about 2% of the time) (``benchmarks/RESULTS.md``,
"Two-fidelity estimators"). (It is unbiased given the
number of draws: the plan stops at a budget of distinct coalitions, so P depends on how often draws
repeat, which is rare away from 2^n.) The leave-one-out fits are rank-2 changes of one Gram
matrix, solved in batches.

The control is one of four (:data:`CONTROLS`): ``a + b c + sum beta_i z_i``, ``a + b c``,
``a + sum beta_i z_i`` (what is left when the proxy is useless) and ``a``. **How it is fitted**
(measured in ``benchmarks/RESULTS.md``, "proxy-shapley's control, weighted and ridged"):

- *weighted* (``weighting="variance"``, :func:`fit_weights`): a coalition counts its draws times
  ``|S| (n - |S|) / n``. Only ``r = v - f`` at the sampled pairs carries variance, each pair's term
  being ``r(S) h(S) / pi(|S|)`` with ``||h(S) / pi(|S|)||^2`` proportional to ``|S| (n - |S|)``
  (``||h||^2 = n / (s (n - s))``, ``pi(s)`` proportional to ``1 / (s (n - s))``): the least
  squares that weighs each residual by that is the one that minimises the sum of the terms'
  squares. ``weighting="draws"`` counts draws only (the estimator before this weighting).
- *ridged*: the players' coefficients ``beta`` carry the penalty ``ridge`` (default
  :func:`default_ridge`, ``3.2 n^2 / m``; ``a`` and ``b`` are free), so the linear terms can be
  fitted from fewer than ``n + 2`` coalitions without each pair. Below ``3 (n + 2)`` coalitions
  besides the two each fit leaves out (:data:`LINEAR_ROWS_PER_TERM`) the control is ``a + b c +
  sum beta_i z_i`` ridged, with no choice (choosing the least spread among few draws understates
  the spread: 87-89% coverage at 3n-4n coalitions, n = 8); from there on every control, the linear
  ones both ridged and by plain least squares, and the one whose ``psi_p`` spread least (the sum
  over players of their sample variance) is kept. ``ridge=0`` is the estimator before: least
  squares, ``a + b c`` or ``a`` below the threshold.
- leaving draw p out removes one draw's weight: a coalition drawn again by an independent draw
  stays in ``f_(p)`` (removing every copy makes ``f_(p)`` depend on which coalition draw p is, and
  biased the ridged estimate by 4 standard errors on the tests' game at 48 coalitions).

Each candidate is unbiased; keeping the least spread one adds a selection bias that the
unbiasedness tests (200 seeds) do not detect. The ridge shrinks the fit, not the correction, so
it leaves the estimate unbiased (the largest bias z over players on the tests' analytic game: 1.4-2.5
at 24-96 coalitions, 200 seeds); it lowers the intervals' coverage where the draws are few (0.88
on the demo at 32, against 0.93). Each ``psi_p`` sums to ``v(N) - v(empty)``, so the estimate is
efficient to float precision when ``phi(c)`` is (RegressionMSR's is). Measured with the shared-KV
proxy (Pearson 0.84-0.95 with the exact game), median error against regression-msr's at 32 exact
coalitions: 0.55x on the demo (n = 10; 0.66x before the weighting and the ridge), 0.40x on
eiffel12 (n = 12), 0.31x and 0.37x on the 14-player games; 0.29-0.72x at 16; 0.79-0.95x at 64.

``cross_fit=False`` is the same decomposition without cross-fitting: b by least squares of v on
``[1, c]`` over the exact coalitions, then ``b phi(c) + RegressionMSR(v - b c)`` on them (the
regression-adjusted estimator of the residual game, its own linear proxy fitted in-sample). It is
what ``phi(v) = b phi(c) + phi(v - b c)`` reads as literally; measured on the tests' analytic game it
has 0.15-0.6x the cross-fitted estimate's error from 3n to 12n coalitions (its residual is nearly
additive, which regression-msr's in-sample linear fit takes out), but 1.3-2.6x on the demo and
eiffel12 at 16-32, and the bias of regression-msr itself.

With every coalition in the exact plan (``budget >= 2^n``) the values are the exact Shapley values
of v (the proxy is not used). Standard errors: the ``psi_p`` are the terms of a mean, and their
delete-one replicates give Tukey's jackknife t interval (:func:`.kernel.jackknife_t_stderr`: the
sample variance of the mean with P - 1 degrees of freedom); the proxy's part adds ``b^2 se(phi(c))^2``
(the pools are independent: the proxy plan's own seed), so ``se = sqrt(se_exact^2 + b^2 se_c^2)``.
They are NaN where KernelSHAP's are (fewer than two draws, a budget within 4n of 2^n) or where the
proxy's are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from ....errors import ConfigError, EstimatorError
from ..base import Capabilities, Estimate, budget_near_all
from ..kernel import _build_plan, jackknife_t_stderr, size_probabilities
from ..msr import RegressionMSR, _proxies
from .common import (
    _check_proxy_budget, _proxy_budget, default_proxy_budget, proxy_budget_notes, proxy_seed, two_fidelity_pools,
)

__all__ = (
    "CONTROLS", "LINEAR_ROWS_PER_TERM", "RIDGE_SCALE", "WEIGHTINGS", "CrossFit", "Shrunk", "TwoFidelityShapley",
    "cross_fitted_shapley", "default_ridge", "fit_weights",
)

LINEAR_ROWS_PER_TERM = 3
""":class:`TwoFidelityShapley` considers controls with the players' linear terms when the exact plan
has at least this many coalitions per coefficient (n + 2) besides the two each fit leaves out."""

def _exact_part_matrix(rows: np.ndarray, enumerated: np.ndarray) -> np.ndarray:
    """``[n, m]`` float64 E with ``E @ r`` the exact part of ``phi(r)``: ``(r(N) - r(empty)) / n``
    plus the stratified terms of the enumerated sizes (rows 0 and 1: empty and grand coalition)."""
    m, n = rows.shape
    e = np.zeros((n, m))
    e[:, 0] -= 1.0 / n
    e[:, 1] += 1.0 / n
    if enumerated.size:
        z = rows[enumerated].astype(np.float64)  # [k, n]
        s = z.sum(axis=1).astype(np.int64)
        inside = np.array([1.0 / math.comb(n - 1, int(k) - 1) for k in s])  # 1 / #{|S| = k, i in S}
        outside = np.array([1.0 / math.comb(n - 1, int(k)) for k in s])
        e[:, enumerated] = (z * inside[:, None] - (1.0 - z) * outside[:, None]).T / n
    return e


def _importance_terms(rows: np.ndarray, sampled_mass: float) -> np.ndarray:
    """``[m, n]`` float64 ``h(S) / pi(|S|)`` per row (module docs); zero rows for sizes 0 and n."""
    m, n = rows.shape
    z = rows.astype(np.float64)
    s = z.sum(axis=1)
    out = np.zeros((m, n))
    proper = (s > 0) & (s < n)
    if not np.any(proper) or sampled_mass <= 0:
        return out
    k = s[proper].astype(np.int64)
    pi = size_probabilities(n)[k - 1] / sampled_mass
    zp = z[proper]
    out[proper] = (zp / k[:, None] - (1.0 - zp) / (n - k)[:, None]) / pi[:, None]
    return out


CONTROLS: tuple[str, ...] = ("c+linear", "c", "linear", "none")
"""The control games :class:`TwoFidelityShapley` can fit (module docs): ``a + b c + sum beta_i z_i``,
``a + b c``, ``a + sum beta_i z_i`` (no proxy: the exact-only fallback) and ``a``."""


def _design(kind: str, z: np.ndarray, c: np.ndarray, phi_c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(X [m, p], Phi [n, p], linear [p] bool)``: the control's columns, the Shapley values of each
    column (the intercept's is 0, c's is phi(c), player j's column's is the unit vector e_j) and
    which columns are the players' (the ones the ridge penalty shrinks)."""
    m, n = z.shape
    cols, phis = [np.ones(m)], [np.zeros(n)]
    if kind in ("c+linear", "c"):
        cols.append(c)
        phis.append(phi_c)
    x = np.column_stack(cols)
    phi = np.column_stack(phis)
    linear = np.zeros(x.shape[1], dtype=bool)
    if kind in ("c+linear", "linear"):
        x = np.hstack([x, z])
        phi = np.hstack([phi, np.eye(n)])
        linear = np.r_[linear, np.ones(n, dtype=bool)]
    return x, phi, linear


RIDGE_SCALE = 3.2
"""The default ridge penalty on the control's linear terms is ``RIDGE_SCALE * n^2 / m`` (m exact
coalitions; 10 for the demo's 10 players at 32): measured best of 3-100 at 16-32 coalitions on the
demo and eiffel12 (``benchmarks/RESULTS.md``, "proxy-shapley's control, weighted and ridged")."""

WEIGHTINGS: tuple[str, ...] = ("variance", "draws")
"""How the control's least squares weighs a coalition: ``"variance"`` (default) its draws times
``|S| (n - |S|) / n``, proportional to ``||h(S) / pi(|S|)||^2``, the weight of its residual in the
importance-sampled term's variance (module docs); ``"draws"`` its draws only (RegressionMSR's)."""


def default_ridge(n_players: int, m: int) -> float:
    """``RIDGE_SCALE * n^2 / m``: the default ridge penalty of the control's linear terms."""
    return RIDGE_SCALE * n_players**2 / max(m, 1)


def fit_weights(rows: np.ndarray, pairs: np.ndarray, enumerated: np.ndarray, weighting: str = "variance") -> np.ndarray:
    """``[m]`` float64 each planned coalition's weight in the control's least squares: its draws (1
    for the empty and grand coalitions and the enumerated sizes), times ``|S| (n - |S|) / n`` for
    a proper coalition under ``weighting="variance"`` (:data:`WEIGHTINGS`)."""
    m, n = rows.shape
    weights = np.bincount(pairs.ravel(), minlength=m).astype(np.float64)  # as RegressionMSR's strata
    weights[enumerated] = 1.0
    weights[:2] = 1.0
    if weighting == "variance":
        s = rows.sum(axis=1).astype(np.float64)
        weights *= np.where((s > 0) & (s < n), s * (n - s) / n, 1.0)
    return weights


_CHUNK = 256


@dataclass(frozen=True, slots=True)
class CrossFit:
    """One cross-fitted estimate (:func:`cross_fitted_shapley`).

    Attributes:
        control: the control game (one of :data:`CONTROLS`).
        values: ``[n]`` float64 the estimate, the mean of ``psi`` over the draws.
        psi: ``[D, n]`` float64 each distinct pair's estimate (its draw's ``psi_p``).
        multiplicity: ``[D]`` int64 how many draws each distinct pair is.
        b: the mean coefficient of c over the leave-one-out fits (0 when c is not in the control).
        ridge: the penalty on the control's linear terms (0: least squares).
    """

    control: str
    values: np.ndarray
    psi: np.ndarray
    multiplicity: np.ndarray
    b: float
    ridge: float = 0.0

    @property
    def spread(self) -> float:
        """The sum over players of the draws' sample variance of ``psi`` (what the choice minimises)."""
        n_draws = int(self.multiplicity.sum())
        if n_draws < 2:
            return math.inf
        return float(self.multiplicity @ ((self.psi - self.values) ** 2).sum(axis=1)) / (n_draws - 1)


def _cross_fit(
    kind: str, z: np.ndarray, u: np.ndarray, c: np.ndarray, phi_c: np.ndarray, weights: np.ndarray,
    e: np.ndarray, imp: np.ndarray, distinct: np.ndarray, multiplicity: np.ndarray, ridge: float,
    per_draw: np.ndarray,
) -> CrossFit | None:
    """The estimate with one control, its linear terms' coefficients shrunk by ``ridge``; None when
    its fit, or its fit without some pair, is singular. ``weights`` ``[m]``: each row's weight in
    the fit; ``per_draw`` ``[m]``: one draw's share of it (what leaving one draw out removes: a
    coalition drawn twice stays in the fit once, an independent draw that happens to repeat it)."""
    n = z.shape[1]
    x, phi, linear = _design(kind, z, c, phi_c)
    gram = x.T @ (weights[:, None] * x) + np.diag(ridge * linear.astype(np.float64))
    moment = x.T @ (weights * u)
    if _proxies(x, u, gram, moment) is None:
        return None
    a_mat = phi - e @ x  # [n, p]: phi(f) minus the exact part of f, per coefficient
    base = e @ u  # [n] the exact part of v
    psi = np.empty((distinct.shape[0], n))
    b_sum = 0.0
    for lo in range(0, distinct.shape[0], _CHUNK):
        block = distinct[lo : lo + _CHUNK]
        xa, xb = x[block[:, 0]], x[block[:, 1]]  # [B, p]
        wa, wb = per_draw[block[:, 0], None], per_draw[block[:, 1], None]  # [B, 1] one draw of the pair
        g = gram[None] - wa[:, :, None] * xa[:, :, None] * xa[:, None, :] - wb[:, :, None] * xb[:, :, None] * xb[:, None, :]
        h = moment[None] - wa * xa * u[block[:, 0], None] - wb * xb * u[block[:, 1], None]
        coef = _proxies(x, u, g, h)  # [B, p] fitted without one draw of the pair
        if coef is None:
            return None
        ra = u[block[:, 0]] - np.einsum("bp,bp->b", xa, coef)  # [B] residual of S
        rb = u[block[:, 1]] - np.einsum("bp,bp->b", xb, coef)  # [B] residual of its complement
        psi[lo : lo + block.shape[0]] = (
            base[None] + coef @ a_mat.T + 0.5 * (ra[:, None] * imp[block[:, 0]] + rb[:, None] * imp[block[:, 1]])
        )
        if kind in ("c+linear", "c"):
            b_sum += float(multiplicity[lo : lo + block.shape[0]] @ coef[:, 1])
    n_draws = int(multiplicity.sum())
    values = multiplicity @ psi / n_draws
    return CrossFit(control=kind, values=values, psi=psi, multiplicity=multiplicity, b=b_sum / n_draws, ridge=float(ridge))


def cross_fitted_shapley(
    rows: np.ndarray,
    pairs: np.ndarray,
    enumerated: np.ndarray,
    sampled_mass: float,
    u: np.ndarray,
    c: np.ndarray,
    phi_c: np.ndarray,
    *,
    control: str | None = None,
    ridge: float | None = None,
    weighting: str = "variance",
) -> CrossFit:
    """The cross-fitted regression-adjusted Shapley estimate of the module docs, on plain arrays.

    Args:
        rows: ``[m, n]`` bool distinct coalitions of a sampled KernelSHAP plan (row 0 empty, row 1
            grand coalition).
        pairs: ``[P, 2]`` int64 rows of each drawn coalition and its complement.
        enumerated: ``[k]`` int64 rows of the enumerated sizes.
        sampled_mass: KernelSHAP's size mass of the sampled sizes.
        u: ``[m]`` float64 exact utilities of ``rows``.
        c: ``[m]`` float64 proxy utilities of ``rows``.
        phi_c: ``[n]`` float64 Shapley values of the proxy game (estimated or exact).
        control: one of :data:`CONTROLS`, or None for the one of least spread among those that
            can be fitted (module docs).
        ridge: the penalty on the control's linear terms (>= 0), or None for
            :func:`default_ridge`; 0 is plain least squares (the linear terms then enter the
            choice only from ``3 (n + 2)`` coalitions on, :data:`LINEAR_ROWS_PER_TERM`).
        weighting: one of :data:`WEIGHTINGS`.

    Returns:
        The :class:`CrossFit`.

    Raises:
        EstimatorError: no control (or not the one asked for) can be fitted.
    """
    m, n = rows.shape
    z = rows.astype(np.float64)
    weights = fit_weights(rows, pairs, enumerated, weighting)
    draws = np.bincount(pairs.ravel(), minlength=m).astype(np.float64)
    per_draw = weights / np.maximum(draws, 1.0)
    lam = default_ridge(n, m) if ridge is None else float(ridge)
    e = _exact_part_matrix(rows, enumerated)  # [n, m]
    imp = _importance_terms(rows, sampled_mass)  # [m, n]
    distinct, multiplicity = np.unique(np.sort(pairs, axis=1), axis=0, return_counts=True)
    few = m - 2 < LINEAR_ROWS_PER_TERM * (n + 2)  # too few coalitions to fit n + 2 coefficients by least squares
    if control is not None:
        candidates = [(control, lam)]
    elif lam == 0:
        candidates = [("c", 0.0), ("none", 0.0)] if few else [(k, 0.0) for k in CONTROLS]
    elif few:
        candidates = [("c+linear", lam), ("linear", lam)]  # the first that can be fitted, no choice by spread
    else:
        candidates = [(k, r) for k in CONTROLS for r in ((lam, 0.0) if k in ("c+linear", "linear") else (0.0,))]
    fits = []
    for kind, r in candidates:
        fit = _cross_fit(kind, z, u, c, phi_c, weights, e, imp, distinct, multiplicity, r, per_draw)
        if fit is not None:
            fits.append(fit)
            if control is None and lam > 0 and few:
                break
    if not fits:
        raise EstimatorError(
            f"the {m} exact coalitions do not identify the control {control or 'of any kind'} without each pair; raise the budget"
        )
    return min(fits, key=lambda f: f.spread)  # ties: the order of the candidates


@dataclass(frozen=True, slots=True, kw_only=True)
class Shrunk:
    """An estimate that replaces the cross-fitted one (:meth:`TwoFidelityShapley._shrink`; the
    blend of :mod:`.blend`).

    Attributes:
        values: ``[n]`` float64 values in nats.
        replicates: ``[D, n]`` float64 leave-one-draw-out replicates of ``values`` (nats), for the
            jackknife's standard errors.
        bias: ``[n]`` float64 a bound on each value's bias in nats, added to its standard error in quadrature.
        diagnostics: added to the estimate's ``diagnostics``.
        note: appended to the estimate's note.
    """

    values: np.ndarray  # [n] float64
    replicates: np.ndarray  # [D, n] float64
    bias: np.ndarray  # [n] float64
    diagnostics: dict[str, float]
    note: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoFidelityShapley(RegressionMSR):
    """Unbiased Shapley values of the exact game with a proxy game as a cross-fitted control variate
    (module docs); without a proxy (:meth:`fit`), :class:`~.msr.RegressionMSR` on the same plan.

    Args:
        budget, seed: as :class:`~.msr.RegressionMSR` (KernelSHAP's plan of the exact game).
        proxy_budget: distinct proxy coalitions (KernelSHAP's plan seeded by
            :func:`proxy_seed`), or None for :func:`default_proxy_budget`; capped at 2^n (then
            ``phi(c)`` is exact).
        control: the control game, one of :data:`CONTROLS`, or None (default) for the module
            docs' choice.
        ridge: the penalty on the control's linear terms (>= 0), or None (default) for
            :func:`default_ridge`; 0: plain least squares (the estimator before the ridge).
        weighting: the control's least-squares weights, one of :data:`WEIGHTINGS` (default
            ``"variance"``).
        cross_fit: True (default): the unbiased cross-fitted estimate. False: b fitted on the
            exact coalitions themselves, then ``b phi(c) + RegressionMSR(v - b c)`` on the same
            coalitions (module docs: lower error on small budgets, RegressionMSR's bias of order
            1/m; its standard errors are RegressionMSR's of the residual game, b held fixed).

    Attributes:
        name: ``"proxy-shapley"``.

    Raises:
        ConfigError: as :class:`~.msr.RegressionMSR`, or a bad ``proxy_budget``
            (``field="proxy_budget"``), ``ridge`` (``field="ridge"``) or ``weighting``
            (``field="weighting"``).
    """

    proxy_budget: int | None = None
    control: str | None = None
    cross_fit: bool = True
    ridge: float | None = None
    weighting: str = "variance"
    name: str = field(default="proxy-shapley", init=False)
    what: ClassVar[str] = "proxy-shapley"
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=True, two_fidelity=True)

    def __post_init__(self) -> None:
        RegressionMSR.__post_init__(self)
        _check_proxy_budget(self.proxy_budget)
        if self.cross_fit not in (True, False):
            raise ConfigError(f"must be True or False, got {self.cross_fit!r}", field="cross_fit")
        if self.ridge is not None and (isinstance(self.ridge, bool) or not isinstance(self.ridge, (int, float)) or not self.ridge >= 0):
            raise ConfigError(f"must be a number >= 0 or None (the default rule), got {self.ridge!r}", field="ridge")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}", field="weighting")
        if self.control is not None and self.control not in CONTROLS:
            raise ConfigError(f"must be one of {', '.join(CONTROLS)} or None, got {self.control!r}", field="control")

    def _proxy_estimator(self, n_players: int) -> RegressionMSR:
        return RegressionMSR(budget=_proxy_budget(self.budget, self.proxy_budget, n_players), seed=proxy_seed(self.seed))

    def validate(self, n_players: int, *, proxy: bool = False) -> None:
        """As :meth:`.msr.RegressionMSR.validate`, and, where the proxy game is played
        (``proxy=True``), the proxy budget against the same minimum.

        Raises:
            EstimatorError: ``n_players == 0``.
            ConfigError: the budget (``field="budget"``) or the proxy budget (``field="proxy_budget"``)
                is below the minimum.
        """
        RegressionMSR.validate(self, n_players)
        if not proxy:
            return
        proxy = self._proxy_estimator(int(n_players))
        minimum = proxy.min_budget(int(n_players))
        if proxy.budget < minimum:
            raise ConfigError(
                f"{proxy.budget} proxy coalitions are below the minimum of {minimum} for the proxy game's "
                f"regression-msr with {n_players} players; raise the proxy budget or leave it out (default "
                f"{default_proxy_budget(self.budget, int(n_players))})",
                field="proxy_budget",
            )

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Without a proxy game: :class:`~.msr.RegressionMSR` on the same plan, its ``method`` this
        estimator's name and a note saying so. Args, Raises: as :meth:`.msr.RegressionMSR.fit`."""
        estimate = RegressionMSR.fit(self, masks, utilities)
        note = (
            f"{self.name} without a proxy game (none was played: --proxy-game none, or a backend, utility or "
            "absence policy that does not play it): regression-msr on the same exact coalitions"
        )
        return replace(estimate, notes=(*estimate.notes, note))

    def proxy_plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The proxy game's coalitions: KernelSHAP's plan at the proxy budget, seeded by :func:`proxy_seed`.

        Raises:
            EstimatorError, ConfigError: as ``validate(n_players, proxy=True)``.
        """
        self.validate(n_players, proxy=True)
        return self._proxy_estimator(int(n_players)).plan(n_players)

    def _shrink(self, fit: CrossFit, plan: object, u: np.ndarray, c: np.ndarray, phi_c: np.ndarray) -> Shrunk | None:
        """A :class:`Shrunk` estimate replacing the cross-fitted one, or None to keep it (this
        class: None; :class:`.blend.ShrunkTwoFidelityShapley` blends)."""
        return None

    def fit_two_fidelity(
        self, masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
    ) -> Estimate:
        """The cross-fitted two-fidelity Shapley estimate (module docs).

        Args:
            masks: ``[m, n_players]`` bool exact pool (every coalition of :meth:`plan`).
            utilities: ``[m]`` float64 exact utilities (nats).
            proxy_masks: ``[k, n_players]`` bool proxy pool (every coalition of :meth:`proxy_plan`
                and of :meth:`plan`).
            proxy_utilities: ``[k]`` float64 proxy utilities (nats).

        Returns:
            an :class:`Estimate` of the exact game: ``values`` ``[n_players]`` float64 nats
            (exact under full enumeration of the exact plan, ``stderr`` None there), ``stderr``
            ``[n_players]`` float64 nats covering both parts (module docs), ``efficiency_gap`` at
            float precision, ``n_evaluations`` = exact distinct coalitions, ``diagnostics``:
            ``b``, ``proxy_pearson``, ``proxy_spearman``, ``proxy_evaluations``,
            ``exact_evaluations``, ``stderr_dof``, ``stderr_unknown``, ``stderr_exact_part``
            and ``stderr_proxy_part`` (their root mean squares over players, nats),
            ``control_linear`` and ``control_proxy`` (1.0 when in the chosen control),
            ``proxy_used`` (0.0 where the values do not depend on the proxy rows: the whole
            exact plan evaluated, or a control without c chosen).

        Raises:
            EstimatorError: a pool misses planned coalitions (which pool, with the count), or no
                control can be fitted.
            ConfigError: the budget is below the minimum.
            MaskError: a pool's masks are not 2-D bool.
        """
        pools = two_fidelity_pools(
            self, masks, utilities, proxy_masks, proxy_utilities, make_plan=lambda n: _build_plan(n, self.budget, self.seed)
        )
        masks, utilities, proxy_masks, proxy_utilities = pools.masks, pools.utilities, pools.proxy_masks, pools.proxy_utilities
        n, plan, u, c, pearson = pools.n, pools.plan, pools.u, pools.c, pools.pearson
        proxy = self._proxy_estimator(n)
        k_proxy = len(list(proxy.plan(n)))
        common = pools.diagnostics(k_proxy)
        if plan.full or n == 1:
            exact = RegressionMSR.fit(self, masks, utilities)
            note = (
                f"two-fidelity {self.name}: every one of the {len(plan.keys)} coalitions evaluated exactly, so the values "
                "are the exact Shapley values and the proxy game is not used"
            )
            return Estimate(
                method=self.name, values=exact.values, stderr=None, v_empty=exact.v_empty, v_full=exact.v_full,
                efficiency_gap=exact.efficiency_gap, n_evaluations=exact.n_evaluations,
                diagnostics={**common, "b": 0.0, "proxy_used": 0.0}, notes=(note,),
            )
        proxy_estimate = proxy.fit(proxy_masks, proxy_utilities)
        phi_c = proxy_estimate.values
        se_c = np.zeros(n) if proxy_estimate.stderr is None else np.asarray(proxy_estimate.stderr)
        v_empty, v_full = float(u[0]), float(u[1])
        shrunk: Shrunk | None = None
        if not self.cross_fit:  # b in-sample, regression-msr on the residual game v - b c (module docs)
            x = np.column_stack([np.ones(u.shape[0]), c])
            b = float(np.linalg.lstsq(x, u, rcond=None)[0][1]) if np.ptp(c) > 0 else 0.0
            residual = RegressionMSR.fit(self, plan.rows, u - b * c)
            values = b * phi_c + residual.values
            se_exact = residual.stderr if residual.stderr is not None else np.full(n, np.nan)
            stderr = np.sqrt(se_exact**2 + (b * se_c) ** 2)
            kind, n_draws, ridge = "a + b c, then regression-msr", int(plan.pairs.shape[0]), 0.0
        else:
            fit = cross_fitted_shapley(
                plan.rows, plan.pairs, plan.enumerated, plan.sampled_mass, u, c, phi_c, control=self.control,
                ridge=self.ridge, weighting=self.weighting,
            )
            values, psi, b, kind, multiplicity, ridge = fit.values, fit.psi, fit.b, fit.control, fit.multiplicity, fit.ridge
            n_draws = int(multiplicity.sum())
            stderr = np.full(n, np.nan)
            se_exact = np.full(n, np.nan)
            replicates = (n_draws * values[None] - psi) / max(n_draws - 1, 1)  # [D, n] the mean without one draw
            shrunk = self._shrink(fit, plan, u, c, phi_c)
            if shrunk is not None:
                values, replicates = shrunk.values, shrunk.replicates
            if psi.shape[0] >= 2 and not budget_near_all(n, self.budget):
                se_exact = jackknife_t_stderr(replicates, multiplicity, n_draws, max(float(np.max(np.abs(u))), 1e-300))
                if shrunk is not None:
                    se_exact = np.sqrt(se_exact**2 + shrunk.bias**2)
                stderr = np.sqrt(se_exact**2 + (b * se_c) ** 2)
        unknown = int(np.count_nonzero(np.isnan(stderr)))
        diagnostics = {
            **common,
            "b": b,
            "stderr_dof": float(n_draws - 1),
            "stderr_unknown": float(unknown),
            "stderr_exact_part": float(np.sqrt(np.nanmean(se_exact**2))) if np.any(np.isfinite(se_exact)) else math.nan,
            "stderr_proxy_part": float(np.sqrt(np.nanmean((b * se_c) ** 2))) if np.any(np.isfinite(se_c)) else math.nan,
            "control_linear": float(kind in ("c+linear", "linear")),
            "control_proxy": float(kind in ("c+linear", "c") or not self.cross_fit),
            "control_ridge": ridge,
            "proxy_used": float(kind in ("c+linear", "c") or not self.cross_fit),
            "cross_fit": float(self.cross_fit),
            **(shrunk.diagnostics if shrunk is not None else {}),
        }
        note = (
            f"two-fidelity {self.name}: {len(plan.keys)} exact and {k_proxy} proxy coalitions; the proxy game entered as a "
            + (f"cross-fitted control variate ({kind}) with mean coefficient b = {b:.3g}" if self.cross_fit
               else f"control variate fitted on the exact coalitions (b = {b:.3g}), regression-msr on v - b c")
            + " (its correlation with the exact game on the "
            f"exact coalitions: Pearson {pearson:.3f}); the values are of the exact game"
            + (shrunk.note if shrunk is not None else "")
        )
        return Estimate.from_values(
            method=self.name, values=values, stderr=stderr, v_empty=v_empty, v_full=v_full,
            n_evaluations=len(plan.keys), diagnostics=diagnostics, notes=(note, *proxy_budget_notes(self.proxy_budget, n)),
        )

