"""What the test modules share (never a test module itself): tiny models and tokenizers, the
chat-template corpus, archive rows, fault injection, in-process CLI runs and reference games.

Importable as ``helpers`` (``[tool.pytest.ini_options] pythonpath = ["tests"]`` in pyproject.toml),
so that no test module imports another or ``conftest`` and the suite collects alike under
``--import-mode=prepend`` and ``--import-mode=importlib``.
"""
