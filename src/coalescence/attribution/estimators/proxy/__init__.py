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
control, ``proxy-shapley-shrunk``); :mod:`.common` what they share. This package exports what
the engine, the registry and the CLI use (the three estimators and the proxy budget's defaults);
the research helpers (the knob tables, the solvers, the cross-fit and blend records) are in their
modules, and the proxy-guided plan, which the engine never plays, is research code in
``benchmarks/guided.py``.

Both estimators report in ``diagnostics``: ``b`` (the proxy's coefficient), ``proxy_pearson`` and
``proxy_spearman`` (the correlation of c and v on the exact coalitions), ``proxy_evaluations`` (the
proxy plan's distinct coalitions) and ``exact_evaluations``.
"""

from .blend import ShrunkTwoFidelityShapley
from .common import PROXY_BUDGET_MULTIPLE, PROXY_PER_PLAYER, _check_proxy_budget, default_proxy_budget, proxy_seed
from .lasso import ControlVariateLasso
from .shapley import TwoFidelityShapley

__all__ = (
    "ControlVariateLasso",
    "ShrunkTwoFidelityShapley",
    "TwoFidelityShapley",
    "PROXY_BUDGET_MULTIPLE",
    "PROXY_PER_PLAYER",
    "default_proxy_budget",
    "proxy_seed",
)
