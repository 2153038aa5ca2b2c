"""The test tree's own rules (docs/development.md): it mirrors ``src/coalescence/``, and no test
module imports another test module or ``conftest`` (what tests share lives in ``tests/helpers/``),
so that the suite runs alike under ``--import-mode=prepend`` and ``--import-mode=importlib``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "coalescence"
NOT_MIRRORS = {"helpers", "data", "integration", "benchmarks", "__pycache__"}
"""Folders of tests/ that mirror no part of src/: shared helpers, test data, the real-model tests,
the tests of research code that lives in benchmarks/ (not in the package)."""


def test_every_test_folder_mirrors_a_module_or_package_of_src() -> None:
    for folder in sorted(p for p in TESTS.rglob("*") if p.is_dir() and not NOT_MIRRORS & set(p.relative_to(TESTS).parts)):
        mirror = SRC / folder.relative_to(TESTS)
        assert mirror.is_dir() or mirror.with_suffix(".py").is_file(), f"tests/{folder.relative_to(TESTS)} mirrors nothing in src/coalescence/"


def test_no_test_module_imports_another_test_module_or_conftest() -> None:
    # the names a bare import could reach in tests/ (with tests/ or a test folder on sys.path): the
    # modules outside the helpers package, and the folders that no installed package of that name
    # shadows (``shapiq`` is the library, not tests/attribution/estimators/shapiq/)
    helpers = TESTS / "helpers"
    local = {p.stem for p in TESTS.rglob("*.py") if helpers not in p.parents}
    for folder in (p for p in TESTS.rglob("*") if p.is_dir() and p.name.isidentifier() and p != helpers):
        spec = importlib.util.find_spec(folder.name)
        if spec is None or spec.origin is None or TESTS in Path(spec.origin).parents:
            local.add(folder.name)
    offending = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # a relative import: tests/ is no package
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            offending += [f"{path.relative_to(TESTS)}:{node.lineno} imports {name}" for name in names if name.split(".")[0] in local or name.startswith(".")]
    assert offending == [], "\n".join(offending)


def test_test_module_names_are_unique() -> None:
    # pytest's default import mode (``prepend``, what ``make test`` runs) imports a test module by
    # its file name alone: two ``test_x.py`` in different folders stop the run at collection
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} and {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert clashes == [], "test modules of one name: " + "; ".join(clashes)
