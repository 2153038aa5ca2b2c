"""Attribution estimators: plan coalitions, fit values from the pool of evaluated coalitions.

:func:`make_estimator` builds one by name (``"exact"``, ``"permutation"``, ``"loo"``); every
estimator follows the :class:`Estimator` protocol and returns an :class:`Estimate`.
"""

from __future__ import annotations

from .base import METHODS, Estimate, Estimator, make_estimator, pool_lookup
from .exact import ExactShapley
from .loo import LeaveOneOut
from .permutation import PermutationShapley

__all__ = (
    "METHODS",
    "Estimate",
    "Estimator",
    "ExactShapley",
    "LeaveOneOut",
    "PermutationShapley",
    "make_estimator",
    "pool_lookup",
)
