"""``proxy-shapley-shrunk`` (issue 37): the cross-fitted two-fidelity Shapley estimate blended
toward its control's own Shapley values with jackknife weights.

The game is a Harsanyi-dividend game (``v(S) = v0 + sum_T d_T [T subset of S]``) whose Shapley
values are written here in closed form (each dividend split equally among its members; Harsanyi
1963); the proxy is a game of moved dividends plus a smooth nonlinear term (correlated, biased).
The blend's rule is re-derived here from its statement (weighted ridge control by numpy's lstsq,
each pair left out by a loop, the weights by the formula), not read from the package.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coalescence.attribution.estimators import make_estimator, methods_with
from coalescence.attribution.estimators.kernel import _build_plan
from coalescence.attribution.estimators.proxy import ShrunkTwoFidelityShapley, TwoFidelityShapley
from coalescence.attribution.estimators.proxy.shapley import cross_fitted_shapley, default_ridge

N = 8
MASKS = np.array([[(k >> i) & 1 for i in range(N)] for k in range(1 << N)], dtype=bool)
_rng = np.random.default_rng(21)
TERMS = {(i,): float(_rng.normal()) for i in range(N)}
for _t in itertools.islice(itertools.combinations(range(N), 2), 1, 28, 4):
    TERMS[_t] = float(_rng.normal(0.0, 1.5))
for _t in itertools.islice(itertools.combinations(range(N), 3), 3, 56, 17):
    TERMS[_t] = float(_rng.normal(0.0, 2.0))


def play(terms: dict, v0: float) -> np.ndarray:
    out = np.full(MASKS.shape[0], v0)
    for players, d in terms.items():
        out += d * MASKS[:, list(players)].all(axis=1)
    return out


V = play(TERMS, 0.4)
PHI = np.zeros(N)
for _players, _d in TERMS.items():
    PHI[list(_players)] += _d / len(_players)
_OTHER = {t: 0.8 * d + float(_rng.normal(0.0, 0.25)) for t, d in TERMS.items()}
C = play(_OTHER, 0.1) + 0.6 * np.sin(MASKS @ _rng.normal(0.0, 0.4, size=N))
INDEX = {tuple(row): k for k, row in enumerate(MASKS)}


def shrunk(budget: int, seed: int):
    return ShrunkTwoFidelityShapley(budget=budget, seed=seed).fit_two_fidelity(MASKS, V, MASKS, C)


def unbiased(budget: int, seed: int):
    return TwoFidelityShapley(budget=budget, seed=seed).fit_two_fidelity(MASKS, V, MASKS, C)


def by_hand(budget: int, seed: int):
    """The blend of the module docs by hand: ``(values, lambda, d, delta^2, m)``."""
    plan = _build_plan(N, budget, seed)
    rows = [INDEX[tuple(r)] for r in plan.rows]
    u, c = V[rows], C[rows]
    est = TwoFidelityShapley(budget=budget, seed=seed)
    phi_c = est._proxy_estimator(N).fit(MASKS, C).values
    fit = cross_fitted_shapley(plan.rows, plan.pairs, plan.enumerated, plan.sampled_mass, u, c, phi_c)
    np.testing.assert_allclose(fit.values, unbiased(budget, seed).values, atol=1e-12)
    m = len(rows)
    z = plan.rows.astype(float)
    sizes = z.sum(axis=1)
    draws = np.bincount(plan.pairs.ravel(), minlength=m).astype(float)
    base = draws.copy()
    base[plan.enumerated] = 1.0
    base[:2] = 1.0
    w = base * np.where((sizes > 0) & (sizes < N), sizes * (N - sizes) / N, 1.0)
    x = np.column_stack([np.ones(m), c, z])
    pen = np.sqrt(3.2 * N * N / m)
    total = V[-1] - V[0]

    def control(weights: np.ndarray) -> np.ndarray:
        a = np.vstack([np.sqrt(weights)[:, None] * x, np.hstack([np.zeros((N, 2)), pen * np.eye(N)])])
        y = np.concatenate([np.sqrt(weights) * u, np.zeros(N)])
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        t = coef[1] * phi_c + coef[2:]
        return t + (total - t.sum()) / N

    t_full = control(w)
    pairs = sorted({tuple(sorted(p)) for p in plan.pairs.tolist()})
    assert len(pairs) == plan.pairs.shape[0]  # no repeated pair at this seed: one draw each
    p_count = len(pairs)
    rep_u, rep_t = [], []
    for k, (i, j) in enumerate(pairs):
        left = w.copy()
        left[i] -= w[i] / draws[i]
        left[j] -= w[j] / draws[j]
        rep_t.append(control(left))
        rep_u.append(np.mean(np.delete(fit.psi, k, axis=0), axis=0))  # the mean of the other pairs' terms
    rep_u, rep_t = np.array(rep_u), np.array(rep_t)
    rep_d = rep_u - rep_t
    var_d = (p_count - 1) / p_count * ((rep_d - rep_d.mean(0)) ** 2).sum(0)
    cov = (p_count - 1) / p_count * ((rep_u - rep_u.mean(0)) * (rep_d - rep_d.mean(0))).sum(0)
    d = fit.values - t_full
    delta2 = max(0.0, float(np.mean(d**2 - var_d)))
    lam = np.clip(cov / (var_d + delta2), 0.0, 1.0)
    blend = fit.values - lam * d
    blend += (total - blend.sum()) * lam * var_d / (lam * var_d).sum()
    return blend, lam, d, delta2, m


def test_the_blend_follows_its_stated_rule() -> None:
    """One seed, by hand (:func:`by_hand`): the control a + b c + sum beta_i z_i fitted by weighted
    ridge least squares (rows weighted by draws x |S|(n-|S|)/n, beta penalised by 3.2 n^2 / m) on all
    the plan's rows and without each pair; t = b phi(c) + beta shifted to sum to v(N) - v(empty);
    the weights lambda_i = Cov_jk(u_i, d_i) / (Var_jk(d_i) + delta^2) clipped to [0, 1]; the sum
    restored in proportion to lambda_i Var_jk(d_i)."""
    blend, lam, d, delta2, m = by_hand(40, 6)
    got = ShrunkTwoFidelityShapley(budget=40, seed=6).fit_two_fidelity(MASKS, V, MASKS, C)
    np.testing.assert_allclose(got.values, blend, atol=1e-9)
    assert got.diagnostics["shrink_weight"] == pytest.approx(lam.mean(), abs=1e-9)
    assert 0.0 < lam.mean() < 1.0  # a real blend at this budget, not either end
    assert default_ridge(N, m) == pytest.approx(3.2 * N * N / m)


def test_the_standard_errors_bound_the_bias_toward_the_control() -> None:
    """stderr_i >= lambda_i max(|d_i|, delta) (the stated bias bound; by hand, seeds whose pairs are
    all distinct)."""
    for seed in (0, 6, 8, 9, 10):
        _, lam, d, delta2, _ = by_hand(40, seed)
        got = ShrunkTwoFidelityShapley(budget=40, seed=seed).fit_two_fidelity(MASKS, V, MASKS, C)
        assert np.all(got.stderr >= lam * np.maximum(np.abs(d), np.sqrt(delta2)) - 1e-9), seed


@pytest.fixture(scope="module")
def errors() -> dict:
    """Relative errors against the closed form over 60 seeds, blend and unbiased, budgets 20-160."""
    out = {}
    for budget in (20, 24, 160):
        pairs = [(shrunk(budget, s), unbiased(budget, s)) for s in range(60)]
        out[budget] = {
            "shrunk": np.array([np.linalg.norm(a.values - PHI) for a, _ in pairs]) / np.linalg.norm(PHI),
            "unbiased": np.array([np.linalg.norm(b.values - PHI) for _, b in pairs]) / np.linalg.norm(PHI),
            "weight": np.array([a.diagnostics.get("shrink_weight", 0.0) for a, _ in pairs]),  # absent: no blend
            "gap": np.array([abs(a.efficiency_gap) for a, _ in pairs]),
            "stderr": np.array([a.stderr for a, _ in pairs]),
        }
    return out


def test_the_blend_has_less_error_than_the_unbiased_estimate_on_few_coalitions(errors) -> None:
    # measured 0.92x and 0.87x at 20 and 24 (the control a + b c + linear fits this game well; on the
    # recorded real games the blend's gain is larger, benchmarks/RESULTS.md); level from 32 on
    for budget in (20, 24):
        e = errors[budget]
        assert np.median(e["shrunk"]) < 0.95 * np.median(e["unbiased"]), (budget, np.median(e["shrunk"]), np.median(e["unbiased"]))
    assert np.median(errors[160]["shrunk"]) < 1.02 * np.median(errors[160]["unbiased"])


def test_the_blend_is_consistent_its_weights_vanish_as_the_budget_grows(errors) -> None:
    weights = [float(np.median(errors[b]["weight"])) for b in (20, 24, 160)]
    assert weights[0] > 0.2 and weights[1] > 0.2 and weights[2] < 0.02, weights  # measured 0.39, 0.31, 0.00
    assert np.median(errors[160]["shrunk"]) < 0.5 * np.median(errors[24]["shrunk"])
    # with every coalition evaluated the values are the exact Shapley values
    whole = shrunk(1 << N, seed=0)
    np.testing.assert_allclose(whole.values, PHI, atol=1e-10)


def test_the_blend_is_efficient_with_finite_standard_errors(errors) -> None:
    for budget in (20, 24, 160):
        assert errors[budget]["gap"].max() < 1e-9
        assert np.isfinite(errors[budget]["stderr"]).all() and (errors[budget]["stderr"] > 0).all()


def test_the_shrunk_method_is_registered_as_two_fidelity() -> None:
    assert "proxy-shapley-shrunk" in methods_with(two_fidelity=True)
    est = make_estimator("proxy-shapley-shrunk", budget=40, seed=2)
    assert isinstance(est, ShrunkTwoFidelityShapley) and est.name == "proxy-shapley-shrunk"
    got = est.fit_two_fidelity(MASKS, V, MASKS, C)
    assert got.method == "proxy-shapley-shrunk" and "blended toward the control" in got.notes[0]


def test_without_a_proxy_it_is_regression_msr_and_says_so() -> None:
    from coalescence.attribution.estimators import RegressionMSR

    got = ShrunkTwoFidelityShapley(budget=40, seed=3).fit(MASKS, V)
    np.testing.assert_allclose(got.values, RegressionMSR(budget=40, seed=3).fit(MASKS, V).values, atol=0)
    assert got.method == "proxy-shapley-shrunk"
    assert any("without a proxy game" in note and "regression-msr" in note for note in got.notes)


def test_a_proxy_budget_below_the_minimum_names_the_proxy_budget() -> None:
    from coalescence.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        ShrunkTwoFidelityShapley(budget=32, seed=0, proxy_budget=3).validate(N, proxy=True)
    assert caught.value.field == "proxy_budget"
    TwoFidelityShapley(budget=32, seed=0, proxy_budget=32).validate(N, proxy=True)  # at the minimum or above: fine
    ShrunkTwoFidelityShapley(budget=32, seed=0, proxy_budget=3).validate(N)  # exact rows alone: no proxy budget applies


def test_with_too_few_pairs_to_blend_it_is_the_unbiased_estimate_without_the_blend_note() -> None:
    budget = 4  # the empty and grand coalitions and one pair: no jackknife, no blend
    got, plain = shrunk(budget, 0), unbiased(budget, 0)
    np.testing.assert_allclose(got.values, plain.values, atol=0)
    assert not any("blended" in note for note in got.notes) and "shrink_weight" not in got.diagnostics
