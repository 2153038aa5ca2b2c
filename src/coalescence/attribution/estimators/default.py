"""The method of a run that names none (no ``--method``, no ``--budget``): exact Shapley values
where they are affordable, else the plan measured to reach ContextCite's quality at the least cost.

The rule (:meth:`DefaultMethod.resolve`):

- **at most** :data:`EXACT_MAX_PLAYERS` **players** (16: 65,536 coalitions at most): exact Shapley
  values (:class:`~.exact.ExactShapley`), as before there was a default plan: the same values,
  method name and notes;
- **more players, the proxy game played**: ``auto`` at :data:`TWO_FIDELITY_BUDGET` exact
  coalitions (8, the surrogate's floor with the proxy game) and its default proxy budget (4 proxy
  coalitions a player: :data:`~.proxy.common.PROXY_PER_PLAYER`). Measured on the three recorded
  long RAG games (67-73 sentence players, SmolLM2-135M; ``benchmarks/RESULTS.md``, "Twenty draws: a
  near-full half"): 0.24-0.27 of ContextCite@64's wall time, a median LDS of 0.818 / 0.917 / 0.918
  against its 0.808 / 0.846 / 0.904, top-3 removal drops of 22.22 / 19.93 / 16.15 nats against its
  22.25 / 19.62 / 15.98;
- **more players, the proxy game not played** (off, a backend that cannot score it, a placeholder
  policy, a generated answer): ``auto`` at :data:`EXACT_ONLY_BUDGET` exact coalitions (64,
  ContextCite's default number of ablations), where the surrogate is ``auto``'s choice.

Which of the last two runs is decided where the proxy game is decided (the engine, per
conversation: :func:`coalescence.engine.two_fidelity.play`), so the plan never has a floor the run
cannot meet. The choice is a pure function of ``(n, proxy played)``; a replay resolves it as the
run did (the archive records whether it played the proxy game).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ...errors import EstimatorError
from .auto import AutoMethod
from .base import Capabilities, Estimate, check_n_players, check_seed
from .exact import ExactShapley
from .proxy import _check_proxy_budget
from .proxy.lasso import TWO_FIDELITY_MIN_BUDGET

__all__ = ("EXACT_MAX_PLAYERS", "EXACT_ONLY_BUDGET", "TWO_FIDELITY_BUDGET", "DefaultMethod")

EXACT_MAX_PLAYERS = ExactShapley.capabilities.max_players or 16
"""Games of at most this many players get exact Shapley values by default."""

TWO_FIDELITY_BUDGET = TWO_FIDELITY_MIN_BUDGET
"""Exact coalitions of the default plan on more players where the proxy game is played (8)."""

EXACT_ONLY_BUDGET = 64
"""Exact coalitions of the default plan on more players without the proxy game (ContextCite's 64)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DefaultMethod:
    """The method of a run that names none (module docs for the rule and its measurements).

    It is resolved to a concrete estimator once the game's size and whether the proxy game is
    played are known (:meth:`resolve`); the engine and the archive's refit do that before planning.
    Its own ``plan``/``fit`` are those of the form with the proxy game.

    Args:
        seed: seed of ``auto``'s plan (more than 16 players).
        proxy_budget: ``auto``'s proxy coalitions (None: its default).

    Attributes:
        name: ``"default"``.

    Raises:
        ConfigError: a bad seed (``field="seed"``) or proxy budget (``field="proxy_budget"``).
    """

    seed: int = 0
    proxy_budget: int | None = None
    name: str = field(default="default", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=False, reports_stderr=False, chooses=True, two_fidelity=True)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        _check_proxy_budget(self.proxy_budget)

    def resolve(self, n_players: int, *, proxy: bool) -> tuple[Any, str | None]:
        """The estimator this run uses on a game of ``n_players``, and a note saying what it chose
        (None for exact values, which need none).

        Args:
            n_players: the game's players (>= 1).
            proxy: whether the proxy game is played with it.

        Raises:
            EstimatorError: ``n_players == 0``.
        """
        n = check_n_players(n_players)
        if n <= EXACT_MAX_PLAYERS:
            return ExactShapley(), None
        budget = TWO_FIDELITY_BUDGET if proxy else EXACT_ONLY_BUDGET
        how = (
            f"{budget} exact coalitions and the proxy game (the plan measured to reach ContextCite@64's LDS in about a "
            "quarter of its time on long contexts)"
            if proxy
            else f"{budget} exact coalitions (ContextCite's 64 ablations; the proxy game is not played here)"
        )
        others = "--method auto --budget N" + (" or --proxy-game none" if proxy else "")
        note = (
            f"no method or budget given: {n} players are more than the {EXACT_MAX_PLAYERS} exact Shapley values allow, "
            f"so the default plan ran method auto at {how}; {others} chooses another"
        )
        return AutoMethod(budget=budget, seed=self.seed, proxy_budget=self.proxy_budget), note

    def validate(self, n_players: int, *, proxy: bool = False) -> None:
        """Refuse what the resolved estimator refuses (:meth:`resolve`).

        Raises:
            EstimatorError, ConfigError: as the resolved estimator's ``validate``.
        """
        estimator, _ = self.resolve(n_players, proxy=proxy)
        if estimator.capabilities.two_fidelity:
            estimator.validate(n_players, proxy=proxy)
        else:
            estimator.validate(n_players)

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The plan of the form with the proxy game (:meth:`resolve`)."""
        return self.resolve(n_players, proxy=True)[0].plan(n_players)

    def proxy_plan(self, n_players: int) -> Iterator[np.ndarray]:
        """The proxy coalitions of the form with the proxy game (none at 16 players or fewer).

        Raises:
            EstimatorError: a game of at most 16 players, which has no proxy plan.
        """
        estimator, _ = self.resolve(n_players, proxy=True)
        if not estimator.capabilities.two_fidelity:
            raise EstimatorError(f"the default method gives {n_players} players exact values: no proxy plan")
        return estimator.proxy_plan(n_players)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """The exact-rows fit of the form without the proxy game (:meth:`resolve`), with its note."""
        n = int(np.asarray(masks).shape[1]) if np.ndim(masks) == 2 else 0
        estimator, note = self.resolve(n, proxy=False)
        estimate = estimator.fit(masks, utilities)
        return estimate if note is None else replace(estimate, notes=(*estimate.notes, note))

    def fit_two_fidelity(
        self, masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
    ) -> Estimate:
        """The two-fidelity fit of the form with the proxy game (:meth:`resolve`), with its note."""
        n = int(np.asarray(masks).shape[1]) if np.ndim(masks) == 2 else 0
        estimator, note = self.resolve(n, proxy=True)
        estimate = estimator.fit_two_fidelity(masks, utilities, proxy_masks, proxy_utilities)
        return estimate if note is None else replace(estimate, notes=(*estimate.notes, note))
