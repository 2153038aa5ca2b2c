"""Attribution estimators: plan coalitions, fit values from the pool of evaluated coalitions.

:func:`make_estimator` builds one by name (``"exact"``, ``"permutation"``, ``"loo"``,
``"kernelshap"``, ``"banzhaf"``, ``"lasso"``); every estimator follows the :class:`Estimator`
protocol and returns an :class:`Estimate`.
"""

from __future__ import annotations

from .banzhaf import Banzhaf
from .base import METHODS, Estimate, Estimator, make_estimator, pool_lookup
from .exact import ExactShapley
from .kernel import KernelSHAP
from .lasso import LassoSurrogate
from .loo import LeaveOneOut
from .permutation import PermutationShapley

__all__ = (
    "METHODS",
    "Banzhaf",
    "Estimate",
    "Estimator",
    "ExactShapley",
    "KernelSHAP",
    "LassoSurrogate",
    "LeaveOneOut",
    "PermutationShapley",
    "make_estimator",
    "pool_lookup",
)
