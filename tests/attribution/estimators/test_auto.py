"""``--method auto``: the rule stated in its docs (sparse surrogate for many players on a budget
under 5 per player, else regression-msr), checked against games with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coalescence import make_estimator
from coalescence.attribution.estimators.auto import AutoMethod
from coalescence.errors import ConfigError
from coalescence.app.settings import RunSettings


def additive(n: int, weights: dict[int, float], base: float = -30.0):
    """v(S) = base + sum of w_i over S: every Shapley value and every surrogate coefficient is w_i."""
    w = np.zeros(n)
    for i, x in weights.items():
        w[i] = x
    return w, lambda rows: base + rows.astype(float) @ w


@pytest.mark.parametrize(
    ("n", "budget", "chosen"),
    [
        (70, 32, "lasso"), (70, 64, "lasso"), (70, 349, "lasso"),  # below 5 per player, many players
        (70, 350, "regression-msr"), (70, 2000, "regression-msr"),  # 5 per player and more
        (16, 32, "regression-msr"), (12, 40, "regression-msr"),  # few players: always regression-msr
        (17, 84, "lasso"), (17, 85, "regression-msr"),
    ],
)
def test_the_choice_follows_players_and_budget(n: int, budget: int, chosen: str) -> None:
    estimator, why = AutoMethod(budget=budget).choose(n)
    assert estimator.name == chosen
    assert why.startswith(f"method auto ran {chosen}: {budget} evaluations for {n} players")
    if chosen == "lasso":
        assert estimator.holdout == 0.0 and estimator.cv_rule == "dense-1se" and "not Shapley values" in why


def test_many_players_on_a_small_budget_recover_a_sparse_game() -> None:
    n = 60
    w, v = additive(n, {3: 4.0, 17: 2.5, 41: -1.5})
    auto = AutoMethod(budget=64, seed=3)
    rows = np.array(list(auto.plan(n)), dtype=bool)
    assert len(rows) <= 64
    estimate = auto.fit(rows, v(rows))
    assert estimate.method == "auto:lasso"
    assert any("method auto ran lasso" in note for note in estimate.notes)
    assert estimate.diagnostics["n_train"] == len(rows)  # fitted on every coalition: no holdout
    assert math.isnan(estimate.diagnostics["lds"])
    top = np.argsort(-np.abs(estimate.values))[:3]
    assert set(top) == {3, 17, 41}
    np.testing.assert_allclose(estimate.values[[3, 17, 41]], [4.0, 2.5, -1.5], atol=0.3)  # L1 shrinkage only
    assert np.abs(np.delete(estimate.values, [3, 17, 41])).max() < 0.1


def test_a_large_budget_gives_the_shapley_values_of_regression_msr() -> None:
    n = 10
    w, v = additive(n, {i: 0.5 * i - 2 for i in range(n)})
    auto = AutoMethod(budget=200, seed=0)
    rows = np.array(list(auto.plan(n)), dtype=bool)
    estimate = auto.fit(rows, v(rows))
    assert estimate.method == "auto:regression-msr"
    np.testing.assert_allclose(estimate.values, w, atol=1e-9)  # an additive game's Shapley values are w
    direct = make_estimator("regression-msr", budget=200, seed=0)
    np.testing.assert_array_equal(np.array(list(direct.plan(n))), rows)  # the same plan: replays alike


def test_a_budget_asks_for_auto_and_none_for_the_default_plan() -> None:
    assert RunSettings(budget=64).method == "auto"
    assert RunSettings().method == "default"  # neither: the default plan (exact on at most 16 players)
    assert RunSettings(method="kernelshap", budget=64).method == "kernelshap"
    # auto's choice (and so whether it reports standard errors) is known once n is: the settings
    # take a target standard error, the run checks what auto chooses (tests/cli/test_cli.py)
    assert RunSettings(method="auto", target_stderr=0.1).target_stderr == 0.1


def test_a_bad_holdout_is_refused() -> None:
    from coalescence.attribution.estimators.lasso import LassoSurrogate

    for bad in (-0.1, 0.6, True, "0.2", math.nan):
        with pytest.raises(ConfigError) as info:
            LassoSurrogate(budget=32, holdout=bad)
        assert info.value.field == "holdout"


def test_the_note_counts_the_coalitions_that_exist() -> None:
    # 5 players have 2^5 = 32 coalitions: a budget of 100 evaluates 32 of them, not 100
    _, why = AutoMethod(budget=100, seed=0).choose(5)
    assert "32 coalitions" in why and "100 evaluations" not in why and "budget of 100" in why
    rows = np.array(list(AutoMethod(budget=100, seed=0).plan(5)), dtype=bool)
    assert len({r.tobytes() for r in rows}) == 32
    # below 2^n the budget is what is spent, and the note says the budget
    assert AutoMethod(budget=20, seed=0).choose(5)[1].startswith("method auto ran regression-msr: 20 evaluations for 5 players")
