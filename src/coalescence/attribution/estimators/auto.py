"""``--method auto``: the estimator for a game's number of players and budget, chosen by a stated rule.

The rule (:meth:`AutoMethod.choose`), from the measurements in ``benchmarks/RESULTS.md`` ("Many
players on long contexts" and "Estimator leaderboard"):

- **many players on a small budget** (``n > SURROGATE_MIN_PLAYERS`` and
  ``budget < SURROGATE_BELOW * n``: ContextCite's regime, e.g. 70 sentences and 32-256
  evaluations): the sparse linear surrogate of :class:`~.lasso.LassoSurrogate` fitted on every
  evaluated coalition (``holdout=0``; the L1 penalty the smallest within one standard error of the
  best cross-validated one, ``cv_rule="dense-1se"``: as accurate by cross-validation, it orders
  more players, which the top-k removal measures of ``benchmarks/RESULTS.md`` reward). With fewer evaluations than a
  few per player no Shapley estimator is accurate, and the surrogate is what predicts the game
  best (its linear datamodeling score) and ranks the sentences that matter first (Cohen-Wang et
  al. 2024, "ContextCite"). Its values are the surrogate's coefficients, not Shapley values, and
  the explanation's note says so;
- **otherwise** regression-adjusted Monte Carlo (:class:`~.msr.RegressionMSR`; Witter, Liu & Musco
  2025), the most accurate Shapley estimator of the leaderboard from 5n evaluations on
  (``budget >= 2^n`` enumerates every coalition: exact values).

With a proxy game (issue 37; :mod:`.proxy`) the same choice runs in its two-fidelity form:
:class:`~.proxy.ControlVariateLasso` for the surrogate (its defaults: ``phi(c)`` by least squares
on the proxy coalitions, the per-player correction ridged toward the scaled proxy),
:class:`~.proxy.ShrunkTwoFidelityShapley` for regression-msr (``proxy-shapley-shrunk``: the cross-fitted
estimate with the weighted, ridged control, blended toward the control's own Shapley values with
jackknife weights; lower error than the unbiased ``proxy-shapley`` on few exact coalitions, biased
toward the control, consistent) (:meth:`AutoMethod.proxy_plan`, :meth:`AutoMethod.fit_two_fidelity`).

The choice is a pure function of ``(n, budget)``, so a resumed or replayed ``auto`` run plans and
fits exactly what the first did; the :class:`~.base.Estimate` names the method that ran
(``method="auto:lasso"``) and its ``notes`` say why.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from .base import Capabilities, Estimate, check_budget_seed, check_n_players
from .lasso import LassoSurrogate
from .msr import RegressionMSR
from .proxy import ControlVariateLasso, ShrunkTwoFidelityShapley, TwoFidelityShapley, _check_proxy_budget

__all__ = ("SURROGATE_BELOW", "SURROGATE_MIN_PLAYERS", "AutoMethod")

SURROGATE_BELOW = 5
"""Budgets below this many evaluations per player take the surrogate (given enough players)."""

SURROGATE_MIN_PLAYERS = 16
"""Games of at most this many players always take regression-msr (its accuracy is measured there)."""

_DENSE_1SE = "its penalty the smallest within one standard error of the best cross-validated one, so that more players are told apart"
_WITH_PROXY = (
    "the proxy game's linear surrogate scaled by b, with a per-player correction fitted on the exact coalitions "
    "and ridged toward it"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoMethod:
    """The estimator chosen by players and budget (see the module docs for the rule and its source).

    Args:
        budget: the most distinct coalitions (model evaluations), as for the chosen method.
        seed: seed of the chosen method's sampler.

    Attributes:
        name: ``"auto"``.

    Raises:
        ConfigError: a bad budget (``field="budget"``) or seed (``field="seed"``).
    """

    budget: int
    seed: int = 0
    proxy_budget: int | None = None
    name: str = field(default="auto", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False, chooses=True, two_fidelity=True)

    def __post_init__(self) -> None:
        check_budget_seed(self.budget, self.seed)
        _check_proxy_budget(self.proxy_budget)

    def choose(self, n_players: int) -> tuple[Any, str]:
        """The estimator for ``n_players`` and this budget, and why (one sentence).

        Raises:
            EstimatorError: ``n_players == 0``.
        """
        n = check_n_players(n_players)
        if n > SURROGATE_MIN_PLAYERS and self.budget < SURROGATE_BELOW * n:
            return LassoSurrogate(budget=self.budget, seed=self.seed, holdout=0.0, cv_rule="dense-1se"), (
                f"method auto ran lasso: {self.budget} evaluations for {n} players is below "
                f"{SURROGATE_BELOW} per player, where a sparse linear surrogate (ContextCite's) predicts "
                f"the game better than any Shapley estimator ({_DENSE_1SE}); the values are its "
                "coefficients, not Shapley values"
            )
        if n < 62 and self.budget >= (1 << n):  # every coalition: 2^n evaluations, whatever the budget above it
            return RegressionMSR(budget=self.budget, seed=self.seed), (
                f"method auto ran regression-msr: {n} players have {1 << n} coalitions, all evaluated within the budget "
                f"of {self.budget} (exact Shapley values)"
            )
        return RegressionMSR(budget=self.budget, seed=self.seed), (
            f"method auto ran regression-msr: {self.budget} evaluations for {n} players "
            + (f"is at least {SURROGATE_BELOW} per player" if n > SURROGATE_MIN_PLAYERS else f"with at most {SURROGATE_MIN_PLAYERS} players")
            + ", where regression-adjusted Monte Carlo is the most accurate Shapley estimator measured"
        )

    def validate(self, n_players: int, *, proxy: bool = False) -> None:
        """Refuse what the chosen estimator refuses: its two-fidelity form's ``validate(n, proxy=proxy)``
        (where the proxy game is played, ``proxy=True``, the surrogate's floor is 8 exact
        coalitions, :data:`.proxy.lasso.TWO_FIDELITY_MIN_BUDGET`; else the exact-only form's).

        Raises:
            EstimatorError, ConfigError: as the chosen estimator's ``validate``.
        """
        self.two_fidelity(n_players)[0].validate(n_players, proxy=proxy)  # the same floors as choose()'s without it

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The chosen estimator's plan (its two-fidelity form's: the same coalitions, down to the
        two-fidelity floor; a run on exact rows alone checks :meth:`validate` first).

        Raises:
            EstimatorError, ConfigError: as the two-fidelity form's ``plan``, raised at the call.
        """
        return self.two_fidelity(n_players)[0].plan(n_players)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """The chosen estimator's fit, its ``method`` ``"auto:<chosen>"`` and the choice in ``notes``.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Raises:
            EstimatorError, ConfigError, MaskError: as the chosen estimator's ``fit``.
        """
        n = int(np.asarray(masks).shape[1]) if np.ndim(masks) == 2 else 0
        estimator, why = self.choose(n)
        estimate = estimator.fit(masks, utilities)
        return replace(estimate, method=f"auto:{estimator.name}", notes=(*estimate.notes, why))

    def two_fidelity(self, n_players: int) -> tuple[ControlVariateLasso | TwoFidelityShapley, str]:
        """The two-fidelity form of :meth:`choose`'s estimator (same plan of exact coalitions), and why.

        Raises:
            EstimatorError: ``n_players == 0``.
        """
        estimator, why = self.choose(n_players)
        # the note names what runs: the chosen method with the proxy game as its control variate
        runs = (
            f"{estimator.name} with the proxy game as a control variate" if isinstance(estimator, LassoSurrogate)
            else "proxy-shapley-shrunk (regression-msr with the proxy game as a control variate, blended toward its control)"
        )
        why = why.replace(f"method auto ran {estimator.name}", f"method auto ran {runs}", 1).replace(_DENSE_1SE, _WITH_PROXY)
        if isinstance(estimator, LassoSurrogate):
            # the ridge correction (its default) ignores cv_rule; "min" is for correction="lasso", where
            # the denser penalty lost 0.05 of LDS at 8 exact coalitions and 0.02 at 16 (benchmarks/RESULTS.md)
            return ControlVariateLasso(
                budget=self.budget, seed=self.seed, holdout=estimator.holdout, cv_rule="min",
                proxy_budget=self.proxy_budget,
            ), why
        # the shrunk form: 0.70-0.81x the unbiased form's median error at 16-32 exact coalitions on the
        # recorded games, level at 64 (benchmarks/RESULTS.md, "The shrunk two-fidelity estimate")
        return ShrunkTwoFidelityShapley(budget=self.budget, seed=self.seed, proxy_budget=self.proxy_budget), why

    def proxy_plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The proxy game's coalitions of the chosen estimator's two-fidelity form.

        Raises:
            EstimatorError, ConfigError: as :meth:`validate`.
        """
        return self.two_fidelity(n_players)[0].proxy_plan(n_players)

    def fit_two_fidelity(
        self, masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
    ) -> Estimate:
        """The chosen estimator's two-fidelity fit (:mod:`.proxy`), its ``method``
        ``"auto:<chosen>"`` and the choice in ``notes``.

        Args: as :meth:`.proxy.TwoFidelityShapley.fit_two_fidelity`.

        Raises:
            EstimatorError, ConfigError, MaskError: as the chosen estimator's ``fit_two_fidelity``.
        """
        n = int(np.asarray(masks).shape[1]) if np.ndim(masks) == 2 else 0
        estimator, why = self.two_fidelity(n)
        estimate = estimator.fit_two_fidelity(masks, utilities, proxy_masks, proxy_utilities)
        return replace(estimate, method=f"auto:{estimator.name}", notes=(*estimate.notes, why))
