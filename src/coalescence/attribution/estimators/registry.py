"""The estimators by name: one registry, so adding a method touches its own file and this table.

Each class declares what it can do (:class:`~coalescence.attribution.estimators.base.Capabilities`:
whether it samples within a budget, reports standard errors, a largest n); callers ask the class
(:func:`estimator_class`) instead of keeping lists of method names.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...registry import Registry
from .auto import AutoMethod
from .banzhaf import Banzhaf
from .default import DefaultMethod
from .base import Estimator, check_interactions
from .exact import ExactShapley
from .kernel import KernelSHAP
from .loo import LeaveOneOut
from .msr import RegressionMSR
from .permutation import PermutationShapley
from .proxy import ControlVariateLasso, ShrunkTwoFidelityShapley, TwoFidelityShapley
from .shapiq import PREFIX, approximator_estimator

__all__ = ("ESTIMATORS", "METHODS", "estimator_class", "interaction_settings", "is_exact", "is_method", "make_estimator", "methods_with", "register_estimator")

def _check_estimator(name: str, cls: object) -> None:
    if not hasattr(cls, "capabilities"):
        raise ConfigError(f"{getattr(cls, '__name__', type(cls).__name__)} declares no capabilities", field="method")


ESTIMATORS: Registry[type] = Registry(
    "method", field="method", check=_check_estimator, alternatives=", or shapiq:<Approximator>", choose="choose one of: "
)
"""Estimator classes by method name (the CLI's ``--method`` choices, in registration order).
``lasso`` is the LASSO surrogate in its two-fidelity-capable form
(:class:`~.proxy.ControlVariateLasso`: without a proxy game it is :class:`~.lasso.LassoSurrogate`);
``proxy-shapley`` is regression-msr's two-fidelity form (:class:`~.proxy.TwoFidelityShapley`),
``proxy-shapley-shrunk`` the same blended toward its control (:class:`~.proxy.ShrunkTwoFidelityShapley`)."""


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS``: the registered method names, in registration order, read live (PEP 562), so a
    method added by :func:`register_estimator` is in every later read, including the CLI's choices
    and help."""
    if name == "METHODS":
        return ESTIMATORS.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_estimator(name: str, cls: type, *, replace: bool = False) -> None:
    """Register an estimator class under ``name`` (it must declare ``capabilities`` and follow the
    :class:`~coalescence.attribution.estimators.base.Estimator` protocol).

    Raises:
        ConfigError: ``cls`` declares no capabilities, or ``name`` is already registered to another
            class while ``replace`` is false (field ``method``).
    """
    ESTIMATORS.register(name, cls, replace=replace)


for _name, _cls in (
    ("exact", ExactShapley),
    ("permutation", PermutationShapley),
    ("loo", LeaveOneOut),
    ("kernelshap", KernelSHAP),
    ("regression-msr", RegressionMSR),
    ("banzhaf", Banzhaf),
    ("lasso", ControlVariateLasso),
    ("proxy-shapley", TwoFidelityShapley),
    ("proxy-shapley-shrunk", ShrunkTwoFidelityShapley),
    ("auto", AutoMethod),
    ("default", DefaultMethod),
):
    register_estimator(_name, _cls)
del _name, _cls


def is_exact(method: object) -> bool:
    """Whether ``method`` (a method name, as a document records it) is computed from every
    coalition, with no sampling error: its class's capabilities say ``exact``."""
    cls = ESTIMATORS.get(method) if isinstance(method, str) else None
    return cls is not None and bool(getattr(cls.capabilities, "exact", False))


def estimator_class(method: str) -> type:
    """The estimator class registered as ``method``, or made for a shapiq approximator
    (``"shapiq:<Approximator>"``, :mod:`.shapiq`).

    Raises:
        ConfigError: unknown method (field ``method``).
        BackendUnavailable: a shapiq method without shapiq installed (naming the install command).
    """
    if isinstance(method, str) and method.startswith(PREFIX):
        return approximator_estimator(method)
    return ESTIMATORS.lookup(method)


def is_method(method: object) -> bool:
    """Whether ``method`` names a registered method or has the shapiq prefix (checked in full by
    :func:`estimator_class`)."""
    return isinstance(method, str) and (method in ESTIMATORS or method.startswith(PREFIX))


def methods_with(**wanted: bool) -> tuple[str, ...]:
    """The method names whose capabilities have the given values, e.g. ``methods_with(reports_stderr=True)``."""
    return tuple(name for name, cls in ESTIMATORS.items() if all(getattr(cls.capabilities, k) == v for k, v in wanted.items()))


def interaction_settings(method: str, interactions: int | None, index: str | None) -> tuple[int | None, str | None]:
    """Check the interactions asked of ``method`` and fill the default index.

    Args:
        method: the method name.
        interactions: the highest interaction order (2 or more), or ``None``.
        index: the interaction index, or ``None`` for the default ``"k-SII"``.

    Returns:
        ``(order, index)``, or ``(None, None)`` when no interactions are asked for.

    Raises:
        ConfigError: an index without an order, an order below 2, a method that computes no
            interactions or not this index (``field`` ``interactions`` / ``index``).
    """
    if interactions is None:
        return check_interactions(method, interactions, index, ())
    indices = estimator_class(method).capabilities.interaction_indices
    if not indices:
        able = [name for name, c in ESTIMATORS.items() if c.capabilities.interaction_indices]
        raise ConfigError(
            f"method {method} computes no interactions; use method {' or '.join(able)}, or a shapiq "
            "interaction approximator (e.g. shapiq:KernelSHAPIQ, shapiq:SVARMIQ)",
            field="interactions",
        )
    return check_interactions(method, interactions, index, indices)


def make_estimator(
    method: str,
    *,
    budget: int | None = None,
    seed: int = 0,
    interactions: int | None = None,
    index: str | None = None,
    proxy_budget: int | None = None,
) -> Estimator:
    """Build an estimator by name.

    Args:
        method: a registered name (:data:`ESTIMATORS`) or ``"shapiq:<Approximator>"``.
        budget: the most distinct coalitions (model evaluations), for the methods whose
            capabilities say ``needs_budget``; ignored by the others (exact: always 2^n, loo:
            n + 2).
        seed: seed of the sampler's ``numpy.random.default_rng`` (shapiq's ``random_state``).
        interactions: the highest interaction order (2 or more) for a method whose capabilities
            list interaction indices; ``None`` for values only.
        index: the interaction index (default ``"k-SII"``).
        proxy_budget: the distinct proxy coalitions of a two-fidelity method (its capabilities
            say ``two_fidelity``; ``None``: the method's default, a multiple of ``budget``).

    Returns:
        an :class:`~coalescence.attribution.estimators.base.Estimator`.

    Raises:
        ConfigError: unknown method (field ``method``), a sampling method without a valid
            budget or with a bad seed (field ``budget`` / ``seed``), or interactions the method does
            not compute (field ``interactions`` / ``index``), or a proxy budget for a method that
            fits the exact game alone (field ``proxy_budget``).
    """
    cls = estimator_class(method)
    if proxy_budget is not None and not cls.capabilities.two_fidelity:
        raise ConfigError(f"method {method} fits the exact game alone; it takes no proxy budget", field="proxy_budget")
    extra: dict[str, object] = {}
    if interactions is not None or index is not None:
        interactions, index = interaction_settings(method, interactions, index)
        extra = {"interactions": interactions, "index": index}
    if cls is DefaultMethod:  # no budget: its plan is chosen by the game (its own docs)
        return cls(seed=seed, proxy_budget=proxy_budget)
    if not cls.capabilities.needs_budget:
        return cls(**extra)
    if budget is None:
        raise ConfigError(
            f"method {method} needs a budget of model evaluations; pass a budget (e.g. 2000)", field="budget"
        )
    if proxy_budget is not None:
        extra["proxy_budget"] = proxy_budget
    return cls(budget=budget, seed=seed, **extra)
