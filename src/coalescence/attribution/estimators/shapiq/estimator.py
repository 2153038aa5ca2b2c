"""The estimator of a shapiq approximator: its plan drawn by a stand-in run (cached per
configuration), its fit by a replay of the approximator on the pool (package docs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ....errors import ConfigError, EstimatorError
from ...interactions import EFFICIENT_INDICES
from ..base import Capabilities, Estimate, check_budget_seed, check_interactions, check_n_players, check_pool, pool_lookup, row_keys
from .library import PREFIX

__all__ = ("ShapiqEstimator",)

# approximators whose order-1 output is not a Shapley value unless they are asked for order 1
_ORDER_ONE_FOR_VALUES = frozenset({"KernelSHAPIQ", "InconsistentKernelSHAPIQ", "SVARMIQ", "SHAPIQ", "PermutationSamplingSII", "RegressionFSII", "SPEX", "ProxySPEX", "ProxySHAP"})

_PLANS: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
"""Drawn plans by (runtime, approximator, n, budget, seed, interactions, index): read-only arrays."""



class ShapiqEstimator:
    """A shapiq approximator through the engine (module docs: plan by a stand-in run, fit by a
    replay from the pool).

    Made per approximator by :func:`approximator_estimator`; ``name`` is ``"shapiq:<Approximator>"``.

    Args:
        budget: the most distinct coalitions (model evaluations), empty and grand coalition
            included.
        seed: shapiq's ``random_state``: the plan is a function of (approximator, n, budget, seed,
            interactions, index) and nothing else.
        interactions: the highest interaction order k (2 or more), or ``None`` for Shapley values.
        index: the interaction index with ``interactions`` (:data:`INTERACTION_INDICES`; default
            ``"k-SII"``).

    Raises:
        ConfigError: a bad budget or seed, an order below 2, or an index the approximator does not
            compute (``field`` names the setting).
    """

    name: ClassVar[str] = PREFIX
    approximator: ClassVar[str] = ""
    runtime: ClassVar[Any] = None  # _InProcess or ExternalShapiq, set by approximator_estimator
    fixed_options: ClassVar[tuple[tuple[str, Any], ...]] = ()  # written after the name (shapiq:NAME:KEY=VALUE)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False)
    __slots__ = ("budget", "seed", "interactions", "index")

    def __init__(self, *, budget: int, seed: int = 0, interactions: int | None = None, index: str | None = None) -> None:
        check_budget_seed(budget, seed)
        self.budget = budget
        self.seed = seed
        interactions, index = check_interactions(self.name, interactions, index, self.capabilities.interaction_indices)
        if interactions is None:
            valid = set(self.runtime.describe(self.approximator)[0]) or {"SV"}
            if not valid & {"SV", "SII", "k-SII", "kADD-SHAP"}:  # order-1 SII (and k-SII of order 1) is SV
                indices = ", ".join(self.capabilities.interaction_indices)
                raise ConfigError(
                    f"{self.name} computes interactions only ({indices}), not Shapley values alone; add --interactions 2 "
                    f"--index {self.capabilities.interaction_indices[0]}, or choose a Shapley-value approximator",
                    field="method",
                )
        self.interactions = interactions
        self.index = index

    # -- the approximator ----------------------------------------------------------------------
    def _options(self, n: int) -> dict[str, Any]:
        valid, params = self.runtime.describe(self.approximator)
        options: dict[str, Any] = dict(self.fixed_options)
        if self.interactions is not None:
            if "index" in params:
                options["index"] = self.index
            if "max_order" in params:
                options["max_order"] = self.interactions
        else:
            if "index" in params and "SV" in valid:
                options["index"] = "SV"
            if "max_order" in params and self.approximator in _ORDER_ONE_FOR_VALUES:
                options["max_order"] = 1
        return options

    def _plan(self, n: int) -> tuple[int, np.ndarray]:
        """(shapiq budget, distinct planned rows ``[m, n]`` bool: empty and grand coalition first);
        drawn once per configuration in this process (a run asks for its plan in several phases)."""
        key = (self.runtime.key, self.name, n, self.budget, self.seed, self.interactions, self.index)
        if key in _PLANS:
            return _PLANS[key]
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = self._draw(n)
        return _PLANS[key]

    def _draw(self, n: int) -> tuple[int, np.ndarray]:
        shapiq_budget = self.budget
        for _ in range(8):
            asked, _, _ = self.runtime.run(self, n, shapiq_budget, None)
            rows = np.concatenate([np.zeros((1, n), bool), np.ones((1, n), bool), asked])
            keys = row_keys(rows)
            first = {k: r for r, k in reversed(list(enumerate(keys)))}  # key -> first row index
            distinct = rows[sorted(first.values())]
            excess = distinct.shape[0] - self.budget
            if excess <= 0:
                distinct.setflags(write=False)
                return shapiq_budget, distinct
            shapiq_budget -= excess
            if shapiq_budget < 2:
                break
        raise ConfigError(
            f"{self.name} cannot keep to a budget of {self.budget} distinct coalitions on {n} players; give a larger budget",
            field="budget",
        )

    # -- the Estimator protocol ----------------------------------------------------------------
    def validate(self, n_players: int) -> None:
        """Refuse a game the approximator cannot play at this budget (drawing the plan, no model).

        Raises:
            EstimatorError: no players.
            ConfigError: an interaction order above n, or a budget the approximator refuses or
                cannot keep to (``field`` names the setting).
        """
        n = check_n_players(n_players)
        if self.interactions is not None and self.interactions > n:
            raise ConfigError(f"order {self.interactions} needs at least {self.interactions} players; this game has {n}", field="interactions")
        self._plan(n)

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Yield the coalitions the approximator asks for with ``random_state = seed`` (empty and
        grand coalition first), as read-only ``[n_players]`` bool rows; at most ``budget`` rows.

        Raises:
            as :meth:`validate`, at the call.
        """
        self.validate(n_players)
        _, rows = self._plan(int(n_players))
        return iter(rows)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Run the approximator again with every game call answered from the pool.

        Args:
            masks: ``[m, n_players]`` bool coalitions (the plan's, and any others).
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 (nats; order-1 terms, module
            docs), ``stderr=None``, ``interactions`` (orders 2..k with ``interactions=k``),
            ``n_evaluations`` = the plan's distinct coalitions, diagnostics ``shapiq_budget``.

        Raises:
            EstimatorError: the pool misses planned coalitions, holds non-finite utilities, or the
                approximator asked for a coalition outside its plan.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        shapiq_budget, planned = self._plan(n)
        lookup = pool_lookup(masks, utilities)
        missing = sum(1 for k in row_keys(planned) if k not in lookup)
        if missing:
            raise EstimatorError(
                f"the pool misses {missing} of the {planned.shape[0]} coalitions planned by {self.name}; "
                "evaluate the whole plan before fitting"
            )

        _, values, interactions = self.runtime.run(self, n, shapiq_budget, lookup)
        empty, full = row_keys(np.stack([np.zeros(n, bool), np.ones(n, bool)]))
        v_empty, v_full = lookup[empty], lookup[full]
        return Estimate.from_values(
            method=self.name,
            values=values,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=int(planned.shape[0]),
            diagnostics={"shapiq_budget": float(shapiq_budget)},
            interactions=interactions,
            interaction_index=self.index,
            interactions_share_total=self.index in EFFICIENT_INDICES,  # order-1 terms and interactions share v(N) - v(empty)
        )
