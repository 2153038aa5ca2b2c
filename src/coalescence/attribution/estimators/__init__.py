"""Attribution estimators: plan coalitions, fit values from the pool of evaluated coalitions.

:func:`make_estimator` builds one by name (``"exact"``, ``"permutation"``, ``"loo"``,
``"kernelshap"``, ``"regression-msr"``, ``"banzhaf"``, ``"lasso"``, ``"proxy-shapley"``, ``"proxy-shapley-shrunk"``, ``"auto"``); every estimator follows the :class:`Estimator`
protocol and returns an :class:`Estimate`.
"""

from __future__ import annotations

from .banzhaf import Banzhaf
from .base import Capabilities, Estimate, Estimator, pool_lookup
from .exact import ExactShapley
from .kernel import KernelSHAP
from .lasso import LassoSurrogate
from .loo import LeaveOneOut
from .msr import RegressionMSR
from .permutation import PermutationShapley
from .proxy import ControlVariateLasso, TwoFidelityShapley
from . import registry as _registry
from .registry import ESTIMATORS, estimator_class, interaction_settings, is_exact, is_method, make_estimator, methods_with, register_estimator

__all__ = (
    "ESTIMATORS",
    "METHODS",
    "Banzhaf",
    "Capabilities",
    "ControlVariateLasso",
    "Estimate",
    "Estimator",
    "ExactShapley",
    "KernelSHAP",
    "LassoSurrogate",
    "LeaveOneOut",
    "PermutationShapley",
    "RegressionMSR",
    "TwoFidelityShapley",
    "estimator_class",
    "interaction_settings",
    "is_exact",
    "is_method",
    "make_estimator",
    "methods_with",
    "pool_lookup",
    "register_estimator",
)


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS``, read live from the registry (a method registered later is in it)."""
    if name == "METHODS":
        return _registry.METHODS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
