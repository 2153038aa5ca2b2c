"""Estimate.from_values: the efficiency gap every estimator reports, by one rule stated here."""

import math

import numpy as np
import pytest

from coalescence.attribution.estimators import Estimate
from coalescence.errors import EstimatorError


def test_gap_is_the_sum_of_values_minus_the_grand_coalitions_gain() -> None:
    est = Estimate.from_values(method="loo", values=np.array([1.0, 2.0, -0.25]), v_empty=0.5, v_full=2.0, n_evaluations=5)
    assert est.efficiency_gap == pytest.approx((1.0 + 2.0 - 0.25) - (2.0 - 0.5))  # 1.25
    assert est.stderr is None and est.interactions == () and dict(est.diagnostics) == {}
    assert not est.values.flags.writeable and est.values.dtype == np.float64


def test_an_efficient_interaction_index_counts_its_interactions_in_the_total() -> None:
    values, pair = np.array([0.75, 0.5]), ((0, 1), 0.25)
    shared = Estimate.from_values(
        method="shapiq", values=values, v_empty=0.0, v_full=1.5, n_evaluations=4,
        interactions=(pair,), interaction_index="k-SII", interactions_share_total=True,
    )
    apart = Estimate.from_values(
        method="exact", values=values, v_empty=0.0, v_full=1.5, n_evaluations=4, interactions=(pair,), interaction_index="SII"
    )
    assert shared.efficiency_gap == pytest.approx(0.0)  # 0.75 + 0.5 + 0.25 = 1.5
    assert apart.efficiency_gap == pytest.approx(-0.25)  # the Shapley values alone: 1.25 - 1.5


def test_a_nan_value_makes_the_gap_nan_and_bad_shapes_are_refused() -> None:
    assert math.isnan(Estimate.from_values(method="banzhaf", values=[1.0, math.nan], v_empty=0, v_full=1, n_evaluations=3).efficiency_gap)
    with pytest.raises(EstimatorError, match="stderr shape"):
        Estimate.from_values(method="kernelshap", values=[1.0, 2.0], stderr=[0.1], v_empty=0, v_full=3, n_evaluations=3)
