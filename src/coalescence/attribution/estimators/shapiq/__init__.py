"""shapiq's approximators as coalescence methods (``--method shapiq:<Approximator>``), and exact
interaction indices; the only package that imports shapiq (through :mod:`.library`).

shapiq (Muschalik, Fumagalli et al., "shapiq: Shapley Interactions for Machine Learning", NeurIPS
2024 Datasets and Benchmarks; PyPI ``shapiq``) implements the field's approximators of Shapley values
and Shapley interactions: KernelSHAP (Lundberg & Lee 2017), Unbiased KernelSHAP (Covert & Lee 2021),
SVARM and SVARM-IQ (Kolpaczki et al. 2024), SHAP-IQ (Fumagalli et al. 2023), KernelSHAP-IQ
(Fumagalli et al. 2024), k-additive SHAP (Pelegrina et al. 2023), permutation sampling (Castro et al.
2009; Tsai et al. 2023 for STII), stratified and Owen sampling, SPEX and ProxySPEX (Kang et al. 2025;
Butler et al. 2025), regression FSII (Faith-Shap, Tsai et al. 2023).

**How an approximator plays on the engine.** coalescence's estimators plan their coalitions before
the model runs, then fit from the pool (:mod:`..base`). A shapiq approximator asks for coalitions
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

Modules: :mod:`.library` (loading shapiq), :mod:`.naming` (method names to estimator classes),
:mod:`.estimator` (plan and fit), :mod:`.inprocess` and :mod:`.external` (the two runners: shapiq in
this Python, or in another one through ``_worker.py``).
"""

from __future__ import annotations

from ...interactions import EFFICIENT_INDICES, INTERACTION_INDICES
from .estimator import ShapiqEstimator
from .external import ENV_PYTHON, LINK_NAME, NEWER_APPROXIMATORS, ExternalShapiq, external_shapiq
from .inprocess import exact_interactions
from .library import INSTALL, PREFIX, shapiq_version
from .naming import approximator_estimator, approximator_names

__all__ = (
    "EFFICIENT_INDICES",
    "ENV_PYTHON",
    "INSTALL",
    "INTERACTION_INDICES",
    "LINK_NAME",
    "NEWER_APPROXIMATORS",
    "PREFIX",
    "ExternalShapiq",
    "ShapiqEstimator",
    "approximator_estimator",
    "approximator_names",
    "exact_interactions",
    "external_shapiq",
    "shapiq_version",
)
