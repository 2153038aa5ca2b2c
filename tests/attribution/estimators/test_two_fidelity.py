"""Two-fidelity estimators (issue 37): an exact game on few coalitions, a correlated proxy on many.

The games are Harsanyi-dividend games, ``v(S) = v0 + sum_T d_T [T subset of S]`` over singletons,
pairs and triples (tests/helpers/dividend_games.py), whose Shapley values are written there in closed form (each dividend split
equally among its members: ``phi_i = sum_{T containing i} d_T / |T|``; Harsanyi 1963), never by
the package. The proxy is the game of other dividends plus a smooth nonlinear term (correlated,
biased: its own Shapley values are not v's), or independent noise (useless).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from coalescence.attribution.estimators import ExactShapley, RegressionMSR, make_estimator, methods_with
from coalescence.attribution.estimators.auto import AutoMethod
from coalescence.attribution.estimators.proxy import ControlVariateLasso, ShrunkTwoFidelityShapley, TwoFidelityShapley
from coalescence.attribution.estimators.proxy.lasso import fit_lasso_with_covariate, fit_ridge_with_covariate, ridge_penalties
from coalescence.attribution.estimators.proxy.shapley import fit_weights
from coalescence.errors import ConfigError, EstimatorError

from helpers.dividend_games import C, MASKS, N, NOISE, OTHER, PHI, THETA, V, dividend_game, every_coalition, play, shapley_of


def two_fidelity(budget: int, seed: int, proxy: np.ndarray = C, **options):
    return TwoFidelityShapley(budget=budget, seed=seed, **options).fit_two_fidelity(MASKS, V, MASKS, proxy)


def test_the_proxy_is_correlated_but_its_shapley_values_are_not_the_games() -> None:
    assert 0.85 < np.corrcoef(V, C)[0, 1] < 0.99
    np.testing.assert_allclose(PHI, _exact_shapley_of(V), atol=1e-12)  # the closed form, checked once
    assert np.max(np.abs(shapley_of(OTHER, N) - PHI)) > 0.2


def test_the_whole_exact_pool_gives_the_exact_shapley_values() -> None:
    estimate = two_fidelity(1 << N, seed=3)
    np.testing.assert_allclose(estimate.values, PHI, atol=1e-10)
    assert estimate.stderr is None and abs(estimate.efficiency_gap) < 1e-10
    assert estimate.n_evaluations == 1 << N and estimate.diagnostics["b"] == 0.0


def test_efficiency_and_diagnostics_on_a_sampled_plan() -> None:
    estimate = two_fidelity(40, seed=1)
    assert abs(estimate.efficiency_gap) < 1e-9  # every term keeps v(N) - v(empty)
    d = estimate.diagnostics
    assert d["exact_evaluations"] == estimate.n_evaluations <= 40
    assert d["proxy_evaluations"] == min(max(16 * 40, 16 * N), 1 << N)
    assert d["proxy_pearson"] == pytest.approx(np.corrcoef(V[_rows(40, 1)], C[_rows(40, 1)])[0, 1])
    assert 0.3 < d["b"] < 2.0
    assert np.all(np.isfinite(estimate.stderr)) and np.all(estimate.stderr > 0)
    assert "values are of the exact game" in estimate.notes[0]


@pytest.mark.parametrize(
    "estimator",
    [
        TwoFidelityShapley(budget=40, seed=1, proxy_budget=5_000),
        ShrunkTwoFidelityShapley(budget=40, seed=1, proxy_budget=5_000),
        ControlVariateLasso(budget=24, seed=1, proxy_budget=5_000),
    ],
    ids=lambda e: e.name,
)
def test_a_proxy_budget_above_every_coalition_plays_each_once_and_says_so(estimator) -> None:
    proxy_plan = np.array(list(estimator.proxy_plan(N)), dtype=bool)
    assert len({row.tobytes() for row in proxy_plan}) == len(proxy_plan) == 1 << N  # 256, not 5,000
    estimate = estimator.fit_two_fidelity(MASKS, V, MASKS, C)
    assert estimate.diagnostics["proxy_evaluations"] == 1 << N
    said = [note for note in estimate.notes if "5000" in note]
    assert len(said) == 1 and "256 coalitions of 8 players" in said[0]
    # a budget within 2^n says nothing of it
    within = type(estimator)(budget=estimator.budget, seed=1, proxy_budget=200).fit_two_fidelity(MASKS, V, MASKS, C)
    assert not [note for note in within.notes if "proxy budget" in note]


def _rows(budget: int, seed: int) -> np.ndarray:
    """Row indices in MASKS of the exact plan's coalitions."""
    plan = np.array(list(TwoFidelityShapley(budget=budget, seed=seed).plan(N)))
    return plan @ (1 << np.arange(N))


SEEDS = range(200)


@pytest.fixture(scope="module")
def draws() -> dict:
    """Two-fidelity estimates over 200 seeds at budgets 24, 48 and 96, the in-sample form's at 48,
    and the proxy-only ones."""
    out = {}
    for budget in (24, 48, 96):
        est = [two_fidelity(budget, seed) for seed in SEEDS]
        out[budget] = (np.array([e.values for e in est]), np.array([e.stderr for e in est]))
    proxy_only = np.array(
        [RegressionMSR(budget=16 * 24, seed=s).fit(MASKS, C).values for s in range(20)]
    )
    out["proxy-only"] = proxy_only
    out["in-sample"] = np.array([two_fidelity(48, seed, cross_fit=False).values for seed in SEEDS])
    return out


def test_the_error_falls_as_the_exact_budget_grows(draws) -> None:
    errors = [np.median(np.linalg.norm(draws[b][0] - PHI, axis=1)) for b in (24, 48, 96)]
    assert errors[0] > 1.3 * errors[1] > 1.3 * 1.3 * errors[2], errors


@pytest.mark.parametrize("budget", [24, 48, 96])
def test_the_mean_over_seeds_is_the_exact_shapley_value(draws, budget) -> None:
    """Unbiased: over 200 seeds the mean is within 3.5 of its standard errors of the closed form,
    for every player. Biased estimators fail the same check: the proxy's own values (what a
    proxy-only estimate converges to), and at 48 the in-sample form (b fitted on the same
    coalitions, regression-msr of v - b c: 4.1 standard errors off)."""
    values = draws[budget][0]
    mean, sem = values.mean(axis=0), values.std(axis=0, ddof=1) / np.sqrt(values.shape[0])
    assert np.all(np.abs(mean - PHI) <= 3.5 * sem), (mean - PHI) / sem
    proxy_only = draws["proxy-only"]
    assert np.any(np.abs(proxy_only.mean(axis=0) - PHI) > 3.5 * sem)
    if budget == 48:
        in_sample = draws["in-sample"]
        z = np.abs(in_sample.mean(axis=0) - PHI) / (in_sample.std(axis=0, ddof=1) / np.sqrt(in_sample.shape[0]))
        assert np.max(z) > 3.5, z


def test_the_standard_errors_cover_about_95_percent(draws) -> None:
    for budget in (24, 48, 96):
        values, stderr = draws[budget]
        inside = np.abs(values - PHI) <= 1.959963984540054 * stderr
        assert 0.90 <= inside.mean() <= 0.99, (budget, inside.mean())


def test_a_useless_proxy_costs_little() -> None:
    """With independent noise as the proxy, from 6n exact coalitions the median error over 40 seeds
    is at most 1.25 times regression-msr's on the same coalitions (the control is then
    ``a + sum beta_i z_i`` fitted without the pair it corrects; measured 0.97-1.10x here)."""
    for budget in (48, 96):
        ours = np.median([np.linalg.norm(two_fidelity(budget, s, proxy=NOISE).values - PHI) for s in range(40)])
        exact_only = np.median([np.linalg.norm(RegressionMSR(budget=budget, seed=s).fit(MASKS, V).values - PHI) for s in range(40)])
        assert ours <= 1.5 * exact_only, (budget, ours, exact_only)


def test_a_good_proxy_beats_the_exact_game_alone() -> None:
    """Median error over 40 seeds against regression-msr's on the same exact coalitions: below it at
    3n (the control is a + b c there, measured 0.89x), under half of it at 6n (0.22x)."""
    for budget, most in ((24, 1.0), (48, 0.5)):
        ours = np.median([np.linalg.norm(two_fidelity(budget, s).values - PHI) for s in range(40)])
        exact_only = np.median([np.linalg.norm(RegressionMSR(budget=budget, seed=s).fit(MASKS, V).values - PHI) for s in range(40)])
        assert ours <= most * exact_only, (budget, ours, exact_only)


def test_the_ridged_control_helps_below_the_least_squares_regime() -> None:
    """At 3n exact coalitions (fewer than the 3 (n + 2) least squares needs for the linear terms)
    the default control is a + b c + sum beta_i z_i with the beta ridged: median error over 40 seeds
    at most 0.8 of regression-msr's (measured 0.69; the least-squares control a + b c, the only
    one before, 0.89)."""
    ours = np.median([np.linalg.norm(two_fidelity(24, s).values - PHI) for s in range(40)])
    exact_only = np.median([np.linalg.norm(RegressionMSR(budget=24, seed=s).fit(MASKS, V).values - PHI) for s in range(40)])
    assert ours <= 0.8 * exact_only, (ours, exact_only)


def test_the_control_weighs_each_coalition_by_its_draws_and_its_size() -> None:
    """Hand-computed: n = 4, the pair ({0}, {1,2,3}) drawn twice and ({0,1}, {2,3}) once; a proper
    coalition counts its draws times |S| (n - |S|) / n, the empty and grand coalitions 1."""
    rows = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=bool)
    pairs = np.array([[2, 3], [2, 3], [4, 5]])
    enumerated = np.zeros(0, dtype=np.int64)
    np.testing.assert_allclose(fit_weights(rows, pairs, enumerated), [1, 1, 2 * 3 / 4, 2 * 3 / 4, 1, 1])
    np.testing.assert_allclose(fit_weights(rows, pairs, enumerated, "draws"), [1, 1, 2, 2, 1, 1])


def test_the_proxy_must_cover_the_exact_coalitions() -> None:
    rows = _rows(40, 0)
    keep = np.ones(MASKS.shape[0], dtype=bool)
    keep[rows[5]] = False
    with pytest.raises(EstimatorError, match="proxy game must be evaluated on the exact plan's coalitions"):
        TwoFidelityShapley(budget=40, seed=0).fit_two_fidelity(MASKS, V, MASKS[keep], C[keep])


def test_the_proxy_plan_is_seeded_apart_from_the_exact_plan() -> None:
    """The proxy's coalitions are drawn by another seed than the exact ones (independent pools):
    KernelSHAP's plan at the proxy budget, not the exact plan's seed's."""
    estimator = TwoFidelityShapley(budget=40, seed=0, proxy_budget=120)
    proxy = [r.tobytes() for r in estimator.proxy_plan(N)]
    assert len(proxy) == 120 and len(set(proxy)) == 120
    same_seed = [r.tobytes() for r in RegressionMSR(budget=120, seed=0).plan(N)]
    assert set(proxy) != set(same_seed)
    assert proxy == [r.tobytes() for r in TwoFidelityShapley(budget=40, seed=0, proxy_budget=120).proxy_plan(N)]


# --- the control-variate LASSO ---------------------------------------------------------------

def test_the_covariate_is_not_penalised() -> None:
    """With a penalty that zeroes every player, (a, b) are still the least-squares fit of v on
    [1, c] (numpy.polyfit), not shrunk."""
    rng = np.random.default_rng(0)
    x = (rng.random((40, 10)) < 0.5).astype(float)
    c = rng.normal(size=40)
    y = 2.0 + 3.0 * c + x @ rng.normal(size=10) * 0.1
    w, a, b, _ = fit_lasso_with_covariate(x, y, c, alpha=1e6)
    assert np.all(w == 0)
    slope, intercept = np.polyfit(c, y, 1)
    assert b == pytest.approx(slope, rel=1e-10) and a == pytest.approx(intercept, rel=1e-10)


def test_the_ridge_correction_is_penalised_least_squares_with_a_and_b_free() -> None:
    """fit_ridge_with_covariate against the augmented least-squares form of ridge regression: the
    rows [1, c, x] plus one row sqrt(p_i) e_i (target 0) per player, a and b unpenalised (numpy
    lstsq); and ridge_penalties by hand: 10 / (|phi_i| / mean |phi| + 1/2)."""
    rng = np.random.default_rng(3)
    x = (rng.random((12, 6)) < 0.5).astype(float)
    c = rng.normal(size=12)
    y = 1.0 + 2.0 * c + x @ rng.normal(size=6) + rng.normal(0.0, 0.1, size=12)
    penalties = np.array([0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    w, a, b = fit_ridge_with_covariate(x, y, c, penalties)
    design = np.vstack([np.column_stack([np.ones(12), c, x]), np.hstack([np.zeros((6, 2)), np.diag(np.sqrt(penalties))])])
    reference = np.linalg.lstsq(design, np.r_[y, np.zeros(6)], rcond=None)[0]
    np.testing.assert_allclose(np.r_[a, b, w], reference, atol=1e-10)
    phi_c = np.array([1.0, -3.0, 0.0, 2.0])  # mean |phi| = 1.5
    np.testing.assert_allclose(ridge_penalties(phi_c), [10 / (1 / 1.5 + 0.5), 10 / 2.5, 10 / 0.5, 10 / (2 / 1.5 + 0.5)])
    np.testing.assert_allclose(ridge_penalties(np.zeros(3)), [10.0, 10.0, 10.0])


def test_the_default_surrogate_is_the_scaled_proxy_when_the_proxy_explains_the_game() -> None:
    """v = 0.7 c + 0.3 exactly: the ridge correction is 0, b = 0.7, and phi(c) by least squares on
    every coalition is c's Banzhaf value (each dividend d_T split as d_T / 2^(|T| - 1) to each
    member), so the values are 0.7 times it."""
    n = 10
    masks = every_coalition(n)
    terms, _ = dividend_game(n, seed=5, scale=0.5)
    c = play(terms, -2.0, masks)
    v = 0.7 * c + 0.3
    banzhaf_c = np.zeros(n)
    for players, d in terms.items():
        banzhaf_c[list(players)] += d / 2 ** (len(players) - 1)
    estimate = ControlVariateLasso(budget=24, seed=1, holdout=0.0, proxy_budget=1 << n).fit_two_fidelity(masks, v, masks, c)
    np.testing.assert_allclose(estimate.values, 0.7 * banzhaf_c, atol=1e-9)
    assert estimate.diagnostics["b"] == pytest.approx(0.7, abs=1e-12)
    assert estimate.diagnostics["proxy_used"] == 1.0


def test_a_game_of_few_coalitions_fits_all_of_them_with_the_proxy() -> None:
    """Two players: 4 coalitions, of which the default holdout (0.2) would keep 1 back, too few for
    an LDS: all 4 are fitted with the proxy game as the control variate (a, b and the two w's under
    the ridge), and a note says there is no held-out LDS."""
    masks = every_coalition(2)
    v = np.array([0.0, 1.0, 2.0, 3.5])
    c = np.array([0.1, 0.9, 2.2, 3.0])
    estimate = ControlVariateLasso(budget=4, seed=0, proxy_budget=4).fit_two_fidelity(masks, v, masks, c)
    assert estimate.diagnostics["proxy_used"] == 1.0
    assert estimate.diagnostics["n_train"] == 4 and estimate.diagnostics["n_heldout"] == 0
    assert any(note.startswith("no held-out LDS: 1 of 4 exact coalitions") for note in estimate.notes)


def test_the_proxy_plan_holds_a_near_full_half() -> None:
    """20 players, 8 exact coalitions: the default proxy plan of max(16 x 8, 4 x 20) = 128 distinct
    coalitions is the keep-half plan's first 64 (the empty and full coalitions first, each player
    kept about half the time) and 64 more that keep each player with probability 0.8; with
    near_full_share=0 it is the proxy surrogate's keep-half plan alone, with 0.25 its first 96 and
    32 near-full ones. Seeded: the same plan twice."""
    n = 20
    plan = np.array(list(ControlVariateLasso(budget=8, seed=3).proxy_plan(n)), dtype=bool)
    assert plan.shape == (128, n) and len({row.tobytes() for row in plan}) == 128
    assert not plan[0].any() and plan[1].all()
    half, near = plan[2:64], plan[64:]
    assert 0.44 < half.mean() < 0.56 and 0.76 < near.mean() < 0.84  # 1,240 and 1,280 Bernoulli draws
    assert np.all((near.sum(axis=1) > 0) & (near.sum(axis=1) < n))
    keep_half = np.array(list(ControlVariateLasso(budget=8, seed=3, near_full_share=0.0).proxy_plan(n)), dtype=bool)
    assert keep_half.shape == (128, n) and np.array_equal(keep_half[:64], plan[:64]) and 0.45 < keep_half.mean() < 0.55
    quarter = np.array(list(ControlVariateLasso(budget=8, seed=3, near_full_share=0.25).proxy_plan(n)), dtype=bool)
    assert quarter.shape == (128, n) and np.array_equal(quarter[:96], keep_half[:96])
    assert 0.76 < quarter[96:].mean() < 0.84  # 640 draws
    assert np.array_equal(plan, np.array(list(ControlVariateLasso(budget=8, seed=3).proxy_plan(n)), dtype=bool))


def test_the_near_full_share_fits_an_additive_proxy_exactly() -> None:
    """An additive proxy c = 1 + x . beta and v = 2 c - 1 on 20 players: whatever the mix of
    keep-half and near-full coalitions, least squares recovers beta, b = 2 and w = 0, so the values
    are 2 beta; the plan's near-full rows are what it fits (a pool without them is refused, naming the plan)."""
    n = 20
    rng = np.random.default_rng(8)
    beta = rng.normal(size=n)
    estimator = ControlVariateLasso(budget=16, seed=2, proxy_budget=400, proxy_fit="least-squares")
    rows = np.array(list(estimator.proxy_plan(n)) + list(estimator.plan(n)), dtype=bool)
    c = 1.0 + rows @ beta
    exact = np.array(list(estimator.plan(n)), dtype=bool)
    estimate = estimator.fit_two_fidelity(exact, 2.0 * (1.0 + exact @ beta) - 1.0, rows, c)
    np.testing.assert_allclose(estimate.values, 2.0 * beta, atol=1e-8)
    assert estimate.diagnostics["b"] == pytest.approx(2.0) and estimate.diagnostics["proxy_evaluations"] == 400
    keep_half_only = np.concatenate([rows[:200], exact])  # the plan's last 200, the near-full ones, gone
    with pytest.raises(EstimatorError, match="proxy game's plan"):
        estimator.fit_two_fidelity(exact, 2.0 * (1.0 + exact @ beta) - 1.0, keep_half_only, 1.0 + keep_half_only @ beta)


@pytest.mark.parametrize("share", [1.0, -0.1, True, "a quarter"])
def test_a_near_full_share_outside_0_to_1_is_refused(share) -> None:
    with pytest.raises(ConfigError) as info:
        ControlVariateLasso(budget=8, seed=0, near_full_share=share)
    assert info.value.field == "near_full_share"


def test_control_variate_lasso_recovers_planted_weights() -> None:
    """v = b c + sparse additive + const: phi = b phi(c) + w, with phi(c) the proxy's best linear
    predictor over keep-half coalitions, its Banzhaf values (here the dividends split in
    halves, thirds... by the uniform distribution: d_T / 2^(|T| - 1) to each member). The L1
    correction (``correction="lasso"``) finds the sparse w."""
    n = 12
    masks = every_coalition(n)
    terms, _ = dividend_game(n, seed=3, scale=0.5)
    c = play(terms, 0.0, masks)
    planted = np.zeros(n)
    planted[[1, 4, 7]] = [2.0, -1.5, 1.0]
    v = 0.7 * c + masks @ planted + 0.3
    banzhaf_c = np.zeros(n)
    for players, d in terms.items():
        banzhaf_c[list(players)] += d / 2 ** (len(players) - 1)
    estimate = ControlVariateLasso(budget=64, seed=0, holdout=0.0, proxy_budget=1 << n, correction="lasso").fit_two_fidelity(
        masks, v, masks, c
    )
    np.testing.assert_allclose(estimate.values, 0.7 * banzhaf_c + planted, atol=0.02)
    assert estimate.diagnostics["b"] == pytest.approx(0.7, abs=0.01)
    assert estimate.diagnostics["nonzero"] <= 5
    exact_only = ControlVariateLasso(budget=64, seed=0, holdout=0.0).fit(masks, v)  # the LASSO alone misses it
    assert np.max(np.abs(exact_only.values - (0.7 * banzhaf_c + planted))) > 0.1


def test_control_variate_lasso_lds_beats_the_lasso_alone_on_a_small_budget() -> None:
    """The attributions' LDS (Spearman of sum_{i in S} phi_i with v(S)) over every coalition, 6 seeds."""
    n = 12
    masks = every_coalition(n)
    terms, _ = dividend_game(n, seed=4)
    v = play(terms, 0.0, masks)
    other = {t: 0.8 * d + float(np.random.default_rng(5).normal(0.0, 0.3)) for t, d in terms.items()}
    c = play(other, 0.0, masks) + 0.5 * np.sin(masks @ np.random.default_rng(6).normal(0.0, 0.4, size=n))
    def lds(values: np.ndarray) -> float:
        predicted = masks @ values
        return 0.0 if np.ptp(predicted) == 0 else float(spearmanr(predicted, v).statistic)

    ours, alone = [], []
    for seed in range(6):
        est = ControlVariateLasso(budget=16, seed=seed, holdout=0.0, proxy_budget=256)
        ours.append(lds(est.fit_two_fidelity(masks, v, masks, c).values))
        alone.append(lds(est.fit(masks, v).values))
    assert np.median(ours) > np.median(alone) + 0.05, (np.median(ours), np.median(alone))  # measured 0.91 against 0.68


def test_the_surrogate_takes_8_exact_coalitions_only_with_the_proxy_game() -> None:
    """The floor: 16 exact coalitions on exact rows alone (the LASSO's), 8 with the proxy game as
    the control variate; min(floor, 2^n) on a small game; auto's surrogate follows it."""
    n = 40
    for est in (ControlVariateLasso(budget=8, seed=0, holdout=0.0), AutoMethod(budget=8, seed=0)):
        est.validate(n, proxy=True)
        with pytest.raises(ConfigError) as caught:
            est.validate(n)
        assert caught.value.field == "budget" and "below the minimum of 16" in caught.value.message
        assert "8 where the proxy game is played" in caught.value.message
        rows = np.array(list(est.plan(n)))  # the plan itself goes down to the two-fidelity floor
        assert rows.shape == (8, n) and len({r.tobytes() for r in rows}) == 8
        assert {int(r.sum()) for r in rows} >= {0, n}  # the empty and grand coalitions
    with pytest.raises(ConfigError, match="minimum of 8 .* with the proxy game"):
        ControlVariateLasso(budget=7, seed=0).validate(n, proxy=True)
    ControlVariateLasso(budget=4, seed=0).validate(2, proxy=True)  # 2^2 coalitions: all of them
    ControlVariateLasso(budget=4, seed=0).validate(2)
    with pytest.raises(ConfigError) as caught:  # a proxy budget below its own fit's floor names itself
        ControlVariateLasso(budget=8, seed=0, proxy_budget=4).validate(n, proxy=True)
    assert caught.value.field == "proxy_budget"


def test_8_exact_coalitions_recover_an_additive_game_through_its_proxy() -> None:
    """v additive with planted weights, the proxy an affine copy c = 2 v + 1 on 400 proxy
    coalitions (least squares of c: exact): 8 exact coalitions fit a and b = 1/2, the correction
    has nothing left, and the values are the planted weights. The exact rows alone (16 at least)
    cannot get near them."""
    n = 40
    weights = np.random.default_rng(3).normal(0.0, 1.0, size=n)

    def v(masks: np.ndarray) -> np.ndarray:
        return masks.astype(float) @ weights + 0.3

    est = ControlVariateLasso(budget=8, seed=1, holdout=0.0, proxy_budget=400)
    exact = np.array(list(est.plan(n)))
    proxy = np.concatenate([np.array(list(est.proxy_plan(n))), exact])
    got = est.fit_two_fidelity(exact, v(exact), proxy, 2.0 * v(proxy) + 1.0)
    np.testing.assert_allclose(got.values, weights, atol=1e-6)
    assert got.n_evaluations == 8 and got.diagnostics["b"] == pytest.approx(0.5, abs=1e-9)
    # lasso's default holdout (0.2) would keep 2 of the 8 back, too few for an LDS: all 8 are fitted
    held = ControlVariateLasso(budget=8, seed=1, proxy_budget=400).fit_two_fidelity(exact, v(exact), proxy, 2.0 * v(proxy) + 1.0)
    assert held.diagnostics["n_train"] == 8 and held.diagnostics["n_heldout"] == 0 and np.isnan(held.diagnostics["lds"])
    np.testing.assert_allclose(held.values, got.values, atol=1e-12)
    assert any(note.startswith("no held-out LDS: 2 of 8 exact coalitions") for note in held.notes)
    alone = ControlVariateLasso(budget=16, seed=1, holdout=0.0)
    exact16 = np.array(list(alone.plan(n)))
    assert np.max(np.abs(alone.fit(exact16, v(exact16)).values - weights)) > 0.5


# --- registration ------------------------------------------------------------------------------

def test_the_two_fidelity_methods_are_registered() -> None:
    assert set(methods_with(two_fidelity=True)) == {"lasso", "proxy-shapley", "proxy-shapley-shrunk", "auto", "default"}
    est = make_estimator("proxy-shapley", budget=40, seed=2)
    assert isinstance(est, TwoFidelityShapley)
    exact_only = est.fit(MASKS, V)  # no proxy: regression-msr on the same plan
    np.testing.assert_allclose(exact_only.values, RegressionMSR(budget=40, seed=2).fit(MASKS, V).values, atol=0)


def test_auto_runs_the_two_fidelity_form_of_its_choice() -> None:
    auto = AutoMethod(budget=40, seed=2)
    estimate = auto.fit_two_fidelity(MASKS, V, MASKS, C)
    assert estimate.method == "auto:proxy-shapley-shrunk"  # the blended form (test_shrunk_shapley.py)
    shrunk = ShrunkTwoFidelityShapley(budget=40, seed=2).fit_two_fidelity(MASKS, V, MASKS, C)
    np.testing.assert_allclose(estimate.values, shrunk.values, atol=0)
    assert np.max(np.abs(estimate.values - two_fidelity(40, 2).values)) > 1e-6  # not the unbiased form
    assert len(list(auto.proxy_plan(N))) == min(max(16 * 40, 16 * N), 1 << N)
    # the default proxy budget: 16 per exact coalition, at least 4 per player (docs/proxy.md)
    assert len(list(ControlVariateLasso(budget=32, seed=0).proxy_plan(70))) == max(16 * 32, 4 * 70) == 512
    assert len(list(ControlVariateLasso(budget=8, seed=0).proxy_plan(70))) == max(16 * 8, 4 * 70) == 280
    surrogate = AutoMethod(budget=32, seed=0).two_fidelity(40)[0]  # 40 players, under 5 per player
    assert isinstance(surrogate, ControlVariateLasso) and surrogate.cv_rule == "min" and surrogate.holdout == 0.0


def test_the_in_sample_form_is_b_phi_c_plus_regression_msr_of_the_residual_game() -> None:
    """cross_fit=False: b is the least-squares slope of v on c over the exact plan's coalitions
    (numpy.polyfit), phi(c) the proxy's exact values at a proxy budget of 2^n, and the rest
    regression-msr of the game v - b c."""
    rows = _rows(40, 4)
    slope = np.polyfit(C[rows], V[rows], 1)[0]
    expected = slope * shapley_of(OTHER, N) + RegressionMSR(budget=40, seed=4).fit(MASKS, V - slope * C).values
    expected += slope * (0.6 * _exact_shapley_of(np.sin(MASKS @ THETA)))
    estimate = two_fidelity(40, 4, cross_fit=False, proxy_budget=1 << N)
    np.testing.assert_allclose(estimate.values, expected, atol=1e-9)
    assert estimate.diagnostics["b"] == pytest.approx(slope, rel=1e-9)
    assert abs(estimate.efficiency_gap) < 1e-9


def _exact_shapley_of(values: np.ndarray) -> np.ndarray:
    """The Shapley subset formula over MASKS (every coalition), for a game with no closed form."""
    from math import factorial

    index = {tuple(row): k for k, row in enumerate(MASKS.tolist())}
    out = np.zeros(N)
    for i in range(N):
        for k, row in enumerate(MASKS):
            if not row[i]:
                s = int(row.sum())
                with_i = row.copy()
                with_i[i] = True
                out[i] += factorial(s) * factorial(N - s - 1) / factorial(N) * (values[index[tuple(with_i.tolist())]] - values[k])
    return out


def _keep_half(n: int, m: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((m, n)) < 0.5


@pytest.mark.parametrize("seed", [0, 3])
def test_a_fit_with_nothing_held_out_reports_its_cross_validated_lds(seed):
    """auto --budget 16 on 52 players fits every exact coalition (no held-out LDS): the run still
    reports a faithfulness number, ``lds_cv``, the Spearman correlation of out-of-fold additive
    predictions with v(S). An additive game with a proxy equal to it is predicted exactly out of
    fold (rank correlation 1 by the rule); a game of pure noise is not (|rho| well below 1)."""
    from coalescence.attribution.estimators import make_estimator

    n = 52
    two, _ = make_estimator("auto", budget=16, seed=seed).two_fidelity(n)
    masks = np.array(list(two.plan(n)))
    pmasks = np.array(list(two.proxy_plan(n)) + list(masks))
    beta = np.linspace(2.0, 0.05, n)  # distinct weights: no ties among the sums
    additive = lambda rows: rows.astype(float) @ beta - 3.0  # noqa: E731
    est = two.fit_two_fidelity(masks, additive(masks), pmasks, additive(pmasks))
    assert np.isnan(est.diagnostics["lds"]) and est.diagnostics["lds_cv"] == pytest.approx(1.0, abs=1e-9)

    noise = np.random.default_rng(100 + seed)
    u, c = noise.normal(size=len(masks)), noise.normal(size=len(pmasks))
    est = two.fit_two_fidelity(masks, u, pmasks, c)
    assert abs(est.diagnostics["lds_cv"]) < 0.9


def test_the_lasso_surrogate_without_a_held_out_share_reports_its_cross_validated_lds():
    """LassoSurrogate(holdout=0) (ContextCite's setting, and auto's on exact rows): lds is NaN
    (nothing held out) and lds_cv scores the fit out of fold: an additive game is ranked exactly."""
    from coalescence.attribution.estimators.lasso import LassoSurrogate

    n, est = 12, LassoSurrogate(budget=64, seed=1, holdout=0.0, alpha=1e-4)
    masks = np.array(list(est.plan(n)))
    u = masks.astype(float) @ np.linspace(1.0, 0.1, n)
    d = est.fit(masks, u).diagnostics
    assert np.isnan(d["lds"]) and d["lds_cv"] > 0.999


def test_no_convergence_warning_reaches_the_user(recwarn):
    """The LASSO's cross-validation paths on few rows may stop at max_iter at their smallest
    penalties: no ConvergenceWarning reaches stderr (the chosen penalty is refitted)."""
    from sklearn.exceptions import ConvergenceWarning

    from coalescence.attribution.estimators.lasso import LassoSurrogate

    n = 52
    rng = np.random.default_rng(0)
    est = LassoSurrogate(budget=24, seed=0, holdout=0.0)
    masks = np.array(list(est.plan(n)))
    u = masks.astype(float) @ rng.normal(size=n) + rng.normal(size=len(masks))
    est.fit(masks, u)
    assert not [w for w in recwarn if issubclass(w.category, ConvergenceWarning) and "path" not in str(w.filename)]
