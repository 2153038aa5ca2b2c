"""The estimators by name: one registry, so adding a method touches its own file and this table.

Each class declares what it can do (:class:`~coalescence.attribution.estimators.base.Capabilities`:
whether it samples within a budget, reports standard errors, a largest n); callers ask the class
(:func:`estimator_class`) instead of keeping lists of method names.
"""

from __future__ import annotations

from ...errors import ConfigError
from .banzhaf import Banzhaf
from .base import Estimator
from .exact import ExactShapley
from .kernel import KernelSHAP
from .lasso import LassoSurrogate
from .loo import LeaveOneOut
from .permutation import PermutationShapley

__all__ = ("ESTIMATORS", "METHODS", "estimator_class", "make_estimator", "methods_with", "register_estimator")

ESTIMATORS: dict[str, type] = {
    "exact": ExactShapley,
    "permutation": PermutationShapley,
    "loo": LeaveOneOut,
    "kernelshap": KernelSHAP,
    "banzhaf": Banzhaf,
    "lasso": LassoSurrogate,
}
"""Estimator classes by method name (the CLI's ``--method`` choices)."""

METHODS: tuple[str, ...] = tuple(ESTIMATORS)
"""The registered method names, in registration order (as of import; see :func:`register_estimator`)."""


def register_estimator(name: str, cls: type) -> None:
    """Register an estimator class under ``name`` (it must declare ``capabilities`` and follow the
    :class:`~coalescence.attribution.estimators.base.Estimator` protocol).

    Raises:
        ConfigError: ``cls`` declares no capabilities.
    """
    global METHODS
    if not hasattr(cls, "capabilities"):
        raise ConfigError(f"{cls.__name__} declares no capabilities", field="method")
    ESTIMATORS[name] = cls
    METHODS = tuple(ESTIMATORS)


def estimator_class(method: str) -> type:
    """The estimator class registered as ``method``.

    Raises:
        ConfigError: unknown method (field ``method``).
    """
    try:
        return ESTIMATORS[method]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown method {method!r}; choose one of: {', '.join(ESTIMATORS)}", field="method") from None


def methods_with(**wanted: bool) -> tuple[str, ...]:
    """The method names whose capabilities have the given values, e.g. ``methods_with(reports_stderr=True)``."""
    return tuple(name for name, cls in ESTIMATORS.items() if all(getattr(cls.capabilities, k) == v for k, v in wanted.items()))


def make_estimator(method: str, *, budget: int | None = None, seed: int = 0) -> Estimator:
    """Build an estimator by name.

    Args:
        method: a registered name (:data:`ESTIMATORS`).
        budget: the most distinct coalitions (model evaluations), for the methods whose
            capabilities say ``needs_budget``; ignored by the others (exact: always 2^n, loo:
            n + 2).
        seed: seed of the sampler's ``numpy.random.default_rng``.

    Returns:
        an :class:`~coalescence.attribution.estimators.base.Estimator`.

    Raises:
        ConfigError: unknown method (field ``method``), or a sampling method without a valid
            budget or with a bad seed (field ``budget`` / ``seed``).
    """
    cls = estimator_class(method)
    if not cls.capabilities.needs_budget:
        return cls()
    if budget is None:
        raise ConfigError(
            f"method {method} needs a budget of model evaluations; pass a budget (e.g. 2000)", field="budget"
        )
    return cls(budget=budget, seed=seed)
