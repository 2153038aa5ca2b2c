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
