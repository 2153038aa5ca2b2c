"""The control-variate surrogate: ContextCite's linear surrogate with the proxy game as an
unpenalised covariate and a per-player correction shrunk toward the scaled proxy.

**The control-variate surrogate** (:class:`ControlVariateLasso`, what ``lasso`` and ``auto``'s
surrogate become with a proxy). On the m exact coalitions of the LASSO surrogate's keep-half plan,
fit

    v(S) ~= a + b c(S) + sum_{i in S} w_i          (a penalty on w only; a, b unpenalised)

and report ``phi = b phi(c) + w``, with ``phi(c)`` the linear surrogate's coefficients of the proxy
game fitted on ``proxy_budget`` proxy coalitions (half keep-half, half near the full coalition: below): by least squares (``proxy_fit="auto"``,
the default, from :data:`LEAST_SQUARES_ROWS_PER_TERM` proxy coalitions per coefficient: the best
linear predictor of c over the plan's mix of keep-half and near-full coalitions), by the LASSO (below
that, or ``proxy_fit="lasso"``), or as the regression-adjusted Shapley estimate
(``proxy_fit="shapley"``). The penalty leaves a and b free by partialling them out (Frisch & Waugh
1933; Lovell 1963): for a fixed w the best (a, b) are the least-squares fit of ``v - X w`` on
``[1, c]``, so the objective equals the penalised regression of the residual of v on the residuals
of the player columns, both after projecting out ``[1, c]``; w comes from that, then (a, b) from
least squares. This is exact, unlike scaling the c column up (which leaves a small penalty on b).

**The correction w** (``correction``). With 8-16 exact coalitions and 70 players w is nearly
unidentified, and the LDS is rank-based: ``b phi(c)`` alone ranks as the proxy does, so w is what
the exact rows can add, or spoil. ``"ridge"`` (default; :func:`fit_ridge_with_covariate`): the
penalty ``sum_i p_i w_i^2`` with ``p_i = RIDGE_PENALTY / (|phi_i(c)| / mean_j |phi_j(c)| + 1/2)``
(:func:`ridge_penalties`): w shrinks toward 0, i.e. the values toward the scaled proxy ``b
phi(c)``, and a player the proxy finds important may move further. ``"lasso"``: the L1 penalty,
cross-validated as the LASSO surrogate's (5 shuffled folds, ``cv_rule``), with (a, b) partialled
out within each fold's training rows and each candidate scored on the held-out fold by the whole
model ``a + b c + X w`` (what glmnet does for an unpenalised column). Measured on the long games'
recorded pools (``benchmarks/RESULTS.md``, "The control-variate surrogate with a ridge
correction"; median LDS over 10 draws at 8 exact and 1,024 proxy coalitions): 0.774 / 0.864 /
0.910 on long_design / long_glossary / long_unicode with the ridge, 0.737 / 0.812 / 0.884 with the
L1 correction, 0.763 / 0.828 / 0.920 for the proxy's least squares alone.

The surrogate's LDS (``diagnostics["lds"]``) is the Spearman correlation of ``sum_{i in S}
phi_i`` with v(S) on the held-out exact coalitions (the attribution's own LDS; ``holdout=0``
gives NaN; so does a share that would hold out fewer than 3 coalitions, all of which are then
fitted). With two players or more at least 4 exact coalitions are fitted (the budget's floor is
``min(8, 2^n)``); a game of one player has the value ``v({1}) - v(empty)``, and
``diagnostics["proxy_used"]`` 0.

**The proxy plan's near-full share** (``near_full_share``, :data:`NEAR_FULL_SHARE` = 1/2 by
default). ``phi(c)`` by the LASSO or least squares is fitted on the proxy surrogate's keep-half plan
with its last half replaced by distinct coalitions that keep each player with probability
:data:`NEAR_FULL_KEEP` (0.8; drawn from their own stream of the proxy seed), so the values are the
best linear fit of the game over that mixture of coalitions (half keep-half, half at 0.8), not over
keep-half ones alone. A keep-half surrogate (ours or ContextCite's) ranks players by their effect
among half the others; which players' removal from the whole conversation lowers the answer most
(the top-k removal measures) is a near-full question, and some sentences differ there
(long_design's last sentence adds 0.17 nats at keep-half and its removal from the full
conversation raises the answer's log p; on long_glossary removing the top three players of the
exact game's own least squares over 447 keep-half coalitions drops the answer 19.35 nats, those of
its fit over 224 near-full ones 21.05). Replaying real runs (8 exact coalitions, 268-292 proxy
ones, 20 seeds; ``benchmarks/RESULTS.md``, "Twenty draws: a near-full
half") the median top-3 removal drop was 22.22 / 19.35 / 15.98 nats on long_design / long_glossary
/ long_unicode with keep-half rows only, 22.22 / 19.35 / 16.15 with a quarter near full and 22.22 /
19.93 / 16.15 with a half (ContextCite@64 on the same draws: 22.25 / 19.70 / 16.15), the LDS level
(0.809 / 0.922 / 0.919 -> 0.815 / 0.917 / 0.916). In the race (one run, 10 draws) ``auto --budget 8``
took 0.24 / 0.25 / 0.27 of ContextCite@64's wall time with a median LDS of 0.818 / 0.917 / 0.918
(its 0.808 / 0.846 / 0.904) and drop@3 of 22.22 / 19.93 / 16.15 nats (its 22.25 / 19.62 / 15.98).
``proxy_fit="shapley"`` (KernelSHAP's plan covers
every size) and a plan of every coalition take no share.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ....errors import ConfigError, EstimatorError
from ..banzhaf import uniform_plan
from ..base import Capabilities, Estimate, check_n_players, gather, library_seed, pool_lookup, row_keys
from ..lasso import MIN_BUDGET, LassoSurrogate, _to_logit, choose_alpha, cross_validated_lds, quiet_convergence
from ..msr import RegressionMSR
from .common import (
    _check_proxy_budget, _proxy_budget, default_proxy_budget, proxy_budget_notes, proxy_seed, two_fidelity_pools,
)

logger = logging.getLogger(__name__)

__all__ = (
    "CORRECTIONS", "LEAST_SQUARES_ROWS_PER_TERM", "NEAR_FULL_KEEP", "NEAR_FULL_SHARE", "PROXY_FITS", "RIDGE_PENALTY",
    "TWO_FIDELITY_MIN_BUDGET", "ControlVariateLasso",
    "fit_lasso_with_covariate", "fit_ridge_with_covariate", "ridge_penalties",
)

PROXY_FITS: tuple[str, ...] = ("auto", "least-squares", "lasso", "shapley")
"""How :class:`ControlVariateLasso` fits ``phi(c)`` on the proxy pool (module docs)."""

CORRECTIONS: tuple[str, ...] = ("ridge", "lasso")
"""How :class:`ControlVariateLasso` fits the per-player correction w on the exact rows (module docs)."""

RIDGE_PENALTY = 10.0
"""The ridge correction's penalty scale (module docs): measured best of 3, 10 and 30 on the long
games at 8-16 exact coalitions (``benchmarks/RESULTS.md``, "The control-variate surrogate with a
ridge correction")."""

LEAST_SQUARES_ROWS_PER_TERM = 8
"""``proxy_fit="auto"`` fits ``phi(c)`` by least squares when the proxy plan has at least this many
coalitions per coefficient (n + 1), by the LASSO otherwise."""

TWO_FIDELITY_MIN_BUDGET = 8
"""The surrogate's budget floor (exact coalitions) when the proxy game is played with it, against
:data:`.lasso.MIN_BUDGET` (16) for the exact rows alone: with the proxy as the control variate the 8
exact coalitions fit only ``a``, ``b`` and a ridged correction, and the compacted proxy game carries
the ranking (median LDS over 10 draws at 8 exact and 512 proxy coalitions above ContextCite's at 64
ablations on the three long games: ``benchmarks/RESULTS.md``, "The compacted proxy game")."""

NEAR_FULL_SHARE = 0.5
"""Share of the proxy plan (LASSO or least-squares ``phi(c)``) drawn near the full coalition (module docs)."""

NEAR_FULL_KEEP = 0.8
"""Each player's probability of being kept in the proxy plan's near-full coalitions (module docs)."""

_NEAR_FULL_STREAM = 0x6E656172  # "near": the near-full coalitions' stream of the proxy seed

_CV_FOLDS = 5
_N_ALPHAS = 100
_ALPHA_EPS = 1e-3

def _residualize(basis: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values - basis @ lstsq(basis, values)``: ``values`` ``[m]`` or ``[m, k]`` with the span of
    ``basis`` ``[m, q]`` projected out."""
    coef = np.linalg.lstsq(basis, values, rcond=None)[0]
    return values - basis @ coef


def fit_lasso_with_covariate(
    x: np.ndarray,
    y: np.ndarray,
    c: np.ndarray,
    *,
    alpha: float | None = None,
    cv_rule: str = "min",
    seed: int = 0,
) -> tuple[np.ndarray, float, float, float]:
    """LASSO of ``y`` on the player columns ``x`` with an intercept and an unpenalised covariate ``c``.

    Minimises ``(1 / (2 m)) ||y - a - b c - x w||^2 + alpha ||w||_1`` over (a, b, w) by
    partialling out ``[1, c]`` (module docs); ``alpha`` given, or chosen by 5-fold
    cross-validation on shuffled folds (seeded by ``seed``) with (a, b) partialled out within each
    fold, by ``cv_rule`` (:func:`.lasso.choose_alpha`) over 100 penalties log-spaced from the
    smallest that zeroes every w down to 1e-3 of it (sklearn's ``LassoCV`` grid). A constant ``c``
    has no coefficient (b = 0: the plain LASSO).

    Args:
        x: ``[m, n]`` float64 0/1 player columns.
        y: ``[m]`` float64 utilities.
        c: ``[m]`` float64 covariate (the proxy game's utilities on the same coalitions).
        alpha: the penalty (> 0), or None to cross-validate it.
        cv_rule: ``"min"`` or ``"dense-1se"``.
        seed: seed of the folds' shuffle.

    Returns:
        ``(w [n] float64, a, b, alpha)``.

    Raises:
        EstimatorError: fewer than 4 rows.
    """
    from sklearn.linear_model import Lasso, lasso_path
    from sklearn.model_selection import KFold

    m = y.shape[0]
    if m < 4:
        raise EstimatorError(f"the control-variate LASSO needs at least 4 exact coalitions to fit, got {m}")
    use_c = bool(np.ptp(c) > 0)
    basis = np.column_stack([np.ones(m), c]) if use_c else np.ones((m, 1))
    xr, yr = _residualize(basis, x), _residualize(basis, y)
    if alpha is None:
        top = float(np.max(np.abs(xr.T @ yr))) / m
        if top <= 0:
            w = np.zeros(x.shape[1])
            coef = np.linalg.lstsq(basis, y, rcond=None)[0]
            return w, float(coef[0]), float(coef[1]) if use_c else 0.0, math.nan
        alphas = top * np.logspace(0, math.log10(_ALPHA_EPS), _N_ALPHAS)
        folds = KFold(n_splits=min(_CV_FOLDS, m), shuffle=True, random_state=library_seed(seed))
        mse = np.empty((_N_ALPHAS, folds.get_n_splits()))
        for k, (train, test) in enumerate(folds.split(x)):
            b_tr = basis[train]
            with quiet_convergence():  # the path's smallest penalties may stop short; the chosen one is refitted
                _, coefs, _ = lasso_path(_residualize(b_tr, x[train]), _residualize(b_tr, y[train]), alphas=alphas, max_iter=10_000)
            # coefs [n, n_alphas]; (a, b) of each candidate by least squares on the training rows
            ab = np.linalg.lstsq(b_tr, y[train][:, None] - x[train] @ coefs, rcond=None)[0]  # [q, n_alphas]
            predicted = basis[test] @ ab + x[test] @ coefs  # [m_test, n_alphas]
            mse[:, k] = ((predicted - y[test][:, None]) ** 2).mean(axis=0)
        alpha = choose_alpha(alphas, mse, cv_rule)
    w = np.asarray(Lasso(alpha=alpha, fit_intercept=False, max_iter=10_000).fit(xr, yr).coef_, dtype=np.float64)
    coef = np.linalg.lstsq(basis, y - x @ w, rcond=None)[0]
    return w, float(coef[0]), float(coef[1]) if use_c else 0.0, float(alpha)


def ridge_penalties(phi_c: np.ndarray, scale: float = RIDGE_PENALTY) -> np.ndarray:
    """``[n]`` float64 the ridge correction's per-player penalties ``scale / (|phi_i(c)| / mean_j
    |phi_j(c)| + 1/2)``: a player the proxy finds important is let further from the proxy (its
    prior variance grows with its proxy attribution); ``scale`` each when ``phi(c)`` is all zero."""
    size = np.abs(np.asarray(phi_c, dtype=np.float64))
    mean = float(size.mean()) if size.size else 0.0
    if not mean > 0:
        return np.full(size.shape, float(scale))
    return float(scale) / (size / mean + 0.5)


def fit_ridge_with_covariate(
    x: np.ndarray, y: np.ndarray, c: np.ndarray, penalties: np.ndarray
) -> tuple[np.ndarray, float, float]:
    """Ridge regression of ``y`` on the player columns ``x`` with an intercept and an unpenalised
    covariate ``c``: minimises ``||y - a - b c - x w||^2 + sum_i penalties_i w_i^2`` over (a, b, w),
    by partialling ``[1, c]`` out as :func:`fit_lasso_with_covariate` does (exact for any penalty
    on w alone); a constant ``c`` has no coefficient (b = 0).

    Args:
        x: ``[m, n]`` float64 0/1 player columns.
        y: ``[m]`` float64 utilities.
        c: ``[m]`` float64 covariate.
        penalties: ``[n]`` float64 > 0 (:func:`ridge_penalties`).

    Returns:
        ``(w [n] float64, a, b)``.

    Raises:
        EstimatorError: fewer than 3 rows.
    """
    m = y.shape[0]
    if m < 3:
        raise EstimatorError(f"the ridge correction needs at least 3 exact coalitions to fit, got {m}")
    use_c = bool(np.ptp(c) > 0)
    basis = np.column_stack([np.ones(m), c]) if use_c else np.ones((m, 1))
    xr, yr = _residualize(basis, x), _residualize(basis, y)
    w = np.linalg.solve(xr.T @ xr + np.diag(np.asarray(penalties, dtype=np.float64)), xr.T @ yr)
    coef = np.linalg.lstsq(basis, y - x @ w, rcond=None)[0]
    return w, float(coef[0]), float(coef[1]) if use_c else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _LeastSquaresSurrogate(LassoSurrogate):
    """The linear surrogate by ordinary least squares with an intercept (the proxy's ``phi(c)``
    under ``proxy_fit="least-squares"``), on the LASSO surrogate's plan; every row is fitted
    (``holdout`` is ignored) and ``lds`` is NaN."""

    def _fit_surrogate(self, rows: np.ndarray, u: np.ndarray, *, cv_lds: bool = True) -> tuple[np.ndarray, dict[str, float]]:
        x = np.column_stack([np.ones(rows.shape[0]), rows.astype(np.float64)])
        coef = np.linalg.lstsq(x, u, rcond=None)[0]
        return coef[1:], {"lds": math.nan, "intercept": float(coef[0]), "n_train": float(rows.shape[0]), "n_heldout": 0.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlVariateLasso(LassoSurrogate):
    """The LASSO surrogate (ContextCite) with a proxy game as an unpenalised control variate (module docs).

    Without a proxy (:meth:`fit`) it is :class:`~.lasso.LassoSurrogate`, unchanged.

    Args:
        budget, seed, utility, holdout: as :class:`~.lasso.LassoSurrogate` (the exact game's plan);
            where ``holdout`` would hold out fewer than 3 exact coalitions (no rank correlation: at
            8-12 with the default 0.2) every one is fitted, and a note says there is no LDS.
        alpha, cv_rule: the LASSO correction's penalty (``correction="lasso"`` only), as
            :class:`~.lasso.LassoSurrogate`'s.
        proxy_budget: distinct proxy coalitions of :meth:`proxy_plan` (keep-half, the last
            ``near_full_share`` of them near-full; seeded by :func:`proxy_seed`), or None for
            :func:`default_proxy_budget`; capped at 2^n.
        proxy_fit: how ``phi(c)`` is fitted on the proxy pool: ``"auto"`` (default:
            ``"least-squares"`` from :data:`LEAST_SQUARES_ROWS_PER_TERM` proxy coalitions per
            coefficient, ``"lasso"`` below), ``"least-squares"`` (the proxy's best linear predictor
            over the plan's keep-half and near-full coalitions), ``"lasso"`` (the LASSO surrogate of c, least-error penalty)
            or ``"shapley"`` (RegressionMSR of c on KernelSHAP's plan).
        correction: how the per-player correction w is fitted on the exact rows: ``"ridge"``
            (default; :func:`ridge_penalties`, shrunk toward the scaled proxy) or ``"lasso"`` (the
            L1 penalty, cross-validated by ``cv_rule``).
        near_full_share: the share of the proxy plan drawn near the full coalition (module docs;
            :data:`NEAR_FULL_SHARE` by default, 0 for keep-half rows only), in [0, 1).

    Attributes:
        name: ``"lasso"``.

    Raises:
        ConfigError: as :class:`~.lasso.LassoSurrogate`, or a bad ``proxy_budget``
            (``field="proxy_budget"``), ``proxy_fit`` (``field="proxy_fit"``), ``correction``
            (``field="correction"``) or ``near_full_share`` (``field="near_full_share"``).
    """

    proxy_budget: int | None = None
    proxy_fit: str = "auto"
    correction: str = "ridge"
    near_full_share: float = NEAR_FULL_SHARE
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False, two_fidelity=True)

    def __post_init__(self) -> None:
        LassoSurrogate.__post_init__(self)
        _check_proxy_budget(self.proxy_budget)
        if self.proxy_fit not in PROXY_FITS:
            raise ConfigError(f"must be one of {', '.join(PROXY_FITS)}, got {self.proxy_fit!r}", field="proxy_fit")
        if self.correction not in CORRECTIONS:
            raise ConfigError(f"must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}", field="correction")
        share = self.near_full_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= float(share) < 1.0:
            raise ConfigError(f"must be a number in [0, 1), got {share!r}", field="near_full_share")

    def min_budget(self, n_players: int, *, proxy: bool = False) -> int:
        """``min(8, 2^n)`` with the proxy game played (``proxy=True``: :data:`TWO_FIDELITY_MIN_BUDGET`),
        else the LASSO surrogate's ``min(16, 2^n)``."""
        return min(TWO_FIDELITY_MIN_BUDGET if proxy else MIN_BUDGET, 1 << n_players)

    def validate(self, n_players: int, *, proxy: bool = False) -> None:
        """Refuse an empty game, or a budget below :meth:`min_budget` of a run that plays the proxy
        game (``proxy=True``) or fits the exact rows alone (the default).

        Raises:
            EstimatorError: ``n_players == 0``.
            ConfigError: the budget is below the minimum (``field="budget"``; without the proxy
                game the message says what the floor is with it), or, with ``proxy=True``, the
                proxy budget below its fit's (``field="proxy_budget"``).
        """
        n = check_n_players(n_players)
        minimum = self.min_budget(n, proxy=proxy)
        if self.budget < minimum:
            how = (
                "with the proxy game as its control variate" if proxy
                else f"on exact rows alone ({self.min_budget(n, proxy=True)} where the proxy game is played with it)"
            )
            raise ConfigError(
                f"{self.budget} is below the minimum of {minimum} for {self.what} with {n} players {how}; raise the budget",
                field="budget",
            )
        if proxy:
            fit = self._proxy_estimator(n)
            if fit.budget < fit.min_budget(n):
                raise ConfigError(
                    f"{fit.budget} proxy coalitions are below the minimum of {fit.min_budget(n)} for the proxy game's "
                    f"{fit.name} with {n} players; raise the proxy budget or leave it out (default "
                    f"{default_proxy_budget(self.budget, n)})",
                    field="proxy_budget",
                )

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The exact game's planned coalitions (:meth:`.lasso.LassoSurrogate.plan`'s), at a budget
        down to the two-fidelity floor (a run on exact rows alone checks :meth:`validate` first).

        Raises:
            EstimatorError, ConfigError: as ``validate(n_players, proxy=True)``.
        """
        self.validate(n_players, proxy=True)
        return iter(self._plan_rows(int(n_players)))

    def _proxy_estimator(self, n_players: int) -> LassoSurrogate | RegressionMSR:
        k = _proxy_budget(self.budget, self.proxy_budget, n_players)
        fit = self.proxy_fit
        if fit == "auto":
            fit = "least-squares" if k >= LEAST_SQUARES_ROWS_PER_TERM * (n_players + 1) else "lasso"
        if fit == "least-squares":
            return _LeastSquaresSurrogate(budget=k, seed=proxy_seed(self.seed), holdout=0.0)
        if fit == "lasso":
            return LassoSurrogate(budget=k, seed=proxy_seed(self.seed), holdout=0.0)
        return RegressionMSR(budget=k, seed=proxy_seed(self.seed))

    def proxy_plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The proxy game's coalitions ``[k, n_players]`` bool, one by one: the plan of the proxy
        fit at the proxy budget, its last ``near_full_share`` near the full coalition (module docs).

        Raises:
            EstimatorError, ConfigError: as ``validate(n_players, proxy=True)``.
        """
        self.validate(n_players, proxy=True)
        n = int(n_players)
        return iter(self._proxy_rows(self._proxy_estimator(n), n))

    def _proxy_rows(self, fit: LassoSurrogate | RegressionMSR, n: int) -> np.ndarray:
        """``[k, n]`` bool the proxy plan's distinct coalitions: the proxy fit's plan, its last
        ``near_full_share`` replaced by near-full coalitions (module docs) where the fit is a
        linear surrogate's on a sampled plan."""
        rows = np.array(list(fit.plan(n)), dtype=bool).reshape(-1, n)
        near = int(round(self.near_full_share * rows.shape[0]))
        if isinstance(fit, RegressionMSR) or near == 0 or n < 2 or (n < 62 and rows.shape[0] >= (1 << n)):
            return rows
        kept = rows[: rows.shape[0] - near]  # the empty and full coalitions come first
        seen = set(row_keys(kept))
        rng = np.random.default_rng([proxy_seed(self.seed), _NEAR_FULL_STREAM])
        extra: list[np.ndarray] = []
        for _ in range(64):  # a few draws' worth; a small game may hold fewer distinct ones
            block = rng.random((4 * near, n)) < NEAR_FULL_KEEP
            for key, row in zip(row_keys(block), block, strict=True):
                if len(extra) < near and key not in seen and 0 < row.sum() < n:
                    seen.add(key)
                    extra.append(row)
            if len(extra) == near:
                break
        return np.concatenate([kept, np.array(extra, dtype=bool).reshape(-1, n)])

    def _proxy_values(self, n: int, proxy_masks: np.ndarray, proxy_utilities: np.ndarray) -> tuple[np.ndarray, int]:
        """``(phi(c) [n] float64, proxy coalitions fitted)``: the proxy fit on :meth:`_proxy_rows`."""
        fit = self._proxy_estimator(n)
        if isinstance(fit, RegressionMSR) or n < 2:
            return fit.fit(proxy_masks, proxy_utilities).values, len(list(fit.plan(n)))
        rows = self._proxy_rows(fit, n)
        c = gather(pool_lookup(proxy_masks, proxy_utilities), tuple(row_keys(rows)), f"{self.name} (the proxy game's plan)")
        return fit._fit_surrogate(rows, c, cv_lds=False)[0], rows.shape[0]

    def _cross_validated_lds(self, x: np.ndarray, u: np.ndarray, c: np.ndarray, phi_c: np.ndarray, alpha: float) -> float:
        """The LDS of the fit on coalitions it did not see: each of ``min(5, m)`` shuffled folds of
        the exact coalitions (seeded by ``seed``) predicted by ``sum_{i in S} phi_i`` of the fit on
        the other folds (the same correction, its penalty fixed at ``alpha``), and Spearman's
        correlation of the pooled out-of-fold predictions with v(S) (:func:`cross_validated_lds`)."""

        def fitted(train: np.ndarray) -> np.ndarray:
            if self.correction == "ridge":
                w, _, b = fit_ridge_with_covariate(x[train], u[train], c[train], ridge_penalties(phi_c))
            else:
                w, _, b, _ = fit_lasso_with_covariate(
                    x[train], u[train], c[train], alpha=alpha if math.isfinite(alpha) else None, seed=self.seed
                )
            return b * phi_c + w

        return cross_validated_lds(x, u, fitted, seed=self.seed)

    def fit_two_fidelity(
        self, masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
    ) -> Estimate:
        """Fit the control-variate surrogate (module docs).

        Args:
            masks: ``[m, n_players]`` bool exact pool (every coalition of :meth:`plan`).
            utilities: ``[m]`` float64 exact utilities (nats).
            proxy_masks: ``[k, n_players]`` bool proxy pool (every coalition of :meth:`proxy_plan`
                and of :meth:`plan`).
            proxy_utilities: ``[k]`` float64 proxy utilities (nats).

        Returns:
            an :class:`Estimate` of the exact game: ``values`` ``[n_players]`` float64
            ``b phi(c) + w`` (nats, or logits), ``stderr=None``, ``n_evaluations`` = exact
            distinct coalitions, ``diagnostics`` as :meth:`fit`'s plus ``b``, ``intercept``,
            ``proxy_pearson``, ``proxy_spearman``, ``proxy_evaluations``, ``exact_evaluations`` and
            ``proxy_used`` (0.0 where the proxy rows were computed but not used: a game of one player).

        Raises:
            EstimatorError: a pool misses planned coalitions (which pool, with the count).
            ConfigError: the budget is below the two-fidelity minimum (:data:`TWO_FIDELITY_MIN_BUDGET`).
            MaskError: a pool's masks are not 2-D bool.
        """
        from scipy.stats import spearmanr

        pools = two_fidelity_pools(
            self, masks, utilities, proxy_masks, proxy_utilities, make_plan=lambda n: uniform_plan(n, self.budget, self.seed),
            transform=_to_logit if self.utility == "logit" else None,
        )
        n, plan, u, c, pearson = pools.n, pools.plan, pools.u, pools.c, pools.pearson
        phi_c, k_proxy = self._proxy_values(n, pools.proxy_masks, pools.proxy_utilities)  # [n]
        v_empty, v_full = float(u[plan.empty_row]), float(u[plan.full_row])
        diagnostics: dict[str, float] = pools.diagnostics(k_proxy)
        unheld = ""
        if n == 1:
            values, b = np.array([v_full - v_empty]), 0.0
            diagnostics.update(lds=math.nan, b=0.0, proxy_used=0.0)
        else:
            x = plan.rows.astype(np.float64)
            m = x.shape[0]
            rng = np.random.default_rng([self.seed, 1])  # LassoSurrogate's held-out split
            order = rng.permutation(m)
            n_held = max(1, round(self.holdout * m)) if self.holdout > 0 else 0
            if 0 < n_held < 3:  # too few to rank (no LDS): every exact coalition is fitted instead
                unheld = (
                    f"no held-out LDS: {n_held} of {m} exact coalitions would be held out, fewer than the 3 a rank "
                    "correlation needs; all were fitted, and lds_cv is the fit's cross-validated LDS (evaluate the "
                    "explanation on fresh coalitions: coalescence evaluate)"
                )
                n_held = 0
            held, train = order[:n_held], order[n_held:]
            assert train.size >= 4  # the floor min(8, 2^n) with n >= 2, and no held-out share under 3
            if self.correction == "ridge":
                w, a, b = fit_ridge_with_covariate(x[train], u[train], c[train], ridge_penalties(phi_c))
                alpha = RIDGE_PENALTY
            else:
                w, a, b, alpha = fit_lasso_with_covariate(
                    x[train], u[train], c[train], alpha=self.alpha, cv_rule=self.cv_rule, seed=self.seed
                )
            values = b * phi_c + w
            lds = math.nan
            if held.size >= 3:
                predicted = x[held] @ values
                if np.ptp(predicted) > 0 and np.ptp(u[held]) > 0:
                    lds = float(spearmanr(predicted, u[held]).statistic)
            diagnostics.update(
                lds=lds, alpha=alpha, b=b, intercept=a, proxy_used=1.0, nonzero=float(np.count_nonzero(w)),
                n_train=float(train.size), n_heldout=float(held.size),
            )
            if held.size < 3:  # no held-out coalitions to score: the fit's cross-validated LDS instead
                diagnostics["lds_cv"] = self._cross_validated_lds(x, u, c, phi_c, alpha)
        notes = (unheld,) if unheld else ()
        note = (
            f"two-fidelity {self.name}: {len(plan.keys)} exact and {int(diagnostics['proxy_evaluations'])} proxy coalitions; "
            f"the proxy game entered as a control variate with coefficient b = {b:.3g} (its correlation with the exact "
            f"game on the exact coalitions: Pearson {pearson:.3f}); the values are of the exact game"
        )
        logger.debug("%s", note)
        return Estimate.from_values(
            method=self.name, values=values, stderr=None, v_empty=v_empty, v_full=v_full,
            n_evaluations=len(plan.keys), diagnostics=diagnostics, notes=(note, *notes, *proxy_budget_notes(self.proxy_budget, n)),
        )

