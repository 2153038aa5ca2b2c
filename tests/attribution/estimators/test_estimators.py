"""Estimators against analytic games: exact Shapley, antithetic permutation sampling, leave-one-out."""

from __future__ import annotations

import inspect

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalescence.attribution import estimators
from coalescence.attribution.estimators import (
    Estimate,
    Estimator,
    ExactShapley,
    LeaveOneOut,
    PermutationShapley,
    make_estimator,
    pool_lookup,
)
from coalescence.attribution.games import (
    AdditiveGame,
    GloveGame,
    PairwiseInteractionGame,
    WeightedMajorityGame,
)
from coalescence.errors import ConfigError, EstimatorError, MaskError


class SumGame:
    """Sum of games, each on a subset of the players; Shapley values add (linearity axiom)."""

    def __init__(self, n_players: int, parts: list[tuple[np.ndarray, object]]) -> None:
        self.n_players = n_players
        self.parts = parts

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        return sum(game(masks[:, idx]) for idx, game in self.parts)

    def shapley_values(self) -> np.ndarray:
        phi = np.zeros(self.n_players)
        for idx, game in self.parts:
            phi[idx] += game.shapley_values()
        return phi


def mixed_game() -> SumGame:
    """12 players: additive + a glove game on 0..6 + a weighted majority on {2, 5, 8, 9, 10}.

    Players 7 and 11 only carry their additive weight (dummies of the interaction parts).
    """
    rng = np.random.default_rng(3)
    return SumGame(
        12,
        [
            (np.arange(12), AdditiveGame(weights=rng.normal(size=12))),
            (np.arange(7), GloveGame(n_left=3, n_right=4)),
            (np.array([2, 5, 8, 9, 10]), WeightedMajorityGame(weights=[3, 2, 2, 1, 1], quota=5)),
        ],
    )


def run(est: Estimator, game) -> Estimate:
    """Evaluate the plan on the game and fit; check the invariants every estimate keeps."""
    rows = np.array(list(est.plan(game.n_players)), dtype=bool).reshape(-1, game.n_players)
    estimate = est.fit(rows, game(rows))
    assert estimate.method == est.name
    assert estimate.values.shape == (game.n_players,)
    assert estimate.values.dtype == np.float64
    assert estimate.n_evaluations == len({r.tobytes() for r in rows})
    empty = np.zeros((1, game.n_players), dtype=bool)
    assert estimate.v_empty == pytest.approx(game(empty)[0], rel=1e-12, abs=1e-12)
    assert estimate.v_full == pytest.approx(game(~empty)[0], rel=1e-12, abs=1e-12)
    gap = estimate.values.sum() - (estimate.v_full - estimate.v_empty)
    assert estimate.efficiency_gap == pytest.approx(gap, abs=1e-12)
    return estimate


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize("n", range(1, 11))
def test_exact_equals_additive_weights(n: int) -> None:
    game = AdditiveGame(weights=np.random.default_rng(n).normal(size=n), constant=-4.0)
    estimate = run(ExactShapley(), game)
    np.testing.assert_allclose(estimate.values, game.shapley_values(), atol=1e-9)
    assert abs(estimate.efficiency_gap) < 1e-9
    assert estimate.stderr is None
    assert estimate.n_evaluations == 2**n


def test_exact_glove_one_left_two_right_textbook() -> None:
    estimate = run(ExactShapley(), GloveGame(n_left=1, n_right=2))
    np.testing.assert_allclose(estimate.values, [2 / 3, 1 / 6, 1 / 6], atol=1e-9)


def test_exact_glove_two_left_three_right_matches_enumeration() -> None:
    game = GloveGame(n_left=2, n_right=3)
    np.testing.assert_allclose(run(ExactShapley(), game).values, game.shapley_values(), atol=1e-9)


def test_exact_weighted_majority_matches_enumeration_and_hand_derivation() -> None:
    game = WeightedMajorityGame(weights=[3, 2, 1, 1], quota=4)
    values = run(ExactShapley(), game).values
    np.testing.assert_allclose(values, game.shapley_values(), atol=1e-9)
    np.testing.assert_allclose(values, [1 / 2, 1 / 6, 1 / 6, 1 / 6], atol=1e-9)


def test_exact_pairwise_interaction_closed_form() -> None:
    game = PairwiseInteractionGame(weights=[0.5, -1.0, 2.0, 0.0, 1.5], i=1, j=3, bonus=4.0, constant=7.0)
    estimate = run(ExactShapley(), game)
    np.testing.assert_allclose(estimate.values, [0.5, 1.0, 2.0, 2.0, 1.5], atol=1e-9)
    assert abs(estimate.efficiency_gap) < 1e-9


def test_exact_single_player_is_full_minus_empty() -> None:
    estimate = run(ExactShapley(), AdditiveGame(weights=[-2.5], constant=1.25))
    assert estimate.values[0] == pytest.approx(-2.5, abs=1e-12)
    assert (estimate.v_empty, estimate.v_full) == (1.25, -1.25)


def test_exact_plan_is_integer_index_order() -> None:
    rows = list(ExactShapley().plan(3))
    assert [int(sum(int(b) << i for i, b in enumerate(r))) for r in rows] == list(range(8))


def test_exact_refuses_seventeen_players_before_planning() -> None:
    with pytest.raises(EstimatorError) as info:
        ExactShapley().plan(17)  # raises at the call, not on first iteration
    assert info.value.field == "method"
    assert "131072" in info.value.message and "method regression-msr with a budget" in info.value.message
    ExactShapley().validate(16)


@pytest.mark.parametrize("est", [ExactShapley(), PermutationShapley(budget=10), LeaveOneOut()])
def test_zero_players_refused(est: Estimator) -> None:
    with pytest.raises(EstimatorError, match="no players"):
        est.validate(0)


def test_dummy_player_gets_zero_under_exact_and_permutation() -> None:
    additive = AdditiveGame(weights=[1.0, 0.0, -2.0, 3.0])
    glove_with_dummy = SumGame(6, [(np.arange(5), GloveGame(n_left=2, n_right=3))])  # player 5 is a dummy
    for game, dummy in ((additive, 1), (glove_with_dummy, 5)):
        for est in (ExactShapley(), PermutationShapley(budget=40, seed=1)):
            assert abs(run(est, game).values[dummy]) < 1e-12


# ---------------------------------------------------------------- permutation


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permutation_accuracy_at_budget_2000(seed: int) -> None:
    game = mixed_game()
    estimate = run(PermutationShapley(budget=2000, seed=seed), game)
    error = np.abs(estimate.values - game.shapley_values())
    assert error.max() < 0.15  # stderr is about 0.02-0.04 per player at this budget
    assert abs(estimate.efficiency_gap) < 1e-9
    # Players 7 and 11 only add their weight: every sampled order gives them exactly that.
    np.testing.assert_allclose(estimate.values[[7, 11]], game.shapley_values()[[7, 11]], atol=1e-12)
    # ... so their samples show no spread and their errors are unknown (NaN), never a claimed 0
    others = np.delete(np.arange(12), [7, 11])
    assert np.all(np.isnan(estimate.stderr[[7, 11]])) and np.all(estimate.stderr[others] > 0)
    assert np.all(error[others] <= 4 * estimate.stderr[others])
    assert estimate.diagnostics["stderr_unknown"] == 2


def test_permutation_plan_respects_budget() -> None:
    n, budget = 12, 2000
    rows = np.array(list(PermutationShapley(budget=budget, seed=4).plan(n)))
    distinct = {r.tobytes() for r in rows}
    assert len(distinct) == len(rows) <= budget
    assert len(rows) > budget - 2 * n  # stops only before a pair that would overflow
    assert not rows[0].any() and any(r.all() for r in rows[: n + 1])


def test_antithetic_pairs_are_exact_on_pairwise_interactions() -> None:
    # In a pair (pi, reversed pi) each of i, j comes second once, so the bonus splits exactly.
    game = PairwiseInteractionGame(weights=np.arange(6.0), i=0, j=4, bonus=3.0)
    estimate = run(PermutationShapley(budget=12, seed=9), game)
    np.testing.assert_allclose(estimate.values, game.shapley_values(), atol=1e-12)
    assert np.isnan(estimate.stderr).all()  # a single pair: no spread to measure


def test_permutation_is_deterministic_per_seed() -> None:
    game = mixed_game()
    a, b, c = (PermutationShapley(budget=500, seed=s) for s in (5, 5, 6))
    plan_a, plan_b, plan_c = (np.array(list(e.plan(12))) for e in (a, b, c))
    np.testing.assert_array_equal(plan_a, plan_b)
    assert plan_a.shape != plan_c.shape or not np.array_equal(plan_a, plan_c)
    np.testing.assert_array_equal(run(a, game).values, run(b, game).values)


def test_permutation_stderr_shrinks_with_budget() -> None:
    game = mixed_game()
    small = run(PermutationShapley(budget=200, seed=0), game).stderr
    large = run(PermutationShapley(budget=3000, seed=0), game).stderr
    assert np.nanmean(large) < np.nanmean(small) / 2


def test_permutation_single_player_is_exact() -> None:
    estimate = run(PermutationShapley(budget=2), AdditiveGame(weights=[1.5], constant=2.0))
    assert estimate.values[0] == pytest.approx(1.5, abs=1e-12)
    assert estimate.n_evaluations == 2


def test_permutation_budget_below_one_pair() -> None:
    with pytest.raises(ConfigError) as info:
        PermutationShapley(budget=5).validate(4)
    assert info.value.field == "budget"
    assert "2n = 8" in info.value.message
    with pytest.raises(ConfigError):
        list(PermutationShapley(budget=7).plan(4))
    assert len(list(PermutationShapley(budget=8).plan(4))) == 8


@pytest.mark.parametrize("budget", [0, -3, True, 2.5])
def test_permutation_budget_must_be_positive_int(budget) -> None:
    with pytest.raises(ConfigError) as info:
        PermutationShapley(budget=budget)
    assert info.value.field == "budget"


def test_permutation_caps_pairs_on_tiny_games() -> None:
    # n = 2 has only 4 coalitions, so pairs after the first are free; the cap ends planning.
    est = PermutationShapley(budget=50, seed=0)
    assert len(list(est.plan(2))) == 4
    assert est.n_pairs(2) == 10 * 50


# ---------------------------------------------------------------- leave-one-out


def test_loo_on_interaction_game() -> None:
    game = PairwiseInteractionGame(weights=[1.0, -2.0, 0.5, 3.0], i=0, j=2, bonus=6.0)
    estimate = run(LeaveOneOut(), game)
    full = np.ones((1, 4), dtype=bool)
    expected = [game(full)[0] - game(~np.eye(4, dtype=bool)[[i]])[0] for i in range(4)]
    np.testing.assert_allclose(estimate.values, expected, atol=1e-12)
    np.testing.assert_allclose(estimate.values, [7.0, -2.0, 6.5, 3.0])
    assert estimate.n_evaluations == 4 + 2
    assert estimate.efficiency_gap == pytest.approx(6.0)  # the bonus is counted twice
    assert estimate.stderr is None


def test_loo_single_player() -> None:
    estimate = run(LeaveOneOut(), AdditiveGame(weights=[2.0], constant=1.0))
    assert estimate.values[0] == 2.0 and estimate.n_evaluations == 2 and estimate.efficiency_gap == 0.0


# ---------------------------------------------------------------- pools


ALL = [ExactShapley(), PermutationShapley(budget=60, seed=3), LeaveOneOut()]


@pytest.mark.parametrize("est", ALL, ids=lambda e: e.name)
def test_fit_on_incomplete_pool_names_missing_count(est: Estimator) -> None:
    game = GloveGame(n_left=2, n_right=3)
    rows = np.array(list(est.plan(5)))
    with pytest.raises(EstimatorError, match=r"misses 3 of the \d+ coalitions"):
        est.fit(rows[3:], game(rows[3:]))


@pytest.mark.parametrize("est", ALL, ids=lambda e: e.name)
def test_fit_ignores_extra_and_duplicate_rows(est: Estimator) -> None:
    game = GloveGame(n_left=2, n_right=3)
    rows = np.array(list(est.plan(5)))
    rng = np.random.default_rng(0)
    extra = rng.random((20, 5)) < 0.5
    pool = np.concatenate([rows, extra, rows[::2]])
    order = rng.permutation(len(pool))
    reference = est.fit(rows, game(rows))
    fitted = est.fit(pool[order], game(pool[order]))
    np.testing.assert_array_equal(fitted.values, reference.values)
    assert fitted.n_evaluations == reference.n_evaluations


def test_fit_rejects_non_finite_utilities_and_bad_masks() -> None:
    rows = np.array(list(LeaveOneOut().plan(3)))
    utilities = np.zeros(len(rows))
    utilities[2] = np.nan
    with pytest.raises(EstimatorError, match="non-finite"):
        LeaveOneOut().fit(rows, utilities)
    with pytest.raises(MaskError):
        LeaveOneOut().fit(rows.astype(np.int8), np.zeros(len(rows)))
    with pytest.raises(EstimatorError):
        LeaveOneOut().fit(rows, np.zeros(len(rows) + 1))


def test_pool_lookup_packs_little_endian() -> None:
    masks = np.array([[True] + [False] * 8, [False] * 8 + [True], [True] + [False] * 8])
    lookup = pool_lookup(masks, np.array([1.0, 2.0, 1.0]))
    assert lookup == {b"\x01\x00": 1.0, b"\x00\x01": 2.0}


# ---------------------------------------------------------------- factory and types


def test_make_estimator() -> None:
    assert isinstance(make_estimator("exact"), ExactShapley)
    assert isinstance(make_estimator("loo"), LeaveOneOut)
    est = make_estimator("permutation", budget=100, seed=4)
    assert isinstance(est, PermutationShapley) and (est.budget, est.seed) == (100, 4)
    for e in (make_estimator("exact"), est, make_estimator("loo")):
        assert isinstance(e, Estimator)
    with pytest.raises(ConfigError) as info:
        make_estimator("kernel")
    assert info.value.field == "method" and "exact, permutation, loo" in info.value.message
    with pytest.raises(ConfigError) as info:
        make_estimator("permutation")
    assert info.value.field == "budget"


def test_public_names_match_all() -> None:
    public = {
        name
        for name, obj in vars(estimators).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    } - {"annotations"}
    live = {"METHODS"}  # served by the module's __getattr__ (PEP 562): read live from the registry
    assert set(estimators.__all__) == public | live
    assert estimators.METHODS == tuple(estimators.ESTIMATORS)


def test_estimate_arrays_are_read_only() -> None:
    estimate = run(ExactShapley(), AdditiveGame(weights=[1.0, 2.0]))
    with pytest.raises(ValueError):
        estimate.values[0] = 9.0
    with pytest.raises(EstimatorError):
        Estimate(method="x", values=np.zeros(2), stderr=np.zeros(3), v_empty=0, v_full=0,
                 efficiency_gap=0, n_evaluations=1)


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=8), st.floats(-1e3, 1e3))
def test_property_exact_recovers_additive_weights(weights: list[float], constant: float) -> None:
    values = run(ExactShapley(), AdditiveGame(weights=weights, constant=constant)).values
    np.testing.assert_allclose(values, weights, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-100, 100), min_size=2**n, max_size=2**n), st.permutations(range(n)))))
def test_property_exact_is_efficient_and_equivariant(case: tuple[list[float], list[int]]) -> None:
    utilities, sigma = np.array(case[0]), list(case[1])
    n = len(sigma)
    rows = np.array(list(itertools.product([False, True], repeat=n)), dtype=bool).reshape(-1, n)
    estimate = ExactShapley().fit(rows, utilities)
    assert abs(estimate.efficiency_gap) < 1e-9
    # Relabel: new player k is old player sigma[k]; same coalitions, same utilities.
    relabelled = ExactShapley().fit(rows[:, sigma], utilities)
    np.testing.assert_allclose(relabelled.values, estimate.values[sigma], atol=1e-9)
    assert math.isclose(relabelled.v_full, estimate.v_full)
