"""Leave-one-out attribution: the drop in utility when one player alone is removed.

``value_i = v(N) - v(N minus {i})`` (the "occlusion" baseline of attribution, e.g. Zeiler & Fergus
2014; in game theory the marginal contribution to the grand coalition). It needs n + 2 coalitions
(the empty one only to report v(empty) and the efficiency gap) but is not a Shapley value: its
values need not sum to ``v(N) - v(empty)``, and the gap is reported as is.
"""

from __future__ import annotations

from typing import ClassVar

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .base import Capabilities, Estimate, check_n_players, check_pool, gather, pool_lookup, row_keys

__all__ = ("LeaveOneOut",)

logger = logging.getLogger(__name__)


def _loo_rows(n: int) -> np.ndarray:
    """``[k, n]`` bool: the grand coalition, the empty one, then N minus {i} for each i."""
    rows = [np.ones(n, dtype=np.bool_), np.zeros(n, dtype=np.bool_)]
    if n > 1:  # for n == 1, N minus {0} is the empty coalition already listed
        rows.extend(~np.eye(n, dtype=np.bool_))
    out = np.array(rows, dtype=np.bool_).reshape(len(rows), n)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveOneOut:
    """Leave-one-out values ``v(N) - v(N minus {i})``.

    Attributes:
        name: ``"loo"``.
    """

    name: str = field(default="loo", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=False, reports_stderr=False)

    def validate(self, n_players: int) -> None:
        """Refuse a game with no players.

        Raises:
            EstimatorError: ``n_players == 0``.
        """
        check_n_players(n_players)

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Yield the grand coalition, the empty one, and N minus {i} for each player i.

        Returns:
            an iterator of n + 2 distinct read-only ``[n_players]`` bool rows (n + 1 when n == 1).

        Raises:
            EstimatorError: ``n_players == 0``, raised at the call.
        """
        self.validate(n_players)
        return iter(_loo_rows(int(n_players)))

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Leave-one-out values from the pool.

        Args:
            masks: ``[m, n_players]`` bool pool; extra coalitions and duplicates are fine.
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values[i] = v(N) - v(N minus {i})`` in nats, ``stderr=None``,
            the (generally nonzero) efficiency gap, ``n_evaluations`` = n + 2 (n + 1 when n == 1).

        Raises:
            EstimatorError: no players, or the pool misses planned coalitions (with the count).
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        rows = _loo_rows(n)
        u = gather(pool_lookup(masks, utilities), row_keys(rows), self.name)
        v_full, v_empty = float(u[0]), float(u[1])
        without = u[2:] if n > 1 else u[1:2]  # [n] v(N minus {i})
        values = v_full - without
        estimate = Estimate.from_values(method=self.name, values=values, v_empty=v_empty, v_full=v_full, n_evaluations=rows.shape[0])
        logger.debug("leave-one-out over %s players: efficiency gap %.3g", n, estimate.efficiency_gap)
        return estimate
