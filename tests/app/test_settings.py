"""The commands' settings refuse a misspelt method with the nearest registered name, as
``explain --method`` does (the one "did you mean" of the package, for replay and evaluate too)."""

from __future__ import annotations

import pytest

from helpers.cli import run_cli

from coalescence.app.settings import EvaluateSettings, ReplaySettings
from coalescence.errors import ConfigError


@pytest.mark.parametrize("settings", [ReplaySettings, EvaluateSettings])
@pytest.mark.parametrize(("methods", "meant"), [("kernalshap", "kernelshap"), ("exact,banzaf", "banzhaf"), ("LOO", "loo")])
def test_a_misspelt_method_is_refused_with_the_nearest_name(settings, methods, meant):
    with pytest.raises(ConfigError) as info:
        settings(methods=methods)
    assert info.value.field == "method"
    assert f"(did you mean {meant}?)" in info.value.message and "kernelshap" in info.value.message


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["replay", "{run}", "--method", "kernalshap"], "--method"),
        (["evaluate", "{run}", "--method", "kernalshap"], "--method"),
        (["sweep", "{chat}", "--methods", "exact,kernalshap", "--budgets", "8", "--out", "{run}/s.json"], "--methods"),
    ],
)
def test_the_commands_name_their_own_method_option_with_the_nearest_name(tmp_path, argv, flag):
    """The library's errors call the field ``method``; each command prints its own option."""
    chat = tmp_path / "chat.json"
    chat.write_text('{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}')
    code, _, err = run_cli([a.format(run=tmp_path, chat=chat) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"coalescence: error: {flag}: unknown method 'kernalshap' (did you mean kernelshap?)"), err


@pytest.mark.parametrize(
    ("given", "method"),
    [
        ({}, "default"),  # neither: the default plan (exact on at most 16 players)
        ({"budget": 64}, "auto"),
        ({"target_stderr": 0.1}, "exact"),  # refused later as before: exact reports no standard errors
        ({"interactions": 2}, "exact"),
    ],
)
def test_the_method_a_run_that_names_none_gets(given, method):
    from coalescence.app.settings import RunSettings

    if "target_stderr" in given:
        with pytest.raises(ConfigError) as caught:
            RunSettings(model="m", **given)
        assert caught.value.field == "target_stderr" and "method exact" in caught.value.message
        return
    assert RunSettings(model="m", **given).method == method


@pytest.mark.parametrize(("n", "proxy", "name", "budget"), [(1, True, "exact", None), (16, True, "exact", None), (17, True, "auto", 8), (17, False, "auto", 64), (70, True, "auto", 8)])
def test_the_default_method_resolves_by_players_and_the_proxy_game(n, proxy, name, budget):
    """The stated rule: exact Shapley values up to 16 players, else auto at 8 exact coalitions with
    the proxy game (the surrogate's floor with it), at 64 without (ContextCite's ablations)."""
    import numpy as np

    from coalescence.attribution.estimators import make_estimator

    default = make_estimator("default", seed=3)
    estimator, note = default.resolve(n, proxy=proxy)
    assert estimator.name == name and getattr(estimator, "budget", None) == budget
    assert (note is None) == (name == "exact")
    if name == "auto":
        assert estimator.seed == 3 and f"at {budget} exact coalitions" in note
        default.validate(n, proxy=proxy)  # the floor of the plan resolved: no refusal
        rows = np.array(list(estimator.plan(n)))
        assert len({r.tobytes() for r in rows}) == budget
