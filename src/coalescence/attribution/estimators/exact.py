"""Exact Shapley values by enumerating all 2^n coalitions.

Shapley (1953), "A value for n-person games":

    phi_i = sum_{S subset of N minus {i}} |S|! (n - |S| - 1)! / n! * (v(S + {i}) - v(S))

The utilities are held in one array indexed by the integer coalition index (bit i = player i), so
the sum for player i is a dot product over the 2^(n-1) indices without bit i. Efficiency
(``sum(phi) == v(N) - v(empty)``) then holds to float precision.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ...errors import ConfigError, EstimatorError
from .base import Capabilities, Estimate, check_interactions, check_n_players, check_pool, gather, pool_lookup, row_keys
from ..interactions import INTERACTION_INDICES

__all__ = ("ExactShapley", "coalition_rows", "shapley_weights")

logger = logging.getLogger(__name__)


def coalition_rows(n_players: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The coalitions with integer index in ``[start, stop)`` as bool rows.

    Args:
        n_players: number of players n.
        start: first integer index (bit i = player i).
        stop: one past the last index; defaults to 2^n.

    Returns:
        ``[stop - start, n_players]`` bool; row r has bit i set when ``(start + r) >> i & 1``.
    """
    stop = (1 << n_players) if stop is None else stop
    idx = np.arange(start, stop, dtype=np.int64)
    return ((idx[:, None] >> np.arange(n_players, dtype=np.int64)) & 1).astype(np.bool_)


def shapley_weights(n_players: int) -> np.ndarray:
    """Shapley weights ``w[k] = k! (n - k - 1)! / n!`` for coalition sizes k = 0 .. n-1.

    Computed as ``1 / (n * C(n - 1, k))``, which equals the factorial form and never overflows.

    Returns:
        ``[n_players]`` float64; ``sum_k C(n-1, k) w[k] == 1``.
    """
    n = n_players
    return np.array([1.0 / (n * math.comb(n - 1, k)) for k in range(n)], dtype=np.float64)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactShapley:
    """Exact Shapley values from all 2^n coalitions (Shapley 1953).

    With ``interactions=k`` it also computes the exact interaction values of orders 2..k of
    ``index`` (SII, k-SII, FSII, STII) from the same 2^n coalitions, by shapiq's ``ExactComputer``
    (:func:`~coalescence.attribution.estimators.shapiq.exact_interactions`; needs the
    shapiq extra); the values stay the Shapley values.

    Attributes:
        name: ``"exact"``.
        MAX_PLAYERS: the largest n accepted (2^16 = 65536 model evaluations).
        interactions: the highest interaction order (2 or more), or ``None``.
        index: the interaction index (default ``"k-SII"`` with ``interactions``).

    Raises:
        ConfigError: an order below 2, an unknown index, or an index without an order.
    """

    MAX_PLAYERS: ClassVar[int] = 16
    name: str = field(default="exact", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_budget=False, reports_stderr=False, max_players=MAX_PLAYERS, interaction_indices=INTERACTION_INDICES, exact=True
    )
    interactions: int | None = None
    index: str | None = None

    def __post_init__(self) -> None:
        _, index = check_interactions(self.name, self.interactions, self.index, INTERACTION_INDICES)
        object.__setattr__(self, "index", index)

    def validate(self, n_players: int) -> None:
        """Refuse games with no players or more than :attr:`MAX_PLAYERS` players.

        Raises:
            EstimatorError: ``n_players == 0``, or ``n_players > 16`` (``field="method"``).
        """
        n = check_n_players(n_players)
        if n > self.MAX_PLAYERS:
            raise EstimatorError(
                f"exact Shapley needs 2^n model evaluations; {n} players would need "
                f"{(1 << n) if n <= 40 else f'2^{n}'} > "
                f"the limit of 2^{self.MAX_PLAYERS}; use method regression-msr with a budget (the sampling method with the lowest error), "
                "or method loo",
                field="method",
            )
        if self.interactions is not None and self.interactions > n:
            raise ConfigError(f"order {self.interactions} needs at least {self.interactions} players; this game has {n}", field="interactions")

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Yield all 2^n coalitions in order of their integer index (bit i = player i).

        Args:
            n_players: number of players n (1 .. 16).

        Returns:
            an iterator of ``[n_players]`` bool rows, the first empty and the last full.

        Raises:
            EstimatorError: as :meth:`validate`, raised at the call, before iteration.
        """
        self.validate(n_players)
        return _iter_all(n_players)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Exact Shapley values from a pool that holds all 2^n coalitions.

        Args:
            masks: ``[m, n_players]`` bool; extra duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate` with ``values`` ``[n_players]`` float64 in nats, ``stderr=None``,
            ``n_evaluations = 2^n``.

        Raises:
            EstimatorError: too many or no players, or the pool misses coalitions (with the count).
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        size = 1 << n
        u = gather(pool_lookup(masks, utilities), row_keys(coalition_rows(n)), self.name)  # [2^n]
        idx = np.arange(size, dtype=np.int64)
        sizes = np.zeros(size, dtype=np.int64)
        for i in range(n):
            sizes += (idx >> i) & 1
        weights = shapley_weights(n)
        values = np.empty(n, dtype=np.float64)
        for i in range(n):
            bit = 1 << i
            without = idx[(idx & bit) == 0]  # [2^(n-1)] coalitions S not containing i
            values[i] = np.dot(weights[sizes[without]], u[without | bit] - u[without])
        v_empty, v_full = float(u[0]), float(u[size - 1])
        interactions = ()
        if self.interactions is not None:
            from .shapiq import exact_interactions

            interactions = exact_interactions(coalition_rows(n), u, order=self.interactions, index=self.index)
        estimate = Estimate.from_values(
            method=self.name,
            values=values,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=size,
            interactions=interactions,
            interaction_index=self.index,
        )
        logger.debug("exact Shapley over %s players: efficiency gap %.3g", n, estimate.efficiency_gap)
        return estimate


def _iter_all(n_players: int, chunk: int = 4096) -> Iterator[np.ndarray]:
    """Yield all coalitions lazily, building ``chunk`` rows at a time."""
    size = 1 << n_players
    for start in range(0, size, chunk):
        block = coalition_rows(n_players, start, min(size, start + chunk))
        block.setflags(write=False)
        yield from block
