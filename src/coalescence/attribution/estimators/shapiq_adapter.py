"""shapiq's approximators as coalescence methods (``--method shapiq:<Approximator>``), and exact
interaction indices; the only module that imports shapiq.

shapiq (Muschalik, Fumagalli et al., "shapiq: Shapley Interactions for Machine Learning", NeurIPS
2024 Datasets and Benchmarks; PyPI ``shapiq``) implements the field's approximators of Shapley values
and Shapley interactions: KernelSHAP (Lundberg & Lee 2017), Unbiased KernelSHAP (Covert & Lee 2021),
SVARM and SVARM-IQ (Kolpaczki et al. 2024), SHAP-IQ (Fumagalli et al. 2023), KernelSHAP-IQ
(Fumagalli et al. 2024), k-additive SHAP (Pelegrina et al. 2023), permutation sampling (Castro et al.
2009; Tsai et al. 2023 for STII), stratified and Owen sampling, SPEX and ProxySPEX (Kang et al. 2025;
Butler et al. 2025), regression FSII (Faith-Shap, Tsai et al. 2023).

**How an approximator plays on the engine.** coalescence's estimators plan their coalitions before
the model runs, then fit from the pool (:mod:`.base`). A shapiq approximator asks for coalitions
through a game callback; every approximator of the pinned shapiq draws its coalitions from its
sampler, seeded by ``random_state``, whatever the game answers. So:

1. :meth:`ShapiqEstimator.plan` runs the approximator once on a stand-in game (a fixed synthetic
   value per coalition, no model) with ``random_state = seed`` and yields the coalitions it asked
   for, the empty and the grand coalition first. The engine evaluates them like any plan: batched
   with prefix sharing, deduplicated, archived; a run resumes after a crash and replays from the
   archive with no model, because the same seed gives the same plan.
2. :meth:`ShapiqEstimator.fit` runs the approximator again from the start with the same
   ``random_state``, answering every game call from the pool. An approximator that asked for a
   coalition outside its plan (one whose sampling depended on the answers) is refused with an
   :class:`~coalescence.errors.EstimatorError` instead of being given a wrong value.

**Budget.** shapiq's budget counts game evaluations; ours counts distinct coalitions. The plan is
drawn with shapiq's budget equal to ``budget``, lowered until the distinct coalitions (empty and
grand coalition included) fit in ``budget``; the shapiq budget used is recorded in the estimate's
diagnostics (``shapiq_budget``).

**Values and interactions.** Without interactions the approximator runs for Shapley values
(index ``SV``, order 1 where it takes those parameters). With ``interactions=k`` it runs for the
interaction index asked (``SII``, ``k-SII``, ``FSII``, ``STII``) up to order k; the estimate's
``values`` are then the index's order-1 terms (Shapley values for SII; the index's own main
effects for k-SII, FSII and STII, which with the higher orders sum to v(N) - v(empty)) and its
``interactions`` the terms of orders 2..k, and the efficiency gap of an efficient index (k-SII,
FSII, STII) is that of all its terms. shapiq reports no standard errors: ``stderr`` is
``None`` (unknown), so these methods do not take ``--target-stderr``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from ...errors import BackendUnavailable, ConfigError, EstimatorError
from .base import Capabilities, Estimate, check_budget_seed, check_interactions, check_n_players, check_pool, pool_lookup, row_keys

__all__ = (
    "INTERACTION_INDICES",
    "PREFIX",
    "ShapiqEstimator",
    "approximator_estimator",
    "approximator_names",
    "exact_interactions",
    "shapiq_version",
)

logger = logging.getLogger(__name__)

PREFIX = "shapiq:"
"""The method-name prefix of shapiq's approximators (``shapiq:KernelSHAP``)."""

INTERACTION_INDICES: tuple[str, ...] = ("SII", "k-SII", "FSII", "STII")
"""The interaction indices ``--index`` takes: the Shapley interaction index (Grabisch & Roubens
1999), its k-additive aggregation k-SII (Bordt & von Luxburg 2023), Faith-Shap FSII (Tsai, Yeh &
Ravikumar 2023) and the Shapley-Taylor index STII (Sundararajan, Dhamdhere & Agarwal 2020)."""

EFFICIENT_INDICES: frozenset[str] = frozenset({"k-SII", "FSII", "STII"})
"""The indices whose terms of every order up to k sum to v(N) - v(empty); with them the estimate's
``values`` are order-1 terms and its efficiency gap counts the interactions too."""

INSTALL = "pip install -c constraints.txt 'coalescence[shapiq]'"

# approximators whose order-1 output is not a Shapley value unless they are asked for order 1
_ORDER_ONE_FOR_VALUES = frozenset({"KernelSHAPIQ", "InconsistentKernelSHAPIQ", "SVARMIQ", "SHAPIQ", "PermutationSamplingSII", "RegressionFSII", "SPEX", "ProxySPEX"})


def _shapiq() -> Any:
    """The shapiq module, or a one-line error naming the install command."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import shapiq
    except ImportError:
        raise BackendUnavailable(f"the shapiq methods need the shapiq extra: {INSTALL}") from None
    return shapiq


def shapiq_version() -> str:
    """The installed shapiq's version string (from the package metadata).

    Raises:
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    from importlib.metadata import version

    _shapiq()
    return version("shapiq")


def approximator_names() -> tuple[str, ...]:
    """The shapiq approximators a method can name (every Shapley-value and interaction approximator
    of the installed shapiq), sorted.

    Raises:
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    approximators = _shapiq().approximator
    classes = {*approximators.SV_APPROXIMATORS, *approximators.SI_APPROXIMATORS}
    return tuple(sorted(cls.__name__ for cls in classes))


@functools.cache
def approximator_estimator(method: str) -> type:
    """The estimator class of ``method`` (``"shapiq:<Approximator>"``), made once per name.

    Raises:
        ConfigError: not a shapiq method name, or an approximator the installed shapiq lacks
            (``field="method"``, listing the ones it has).
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    if not isinstance(method, str) or not method.startswith(PREFIX):
        raise ConfigError(f"{method!r} is not a shapiq method; write shapiq:<Approximator>", field="method")
    name = method[len(PREFIX) :]
    names = approximator_names()
    if name not in names:
        hint = ""
        if name in ("RegressionMSR", "ProxySHAP"):
            import sys

            hint = (
                f" ({name} is in shapiq releases after 1.4.1, which need Python 3.12 or newer; this install "
                f"has shapiq {shapiq_version()} on Python {sys.version_info.major}.{sys.version_info.minor})"
            )
        if not hint:
            import difflib

            lowered = {n.lower(): n for n in names}
            close = [lowered[name.lower()]] if name.lower() in lowered else difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean shapiq:{close[0]}?)" if close else ""
        raise ConfigError(f"shapiq has no approximator {name!r}{hint}; choose one of: {', '.join(names)}", field="method")
    cls = getattr(_shapiq().approximator, name)
    valid = set(getattr(cls, "valid_indices", ()))
    indices = tuple(i for i in INTERACTION_INDICES if i in valid)
    capabilities = Capabilities(needs_budget=True, reports_stderr=False, interaction_indices=indices)
    return type(f"Shapiq{name}", (ShapiqEstimator,), {"name": method, "approximator": name, "capabilities": capabilities, "__slots__": ()})


_PLANS: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
"""Drawn plans by (approximator, n, budget, seed, interactions, index): read-only arrays."""


@functools.lru_cache(maxsize=32)
def _pristine(name: str, n: int, seed: int, options: tuple[tuple[str, Any], ...]) -> Any:
    """An approximator never run, to copy from (construction is deterministic in its arguments)."""
    cls = getattr(_shapiq().approximator, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(n=n, random_state=seed, **dict(options))


def _standin_values(rows: np.ndarray) -> np.ndarray:
    """A fixed synthetic utility per coalition (no model): an additive part and pairwise terms
    from a generator seeded by n, so the approximator's regressions are well posed while it
    draws its plan."""
    n = rows.shape[1]
    rng = np.random.default_rng(n)
    weights = rng.normal(size=n)
    pairs = rng.normal(size=(n, n)) / max(n, 1)
    x = rows.astype(np.float64)
    return x @ weights + np.einsum("ki,ij,kj->k", x, pairs, x)


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
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False)
    __slots__ = ("budget", "seed", "interactions", "index")

    def __init__(self, *, budget: int, seed: int = 0, interactions: int | None = None, index: str | None = None) -> None:
        check_budget_seed(budget, seed)
        self.budget = budget
        self.seed = seed
        interactions, index = check_interactions(self.name, interactions, index, self.capabilities.interaction_indices)
        if interactions is None:
            valid = set(getattr(getattr(_shapiq().approximator, self.approximator), "valid_indices", ("SV",)))
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
    def _approximator(self, n: int) -> Any:
        """A fresh approximator: a copy of a pristine one made once per (approximator, n, seed,
        options) in this process (SPEX-family constructors build a BCH code, seconds each)."""
        return copy.deepcopy(_pristine(self.approximator, n, self.seed, tuple(sorted(self._options(n).items()))))

    def _options(self, n: int) -> dict[str, Any]:
        cls = getattr(_shapiq().approximator, self.approximator)
        params = inspect.signature(cls.__init__).parameters
        options: dict[str, Any] = {}
        if self.interactions is not None:
            if "index" in params:
                options["index"] = self.index
            if "max_order" in params:
                options["max_order"] = self.interactions
        else:
            if "index" in params and "SV" in getattr(cls, "valid_indices", ()):
                options["index"] = "SV"
            if "max_order" in params and self.approximator in _ORDER_ONE_FOR_VALUES:
                options["max_order"] = 1
        return options

    def _run(self, n: int, budget: int, game: Callable[[np.ndarray], np.ndarray]) -> Any:
        approximator = self._approximator(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return approximator.approximate(budget=budget, game=game)
            except EstimatorError:
                raise
            except (ValueError, TypeError, ZeroDivisionError, np.linalg.LinAlgError) as exc:
                raise ConfigError(
                    f"{self.name} cannot run at budget {self.budget} on {n} players: {exc}; try a larger budget",
                    field="budget",
                ) from exc

    def _plan(self, n: int) -> tuple[int, np.ndarray]:
        """(shapiq budget, distinct planned rows ``[m, n]`` bool: empty and grand coalition first);
        drawn once per configuration in this process (a run asks for its plan in several phases)."""
        key = (self.approximator, n, self.budget, self.seed, self.interactions, self.index)
        if key in _PLANS:
            return _PLANS[key]
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = self._draw(n)
        return _PLANS[key]

    def _draw(self, n: int) -> tuple[int, np.ndarray]:
        shapiq_budget = self.budget
        for _ in range(8):
            asked: list[np.ndarray] = []

            def standin(coalitions: np.ndarray) -> np.ndarray:
                rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
                asked.append(rows.copy())
                return _standin_values(rows)

            self._run(n, shapiq_budget, standin)
            rows = np.concatenate([np.zeros((1, n), bool), np.ones((1, n), bool), *asked])
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

        def from_pool(coalitions: np.ndarray) -> np.ndarray:
            rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
            keys = row_keys(rows)
            out = np.fromiter((lookup.get(k, np.nan) for k in keys), dtype=np.float64, count=len(keys))
            if not np.isfinite(out).all():
                raise EstimatorError(
                    f"{self.name} asked for a coalition outside its plan or with a non-finite utility; "
                    "its sampling depends on the values, which this adapter cannot replay"
                )
            return out

        result = self._run(n, shapiq_budget, from_pool)
        values = np.array([float(result[(i,)]) for i in range(n)], dtype=np.float64)
        interactions = _terms(result, n, self.interactions) if self.interactions is not None else ()
        empty, full = row_keys(np.stack([np.zeros(n, bool), np.ones(n, bool)]))
        v_empty, v_full = lookup[empty], lookup[full]
        total = float(values.sum())
        if self.index in EFFICIENT_INDICES:  # order-1 terms and interactions share v(N) - v(empty)
            total += float(sum(v for _, v in interactions))
        return Estimate(
            method=self.name,
            values=values,
            stderr=None,
            v_empty=v_empty,
            v_full=v_full,
            efficiency_gap=total - (v_full - v_empty),
            n_evaluations=int(planned.shape[0]),
            diagnostics={"shapiq_budget": float(shapiq_budget)},
            interactions=interactions,
            interaction_index=self.index,
        )


def exact_interactions(masks: np.ndarray, utilities: np.ndarray, *, order: int, index: str) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Exact interaction values of orders 2..``order`` from a pool holding all 2^n coalitions, by
    shapiq's ``ExactComputer`` (the index's definition summed over every coalition).

    Args:
        masks: ``[m, n]`` bool, every coalition at least once.
        utilities: ``[m]`` float64 (nats).
        order: the highest order (2 .. n).
        index: one of :data:`INTERACTION_INDICES`.

    Returns:
        ``((players, value), ...)``: each set of 2..order players (ascending indices) with its
        value in the utilities' unit.

    Raises:
        EstimatorError: the pool misses coalitions.
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    masks, utilities = check_pool(masks, utilities)
    n = masks.shape[1]
    lookup = pool_lookup(masks, utilities)

    def game(coalitions: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
        keys = row_keys(rows)
        if any(k not in lookup for k in keys):
            raise EstimatorError("exact interactions need every coalition in the pool; evaluate all 2^n first")
        return np.fromiter((lookup[k] for k in keys), dtype=np.float64, count=len(keys))

    shapiq = _shapiq()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = shapiq.ExactComputer(n_players=n, game=game)(index, order)
    return _terms(result, n, order)


def _terms(result: Any, n: int, order: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Every set of 2..``order`` of the ``n`` players with its value in shapiq's result (zero for
    a set shapiq left out of its sparse result), by size, then lexicographically."""
    return tuple(
        (players, float(result[players]))
        for size in range(2, order + 1)
        for players in itertools.combinations(range(n), size)
    )
