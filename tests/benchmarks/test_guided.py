"""The proxy-guided plan (benchmarks/guided.py, research code moved out of the package in issue 48):
KernelSHAP's distribution by hand (n = 4), closed-form Shapley values of the dividend games
(tests/helpers/dividend_games.py), and the module docs' rule (a defensive mixture: q >= mix *
q_kernel, q(S) = q(N minus S)). Moved here unchanged from tests/attribution/estimators/test_two_fidelity.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.dividend_games import C, MASKS, N, NOISE, PHI, V, dividend_game, every_coalition, play, shapley_of

from coalescence.attribution.estimators import ExactShapley
from coalescence.errors import ConfigError, EstimatorError

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "guided.py"
_spec = importlib.util.spec_from_file_location("benchmarks_guided", _PATH)
assert _spec is not None and _spec.loader is not None
guided = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = guided  # a dataclass module must be importable by name while it loads
_spec.loader.exec_module(guided)
guide_probabilities, guided_plan, guided_shapley = guided.guide_probabilities, guided.guided_plan, guided.guided_shapley


def kernel_by_hand(masks: np.ndarray) -> np.ndarray:
    """n = 4: size k drawn with probability (1/(k (4 - k))) / (1/3 + 1/4 + 1/3) = 4/11, 3/11, 4/11,
    then a uniform coalition of that size: 1/11 per singleton and triple, 1/22 per pair."""
    size = masks.sum(axis=1)
    return np.select([size == 1, size == 2, size == 3], [1 / 11, 1 / 22, 1 / 11], 0.0)


def test_mix_one_is_kernelshaps_distribution_by_hand():
    masks = every_coalition(4)
    c = np.random.default_rng(0).normal(size=16)
    np.testing.assert_allclose(guide_probabilities(masks, c, mix=1.0), kernel_by_hand(masks), rtol=1e-12, atol=0)


def test_an_additive_proxy_guides_nowhere():
    masks = every_coalition(4)
    c = 0.7 + masks @ np.array([1.0, -2.0, 0.5, 3.0])  # no residual after the additive fit
    np.testing.assert_allclose(guide_probabilities(masks, c, mix=0.3), kernel_by_hand(masks), rtol=1e-9, atol=1e-15)


def test_the_guided_distribution_is_a_symmetric_defensive_mixture():
    q = guide_probabilities(MASKS, C, mix=0.3)
    kernel = guide_probabilities(MASKS, C, mix=1.0)
    code = MASKS.astype(int) @ (1 << np.arange(N))
    complement = np.argsort(code)[(1 << N) - 1 - code]  # the row of N minus S (rows in code order here)
    assert q.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(q, q[complement], rtol=1e-12)
    assert np.all(q >= 0.3 * kernel - 1e-15)
    assert q[0] == 0 and q[-1] == 0  # empty and grand coalitions are never drawn
    assert np.max(np.abs(q - kernel)) > 0.1 * kernel.max()  # it does guide


def test_the_plan_draws_complement_pairs_within_the_budget():
    plan = guided_plan(MASKS, C, budget=40, seed=3, mix=0.5)
    assert plan.rows.shape[0] <= 40
    assert not plan.rows[0].any() and plan.rows[1].all()
    assert len({r.tobytes() for r in plan.rows}) == plan.rows.shape[0]
    np.testing.assert_array_equal(plan.rows[plan.pairs[:, 0]], ~plan.rows[plan.pairs[:, 1]])
    assert plan.pairs.shape[0] >= (plan.rows.shape[0] - 2) // 2


def test_a_game_the_control_spans_is_recovered_exactly():
    terms, v0 = dividend_game(N, seed=21)
    c = play(terms, v0, MASKS)
    beta = np.linspace(-1.0, 1.0, N)
    v = 3.0 + 2.0 * c + MASKS @ beta  # a + b c + linear: the control's residual is zero
    phi_c = shapley_of(terms, N)
    for seed in range(3):
        plan = guided_plan(MASKS, c, budget=40, seed=seed, mix=0.5)
        rows = plan.rows.astype(int) @ (1 << np.arange(N))  # MASKS is in code order
        est = guided_shapley(plan, v[rows], c[rows], phi_c, ridge=0.0)  # least squares: the fit is v itself
        np.testing.assert_allclose(est.values, 2.0 * phi_c + beta, atol=1e-9)


@pytest.mark.parametrize("proxy", ["correlated", "noise"])
def test_unbiased_on_the_analytic_game_with_a_strongly_guided_plan(proxy):
    # mix 0.3: q is far from KernelSHAP's; with KernelSHAP's importance weights instead of 1 / q the
    # largest |z| is 6.7 with the noise proxy (its residual is large), 3.1 with the correlated one
    c = C if proxy == "correlated" else NOISE
    values, covered, seeds = [], 0, 200
    phi_c = ExactShapley().fit(MASKS, c).values  # an input (the proxy has no closed form); the check is against PHI
    for seed in range(seeds):
        plan = guided_plan(MASKS, c, budget=48, seed=seed, mix=0.3)
        rows = plan.rows.astype(int) @ (1 << np.arange(N))
        est = guided_shapley(plan, V[rows], c[rows], phi_c)
        assert est.values.sum() == pytest.approx(V[-1] - V[0], abs=1e-9)  # efficiency
        values.append(est.values)
        covered += int(np.sum(np.abs(est.values - PHI) <= 1.96 * est.stderr))
    values = np.array(values)
    z = (values.mean(axis=0) - PHI) / (values.std(axis=0, ddof=1) / np.sqrt(seeds))
    assert np.max(np.abs(z)) < 3.5, z
    assert covered / (seeds * N) > 0.85


def test_bad_input_names_the_field():
    with pytest.raises(ConfigError) as err:
        guide_probabilities(MASKS, C, mix=0.0)
    assert err.value.field == "mix"
    with pytest.raises(ConfigError) as err:
        guided_plan(MASKS, C, budget=1 << N, seed=0)
    assert err.value.field == "budget"
    with pytest.raises(EstimatorError, match="all 256 coalitions"):
        guide_probabilities(MASKS[:200], C[:200])
