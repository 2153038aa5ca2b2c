"""Analytic cooperative games with known Shapley values, for testing estimators.

Each game is a plain callable over boolean coalition masks ``[m, n_players]`` returning utilities
``[m]`` float64, and knows its own Shapley values:

- :class:`AdditiveGame` and :class:`PairwiseInteractionGame` by closed form;
- :class:`GloveGame` and :class:`WeightedMajorityGame` by :func:`shapley_by_enumeration`, a direct
  average of marginal contributions over all n! player orders (Shapley 1953's permutation form),
  which is independent of the subset formula used by
  :class:`~coalescence.attribution.estimators.ExactShapley`. It is limited to
  :data:`MAX_ENUMERATION_PLAYERS` players.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, EstimatorError, MaskError

__all__ = (
    "MAX_ENUMERATION_PLAYERS",
    "AdditiveGame",
    "Game",
    "GloveGame",
    "PairwiseInteractionGame",
    "WeightedMajorityGame",
    "shapley_by_enumeration",
)

logger = logging.getLogger(__name__)

MAX_ENUMERATION_PLAYERS = 8
"""Largest n for :func:`shapley_by_enumeration` (8! = 40320 orders)."""


@runtime_checkable
class Game(Protocol):
    """A cooperative game on ``n_players`` players with known Shapley values.

    Attributes:
        n_players: number of players n.
    """

    n_players: int

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """Utilities ``[m]`` float64 of the coalitions ``masks`` ``[m, n_players]`` bool."""
        ...

    def shapley_values(self) -> np.ndarray:
        """The true Shapley values, ``[n_players]`` float64."""
        ...


def shapley_by_enumeration(game: Game) -> np.ndarray:
    """Shapley values by averaging marginal contributions over all n! player orders.

    ``phi_i = (1 / n!) * sum_pi [v(P_i(pi) + {i}) - v(P_i(pi))]`` with ``P_i(pi)`` the players
    before i in order pi (Shapley 1953; for simple games the Shapley–Shubik index, 1954).

    Args:
        game: the game; evaluated on ``(n + 1) * n!`` coalitions.

    Returns:
        ``[n_players]`` float64 Shapley values, in the game's utility unit.

    Raises:
        EstimatorError: ``game.n_players`` exceeds :data:`MAX_ENUMERATION_PLAYERS` or is 0.
    """
    n = game.n_players
    if not 1 <= n <= MAX_ENUMERATION_PLAYERS:
        raise EstimatorError(
            f"enumerating all n! orders is limited to 1..{MAX_ENUMERATION_PLAYERS} players, got {n}"
        )
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)  # [n!, n]
    orders = np.arange(perms.shape[0])
    current = np.zeros((perms.shape[0], n), dtype=np.bool_)
    before = np.asarray(game(current), dtype=np.float64)
    totals = np.zeros(n, dtype=np.float64)
    for k in range(n):
        current[orders, perms[:, k]] = True
        after = np.asarray(game(current), dtype=np.float64)
        totals += np.bincount(perms[:, k], weights=after - before, minlength=n)
        before = after
    return totals / math.factorial(n)


def _check_masks(masks: np.ndarray, n: int) -> np.ndarray:
    masks = np.asarray(masks)
    if masks.ndim != 2 or masks.dtype != np.bool_ or masks.shape[1] != n:
        raise MaskError(
            f"masks must be a bool array [m, {n}], got {masks.dtype} of shape {masks.shape}",
            field="masks",
        )
    return masks


def _float_vector(values: Sequence[float] | np.ndarray, name: str) -> tuple[float, ...]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] == 0 or not np.all(np.isfinite(arr)):
        raise ConfigError(
            f"{name} must be a non-empty 1-D sequence of finite numbers, got {values!r}", field=name
        )
    return tuple(arr.tolist())


@dataclass(frozen=True, slots=True, kw_only=True)
class AdditiveGame:
    """``v(S) = constant + sum_{i in S} weights[i]``; Shapley values are the weights.

    Args:
        weights: ``[n_players]`` finite per-player worths.
        constant: v(empty), shared by every coalition (default 0).

    Raises:
        ConfigError: empty or non-finite weights, or a non-finite constant.
    """

    weights: Sequence[float]
    constant: float = 0.0
    n_players: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _float_vector(self.weights, "weights"))
        if not math.isfinite(self.constant):
            raise ConfigError(f"constant must be finite, got {self.constant!r}", field="constant")
        object.__setattr__(self, "constant", float(self.constant))
        object.__setattr__(self, "n_players", len(self.weights))

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """Utilities ``[m]`` float64 of ``masks`` ``[m, n_players]`` bool."""
        masks = _check_masks(masks, self.n_players)
        return self.constant + masks.astype(np.float64) @ np.asarray(self.weights)

    def shapley_values(self) -> np.ndarray:
        """Closed form: ``phi = weights`` (``[n_players]`` float64)."""
        return np.array(self.weights, dtype=np.float64)


@dataclass(frozen=True, slots=True, kw_only=True)
class GloveGame:
    """Glove game: players ``0 .. n_left-1`` hold a left glove, the rest a right glove.

    ``v(S) = min(#left gloves in S, #right gloves in S)`` (pairs of gloves). For ``n_left == 1`` the
    textbook values are ``R / (R + 1)`` for the left glove and ``1 / (R (R + 1))`` for each of the R
    right gloves; :meth:`shapley_values` does not use a closed form but enumerates all n! orders.

    Args:
        n_left: number of left-glove holders (>= 0).
        n_right: number of right-glove holders (>= 0); ``n_left + n_right >= 1``.

    Raises:
        ConfigError: negative counts or no players.
    """

    n_left: int
    n_right: int
    n_players: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("n_left", "n_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}", field=name)
        if self.n_left + self.n_right == 0:
            raise ConfigError(
                "a glove game needs at least one player, got n_left = n_right = 0", field="n_left"
            )
        object.__setattr__(self, "n_players", self.n_left + self.n_right)

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """Utilities ``[m]`` float64: pairs of gloves in each coalition."""
        masks = _check_masks(masks, self.n_players)
        left = masks[:, : self.n_left].sum(axis=1)
        right = masks[:, self.n_left :].sum(axis=1)
        return np.minimum(left, right).astype(np.float64)

    def shapley_values(self) -> np.ndarray:
        """Shapley values by enumeration of all n! orders (:func:`shapley_by_enumeration`).

        Raises:
            EstimatorError: more than :data:`MAX_ENUMERATION_PLAYERS` players.
        """
        return shapley_by_enumeration(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightedMajorityGame:
    """Weighted majority (simple) game: ``v(S) = 1`` if ``sum_{i in S} weights[i] >= quota`` else 0.

    Its Shapley value is the Shapley–Shubik power index (Shapley & Shubik 1954), computed by
    enumerating all n! orders.

    Args:
        weights: ``[n_players]`` finite voting weights.
        quota: finite winning threshold.

    Raises:
        ConfigError: empty or non-finite weights, or a non-finite quota.
    """

    weights: Sequence[float]
    quota: float
    n_players: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _float_vector(self.weights, "weights"))
        if not math.isfinite(self.quota):
            raise ConfigError(f"quota must be finite, got {self.quota!r}", field="quota")
        object.__setattr__(self, "quota", float(self.quota))
        object.__setattr__(self, "n_players", len(self.weights))

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """Utilities ``[m]`` float64 in {0, 1}: whether each coalition reaches the quota."""
        masks = _check_masks(masks, self.n_players)
        totals = masks.astype(np.float64) @ np.asarray(self.weights)
        return (totals >= self.quota).astype(np.float64)

    def shapley_values(self) -> np.ndarray:
        """Shapley–Shubik index by enumeration of all n! orders (:func:`shapley_by_enumeration`).

        Raises:
            EstimatorError: more than :data:`MAX_ENUMERATION_PLAYERS` players.
        """
        return shapley_by_enumeration(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class PairwiseInteractionGame:
    """Additive game plus a ``bonus`` when players ``i`` and ``j`` are both present.

    ``v(S) = constant + sum_{k in S} weights[k] + bonus * [i in S and j in S]``. The interaction is
    a unanimity game on {i, j}, whose value splits equally, so ``phi = weights`` plus ``bonus / 2``
    on i and on j.

    Args:
        weights: ``[n_players]`` finite per-player worths (n >= 2).
        i: first interacting player.
        j: second interacting player, ``j != i``.
        bonus: finite worth of the pair together.
        constant: v(empty) (default 0).

    Raises:
        ConfigError: bad weights, i or j out of range or equal, non-finite bonus or constant.
    """

    weights: Sequence[float]
    i: int
    j: int
    bonus: float
    constant: float = 0.0
    n_players: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _float_vector(self.weights, "weights"))
        n = len(self.weights)
        for name in ("i", "j"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
                raise ConfigError(
                    f"{name} must be a player index in [0, {n}), got {value!r}", field=name
                )
        if self.i == self.j:
            raise ConfigError(f"i and j must differ, got both {self.i}", field="j")
        for name in ("bonus", "constant"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be finite, got {value!r}", field=name)
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "n_players", n)

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        """Utilities ``[m]`` float64 of ``masks`` ``[m, n_players]`` bool."""
        masks = _check_masks(masks, self.n_players)
        both = masks[:, self.i] & masks[:, self.j]
        additive = masks.astype(np.float64) @ np.asarray(self.weights)
        return self.constant + additive + self.bonus * both

    def shapley_values(self) -> np.ndarray:
        """Closed form: ``weights`` plus ``bonus / 2`` on i and on j (``[n_players]`` float64)."""
        phi = np.array(self.weights, dtype=np.float64)
        phi[self.i] += self.bonus / 2
        phi[self.j] += self.bonus / 2
        return phi
