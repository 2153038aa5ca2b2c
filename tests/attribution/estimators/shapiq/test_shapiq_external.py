"""The approximators of shapiq 1.5 and later (RegressionMSR, ProxySHAP, LeverageSHAP, PolySHAP,
OddSHAP), which need Python >= 3.12, run by the external shapiq (a worker in another interpreter)
as coalescence methods on this Python 3.11 install.

Reference independent of the adapter and its worker: shapiq itself, called in the external
interpreter by a script written here on the same game formula (the same approximator,
random_state and budget), and the Shapley formula enumerated in this file. Everything is real: the
external interpreter is the one `make install` sets up (.venv-shapiq, Python 3.12, shapiq 1.8);
without one these tests skip, saying how to get it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers.games import brute_force_shapley

from coalescence.attribution.estimators import make_estimator
from coalescence.attribution.estimators import shapiq as adapter
from coalescence.errors import BackendUnavailable, ConfigError

EXTERNAL = adapter.external_shapiq()
pytestmark = pytest.mark.skipif(
    EXTERNAL is None, reason=f"no external shapiq: `make install` sets one up (.venv-shapiq), or set {adapter.ENV_PYTHON}"
)

NEWER = ("RegressionMSR", "ProxySHAP", "LeverageSHAP", "PolySHAP", "OddSHAP")

# v(S) = w.x + 1.5 [0 and 1 in S] - 0.7 [2, 3, 4 in S] + sin(sum_k k x_k): the same formula here
# and in the script run by the external interpreter
GAME_SOURCE = """
import numpy as np
def make_game(n, seed=0):
    w = np.random.default_rng(seed).normal(size=n)
    def game(coalitions):
        x = np.atleast_2d(np.asarray(coalitions, dtype=bool))
        return x @ w + 1.5 * (x[:, 0] & x[:, 1]) - 0.7 * (x[:, 2] & x[:, 3] & x[:, 4]) + np.sin(x @ np.arange(1.0, n + 1))
    return game
"""
namespace: dict = {}
exec(GAME_SOURCE, namespace)  # noqa: S102 - the one formula both interpreters run
make_game = namespace["make_game"]


def shapiq_in_the_external_python(name: str, n: int, budget: int, seed: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """(values, every coalition asked) of shapiq's approximator run directly on the game."""
    script = GAME_SOURCE + textwrap.dedent(
        f"""
        import json, warnings
        warnings.simplefilter("ignore")
        import shapiq
        game = make_game({n})
        asked = []
        def recording(c):
            asked.append(np.atleast_2d(c).astype(int).tolist())
            return game(c)
        cls = getattr(shapiq.approximator, {name!r})
        result = cls(n={n}, random_state={seed}, **{options!r}).approximate(budget={budget}, game=recording)
        print(json.dumps({{"values": [float(result[(i,)]) for i in range({n})], "asked": [r for a in asked for r in a]}}))
        """
    )
    out = subprocess.run([EXTERNAL.python, "-I", "-c", script], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    return np.array(doc["values"]), np.array(doc["asked"], dtype=bool)


def test_the_newer_approximators_are_methods_run_by_the_external_shapiq():
    names = adapter.approximator_names()
    assert set(NEWER) <= set(names)
    assert "shapiq 1.8" in EXTERNAL.version() and "Python 3.1" in EXTERNAL.version()
    for name in NEWER:
        assert adapter.approximator_estimator(f"shapiq:{name}").runtime is EXTERNAL
    # what the shapiq of this Python has stays here (plans of earlier runs unchanged)
    assert adapter.approximator_estimator("shapiq:KernelSHAP").runtime is not EXTERNAL


@pytest.mark.parametrize("name", NEWER)
def test_plan_is_what_shapiq_asks_for_and_fit_equals_shapiq_on_the_game(name):
    n, budget, seed = 7, 60, 3
    game = make_game(n)
    estimator = make_estimator(f"shapiq:{name}", budget=budget, seed=seed)
    plan = np.array(list(estimator.plan(n)))
    estimate = estimator.fit(plan, game(plan))
    assert len(plan) <= budget and len({r.tobytes() for r in plan}) == len(plan)
    assert not plan[0].any() and plan[1].all()
    again = np.array(list(make_estimator(f"shapiq:{name}", budget=budget, seed=seed).plan(n)))
    np.testing.assert_array_equal(plan, again)
    options = {"index": "SV"} if name in ("RegressionMSR", "ProxySHAP") else {}
    if name == "ProxySHAP":
        options["max_order"] = 1
    direct, asked = shapiq_in_the_external_python(name, n, int(estimate.diagnostics["shapiq_budget"]), seed, options)
    planned = {r.tobytes() for r in plan}
    assert asked.size and all(r.tobytes() in planned for r in asked)
    np.testing.assert_allclose(estimate.values, direct, rtol=0, atol=1e-9)
    assert estimate.v_empty == game(np.zeros(n, bool))[0] and estimate.v_full == game(np.ones(n, bool))[0]
    assert estimate.n_evaluations == len(plan) and estimate.stderr is None


def test_leverage_shap_with_every_coalition_gives_the_shapley_formula():
    n = 6
    game = make_game(n)
    estimator = make_estimator("shapiq:LeverageSHAP", budget=2**n, seed=0)
    plan = np.array(list(estimator.plan(n)))
    estimate = estimator.fit(plan, game(plan))
    np.testing.assert_allclose(estimate.values, brute_force_shapley(game, n), atol=1e-8)


def test_a_pool_without_the_plan_is_refused():
    n = 7
    estimator = make_estimator("shapiq:RegressionMSR", budget=40, seed=0)
    plan = np.array(list(estimator.plan(n)))
    from coalescence.errors import EstimatorError

    with pytest.raises(EstimatorError, match="misses"):
        estimator.fit(plan[:-3], make_game(n)(plan[:-3]))


@pytest.fixture
def fresh_caches():
    adapter.approximator_estimator.cache_clear()
    yield
    adapter.approximator_estimator.cache_clear()


def test_no_external_shapiq_names_the_setup(monkeypatch, tmp_path, fresh_caches):
    monkeypatch.delenv(adapter.ENV_PYTHON, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no link beside it
    assert adapter.external_shapiq() is None
    with pytest.raises(ConfigError) as info:
        adapter.approximator_estimator("shapiq:RegressionMSR")
    message = str(info.value)
    assert info.value.field == "method" and "Python 3.12" in message and adapter.ENV_PYTHON in message and "\n" not in message


def test_a_bad_external_python_is_one_clear_error(monkeypatch, tmp_path, fresh_caches):
    monkeypatch.setenv(adapter.ENV_PYTHON, str(tmp_path / "no-such-python"))
    with pytest.raises(BackendUnavailable, match=adapter.ENV_PYTHON):
        adapter.approximator_estimator("shapiq:RegressionMSR")
    # a real interpreter without shapiq: the worker stops at its import, the error says so
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    monkeypatch.setenv(adapter.ENV_PYTHON, str(bare / "bin" / "python"))
    with pytest.raises(BackendUnavailable) as info:
        adapter.approximator_estimator("shapiq:RegressionMSR")
    assert "ModuleNotFoundError" in str(info.value) and "\n" not in str(info.value)


def test_an_option_after_the_name_reaches_the_approximator():
    """shapiq:RegressionMSR:proxy_model=linear is RegressionMSR(proxy_model="linear"): its plan
    (Leverage-SHAP sampling weights) and values equal shapiq's own with that option, and differ
    from the default proxy's."""
    n, budget, seed = 7, 60, 1
    game = make_game(n)
    estimator = make_estimator("shapiq:RegressionMSR:proxy_model=linear", budget=budget, seed=seed)
    plan = np.array(list(estimator.plan(n)))
    estimate = estimator.fit(plan, game(plan))
    options = {"index": "SV", "proxy_model": "linear"}
    direct, asked = shapiq_in_the_external_python("RegressionMSR", n, int(estimate.diagnostics["shapiq_budget"]), seed, options)
    planned = {r.tobytes() for r in plan}
    assert all(r.tobytes() in planned for r in asked)
    np.testing.assert_allclose(estimate.values, direct, rtol=0, atol=1e-9)
    default = make_estimator("shapiq:RegressionMSR", budget=budget, seed=seed)
    default_plan = np.array(list(default.plan(n)))
    assert not np.allclose(default.fit(default_plan, game(default_plan)).values, estimate.values)


@pytest.mark.parametrize(
    ("method", "words"),
    [
        ("shapiq:RegressionMSR:proxy=linear", "takes no option 'proxy'; it takes proxy_model"),
        ("shapiq:RegressionMSR:random_state=3", "takes no option 'random_state'"),
        ("shapiq:RegressionMSR:proxy_model", "KEY=VALUE"),
    ],
)
def test_a_bad_option_names_the_method_field(method, words):
    with pytest.raises(ConfigError, match=words) as info:
        make_estimator(method, budget=64)
    assert info.value.field == "method"
