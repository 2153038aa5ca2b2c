"""The estimator interface: plan coalitions, then fit values from a pool of evaluated coalitions.

An estimator is a plain two-step state machine with no model in it (the engine owns the model):

1. :meth:`Estimator.plan` lazily yields the coalitions it needs, as 1-D boolean rows ``[n_players]``
   (bit i True = player i present), deterministically for a given configuration (seeded);
2. the engine evaluates them (deduplicating, caching, archiving) into a pool;
3. :meth:`Estimator.fit` turns the pool ``(masks, utilities)`` into an :class:`Estimate`.

Every estimator plans the empty and the grand coalition, so every :class:`Estimate` reports
``v(empty)``, ``v(full)`` and its efficiency gap ``sum(values) - (v(full) - v(empty))``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ...errors import ConfigError, EstimatorError
from .pool import check_pool, gather, pool_lookup, row_keys

__all__ = (
    "Z95",
    "budget_near_all",
    "Capabilities",
    "check_budget_seed",
    "check_interactions",
    "check_n_players",
    "check_pool",
    "check_seed",
    "Estimate",
    "SampledEstimator",
    "Estimator",
    "for_target_stderr",
    "gather",
    "library_seed",
    "pool_lookup",
    "row_keys",
    "student_t_factor",
)

Z95 = 1.959963984540054
"""The 97.5% standard normal quantile: a reported standard error ``se`` means the 95% interval
``value +- Z95 * se`` (the ``+- 1.96 se`` users read off)."""


def student_t_factor(dof: np.ndarray | float) -> np.ndarray:
    """Factor that widens a normal 95% interval into Student's t interval with ``dof`` degrees of freedom.

    ``t_{0.975, dof} / z_{0.975}`` (Student 1908; Welch 1947 for fractional ``dof``): a sample
    standard error ``s`` estimated from ``dof`` degrees of freedom is reported as
    ``s * student_t_factor(dof)``, so that ``value +- 1.96 * reported`` is the t interval.
    The factor is 12.7 / 1.96 = 6.5 at one degree of freedom, 1.14 at ten, 1.01 at two hundred.

    Args:
        dof: degrees of freedom, scalar or array, float64; values below 1 (or NaN) give NaN.

    Returns:
        float64 array of the broadcast shape of ``dof``, each factor >= 1 (NaN where dof < 1).
    """
    from scipy.stats import t as student_t

    d = np.asarray(dof, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = d >= 1.0
    out = np.full(d.shape, np.nan)
    out[ok] = student_t.ppf(0.975, d[ok]) / Z95
    return out


def budget_near_all(n_players: int, budget: int) -> bool:
    """Whether a sampling budget leaves fewer than ``4 n`` of the ``2^n`` coalitions unplanned.

    ``budget < 2^n`` and ``2^n - budget < 4 n`` (two antithetic pairs' worth of coalitions). The
    sampling plans draw until the next draw would exceed the budget; this close to every coalition,
    the last draws are kept because they repeat what is already planned (no longer uniform), and the
    games are so small (every sampled budget when n <= 4, budgets 13-31 when n = 5) that each draw
    takes a handful of values. Permutation sampling and KernelSHAP report their standard errors as
    unknown (NaN) there: measured coverage of their 95% intervals was 63-91% (n = 4 and 5). A
    budget of ``2^n`` or more is not near: it enumerates (KernelSHAP) or fits every draw.

    Args:
        n_players: number of players n >= 1.
        budget: the most distinct coalitions.

    Returns:
        True when ``budget < 2^n`` and ``2^n - budget < 4 * n_players``.
    """
    total = 1 << n_players
    return budget < total and total - budget < 4 * n_players


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What an estimator class can do, declared on the class (``capabilities``), so callers never
    keep lists of method names.

    Attributes:
        needs_budget: the estimator samples: it takes ``budget`` (the most distinct model
            evaluations) and ``seed``; otherwise its number of evaluations is fixed by n.
        reports_stderr: its :class:`Estimate` carries standard errors (so it can sample until a
            target standard error, ``--target-stderr``).
        max_players: the largest n it accepts, or ``None`` for no limit.
        budget_per_player: the default budget is this many evaluations per player.
        interaction_indices: the interaction indices it also computes (``interactions=k``,
            ``index=...``; e.g. ``("SII", "k-SII")``); empty for a method of values only.
        chooses: the method runs another estimator, chosen by the game
            (``choose(n_players) -> (estimator, why)``, e.g. ``auto``): what it can do beyond these
            flags (standard errors) is the chosen one's, known once n is.
        two_fidelity: it also fits from a second, cheaper game (a proxy of the utility evaluated
            on many more coalitions) together with the exact one: it has ``proxy_budget``,
            ``proxy_plan(n)`` and ``fit_two_fidelity(masks, utilities, proxy_masks,
            proxy_utilities)`` (:mod:`.proxy`); its ``fit`` alone is its exact-only form, and its
            ``validate(n_players, *, proxy=False)`` checks the budget for a run that plays the
            proxy game (``proxy=True``: the floor may be lower, e.g. the surrogate's 8 against 16)
            or fits the exact rows alone.
        exact: its values are computed from every coalition, with no sampling error (they are the
            game's Shapley values): the reference other methods are compared with.
    """

    needs_budget: bool
    reports_stderr: bool
    max_players: int | None = None
    budget_per_player: int = 32
    interaction_indices: tuple[str, ...] = ()
    chooses: bool = False
    two_fidelity: bool = False
    exact: bool = False

    def default_budget(self, n_players: int) -> int | None:
        """The budget used when none is given: ``budget_per_player * n``, or ``None`` when the
        estimator takes no budget."""
        return self.budget_per_player * n_players if self.needs_budget else None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Estimate:
    """Attribution values fitted from a pool of evaluated coalitions.

    Arrays are copied to read-only float64 on construction. Equality is identity (arrays have no
    single truth value); compare fields with ``numpy.testing`` instead.

    Args:
        method: the estimator's name (``"exact"``, ``"permutation"``, ``"loo"``).
        values: ``[n_players]`` float64 attribution values, in the unit of the utilities (nats for
            log-probabilities).
        stderr: ``[n_players]`` float64 standard errors of ``values``, in the unit of the values,
            calibrated so that ``values +- 1.96 * stderr`` is a 95% confidence interval (small-sample
            corrections included: each sampling method's docstring gives its rule); NaN where the
            samples cannot say (the method's docstring lists when, and ``diagnostics`` counts them
            in ``"stderr_unknown"``); ``None`` for deterministic methods and full enumeration.
        v_empty: utility of the empty coalition, v(empty).
        v_full: utility of the grand coalition, v(N).
        efficiency_gap: ``sum(values) - (v_full - v_empty)``; float-precision zero for Shapley
            estimators (efficiency axiom), generally nonzero for leave-one-out. For a shapiq
            approximator of an efficient interaction index (k-SII, FSII, STII), whose ``values``
            are order-1 terms, the interactions' sum is added to ``sum(values)``.
        n_evaluations: number of distinct coalitions the estimate used (model evaluations).
        diagnostics: method-specific scalar diagnostics (e.g. the LASSO surrogate's ``"lds"``,
            its linear datamodeling score); copied to a read-only mapping of str to float.
            Empty by default.
        interactions: interaction values of sets of 2 or more players, ``((players, value), ...)``
            with ``players`` ascending player indices and ``value`` in the utilities' unit; empty
            unless interactions were asked for.
        interaction_index: the index of ``interactions`` (``"SII"``, ``"k-SII"``, ``"FSII"``,
            ``"STII"``), or ``None``.
        notes: sentences for the reader about how the values were obtained (e.g. which method
            ``auto`` ran and why); shown with the explanation's notes. Empty by default.

    Raises:
        EstimatorError: an empty method name, ``values`` not 1-D, ``stderr`` of another shape, a
            negative ``n_evaluations``, or a diagnostics key that is not a str.
    """

    method: str
    values: np.ndarray  # [n_players] float64, utility units (nats)
    stderr: np.ndarray | None  # [n_players] float64 or None
    v_empty: float
    v_full: float
    efficiency_gap: float
    n_evaluations: int
    diagnostics: Mapping[str, float] = field(default_factory=dict)
    interactions: tuple[tuple[tuple[int, ...], float], ...] = ()
    interaction_index: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))
        if not isinstance(self.method, str) or not self.method:
            raise EstimatorError(f"Estimate.method must be a non-empty str, got {self.method!r}")
        values = np.array(self.values, dtype=np.float64)
        if values.ndim != 1:
            raise EstimatorError(
                f"Estimate.values must be 1-D [n_players], got shape {values.shape}"
            )
        values.setflags(write=False)
        object.__setattr__(self, "values", values)
        if self.stderr is not None:
            stderr = np.array(self.stderr, dtype=np.float64)
            if stderr.shape != values.shape:
                raise EstimatorError(
                    f"Estimate.stderr shape {stderr.shape} differs from values shape {values.shape}"
                )
            stderr.setflags(write=False)
            object.__setattr__(self, "stderr", stderr)
        for name in ("v_empty", "v_full", "efficiency_gap"):
            object.__setattr__(self, name, float(getattr(self, name)))
        count = self.n_evaluations
        if isinstance(count, bool) or not isinstance(count, int | np.integer):
            raise EstimatorError(f"Estimate.n_evaluations must be an int, got {count!r}")
        if self.n_evaluations < 0:
            raise EstimatorError(f"Estimate.n_evaluations must be >= 0, got {self.n_evaluations}")
        object.__setattr__(self, "n_evaluations", int(self.n_evaluations))
        diagnostics: dict[str, float] = {}
        for key, value in dict(self.diagnostics).items():
            if not isinstance(key, str):
                raise EstimatorError(f"Estimate.diagnostics keys must be str, got {key!r}")
            diagnostics[key] = float(value)
        object.__setattr__(self, "diagnostics", MappingProxyType(diagnostics))
        n = values.shape[0]
        terms = []
        for players, value in self.interactions:
            players = tuple(int(p) for p in players)
            if len(players) < 2 or len(set(players)) != len(players) or not all(0 <= p < n for p in players):
                raise EstimatorError(f"Estimate.interactions: {players} is not a set of 2 or more of the {n} players")
            terms.append((tuple(sorted(players)), float(value)))
        object.__setattr__(self, "interactions", tuple(terms))
        if terms and not self.interaction_index:
            raise EstimatorError("Estimate.interactions need their interaction_index")

    @property
    def n_players(self) -> int:
        """Number of players n (the length of ``values``)."""
        return int(self.values.shape[0])

    @classmethod
    def from_values(
        cls,
        *,
        method: str,
        values: np.ndarray,
        v_empty: float,
        v_full: float,
        n_evaluations: int,
        stderr: np.ndarray | None = None,
        diagnostics: Mapping[str, float] | None = None,
        interactions: tuple[tuple[tuple[int, ...], float], ...] = (),
        interaction_index: str | None = None,
        interactions_share_total: bool = False,
        notes: tuple[str, ...] = (),
    ) -> Estimate:
        """An estimate whose efficiency gap is computed here, by the one rule every estimator
        reports: ``sum(values) - (v_full - v_empty)``, the interactions' sum added to
        ``sum(values)`` when ``interactions_share_total`` (an efficient interaction index whose
        ``values`` are its order-1 terms: k-SII, FSII, STII; Fumagalli et al. 2023). NaN values
        (a player the samples never separated) give a NaN gap.

        Args: as the class; ``values`` ``[n_players]`` float64 in the utilities' unit.

        Raises:
            EstimatorError: as the class.
        """
        values = np.asarray(values, dtype=np.float64)
        total = float(values.sum())
        if interactions_share_total:
            total += float(sum(v for _, v in interactions))
        return cls(
            method=method,
            values=values,
            stderr=stderr,
            v_empty=float(v_empty),
            v_full=float(v_full),
            efficiency_gap=total - (float(v_full) - float(v_empty)),
            n_evaluations=n_evaluations,
            diagnostics={} if diagnostics is None else diagnostics,
            interactions=interactions,
            interaction_index=interaction_index,
            notes=notes,
        )


@runtime_checkable
class Estimator(Protocol):
    """What the engine needs from an attribution method.

    Attributes:
        name: the method name (``"exact"``, ``"permutation"``, ``"loo"``).
        capabilities: what the method can do (a class attribute, see :class:`Capabilities`).
    """

    name: str
    capabilities: ClassVar[Capabilities]

    def validate(self, n_players: int) -> None:
        """Refuse a game this estimator cannot handle, before any model call.

        Raises:
            EstimatorError: the game has no players or too many (``field="method"``).
            ConfigError: the configuration cannot work for ``n_players`` (``field="budget"``).
        """
        ...

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Lazily yield the needed coalitions as read-only ``[n_players]`` bool rows.

        Deterministic for a given configuration; always includes the empty and grand coalitions; may
        repeat a coalition (the engine deduplicates).
        """
        ...

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Fit values from a pool of evaluated coalitions.

        Args:
            masks: ``[m, n_players]`` bool coalitions; may hold extra coalitions and duplicates.
            utilities: ``[m]`` float64 utilities of those coalitions (nats).

        Raises:
            EstimatorError: the pool lacks planned coalitions (the message says how many).
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledEstimator:
    """What every sampling estimator shares: a budget of distinct coalitions, a seed, a minimum
    budget, and a plan that is a pure function of (n, budget, seed). A subclass (a frozen dataclass
    adding its ``name`` and options) keeps only its mathematics: :meth:`min_budget`,
    :meth:`_plan_rows` and ``fit``.

    Args:
        budget: the most distinct coalitions (model evaluations), a positive int.
        seed: seed of ``numpy.random.default_rng``, a non-negative int of any size.

    Raises:
        ConfigError: ``budget`` is not a positive int (``field="budget"``), or ``seed`` is not a
            non-negative int (``field="seed"``).
    """

    budget: int
    seed: int = 0
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=True)
    what: ClassVar[str] = "this method"
    """The method in the budget error (``"permutation sampling"``)."""
    minimum_why: ClassVar[str] = ""
    """What the minimum budget buys, in the budget error (``" (one antithetic pair)"``)."""

    def __post_init__(self) -> None:
        check_budget_seed(self.budget, self.seed)

    def min_budget(self, n_players: int) -> int:
        """The smallest budget for ``n_players`` players (subclasses say theirs)."""
        raise NotImplementedError

    def _minimum_text(self, n_players: int, minimum: int) -> str:
        return str(minimum)

    def validate(self, n_players: int) -> None:
        """Refuse an empty game or a budget below :meth:`min_budget`.

        Raises:
            EstimatorError: ``n_players == 0``.
            ConfigError: the budget is below the minimum (``field="budget"``).
        """
        n = check_n_players(n_players)
        minimum = self.min_budget(n)
        if self.budget < minimum:
            raise ConfigError(
                f"{self.budget} is below the minimum of {self._minimum_text(n, minimum)} for {self.what} "
                f"with {n} players{self.minimum_why}; raise the budget",
                field="budget",
            )

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Yield the planned distinct coalitions, in the order the plan first meets them.

        Returns:
            an iterator of at most ``budget`` read-only ``[n_players]`` bool rows (each
            subclass's docstring says which and in what order).

        Raises:
            EstimatorError, ConfigError: as :meth:`validate`, raised at the call.
        """
        self.validate(n_players)
        return iter(self._plan_rows(int(n_players)))

    def _plan_rows(self, n_players: int) -> Any:
        """The plan's rows (``[k, n_players]`` bool, k <= budget) for a valid game."""
        raise NotImplementedError


def for_target_stderr(estimator: Any, n_players: int) -> tuple[Any, tuple[str, str] | None]:
    """The estimator that samples in rounds until a target standard error, for a game of
    ``n_players``: ``estimator`` itself, or the one it chooses (``capabilities.chooses``: ``auto``
    runs regression-msr or lasso by n and budget).

    Returns:
        ``(estimator, chosen)``: ``chosen`` is ``None``, or ``(method shown, why)`` of the choice
        (``("auto:regression-msr", "method auto ran ...")``) for the explanation.

    Raises:
        ConfigError: the estimator (or the one chosen) reports no standard errors
            (``field="target_stderr"``), naming it.
    """
    chosen = None
    name = estimator.name
    if estimator.capabilities.chooses:
        picked, why = estimator.choose(n_players)
        chosen = (f"{name}:{picked.name}", why)
        name = f"{name} chooses {picked.name} for {n_players} players at budget {estimator.budget}, and {picked.name}"
        estimator = picked
    if not estimator.capabilities.reports_stderr:
        raise ConfigError(
            f"method {name} reports no standard errors; use a method that does (permutation, kernelshap, "
            "regression-msr, banzhaf)" + (" or raise the budget" if chosen else ""),
            field="target_stderr",
        )
    return estimator, chosen


def check_budget_seed(budget: object, seed: object) -> None:
    """Check a sampler's ``budget`` (positive int) and ``seed`` (non-negative int).

    Raises:
        ConfigError: a bad budget (``field="budget"``) or seed (``field="seed"``), quoting it.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"must be a positive integer, got {budget!r}", field="budget")
    check_seed(seed)


def check_seed(seed: object) -> None:
    """Check a seed against the one rule of every method: a non-negative int of any size (numpy's
    ``Generator`` seeds; libraries with narrower seeds get :func:`library_seed`).

    Raises:
        ConfigError: a negative seed, or one that is not an int (``field="seed"``), quoting it.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"must be a non-negative integer (any size), got {seed!r}", field="seed")


LIBRARY_SEED_BOUND = 2**32
"""Seeds at and above this are derived before they reach a library with a seed limit (sklearn's
``random_state`` takes ``[0, 2**32)``; XGBoost's ``seed`` is a signed 64-bit int)."""


def library_seed(seed: int) -> int:
    """The seed handed to a library whose seeds are bounded (sklearn, shapiq's approximators and
    the XGBoost/sklearn models inside them), derived deterministically from a run's seed.

    The run's seed rule is numpy's: any non-negative integer (``numpy.random.default_rng`` takes
    them all). A seed below ``2**32`` is passed as it is (the plans of every seed that worked
    before stay the same); a larger one becomes the first 32-bit word of
    ``numpy.random.SeedSequence(seed).generate_state(1)``, a pure function of the seed.

    Args:
        seed: a non-negative int (checked by :func:`check_budget_seed`).

    Returns:
        An int in ``[0, 2**32)``.
    """
    if seed < LIBRARY_SEED_BOUND:
        return int(seed)
    return int(np.random.SeedSequence(int(seed)).generate_state(1, dtype=np.uint32)[0])


def check_interactions(
    name: str, interactions: object, index: str | None, indices: tuple[str, ...]
) -> tuple[int | None, str | None]:
    """Check an interaction order and index asked of the method ``name``, filling the default index.

    Args:
        name: the method's name, for the messages.
        interactions: the highest interaction order (an int of 2 or more), or ``None``.
        index: the interaction index, or ``None`` for the default ``"k-SII"``.
        indices: the indices the method computes (its capabilities' ``interaction_indices``).

    Returns:
        ``(order, index)``, or ``(None, None)`` when neither is given.

    Raises:
        ConfigError: an index without an order (``field="index"``), an order that is not an int of
            2 or more (``field="interactions"``), an index the method does not compute
            (``field="index"``, listing the ones it does).
    """
    if interactions is None:
        if index is not None:
            raise ConfigError("applies with --interactions ORDER (2 or more), e.g. --interactions 2; add it or drop the index", field="index")
        return None, None
    if isinstance(interactions, bool) or not isinstance(interactions, int) or interactions < 2:
        raise ConfigError(f"must be an interaction order of 2 or more, got {interactions!r}", field="interactions")
    index = "k-SII" if index is None else index
    if index not in indices:
        can = ", ".join(indices) or "none (it estimates values only)"
        raise ConfigError(f"method {name} does not compute the {index} index; it computes: {can}", field="index")
    return interactions, index


def check_n_players(n_players: int) -> int:
    """Return ``n_players`` as an int after checking it is at least 1.

    Raises:
        EstimatorError: ``n_players`` is not an int, or is 0 ("no players to attribute").
    """
    if isinstance(n_players, bool) or not isinstance(n_players, int | np.integer) or n_players < 0:
        raise EstimatorError(f"n_players must be a non-negative int, got {n_players!r}")
    if n_players == 0:
        raise EstimatorError(
            "no players to attribute; the conversation must have at least one player"
        )
    return int(n_players)
