"""Analytic games: utilities and their own Shapley values against textbook closed forms."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from coalescence.attribution import games
from coalescence.attribution.games import (
    AdditiveGame,
    Game,
    GloveGame,
    PairwiseInteractionGame,
    WeightedMajorityGame,
    shapley_by_enumeration,
)
from coalescence.errors import ConfigError, EstimatorError, MaskError


def all_rows(n: int) -> np.ndarray:
    return np.array(list(itertools.product([False, True], repeat=n)), dtype=bool).reshape(-1, n)


def test_additive_game_utilities_and_values() -> None:
    g = AdditiveGame(weights=[1.0, -2.0, 0.5], constant=3.0)
    masks = np.array([[False, False, False], [True, False, True], [True, True, True]])
    np.testing.assert_allclose(g(masks), [3.0, 4.5, 2.5])
    np.testing.assert_array_equal(g.shapley_values(), [1.0, -2.0, 0.5])
    assert g.n_players == 3
    assert g(masks).dtype == np.float64


def test_glove_game_utilities_count_pairs() -> None:
    g = GloveGame(n_left=2, n_right=3)
    masks = np.array(
        [
            [True, True, False, False, False],  # two left, no right
            [True, False, True, True, False],  # one left, two right
            [True, True, True, True, True],  # two left, three right
        ]
    )
    np.testing.assert_array_equal(g(masks), [0.0, 1.0, 2.0])


def test_glove_game_one_left_two_right_textbook_values() -> None:
    # Textbook: the single left glove is worth 2/3, each right glove 1/6.
    values = GloveGame(n_left=1, n_right=2).shapley_values()
    np.testing.assert_allclose(values, [2 / 3, 1 / 6, 1 / 6], atol=1e-12)


@pytest.mark.parametrize("n_right", [1, 2, 3, 4, 5])
def test_glove_game_one_left_closed_form(n_right: int) -> None:
    # One left glove among R right gloves: left gets R/(R+1), each right 1/(R(R+1)).
    expected = [n_right / (n_right + 1)] + [1 / (n_right * (n_right + 1))] * n_right
    values = GloveGame(n_left=1, n_right=n_right).shapley_values()
    np.testing.assert_allclose(values, expected, atol=1e-12)


def test_weighted_majority_hand_derived_index() -> None:
    # Quota 4, weights 3,2,1,1. Count the 24 orders where each player is pivotal:
    # A(3) is pivotal after {B},{C},{D} (2 orders each) and {C,D},{B,C},{B,D} (2 each) -> 12/24;
    # B(2) after {A} or {C,D} -> 4/24; C(1) after {A} or {B,D} -> 4/24; D likewise -> 4/24.
    g = WeightedMajorityGame(weights=[3, 2, 1, 1], quota=4)
    np.testing.assert_allclose(g.shapley_values(), [1 / 2, 1 / 6, 1 / 6, 1 / 6], atol=1e-12)
    winning = np.array([[True, False, True, False], [False, True, True, True]])
    losing = np.array([[True, False, False, False], [False, True, True, False]])
    np.testing.assert_array_equal(g(winning), [1.0, 1.0])
    np.testing.assert_array_equal(g(losing), [0.0, 0.0])


def test_pairwise_interaction_closed_form_and_utilities() -> None:
    g = PairwiseInteractionGame(weights=[1.0, 2.0, 3.0], i=0, j=2, bonus=5.0, constant=-1.0)
    masks = np.array([[True, False, False], [True, False, True], [True, True, True], [False, False, False]])
    np.testing.assert_allclose(g(masks), [0.0, 8.0, 10.0, -1.0])
    np.testing.assert_allclose(g.shapley_values(), [3.5, 2.0, 5.5])


def test_enumeration_matches_closed_forms() -> None:
    rng = np.random.default_rng(7)
    additive = AdditiveGame(weights=rng.normal(size=6), constant=2.0)
    np.testing.assert_allclose(shapley_by_enumeration(additive), additive.shapley_values(), atol=1e-12)
    pair = PairwiseInteractionGame(weights=rng.normal(size=5), i=1, j=4, bonus=-3.0)
    np.testing.assert_allclose(shapley_by_enumeration(pair), pair.shapley_values(), atol=1e-12)


def test_enumeration_values_are_efficient() -> None:
    g = GloveGame(n_left=3, n_right=4)
    phi = g.shapley_values()
    full = g(np.ones((1, 7), dtype=bool))[0]
    assert abs(phi.sum() - full) < 1e-12
    # Symmetry: holders of the same glove get the same value; the scarcer side is worth more.
    np.testing.assert_allclose(phi[:3], phi[0])
    np.testing.assert_allclose(phi[3:], phi[3])
    assert phi[0] > phi[3]


def test_enumeration_refuses_too_many_players() -> None:
    with pytest.raises(EstimatorError, match="limited"):
        shapley_by_enumeration(GloveGame(n_left=4, n_right=games.MAX_ENUMERATION_PLAYERS - 3))


def test_games_follow_the_protocol_and_are_frozen() -> None:
    built = [
        AdditiveGame(weights=[1.0]),
        GloveGame(n_left=1, n_right=1),
        WeightedMajorityGame(weights=[1.0, 1.0], quota=1.0),
        PairwiseInteractionGame(weights=[0.0, 0.0], i=0, j=1, bonus=1.0),
    ]
    for g in built:
        assert isinstance(g, Game)
        with pytest.raises(dataclasses.FrozenInstanceError):
            g.n_players = 5  # type: ignore[misc]
        assert g(all_rows(g.n_players)).shape == (2**g.n_players,)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: AdditiveGame(weights=[]), "weights"),
        (lambda: AdditiveGame(weights=[1.0, float("nan")]), "weights"),
        (lambda: GloveGame(n_left=-1, n_right=2), "n_left"),
        (lambda: GloveGame(n_left=0, n_right=0), "n_left"),
        (lambda: WeightedMajorityGame(weights=[1.0], quota=float("inf")), "quota"),
        (lambda: PairwiseInteractionGame(weights=[1.0, 2.0], i=0, j=0, bonus=1.0), "j"),
        (lambda: PairwiseInteractionGame(weights=[1.0, 2.0], i=0, j=2, bonus=1.0), "j"),
    ],
)
def test_bad_game_parameters_raise_config_error(build, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.field == field


def test_bad_masks_raise_mask_error() -> None:
    g = AdditiveGame(weights=[1.0, 2.0])
    with pytest.raises(MaskError):
        g(np.ones((2, 3), dtype=bool))
    with pytest.raises(MaskError):
        g(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(MaskError):
        g(np.ones(2, dtype=bool))
