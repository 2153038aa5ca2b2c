"""The commands' settings refuse a misspelt method with the nearest registered name, as
``explain --method`` does (the one "did you mean" of the package, for replay and evaluate too)."""

from __future__ import annotations

import pytest

from coalescence.app.settings import EvaluateSettings, ReplaySettings
from coalescence.errors import ConfigError


@pytest.mark.parametrize("settings", [ReplaySettings, EvaluateSettings])
@pytest.mark.parametrize(("methods", "meant"), [("kernalshap", "kernelshap"), ("exact,banzaf", "banzhaf"), ("LOO", "loo")])
def test_a_misspelt_method_is_refused_with_the_nearest_name(settings, methods, meant):
    with pytest.raises(ConfigError) as info:
        settings(methods=methods)
    assert info.value.field == "method"
    assert f"(did you mean {meant}?)" in info.value.message and "kernelshap" in info.value.message
