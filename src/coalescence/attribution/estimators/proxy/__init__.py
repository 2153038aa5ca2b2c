"""Two-fidelity estimators: the exact game v on few coalitions, a cheap proxy game c on many.

A *proxy game* c(S) is a cheaper utility that correlates with the exact one v(S) (issue 37: the
answer scored over one shared KV with the absent players masked out of the tail's attention;
Pearson 0.97 against the exact game on a long RAG conversation). The engine evaluates the exact
game on an estimator's ``plan(n)`` and the proxy game on the union of ``proxy_plan(n)`` and
``plan(n)`` (so that c is known on every exact coalition), and calls
``fit_two_fidelity(masks, utilities, proxy_masks, proxy_utilities)``. Every estimate is of the
EXACT game; the proxy only reduces its error. Without a proxy, ``fit`` is the exact-only method.

The control-variate surrogate is :mod:`.lasso`'s, the Shapley estimator :mod:`.shapley`'s (each
module's docstring has its mathematics; :mod:`.blend` the Shapley estimate shrunk toward its
control, ``proxy-shapley-shrunk``); :mod:`.common` what they share. :mod:`.guided` draws the
exact coalitions from a proxy-guided distribution when the proxy is known on all 2^n coalitions
first (on arrays only: the engine plays the exact plan first).

Both estimators report in ``diagnostics``: ``b`` (the proxy's coefficient), ``proxy_pearson`` and
``proxy_spearman`` (the correlation of c and v on the exact coalitions), ``proxy_evaluations`` (the
proxy plan's distinct coalitions) and ``exact_evaluations``.
"""

from .common import (
    PROXY_BUDGET_MULTIPLE,
    PROXY_PER_PLAYER,
    _check_proxy_budget,
    default_proxy_budget,
    proxy_budget_notes,
    proxy_correlation,
    proxy_pools,
    proxy_seed,
)
from .blend import Blend, ShrunkTwoFidelityShapley, shrunk_shapley
from .guided import GUIDE_MIX, GuidedPlan, guide_probabilities, guided_plan, guided_shapley
from .lasso import (
    CORRECTIONS,
    PROXY_FITS,
    RIDGE_PENALTY,
    ControlVariateLasso,
    fit_lasso_with_covariate,
    fit_ridge_with_covariate,
    ridge_penalties,
)
from .shapley import (
    CONTROLS,
    LINEAR_ROWS_PER_TERM,
    RIDGE_SCALE,
    WEIGHTINGS,
    CrossFit,
    TwoFidelityShapley,
    cross_fitted_shapley,
    default_ridge,
)

__all__ = (
    "Blend",
    "ShrunkTwoFidelityShapley",
    "shrunk_shapley",
    "CONTROLS",
    "GUIDE_MIX",
    "GuidedPlan",
    "guide_probabilities",
    "guided_plan",
    "guided_shapley",
    "CORRECTIONS",
    "LINEAR_ROWS_PER_TERM",
    "RIDGE_PENALTY",
    "RIDGE_SCALE",
    "WEIGHTINGS",
    "default_ridge",
    "fit_ridge_with_covariate",
    "ridge_penalties",
    "CrossFit",
    "cross_fitted_shapley",
    "PROXY_BUDGET_MULTIPLE",
    "PROXY_PER_PLAYER",
    "default_proxy_budget",
    "proxy_budget_notes",
    "PROXY_FITS",
    "ControlVariateLasso",
    "TwoFidelityShapley",
    "fit_lasso_with_covariate",
    "proxy_pools",
    "proxy_seed",
    "proxy_correlation",
)
