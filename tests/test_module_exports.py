"""Every public module of src/ says what it exports: its __all__ names only what it has, and every
public class or function defined in it is in __all__ (the rule, stated: public = no leading
underscore in the module path or the name)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

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


def _imported_modules(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, module-level and function-level alike, relative imports
    resolved against ``module`` (its dotted name); ``from X import name`` counts ``X.name`` too (a
    submodule imported by name)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_results_never_import_their_presentation() -> None:
    """docs/development.md: imports run down the floors only. The report reads explanations; the
    attribution package (estimators and the result object) imports neither the report nor anything
    above it (the application layer, the CLI, the API)."""
    root = Path(coalescence.__file__).parent
    above = ("coalescence.report", "coalescence.app", "coalescence.cli", "coalescence.api")
    wrong = []
    for path in sorted((root / "attribution").rglob("*.py")):
        module = "coalescence." + ".".join(path.relative_to(root).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        wrong += [f"{module} -> {m}" for m in _imported_modules(path, module) if m == "coalescence" or m.startswith(above)]
    assert wrong == []
    # the reading resolves relative imports, at module level and inside a function
    assert "coalescence.attribution.interactions" in _imported_modules(root / "attribution" / "estimators" / "exact.py", "coalescence.attribution.estimators.exact")
    assert "coalescence.report.chart" in _imported_modules(root / "report" / "formatter.py", "coalescence.report.formatter")
