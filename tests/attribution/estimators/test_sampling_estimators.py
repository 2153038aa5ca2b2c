"""KernelSHAP, Banzhaf (maximum sample reuse) and the LASSO surrogate against analytic games."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coalescence.attribution.estimators import (
    Banzhaf,
    Estimate,
    Estimator,
    ExactShapley,
    KernelSHAP,
    LassoSurrogate,
    make_estimator,
)
from coalescence.attribution.games import (
    AdditiveGame,
    GloveGame,
    PairwiseInteractionGame,
    WeightedMajorityGame,
)
from coalescence.errors import ConfigError, EstimatorError


class TableGame:
    """A random game: one independent normal utility per coalition (no structure at all)."""

    def __init__(self, n_players: int, seed: int) -> None:
        self.n_players = n_players
        self.table = np.random.default_rng(seed).normal(size=2**n_players)

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        index = (masks.astype(np.int64) << np.arange(self.n_players)).sum(axis=1)
        return self.table[index]


def rows_of(est: Estimator, n: int) -> np.ndarray:
    return np.array(list(est.plan(n)), dtype=bool).reshape(-1, n)


def run(est: Estimator, game) -> Estimate:
    """Evaluate the plan on the game and fit; check the invariants every estimate keeps."""
    n = game.n_players
    rows = rows_of(est, n)
    distinct = len({r.tobytes() for r in rows})
    assert distinct == rows.shape[0]  # plans yield distinct coalitions
    assert distinct <= getattr(est, "budget", 2**n)
    estimate = est.fit(rows, game(rows))
    assert estimate.method == est.name
    assert estimate.values.shape == (n,)
    assert estimate.n_evaluations == distinct
    empty = np.zeros((1, n), dtype=bool)
    assert estimate.v_empty == pytest.approx(game(empty)[0], abs=1e-12)
    assert estimate.v_full == pytest.approx(game(~empty)[0], abs=1e-12)
    gap = estimate.values.sum() - (estimate.v_full - estimate.v_empty)
    assert estimate.efficiency_gap == pytest.approx(gap, abs=1e-12)
    return estimate


def brute_force_banzhaf(game) -> np.ndarray:
    """``beta_i = 2^-(n-1) sum_{S without i} v(S + i) - v(S)``, straight from the definition."""
    n = game.n_players
    beta = np.zeros(n)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for bits in itertools.product([False, True], repeat=n - 1):
            without = np.zeros((1, n), dtype=bool)
            without[0, others] = bits
            with_i = without.copy()
            with_i[0, i] = True
            beta[i] += game(with_i)[0] - game(without)[0]
    return beta / 2 ** (n - 1)


def glove12() -> GloveGame:
    return GloveGame(n_left=5, n_right=7)


# ---------------------------------------------------------------- KernelSHAP


@pytest.mark.parametrize("n", range(1, 9))
def test_kernelshap_full_enumeration_equals_exact(n: int) -> None:
    game = TableGame(n, seed=100 + n)
    estimate = run(KernelSHAP(budget=2**n, seed=5), game)
    exact = run(ExactShapley(), game)
    np.testing.assert_allclose(estimate.values, exact.values, rtol=0, atol=1e-9)
    assert abs(estimate.efficiency_gap) < 1e-9
    assert estimate.stderr is None and estimate.n_evaluations == 2**n


def test_kernelshap_full_enumeration_gives_dummies_zero() -> None:
    # players 2 and 5 never change the utility
    game = PairwiseInteractionGame(weights=[1.0, -2.0, 0.0, 0.5, 3.0, 0.0], i=0, j=3, bonus=2.0)
    values = run(KernelSHAP(budget=10_000), game).values
    np.testing.assert_allclose(values[[2, 5]], 0.0, atol=1e-12)
    np.testing.assert_allclose(values, game.shapley_values(), atol=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_kernelshap_sampled_is_efficient(seed: int) -> None:
    for game, budget in ((glove12(), 100), (TableGame(9, seed), 60)):
        estimate = run(KernelSHAP(budget=budget, seed=seed), game)
        assert abs(estimate.efficiency_gap) < 1e-9
        assert estimate.stderr is not None and np.all(np.isfinite(estimate.stderr))


@pytest.mark.parametrize(
    ("game", "tolerance"),
    [
        (glove12(), 0.1),
        (WeightedMajorityGame(weights=[5, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1], quota=14), 0.35),
        (
            PairwiseInteractionGame(
                weights=np.linspace(-1, 1, 10).tolist(), i=2, j=7, bonus=3.0, constant=-1.0
            ),
            0.1,
        ),
    ],
    ids=["glove-12", "majority-14", "pairwise-10"],
)
def test_kernelshap_converges(game, tolerance: float) -> None:
    """Median (5 seeds) relative L2 error shrinks from 64 to 256 to 1024 evaluations."""
    truth = run(ExactShapley(), game).values
    scale = np.linalg.norm(truth)

    def median_error(budget: int) -> float:
        errors = [
            np.linalg.norm(run(KernelSHAP(budget=budget, seed=s), game).values - truth) / scale
            for s in range(5)
        ]
        return float(np.median(errors))

    errors = [median_error(b) for b in (64, 256, 1024)]
    assert errors[0] < 1e-9 or errors[2] < errors[1] < errors[0], errors
    assert errors[2] < tolerance  # relative L2 error at 1024 evaluations


def test_kernelshap_stderr_coverage() -> None:
    game = glove12()
    truth = run(ExactShapley(), game).values
    hits = []
    for seed in range(40):
        estimate = run(KernelSHAP(budget=256, seed=seed), game)
        hits.append(np.abs(estimate.values - truth) <= 1.96 * estimate.stderr)
    coverage = float(np.mean(hits))
    assert 0.85 <= coverage <= 1.0, coverage


def test_kernelshap_stderr_shrinks_with_budget() -> None:
    game = glove12()
    small = run(KernelSHAP(budget=100, seed=1), game).stderr
    large = run(KernelSHAP(budget=1600, seed=1), game).stderr
    assert np.all(large < small)


def test_kernelshap_minimum_budget() -> None:
    with pytest.raises(ConfigError) as info:
        KernelSHAP(budget=3).validate(5)
    assert info.value.field == "budget" and "3" in info.value.message
    estimate = run(KernelSHAP(budget=4, seed=2), glove12())  # one pair: values, NaN errors
    assert KernelSHAP(budget=4, seed=2).n_pairs(12) == 1
    assert abs(estimate.efficiency_gap) < 1e-9 and np.all(np.isnan(estimate.stderr))


def test_kernelshap_config_errors() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError) as info:
            KernelSHAP(budget=bad)
        assert info.value.field == "budget" and repr(bad) in info.value.message
    with pytest.raises(ConfigError) as info:
        KernelSHAP(budget=10, seed=-3)
    assert info.value.field == "seed"
    with pytest.raises(ConfigError):
        KernelSHAP(budget=10, paired=False)


# ---------------------------------------------------------------- Banzhaf


@pytest.mark.parametrize("n", range(1, 8))
def test_banzhaf_full_enumeration_equals_brute_force(n: int) -> None:
    game = TableGame(n, seed=200 + n)
    estimate = run(Banzhaf(budget=2**n + 3, seed=1), game)
    np.testing.assert_allclose(estimate.values, brute_force_banzhaf(game), rtol=0, atol=1e-9)
    assert estimate.stderr is None


def test_banzhaf_of_majority_game_is_not_efficient() -> None:
    # [3; 2, 1, 1]: Banzhaf values 3/4, 1/4, 1/4 (swings / 2^(n-1)), sum 5/4 != v(N) - v(empty) = 1
    game = WeightedMajorityGame(weights=[2, 1, 1], quota=3)
    estimate = run(Banzhaf(budget=8), game)
    np.testing.assert_allclose(estimate.values, [0.75, 0.25, 0.25], atol=1e-12)
    assert estimate.efficiency_gap == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_banzhaf_sampled_within_four_stderr(seed: int) -> None:
    game = GloveGame(n_left=4, n_right=6)
    truth = brute_force_banzhaf(game)
    estimate = run(Banzhaf(budget=400, seed=seed), game)
    assert np.all(estimate.stderr > 0)
    assert np.all(np.abs(estimate.values - truth) <= 4 * estimate.stderr)


def test_banzhaf_minimum_budget() -> None:
    with pytest.raises(ConfigError) as info:
        Banzhaf(budget=3).validate(4)
    assert info.value.field == "budget"
    Banzhaf(budget=2).validate(1)


# ---------------------------------------------------------------- LASSO surrogate


def sparse_game(seed: int = 0) -> tuple[AdditiveGame, np.ndarray]:
    weights = np.zeros(20)
    weights[[3, 11, 17]] = [2.0, -1.5, 1.0]
    return AdditiveGame(weights=weights, constant=-5.0), weights


def test_lasso_recovers_sparse_additive_game() -> None:
    game, weights = sparse_game()
    estimate = run(LassoSurrogate(budget=200, seed=0), game)
    np.testing.assert_allclose(estimate.values, weights, atol=0.05)
    assert set(np.flatnonzero(np.abs(estimate.values) > 0.2)) == {3, 11, 17}
    assert estimate.diagnostics["lds"] > 0.9
    assert estimate.diagnostics["n_heldout"] == pytest.approx(0.2 * estimate.n_evaluations, abs=1)
    assert estimate.stderr is None


def test_lasso_fixed_alpha_and_lds_drops_on_a_nonlinear_game() -> None:
    game, weights = sparse_game()
    fixed = run(LassoSurrogate(budget=200, seed=0, alpha=0.01), game)
    assert fixed.diagnostics["alpha"] == 0.01
    np.testing.assert_allclose(fixed.values, weights, atol=0.1)
    table = TableGame(10, seed=1)  # no linear structure at all
    noisy = run(LassoSurrogate(budget=400, seed=0, alpha=0.001), table)
    assert abs(noisy.diagnostics["lds"]) < 0.5
    # cross-validation keeps no player on a structureless game: constant predictions, LDS NaN
    assert np.isnan(run(LassoSurrogate(budget=400, seed=0), table).diagnostics["lds"])


def test_lasso_dense_one_standard_error_rule() -> None:
    """``cv_rule="dense-1se"``: among the alphas LassoCV tries, the smallest whose mean squared error
    over the 5 folds is at most the least mean error plus its standard error (the folds' standard
    deviation / sqrt(5)); the values are the Lasso at that alpha on every training row (in the
    estimator's seeded order, ``default_rng([seed, 1])``, which sets the folds). Computed
    here with scikit-learn on the same rows and folds. On a game with many small effects under one
    large one it keeps at least as many players as the least-error alpha, and more here."""
    from sklearn.linear_model import Lasso, LassoCV
    from sklearn.model_selection import KFold

    from coalescence.attribution.estimators.base import library_seed

    rng = np.random.default_rng(4)
    weights = np.zeros(40)
    weights[7] = 20.0
    weights[rng.choice(40, 12, replace=False)] += rng.normal(0, 0.6, 12)
    game = AdditiveGame(weights=weights, constant=-40.0)
    more = 0
    for seed in range(6):
        dense = LassoSurrogate(budget=48, seed=seed, holdout=0.0, cv_rule="dense-1se")
        rows = rows_of(dense, 40)
        u = game(rows) + np.random.default_rng(seed).normal(0, 0.5, len(rows))
        got, least = dense.fit(rows, u), LassoSurrogate(budget=48, seed=seed, holdout=0.0).fit(rows, u)
        order = np.random.default_rng([seed, 1]).permutation(len(rows))  # the estimator's seeded shuffle of its rows
        x, u = rows[order].astype(np.float64), u[order]
        cv = LassoCV(cv=KFold(n_splits=5, shuffle=True, random_state=library_seed(seed)), max_iter=10_000).fit(x, u)
        mean, se = cv.mse_path_.mean(axis=1), cv.mse_path_.std(axis=1) / np.sqrt(5)
        alpha = cv.alphas_[mean <= mean.min() + se[np.argmin(mean)]].min()
        assert got.diagnostics["alpha"] == pytest.approx(alpha, rel=1e-12)
        assert got.diagnostics["alpha"] <= least.diagnostics["alpha"]
        np.testing.assert_allclose(got.values, Lasso(alpha=alpha, max_iter=10_000).fit(x, u).coef_, atol=1e-9)
        assert got.diagnostics["nonzero"] == np.count_nonzero(got.values) >= least.diagnostics["nonzero"]
        more += got.diagnostics["nonzero"] > least.diagnostics["nonzero"]
        assert int(np.argmax(got.values)) == 7
    assert more >= 3  # the least-error alpha leaves players tied at 0 that the rule tells apart
    with pytest.raises(ConfigError) as info:
        LassoSurrogate(budget=48, cv_rule="1se")
    assert info.value.field == "cv_rule"


def test_lasso_logit_utility() -> None:
    game = AdditiveGame(weights=[-0.1, -0.4, -0.2, -0.3] * 2, constant=-0.05)  # log-probs < 0
    est = LassoSurrogate(budget=256, seed=0, utility="logit")
    rows = rows_of(est, 8)
    estimate = est.fit(rows, game(rows))
    logit = lambda lp: lp - np.log(-np.expm1(lp))  # noqa: E731
    assert estimate.v_full == pytest.approx(logit(game(np.ones((1, 8), bool))[0]))
    with pytest.raises(EstimatorError):
        est.fit(rows, -game(rows))


def test_lasso_config_errors() -> None:
    for alpha in (0.0, -1.0, float("nan"), "1"):
        with pytest.raises(ConfigError) as info:
            LassoSurrogate(budget=100, alpha=alpha)
        assert info.value.field == "alpha"
    with pytest.raises(ConfigError) as info:
        LassoSurrogate(budget=100, utility="prob")
    assert info.value.field == "utility" and "'prob'" in info.value.message
    with pytest.raises(ConfigError) as info:
        LassoSurrogate(budget=15).validate(10)
    assert info.value.field == "budget"


# ---------------------------------------------------------------- shared behaviour


def all_three(budget: int, seed: int) -> list[Estimator]:
    return [
        KernelSHAP(budget=budget, seed=seed),
        Banzhaf(budget=budget, seed=seed),
        LassoSurrogate(budget=budget, seed=seed),
    ]


@pytest.mark.parametrize("index", range(3), ids=["kernelshap", "banzhaf", "lasso"])
def test_single_player_is_full_minus_empty(index: int) -> None:
    est = all_three(budget=50, seed=3)[index]
    estimate = run(est, AdditiveGame(weights=[-2.5], constant=1.25))
    assert estimate.values[0] == pytest.approx(-2.5, abs=1e-12)
    assert estimate.n_evaluations == 2


@pytest.mark.parametrize("index", range(3), ids=["kernelshap", "banzhaf", "lasso"])
def test_zero_players_refused(index: int) -> None:
    est = all_three(budget=50, seed=0)[index]
    with pytest.raises(EstimatorError, match="no players"):
        est.plan(0)
    with pytest.raises(EstimatorError, match="no players"):
        est.fit(np.zeros((1, 0), dtype=bool), np.zeros(1))


@pytest.mark.parametrize("budget", [16, 37, 100, 500, 1023, 1024, 5000])
def test_plans_never_exceed_budget(budget: int) -> None:
    for est in all_three(budget, seed=budget):
        for n in (3, 10, 30):
            rows = rows_of(est, n)
            assert len({r.tobytes() for r in rows}) == rows.shape[0] <= budget
            assert not rows[0].any() and rows.all(axis=1).any()
            if n == 30:  # a large game uses all of the budget (kernelshap: up to one short)
                assert rows.shape[0] >= budget - 1


def test_seeded_reproducibility_and_seed_sensitivity() -> None:
    game = glove12()
    for make in (KernelSHAP, Banzhaf, LassoSurrogate):
        a = run(make(budget=300, seed=7), game)
        b = run(make(budget=300, seed=7), game)
        c = run(make(budget=300, seed=8), game)
        assert a.values.tobytes() == b.values.tobytes()
        if a.stderr is not None:
            assert a.stderr.tobytes() == b.stderr.tobytes()
        assert dict(a.diagnostics) == dict(b.diagnostics)
        assert not np.array_equal(rows_of(make(budget=300, seed=7), 12),
                                  rows_of(make(budget=300, seed=8), 12))
        assert not np.array_equal(a.values, c.values)


def test_banzhaf_and_lasso_share_one_pool() -> None:
    game = glove12()
    banzhaf, lasso = Banzhaf(budget=300, seed=4), LassoSurrogate(budget=300, seed=4)
    rows = rows_of(banzhaf, 12)
    np.testing.assert_array_equal(rows, rows_of(lasso, 12))
    pool_masks, pool_u = rows[::-1], game(rows[::-1])  # any order, one evaluation each
    banzhaf.fit(pool_masks, pool_u)
    lasso.fit(pool_masks, pool_u)


@pytest.mark.parametrize("index", range(3), ids=["kernelshap", "banzhaf", "lasso"])
def test_fit_on_incomplete_pool_names_missing_count(index: int) -> None:
    est = all_three(budget=100, seed=0)[index]
    game = glove12()
    rows = rows_of(est, 12)
    with pytest.raises(EstimatorError, match=r"misses 3 of the"):
        est.fit(rows[3:], game(rows[3:]))


def test_make_estimator_builds_new_methods() -> None:
    for name, cls in (("kernelshap", KernelSHAP), ("banzhaf", Banzhaf), ("lasso", LassoSurrogate)):
        est = make_estimator(name, budget=123, seed=9)
        assert isinstance(est, cls) and isinstance(est, Estimator)
        assert (est.name, est.budget, est.seed) == (name, 123, 9)
        with pytest.raises(ConfigError) as info:
            make_estimator(name)
        assert info.value.field == "budget"


def test_estimate_diagnostics_default_and_read_only() -> None:
    plain = run(ExactShapley(), AdditiveGame(weights=[1.0, 2.0]))
    assert dict(plain.diagnostics) == {}
    lasso = run(LassoSurrogate(budget=64), AdditiveGame(weights=[1.0, 2.0, 0.0, 4.0, 1.0, 1.0]))
    with pytest.raises(TypeError):
        lasso.diagnostics["lds"] = 0.0  # type: ignore[index]
    with pytest.raises(EstimatorError):
        Estimate(method="x", values=np.zeros(1), stderr=None, v_empty=0, v_full=0,
                 efficiency_gap=0, n_evaluations=1, diagnostics={1: 0.5})


def test_kernelshap_stderr_is_unknown_not_zero_with_fewer_pairs_than_players() -> None:
    # n = 4, budget 8: empty, full and at most 3 distinct complement pairs (6 coalitions); 3 pairs
    # cannot estimate a 4-player covariance, and a fit through so few points has zero residuals: a
    # reported error of 0 would claim certainty (a user saw seed 0 off by 7 nats with +-0)
    game = TableGame(4, seed=3)
    truth = run(ExactShapley(), game).values
    for seed in range(6):
        estimate = run(KernelSHAP(budget=8, seed=seed), game)
        assert np.all(np.isnan(estimate.stderr)), (seed, estimate.stderr)
    assert truth.shape == (4,)
    # with more distinct pairs than players the error is known again, and covers the truth loosely
    game = TableGame(6, seed=3)
    truth = run(ExactShapley(), game).values
    estimate = run(KernelSHAP(budget=40, seed=0), game)
    assert np.all(np.isfinite(estimate.stderr)) and np.all(estimate.stderr > 0)
    assert np.all(np.abs(estimate.values - truth) <= 6 * estimate.stderr)
