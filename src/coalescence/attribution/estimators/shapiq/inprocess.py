"""shapiq in this process: the runner that plays an approximator on a stand-in game (to draw its
plan) or on the pool (to fit), and exact interaction indices by shapiq's ``ExactComputer``."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ....errors import ConfigError, EstimatorError
from ..base import check_pool, library_seed, pool_lookup, row_keys
from .library import _shapiq, shapiq_version

if TYPE_CHECKING:
    from .estimator import ShapiqEstimator

__all__ = ("exact_interactions",)


@functools.lru_cache(maxsize=32)
def _pristine(name: str, n: int, seed: int, options: tuple[tuple[str, Any], ...]) -> Any:
    """An approximator never run, to copy from (construction is deterministic in its arguments)."""
    cls = getattr(_shapiq().approximator, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(n=n, random_state=library_seed(seed), **dict(options))


def _standin_values(rows: np.ndarray) -> np.ndarray:
    """A fixed synthetic utility per coalition (no model): an additive part and pairwise terms
    from a generator seeded by n, so the approximator's regressions are well posed while it
    draws its plan. (``_worker.standin`` is the same formula.)"""
    n = rows.shape[1]
    rng = np.random.default_rng(n)
    weights = rng.normal(size=n)
    pairs = rng.normal(size=(n, n)) / max(n, 1)
    x = rows.astype(np.float64)
    return x @ weights + np.einsum("ki,ij,kj->k", x, pairs, x)


_Run = tuple[np.ndarray, np.ndarray, tuple[tuple[tuple[int, ...], float], ...]]
"""One approximator run: (coalitions asked ``[m, n]`` bool, order-1 terms ``[n]`` float64,
terms of orders 2..k)."""


class _InProcess:
    """shapiq imported in this process."""

    key = "here"

    @staticmethod
    @functools.cache
    def names() -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
        """name -> (valid indices, constructor parameters) of every approximator of this shapiq."""
        approximators = _shapiq().approximator
        classes = {*approximators.SV_APPROXIMATORS, *approximators.SI_APPROXIMATORS}
        return {
            cls.__name__: (frozenset(getattr(cls, "valid_indices", ())), tuple(inspect.signature(cls.__init__).parameters))
            for cls in classes
            if not inspect.isabstract(cls)
        }

    def describe(self, name: str) -> tuple[frozenset[str], tuple[str, ...]]:
        return self.names()[name]

    def version(self) -> str:
        return f"shapiq {shapiq_version()} (this Python)"

    def run(self, est: ShapiqEstimator, n: int, budget: int, lookup: dict[bytes, float] | None) -> _Run:
        approximator = copy.deepcopy(_pristine(est.approximator, n, est.seed, tuple(sorted(est._options(n).items()))))
        asked: list[np.ndarray] = []

        def game(coalitions: np.ndarray) -> np.ndarray:
            rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
            asked.append(rows.copy())
            if lookup is None:
                return _standin_values(rows)
            keys = row_keys(rows)
            out = np.fromiter((lookup.get(k, np.nan) for k in keys), dtype=np.float64, count=len(keys))
            if not np.isfinite(out).all():
                raise EstimatorError(_outside(est.name))
            return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = approximator.approximate(budget=budget, game=game)
            except EstimatorError:
                raise
            except (ValueError, TypeError, ZeroDivisionError, np.linalg.LinAlgError) as exc:
                raise _cannot_run(est, n, str(exc)) from exc
        rows = np.concatenate(asked) if asked else np.zeros((0, n), bool)
        values = np.array([float(result[(i,)]) for i in range(n)], dtype=np.float64)
        terms = _terms(result, n, est.interactions) if est.interactions is not None else ()
        return rows, values, terms


def _outside(method: str) -> str:
    return (
        f"{method} asked for a coalition outside its plan or with a non-finite utility; "
        "its sampling depends on the values, which this adapter cannot replay"
    )


def _cannot_run(est: ShapiqEstimator, n: int, why: str) -> ConfigError:
    return ConfigError(f"{est.name} cannot run at budget {est.budget} on {n} players: {why}; try a larger budget", field="budget")


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
