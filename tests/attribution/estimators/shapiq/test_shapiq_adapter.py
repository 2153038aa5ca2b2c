"""shapiq's approximators as coalescence methods: the plan is what shapiq asks for, the fit equals
shapiq run directly on the game, full budgets give the exact values of the Shapley formula written
here, and the exact interaction indices of analytic games have their closed forms.

References independent of the adapter: shapiq itself called on the game function (the same
approximator, random_state and budget); the Shapley formula and the pairwise Shapley interaction
index enumerated over all coalitions in this file; closed forms of a pairwise game.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

shapiq = pytest.importorskip("shapiq", reason="the shapiq extra: pip install -c constraints.txt 'coalescence[shapiq]'")

from helpers.games import brute_force_shapley

from coalescence.attribution.estimators import estimator_class, make_estimator  # noqa: E402
from coalescence.attribution.estimators.shapiq import approximator_names  # noqa: E402
from coalescence.errors import ConfigError, EstimatorError  # noqa: E402

SV_APPROXIMATORS = (
    "KernelSHAP", "UnbiasedKernelSHAP", "SVARM", "PermutationSamplingSV", "StratifiedSamplingSV", "OwenSamplingSV",
    "kADDSHAP", "KernelSHAPIQ", "SVARMIQ", "SHAPIQ", "RegressionFSII", "InconsistentKernelSHAPIQ",
)  # fmt: skip


class Game:
    """v(S) = sum of weights + bonus * [a and b in S] - penalty * [c, d, e all in S] + sin(sum k x_k)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.n = n
        self.w = rng.normal(size=n)

    def __call__(self, coalitions: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(np.asarray(coalitions, dtype=bool))
        return (
            x @ self.w + 1.5 * (x[:, 0] & x[:, 1]) - 0.7 * (x[:, 2] & x[:, 3] & x[:, 4]) + np.sin(x @ np.arange(1.0, self.n + 1))
        )


def brute_force_sii_pairs(game, n: int) -> dict[tuple[int, int], float]:
    """SII_ij = sum_{S without i, j} |S|! (n-|S|-2)! / (n-1)! * (v(S+ij) - v(S+i) - v(S+j) + v(S))."""
    out = {}
    for i, j in itertools.combinations(range(n), 2):
        others = [k for k in range(n) if k not in (i, j)]
        total = 0.0
        for r in range(n - 1):
            for subset in itertools.combinations(others, r):
                base = np.zeros(n, bool)
                base[list(subset)] = True
                si, sj, sij = base.copy(), base.copy(), base.copy()
                si[i] = sj[j] = sij[i] = sij[j] = True
                delta = game(sij)[0] - game(si)[0] - game(sj)[0] + game(base)[0]
                total += math.factorial(r) * math.factorial(n - r - 2) / math.factorial(n - 1) * delta
        out[(i, j)] = total
    return out


def fit(method: str, game, n: int, budget: int, seed: int = 0, **extra):
    estimator = make_estimator(method, budget=budget, seed=seed, **extra)
    plan = np.array(list(estimator.plan(n)))
    return estimator, plan, estimator.fit(plan, game(plan))


def shapiq_direct(name: str, game, n: int, budget: int, seed: int, **options) -> np.ndarray:
    cls = getattr(shapiq.approximator, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = cls(n=n, random_state=seed, **options).approximate(budget=budget, game=game)
    return np.array([result[(i,)] for i in range(n)])


def test_every_shapiq_approximator_is_a_method():
    names = approximator_names()
    assert {"KernelSHAP", "SVARM", "KernelSHAPIQ", "ProxySPEX", "PermutationSamplingSV"} <= set(names)
    for name in names:
        cls = estimator_class(f"shapiq:{name}")
        assert cls.capabilities.needs_budget and not cls.capabilities.reports_stderr
    assert set(estimator_class("shapiq:KernelSHAPIQ").capabilities.interaction_indices) == {"SII", "k-SII"}
    assert estimator_class("shapiq:KernelSHAP").capabilities.interaction_indices == ()


@pytest.mark.parametrize("name", SV_APPROXIMATORS)
def test_plan_is_what_shapiq_asks_for_and_fit_equals_shapiq_on_the_game(name):
    n, budget, seed = 7, 60, 3
    game = Game(n)
    estimator, plan, estimate = fit(f"shapiq:{name}", game, n, budget, seed)
    # at most the budget of distinct coalitions, the empty and the grand coalition first
    assert len(plan) <= budget and len({r.tobytes() for r in plan}) == len(plan)
    assert not plan[0].any() and plan[1].all()
    # the same seed plans the same coalitions; another seed (almost always) others
    again = np.array(list(make_estimator(f"shapiq:{name}", budget=budget, seed=seed).plan(n)))
    np.testing.assert_array_equal(plan, again)
    # every coalition shapiq asks for on the real game is in the plan
    asked: list[np.ndarray] = []

    def recording(c):
        asked.append(np.atleast_2d(c).copy())
        return game(c)

    options = {"index": "SV"} if name in ("SVARM", "KernelSHAPIQ", "SVARMIQ", "SHAPIQ", "InconsistentKernelSHAPIQ") else {}
    if name in ("KernelSHAPIQ", "SVARMIQ", "SHAPIQ", "RegressionFSII", "InconsistentKernelSHAPIQ"):
        options["max_order"] = 1
    shapiq_budget = int(estimate.diagnostics["shapiq_budget"])
    direct = shapiq_direct(name, recording, n, shapiq_budget, seed, **options)
    planned = {r.tobytes() for r in plan}
    assert all(r.tobytes() in planned for r in np.concatenate(asked))
    # values identical to shapiq run on the game itself
    np.testing.assert_allclose(estimate.values, direct, rtol=0, atol=1e-9)
    assert estimate.v_empty == game(np.zeros(n, bool))[0] and estimate.v_full == game(np.ones(n, bool))[0]
    assert estimate.n_evaluations == len(plan) and estimate.stderr is None


@pytest.mark.parametrize("name", ["KernelSHAP", "UnbiasedKernelSHAP", "SVARM", "KernelSHAPIQ", "SHAPIQ"])
def test_a_budget_of_every_coalition_gives_the_shapley_formula(name):
    n = 6
    game = Game(n, seed=1)
    _, plan, estimate = fit(f"shapiq:{name}", game, n, 2**n)
    assert len(plan) == 2**n
    np.testing.assert_allclose(estimate.values, brute_force_shapley(game, n), atol=1e-6)
    assert abs(estimate.efficiency_gap) < 1e-6


def test_exact_pairwise_sii_and_k_sii_of_a_pairwise_game_have_their_closed_form():
    n = 5
    w = np.array([0.5, -1.0, 2.0, 0.25, 1.0])

    def game(c):
        x = np.atleast_2d(c)
        return x @ w + 3.0 * (x[:, 1] & x[:, 3])  # one pairwise bonus: SII_13 = 3, every other pair 0

    _, plan, estimate = fit("exact", game, n, None, interactions=2, index="SII")
    pairs = dict(estimate.interactions)
    assert len(pairs) == math.comb(n, 2)
    for pair, value in pairs.items():
        assert value == pytest.approx(3.0 if pair == (1, 3) else 0.0, abs=1e-12)
    # Shapley values are still the values: the bonus split in halves
    np.testing.assert_allclose(estimate.values, w + np.array([0, 1.5, 0, 1.5, 0]), atol=1e-12)
    # k-SII of the top order equals SII
    _, _, k_sii = fit("exact", game, n, None, interactions=2, index="k-SII")
    assert dict(k_sii.interactions) == pytest.approx(pairs, abs=1e-12)


def test_exact_sii_of_a_richer_game_equals_the_definition():
    n = 6
    game = Game(n, seed=2)
    _, _, estimate = fit("exact", game, n, None, interactions=2, index="SII")
    truth = brute_force_sii_pairs(game, n)
    assert dict(estimate.interactions) == pytest.approx(truth, abs=1e-9)


def test_kernelshapiq_at_full_budget_finds_the_exact_sii_pairs():
    n = 6
    game = Game(n, seed=2)
    _, _, estimate = fit("shapiq:KernelSHAPIQ", game, n, 2**n, interactions=2, index="SII")
    assert estimate.interaction_index == "SII"
    assert dict(estimate.interactions) == pytest.approx(brute_force_sii_pairs(game, n), abs=1e-6)
    np.testing.assert_allclose(estimate.values, brute_force_shapley(game, n), atol=1e-6)  # SII order 1 = SV


def test_a_pool_without_the_plan_is_refused():
    n = 6
    game = Game(n)
    estimator, plan, _ = fit("shapiq:KernelSHAP", game, n, 40)
    with pytest.raises(EstimatorError, match="misses 1 of the"):
        estimator.fit(plan[1:], game(plan[1:]))


@pytest.mark.parametrize(
    ("method", "extra", "field", "words"),
    [
        ("shapiq:NoSuchThing", {}, "method", "choose one of: "),
        ("shapiq:svarm", {}, "method", "did you mean shapiq:SVARM\\?"),
        ("shapiq:KernelShap", {}, "method", "did you mean shapiq:KernelSHAP\\?"),
        ("kernelshap", {"interactions": 2}, "interactions", "computes no interactions"),
        ("shapiq:KernelSHAP", {"interactions": 2}, "interactions", "computes no interactions"),
        ("shapiq:KernelSHAPIQ", {"interactions": 2, "index": "FSII"}, "index", "SII, k-SII"),
        ("shapiq:KernelSHAPIQ", {"interactions": 1}, "interactions", "2 or more"),
        ("exact", {"index": "SII"}, "index", "applies with --interactions ORDER"),
        ("shapiq:PermutationSamplingSTII", {}, "method", "interactions only \\(STII\\)"),
    ],
)
def test_bad_settings_name_the_field(method, extra, field, words):
    with pytest.raises(ConfigError, match=words) as info:
        make_estimator(method, budget=64, **extra)
    assert info.value.field == field


def test_a_budget_the_approximator_cannot_use_is_a_config_error():
    estimator = make_estimator("shapiq:SPEX", budget=20)
    with pytest.raises(ConfigError) as info:
        estimator.validate(8)
    assert info.value.field == "budget" and "budget" in str(info.value)


def test_proxyspex_fit_equals_proxyspex_on_the_game():
    """The SPEX family holds samplers and a proxy model of its own: the copied approximator must
    still be a fresh one (same values as shapiq run directly, twice in a row)."""
    n, budget, seed = 8, 96, 4
    game = Game(n, seed=3)
    _, _, first = fit("shapiq:ProxySPEX", game, n, budget, seed)
    _, _, second = fit("shapiq:ProxySPEX", game, n, budget, seed)
    direct = shapiq_direct("ProxySPEX", game, n, int(first.diagnostics["shapiq_budget"]), seed, index="SV", max_order=1)
    np.testing.assert_allclose(first.values, direct, atol=1e-9)
    np.testing.assert_array_equal(first.values, second.values)


def test_an_interactions_only_approximator_runs_with_its_index():
    """Shapley-Taylor (STII) of order 2 on a game with one pairwise bonus: order-1 terms are
    v({i}) - v(empty), the pair (0, 1) carries the bonus 1.5, every other pair 0, and the terms
    sum to v(N) - v(empty) (Sundararajan et al. 2020). shapiq's permutation sampler needs more
    evaluations than 2^n to cover every pair; the distinct coalitions stay at most 2^n."""
    n = 5
    w = np.random.default_rng(4).normal(size=n)

    def game(c):
        x = np.atleast_2d(c)
        return x @ w + 1.5 * (x[:, 0] & x[:, 1])

    _, plan, estimate = fit("shapiq:PermutationSamplingSTII", game, n, 400, interactions=2, index="STII")
    assert len(plan) <= 2**n
    assert estimate.interaction_index == "STII" and len(estimate.interactions) == 10
    np.testing.assert_allclose(estimate.values, w, atol=1e-9)
    for pair, value in estimate.interactions:
        assert value == pytest.approx(1.5 if pair == (0, 1) else 0.0, abs=1e-9)
    total = estimate.values.sum() + sum(v for _, v in estimate.interactions)
    assert total == pytest.approx(estimate.v_full - estimate.v_empty, abs=1e-9)


def test_an_efficient_index_counts_its_interactions_in_the_efficiency_gap():
    """k-SII is efficient over all its orders: order-1 terms plus pairs sum to v(N) - v(empty), so
    the gap of a k-SII estimate counts the pairs; SII's order-1 terms are Shapley values alone."""
    n = 6
    game = Game(n, seed=5)
    _, _, k_sii = fit("shapiq:KernelSHAPIQ", game, n, 2**n, interactions=2, index="k-SII")
    span = k_sii.v_full - k_sii.v_empty
    pairs = sum(v for _, v in k_sii.interactions)
    assert abs(pairs) > 0.1  # the game has interactions: the order-1 terms alone are not efficient
    assert k_sii.values.sum() + pairs == pytest.approx(span, abs=1e-6)
    assert abs(k_sii.efficiency_gap) < 1e-6
    _, _, sii = fit("shapiq:KernelSHAPIQ", game, n, 2**n, interactions=2, index="SII")
    assert abs(sii.efficiency_gap) < 1e-6  # order-1 SII = Shapley values, efficient alone


def test_an_option_after_the_name_reaches_the_approximator_here():
    """shapiq:KernelSHAP:pairing_trick=true is KernelSHAP(pairing_trick=True) of this Python's
    shapiq: values equal shapiq's own with that option, and differ from the default's."""
    n, budget, seed = 7, 50, 2
    game = Game(n)
    estimator, plan, estimate = fit("shapiq:KernelSHAP:pairing_trick=true", game, n, budget, seed)
    direct = shapiq_direct("KernelSHAP", game, n, int(estimate.diagnostics["shapiq_budget"]), seed, pairing_trick=True)
    np.testing.assert_allclose(estimate.values, direct, rtol=0, atol=1e-9)
    _, _, default = fit("shapiq:KernelSHAP", game, n, budget, seed)
    assert not np.allclose(default.values, estimate.values)
