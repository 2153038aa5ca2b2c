"""Every public module of src/ says what it exports: its __all__ names only what it has, and every
public class or function defined in it is in __all__ (the rule, stated: public = no leading
underscore in the module path or the name)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import coalescence

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(coalescence.__path__, "coalescence.")
    if not any(part.startswith("_") for part in info.name.split(".")[1:])
)


def test_the_walk_sees_the_layers() -> None:  # a walk that found nothing would pass everything below
    for name in ("coalescence.app.explain", "coalescence.snapshot", "coalescence.report.sources", "coalescence.backends.hf"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_all_matches_what_the_module_defines(name: str) -> None:
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), tuple), f"{name} has no __all__ tuple"
    assert len(set(module.__all__)) == len(module.__all__), "a name twice"
    assert [n for n in module.__all__ if not hasattr(module, n)] == []
    defined = {
        n
        for n, obj in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name
    }
    assert sorted(defined - set(module.__all__)) == []
