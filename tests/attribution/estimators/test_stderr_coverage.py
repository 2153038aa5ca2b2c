"""Do the reported standard errors mean what they say? Coverage of ``value +- 1.96 * stderr``.

For every estimator that reports standard errors (``methods_with(reports_stderr=True)``), over
games whose exact values are computed here by brute force (the Shapley subset formula and the
Banzhaf mean over all coalitions, written in this file, not the package's ExactShapley), several n
and budgets from the smallest each method accepts up to a few hundred, and 200 seeds each:

- wherever the standard error is finite, the 95% interval covers the exact value in 90-98% of
  the (seed, player) cells, up to binomial noise (3 standard deviations of a proportion);
- a finite standard error is never 0 (or below float rounding) when the value is not exact;
- a NaN (unknown) standard error appears exactly where the estimator's documented rule says, and
  ``diagnostics["stderr_unknown"]`` counts it.

The issue's case is among them: a random 6-player game at budget 24 (before this change kernelshap
reported 0.215 against a real spread of 0.289, permutation 0.353 against 0.451).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from helpers.games import all_masks, third_order_table

from coalescence.attribution.estimators import make_estimator
from coalescence.attribution.estimators.banzhaf import uniform_plan
from coalescence.attribution.estimators.permutation import _build_plan as permutation_plan
from coalescence.attribution.estimators.registry import estimator_class, methods_with

SEEDS = 200
LOW, HIGH = 0.90, 0.98


# ------------------------------------------------------------------ games, as tables over 2^n


def random_table(n: int, seed: int) -> np.ndarray:
    """A random game: an independent standard normal utility per coalition (no structure)."""
    return np.random.default_rng(seed).normal(size=1 << n)


def majority_table(n: int, seed: int) -> np.ndarray:
    """Weighted majority: 1 when the coalition's integer weights (1-5) pass half the total, else 0."""
    weights = np.random.default_rng(seed).integers(1, 6, size=n).astype(np.float64)
    return (all_masks(n) @ weights >= weights.sum() // 2 + 1).astype(np.float64)


GAMES = {"random": random_table, "third_order": third_order_table, "majority": majority_table}


def exact_shapley(table: np.ndarray, n: int) -> np.ndarray:
    """``phi_i = sum_{S without i} |S|! (n - |S| - 1)! / n! * (v(S + i) - v(S))`` (Shapley 1953)."""
    index = np.arange(1 << n)
    sizes = all_masks(n).sum(axis=1)
    weight = np.array([math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n) for k in range(n)])
    phi = np.empty(n)
    for i in range(n):
        without = index[(index >> i) & 1 == 0]
        phi[i] = weight[sizes[without]] @ (table[without | (1 << i)] - table[without])
    return phi


def exact_banzhaf(table: np.ndarray, n: int) -> np.ndarray:
    """``beta_i = 2^-(n-1) sum_{S without i} (v(S + i) - v(S))`` (Banzhaf 1965)."""
    index = np.arange(1 << n)
    return np.array(
        [np.mean(table[index[(index >> i) & 1 == 0] | (1 << i)] - table[index[(index >> i) & 1 == 0]]) for i in range(n)]
    )


def near_all(n: int, budget: int) -> bool:
    """The documented rule, restated: fewer than 4n of the 2^n coalitions left unplanned."""
    return budget < 2**n and 2**n - budget < 4 * n


# ------------------------------------------------------------------ one cell: (method, game, n, budget)


def run_cell(method: str, game: str, n: int, budget: int) -> dict[str, float]:
    """Fit ``SEEDS`` seeds; check the NaN rule and zero errors per estimate; return coverage numbers."""
    table = GAMES[game](n, 1000 + n)
    truth = exact_banzhaf(table, n) if method == "banzhaf" else exact_shapley(table, n)
    values, stderrs = [], []
    singular = 0.0
    for seed in range(SEEDS):
        est = make_estimator(method, budget=budget, seed=seed)
        rows = np.array(list(est.plan(n)), dtype=bool).reshape(-1, n)
        index = (rows.astype(np.int64) << np.arange(n)).sum(axis=1)
        estimate = est.fit(rows, table[index])
        if estimate.stderr is None:  # full enumeration: exact values
            np.testing.assert_allclose(estimate.values, truth, atol=1e-9)
            continue
        se = estimate.stderr
        nan = np.isnan(se)
        assert estimate.diagnostics["stderr_unknown"] == nan.sum()
        assert np.all(se[~nan] > 0), (method, game, n, budget, seed, se)
        if game == "random":  # continuous utilities: no player's samples are ever all equal
            check_nan_rule(method, n, budget, seed, estimate, nan, table)
        if method in ("kernelshap", "regression-msr"):  # singular although enough pairs: must stay rare
            d = estimate.diagnostics
            enough = d["pairs_distinct"] >= d["stderr_min_pairs"] and not near_all(n, budget)
            singular += enough and d["stderr_singular"] == 1.0
        values.append(estimate.values)
        stderrs.append(se)
    assert singular <= 0.02 * SEEDS, (method, game, n, budget, singular)  # a rare event, not a rule
    if not values:
        return {"finite": 0, "cells": 0, "covered": 0, "mean_se": math.nan, "spread": 0.0}
    values, stderrs = np.array(values), np.array(stderrs)  # [seeds, n] each
    finite = np.isfinite(stderrs)
    error = np.abs(values - truth)
    covered = error <= 1.96 * stderrs
    # a finite error at float rounding while the value is off would be a claimed certainty
    assert not np.any(finite & (stderrs < 1e-9) & (error > 1e-9)), (method, game, n, budget)
    spread = float(np.sqrt(np.nanmean((values - truth) ** 2)))  # real spread: RMS error over seeds
    return {
        "finite": int(finite.sum()),
        "cells": int(finite.size),
        "covered": int(covered[finite].sum()),
        "mean_se": float(stderrs[finite].mean()) if finite.any() else math.nan,
        "spread": spread,
    }


def pair_sample(table: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """One antithetic sample: the mean of each player's marginal contribution in perm and reversed."""
    out = np.zeros(perm.shape[0])
    for order in (perm, perm[::-1]):
        index = 0
        for player in order:
            out[player] += 0.5 * (table[index | (1 << player)] - table[index])
            index |= 1 << player
    return out


def check_nan_rule(
    method: str, n: int, budget: int, seed: int, estimate, nan: np.ndarray, table: np.ndarray
) -> None:
    """NaN exactly where the estimator's docstring says, on a game with continuous utilities."""
    if method == "permutation":
        # the plan's random orders (only the estimator knows them); the samples are computed here
        perms = permutation_plan(n, budget, seed).perms  # [m, n]
        samples = np.array([pair_sample(table, perm) for perm in perms])  # [m, n]
        no_spread = samples.std(axis=0) <= 1e-12 * np.abs(table).max()
        expected = np.full(n, len(perms) < 2 or near_all(n, budget)) | no_spread
    elif method in ("kernelshap", "regression-msr"):  # one plan, one rule (msr.py's docstring)
        distinct = estimate.diagnostics["pairs_distinct"]
        least = estimate.diagnostics["stderr_min_pairs"]
        assert least in (n, 2 * (n - 1))
        singular = estimate.diagnostics["stderr_singular"] == 1.0
        expected = np.full(n, distinct < least or near_all(n, budget) or singular)
    elif method == "banzhaf":
        plan = uniform_plan(n, budget, seed)
        inside = plan.rows[plan.samples].sum(axis=0)  # [n] samples with each player
        expected = (inside < 2) | (plan.samples.shape[0] - inside < 2)
    else:  # a new method with standard errors: add its rule here
        pytest.fail(f"no NaN rule known for {method}")
    np.testing.assert_array_equal(nan, expected, err_msg=f"{method} n={n} budget={budget} seed={seed}")


def min_budget(method: str, n: int) -> int:
    """The smallest budget the method accepts for n players (asked of the method itself)."""
    budget = 1
    while True:
        try:
            make_estimator(method, budget=budget, seed=0).validate(n)
            return budget
        except Exception:
            budget += 1


BUDGETS = {4: (8, 10, 12, 14, 16), 6: (8, 12, 16, 24, 32, 40, 48), 10: (24, 40, 64, 128, 256)}
METHODS = methods_with(reports_stderr=True, two_fidelity=False)
"""The two-fidelity methods (proxy-shapley) fit exact-only as the method they extend (regression-msr,
checked here); their two-fidelity errors' coverage is tests/attribution/estimators/test_two_fidelity.py's."""


def test_the_methods_with_standard_errors_are_the_ones_checked() -> None:
    assert set(METHODS) == {"permutation", "kernelshap", "regression-msr", "banzhaf"}
    for method in METHODS:
        assert estimator_class(method).capabilities.needs_budget


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("game", list(GAMES))
def test_coverage_of_reported_standard_errors(method: str, game: str, caplog) -> None:
    caplog.set_level(logging.ERROR)  # the estimators log every unknown error and rank warning
    pooled_finite = pooled_covered = 0
    report = []
    for n, budgets in BUDGETS.items():
        for budget in sorted({min_budget(method, n), *budgets}):
            if budget < min_budget(method, n):
                continue
            cell = run_cell(method, game, n, budget)
            report.append((n, budget, cell))
            if cell["finite"]:
                rate = cell["covered"] / cell["finite"]
                noise_low = 3 * math.sqrt(LOW * (1 - LOW) / cell["finite"])
                noise_high = 3 * math.sqrt(HIGH * (1 - HIGH) / cell["finite"])
                assert rate >= LOW - noise_low, (method, game, n, budget, cell)
                if not (method == "permutation" and game == "majority"):
                    assert rate <= HIGH + noise_high, (method, game, n, budget, cell)
                pooled_finite += cell["finite"]
                pooled_covered += cell["covered"]
    assert pooled_finite > 0
    pooled = pooled_covered / pooled_finite
    assert pooled >= LOW, (method, game, pooled, report)
    if not (method == "permutation" and game == "majority"):
        # 0/1 utilities and few permutation pairs: a player's pair samples are lumpy (0, 1/2, 1) and
        # the t interval is conservative there (98-100% at 2-7 pairs); never below 90%
        assert pooled <= HIGH, (method, game, pooled, report)


@pytest.mark.parametrize("method", ["kernelshap", "regression-msr", "permutation"])
def test_issue_case_random_six_players_budget_24(method: str, caplog) -> None:
    """The issue's case: errors at budget 24 on a random 6-player game now match the real spread."""
    caplog.set_level(logging.ERROR)
    cell = run_cell(method, "random", 6, 24)
    assert cell["finite"] >= 0.9 * cell["cells"]  # known for (nearly) every seed
    rate = cell["covered"] / cell["finite"]
    assert LOW <= rate <= HIGH, cell
    # reported errors at least as large as the real spread (before: 0.74 and 0.78 times it)
    assert cell["mean_se"] >= cell["spread"], cell
