"""A sparse linear surrogate of the utility, as in ContextCite.

Cohen-Wang, Shah, Georgiev & Madry (2024), "ContextCite: attributing model generation to context"
(NeurIPS): sample coalitions keeping each player with probability 1/2, evaluate the utility, and fit
a LASSO linear model ``v(S) ~= intercept + sum_{i in S} w_i``; the attribution of player i is
``w_i``. The fit is :class:`sklearn.linear_model.Lasso`, which minimises

    (1 / (2 m)) * ||y - intercept - X w||^2 + alpha * ||w||_1

over the m training coalitions, with ``alpha`` given or chosen by 5-fold
:class:`sklearn.linear_model.LassoCV` on shuffled folds seeded by ``seed``: by default the alpha of
the least mean squared error over the folds (``cv_rule="min"``), or with ``cv_rule="dense-1se"`` the
smallest alpha whose mean error is within one standard error (over the folds) of that least one.
That is the one-standard-error rule of Breiman et al. (1984; Hastie, Tibshirani & Friedman, "The
Elements of Statistical Learning", 2nd ed., section 7.10) turned toward the denser end: every
alpha within one standard error predicts about as well by cross-validation, and the smallest
keeps the most players apart, so that a ranking does not fall back on ties at 0 (what
``method auto`` takes on many players and a small budget).

The coalitions are those of :func:`~coalescence.attribution.estimators.banzhaf.uniform_plan` (the
same ``(n, budget, seed)`` plans the same coalitions as :class:`Banzhaf`, so one pool serves both).
Every distinct planned coalition (the empty and grand ones included) is one regression row. A
seeded share of them (``holdout``, 20% by default; 0 fits on every row, as ContextCite does) is held
out; the surrogate is fitted on the rest, and its linear datamodeling
score (LDS, Ilyas et al. 2022, "Datamodels"; used by ContextCite) is the Spearman rank correlation
(:func:`scipy.stats.spearmanr`) between its predictions and the true utilities on the held-out
coalitions. The values are the coefficients of that same fitted surrogate.

``utility="logit"`` fits the logit of the probability, ``log p - log(1 - p)``, computed from
log-probability utilities ``log p <= 0``; the values, ``v_empty`` and ``v_full`` are then in logits.
"""

from __future__ import annotations

from typing import ClassVar

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError, EstimatorError
from .banzhaf import uniform_plan
from .base import Capabilities, Estimate, SampledEstimator, check_pool, gather, library_seed, pool_lookup

__all__ = (
    "CV_RULES", "HOLDOUT_FRACTION", "MIN_BUDGET", "UTILITIES", "LassoSurrogate", "choose_alpha", "cross_validated_lds",
    "quiet_convergence",
)

logger = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.2
"""Share of the distinct planned coalitions held out to compute the LDS."""

MIN_BUDGET = 16
"""Smallest budget for n >= 2 (or 2^n when that is smaller): enough rows to fit and to score."""

UTILITIES: tuple[str, ...] = ("logprob", "logit")
"""Accepted ``utility`` transforms."""

CV_RULES: tuple[str, ...] = ("min", "dense-1se")
"""How the cross-validated penalty is chosen (module docs)."""

_CV_FOLDS = 5


def choose_alpha(alphas: np.ndarray, mse_path: np.ndarray, cv_rule: str) -> float:
    """The cross-validated penalty by ``cv_rule`` (module docs).

    Args:
        alphas: ``[n_alphas]`` float64 candidate penalties.
        mse_path: ``[n_alphas, n_folds]`` float64 held-out mean squared error of each penalty on
            each fold (utility units squared).
        cv_rule: ``"min"`` (the least mean error) or ``"dense-1se"`` (the smallest alpha whose
            mean error is within one standard error over the folds of the least).

    Returns:
        The chosen alpha.
    """
    mean = mse_path.mean(axis=1)
    best = int(np.argmin(mean))
    if cv_rule == "min":
        return float(alphas[best])
    se = mse_path.std(axis=1) / math.sqrt(mse_path.shape[1])
    return float(alphas[mean <= mean[best] + se[best]].min())


def _to_logit(logprob: np.ndarray) -> np.ndarray:
    """``log p - log(1 - p)`` from ``log p`` (``[m]`` float64 nats, all <= 0)."""
    if np.any(logprob > 0):
        raise EstimatorError(
            "utility='logit' needs log-probability utilities <= 0, got a maximum of "
            f"{float(logprob.max())!r}; use utility='logprob'"
        )
    with np.errstate(divide="ignore"):
        return logprob - np.log(-np.expm1(logprob))


@dataclass(frozen=True, slots=True, kw_only=True)
class LassoSurrogate(SampledEstimator):
    """LASSO surrogate attributions with their linear datamodeling score (ContextCite, 2024).

    Args:
        budget: maximum number of distinct coalitions (model evaluations), counting the empty and
            grand coalitions; at least ``min(16, 2^n)``.
        seed: seed of the coalition sampler, of the held-out split and of the CV folds.
        alpha: the L1 penalty (> 0, in utility units per player), or None to choose it by 5-fold
            cross-validation (:class:`sklearn.linear_model.LassoCV`).
        utility: the regression target: ``"logprob"`` (the utility as given, nats) or
            ``"logit"`` (logit of the probability).
        holdout: the share of the distinct planned coalitions held out to score the surrogate (its
            LDS), in ``[0, 0.5]``; 0 fits on every coalition (no LDS: NaN), as ContextCite does.
        cv_rule: with ``alpha=None``, how the cross-validated alpha is chosen: ``"min"`` (least
            mean error) or ``"dense-1se"`` (the smallest alpha within one standard error of it;
            module docs).

    Attributes:
        name: ``"lasso"``.

    Raises:
        ConfigError: a bad budget (``field="budget"``), seed (``field="seed"``), alpha
            (``field="alpha"``), utility (``field="utility"``) or cv_rule (``field="cv_rule"``),
            quoting it.
    """

    alpha: float | None = None
    utility: str = "logprob"
    holdout: float = HOLDOUT_FRACTION
    cv_rule: str = "min"
    name: str = field(default="lasso", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False)
    what: ClassVar[str] = "the LASSO surrogate"

    def __post_init__(self) -> None:
        SampledEstimator.__post_init__(self)
        if self.alpha is not None:
            ok = isinstance(self.alpha, int | float) and not isinstance(self.alpha, bool)
            if not ok or not math.isfinite(self.alpha) or self.alpha <= 0:
                raise ConfigError(
                    f"alpha must be a finite number > 0 or None, got {self.alpha!r}", field="alpha"
                )
            object.__setattr__(self, "alpha", float(self.alpha))
        ok = isinstance(self.holdout, int | float) and not isinstance(self.holdout, bool)
        if not ok or not 0 <= self.holdout <= 0.5:
            raise ConfigError(f"holdout must be a share in [0, 0.5], got {self.holdout!r}", field="holdout")
        object.__setattr__(self, "holdout", float(self.holdout))
        if self.utility not in UTILITIES:
            raise ConfigError(
                f"utility must be one of {', '.join(UTILITIES)}, got {self.utility!r}",
                field="utility",
            )
        if self.cv_rule not in CV_RULES:
            raise ConfigError(f"must be one of {', '.join(CV_RULES)}, got {self.cv_rule!r}", field="cv_rule")

    def min_budget(self, n_players: int) -> int:
        """``min(16, 2^n)``."""
        return min(MIN_BUDGET, 1 << n_players)

    def _plan_rows(self, n_players: int) -> np.ndarray:
        """The planned distinct coalitions (uniform, as for :class:`Banzhaf`)."""
        return uniform_plan(n_players, self.budget, self.seed).rows

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Fit the LASSO surrogate on all but the held-out share of the planned coalitions (``holdout``,
        20% by default) and score it on those.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 log-probability utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 coefficients (nats, or logits),
            ``stderr=None``, the (generally nonzero) efficiency gap, ``n_evaluations`` = distinct
            planned coalitions, and ``diagnostics`` with ``"lds"`` (Spearman correlation on the
            held-out coalitions, NaN when undefined), ``"alpha"``, ``"intercept"``,
            ``"n_train"`` and ``"n_heldout"``. For n = 1 the value is ``v({1}) - v(empty)``.

        Raises:
            EstimatorError: no players, the pool misses planned coalitions (with the count), or
                ``utility="logit"`` with a utility above 0.
            ConfigError: the budget is below the minimum.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        plan = uniform_plan(n, self.budget, self.seed)
        u = gather(pool_lookup(masks, utilities), plan.keys, self.name)  # [n_distinct]
        if self.utility == "logit":
            u = _to_logit(u)
        v_empty, v_full = float(u[plan.empty_row]), float(u[plan.full_row])
        if n == 1:
            values = np.array([v_full - v_empty])
            diagnostics = {"lds": math.nan}
        else:
            values, diagnostics = self._fit_surrogate(plan.rows, u)
        return Estimate.from_values(
            method=self.name,
            values=values,
            stderr=None,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=len(plan.keys),
            diagnostics=diagnostics,
        )

    def _fit_surrogate(
        self, rows: np.ndarray, u: np.ndarray, *, cv_lds: bool = True
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Seeded holdout split, LASSO fit on the training rows, LDS on the held-out rows (where
        fewer than 3 are held out and ``cv_lds``, ``lds_cv``: :func:`cross_validated_lds` at the
        chosen penalty)."""
        from scipy.stats import spearmanr
        from sklearn.linear_model import Lasso, LassoCV
        from sklearn.model_selection import KFold

        x = rows.astype(np.float64)  # [n_distinct, n]
        m = x.shape[0]
        rng = np.random.default_rng([self.seed, 1])  # independent of the coalition sampler
        order = rng.permutation(m)
        n_held = max(1, round(self.holdout * m)) if self.holdout > 0 else 0
        held, train = order[:n_held], order[n_held:]
        if self.alpha is None:
            folds = KFold(n_splits=min(_CV_FOLDS, train.size), shuffle=True, random_state=library_seed(self.seed))
            with quiet_convergence():  # the path's smallest penalties may stop short; the chosen one is refitted
                model = LassoCV(cv=folds, max_iter=10_000).fit(x[train], u[train])
            alpha = float(model.alpha_)
            if self.cv_rule == "dense-1se":
                alpha = choose_alpha(model.alphas_, model.mse_path_, self.cv_rule)
                model = Lasso(alpha=alpha, max_iter=10_000).fit(x[train], u[train])
        else:
            alpha = self.alpha
            model = Lasso(alpha=alpha, max_iter=10_000).fit(x[train], u[train])
        lds = math.nan
        predicted = model.predict(x[held]) if held.size else np.zeros(0)
        if held.size >= 3 and np.ptp(predicted) > 0 and np.ptp(u[held]) > 0:
            lds = float(spearmanr(predicted, u[held]).statistic)
        logger.debug("lasso surrogate: alpha=%.3g, LDS=%.3f on %s held-out", alpha, lds, held.size)
        diagnostics = {
            "lds": lds,
            "alpha": alpha,
            "nonzero": float(np.count_nonzero(model.coef_)),
            "intercept": float(model.intercept_),
            "n_train": float(train.size),
            "n_heldout": float(held.size),
        }
        if held.size < 3 and cv_lds:  # no held-out coalitions to score: the fit's cross-validated LDS instead
            fold_fit = lambda t: Lasso(alpha=alpha, max_iter=10_000).fit(x[t], u[t]).coef_  # noqa: E731
            diagnostics["lds_cv"] = cross_validated_lds(x, u, fold_fit, seed=self.seed)
        return np.asarray(model.coef_, dtype=np.float64), diagnostics


@contextlib.contextmanager
def quiet_convergence() -> Iterator[None]:
    """scikit-learn's ``ConvergenceWarning`` silenced inside the block: a cross-validation path's
    smallest penalties may stop at ``max_iter`` on few rows (4 warnings on stderr at ``auto
    --budget 16`` on 52 players), which only moves their own cross-validated errors; the penalty
    chosen is refitted outside it."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        yield


def cross_validated_lds(x: np.ndarray, u: np.ndarray, fit: Callable[[np.ndarray], np.ndarray], *, seed: int) -> float:
    """A surrogate's LDS on coalitions it did not see, where none were held out: the coalitions in
    ``min(5, m)`` shuffled folds (``KFold`` seeded by :func:`.base.library_seed` of ``seed``), each
    fold's coalitions S predicted by ``sum_{i in S} phi_i`` with ``phi = fit(train_rows)`` fitted on
    the other folds, and Spearman's correlation of those pooled out-of-fold predictions with v(S)
    (K-fold cross-validation of the LDS: Park et al., 2023, TRAK; here over the run's own plan).

    Args:
        x: ``[m, n]`` float64 0/1 coalitions; ``u``: ``[m]`` float64 their values v(S).
        fit: row indices of the training folds -> ``[n]`` float64 attributions.
        seed: the folds' seed.

    Returns:
        The correlation, or NaN under 6 coalitions (a fold of one, a training set of four) or
        where either side is constant.
    """
    from scipy.stats import spearmanr
    from sklearn.model_selection import KFold

    m = x.shape[0]
    if m < 6:
        return math.nan
    predicted = np.empty(m)
    with quiet_convergence():
        for train, test in KFold(n_splits=min(_CV_FOLDS, m), shuffle=True, random_state=library_seed(seed)).split(x):
            predicted[test] = x[test] @ np.asarray(fit(train), dtype=np.float64)
    if np.ptp(predicted) == 0 or np.ptp(u) == 0:
        return math.nan
    return float(spearmanr(predicted, u).statistic)
