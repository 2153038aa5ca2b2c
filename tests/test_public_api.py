"""The curated public front: __all__ is exactly the public names, each documented."""

from __future__ import annotations

import inspect

import coalescence


def test_all_matches_public_names():
    public = {
        name
        for name, obj in vars(coalescence).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    }
    live = {"UTILITY_KINDS"}  # served by the package's __getattr__ (PEP 562): read live from the registry
    assert set(coalescence.__all__) - {"__version__"} == public | live
    assert isinstance(coalescence.__all__, tuple)
    assert len(set(coalescence.__all__)) == len(coalescence.__all__)


def test_every_public_name_has_a_docstring():
    missing = [
        name
        for name in coalescence.__all__
        if name != "__version__" and not inspect.getdoc(getattr(coalescence, name))
    ]
    assert missing == []


def test_import_does_not_load_torch():
    import subprocess
    import sys

    code = "import sys, coalescence; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
