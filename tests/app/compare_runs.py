"""What the compare tests share: one conversation, the CLI called in-process, and an exact run of
it (the fixture ``compare_run``, imported by each test module that uses it)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from coalescence.cli import main

MESSAGES = [
    {"role": "system", "content": "You answer from the context."},
    {"role": "user", "content": "The Eiffel Tower was completed in 1889.\nBig Ben was finished in 1859.\n- Pisa took two centuries.\nWhen was the tower completed?"},
    {"role": "assistant", "content": "In 1889."},
]


def cli(argv: list[str]) -> tuple[int, str, str]:
    """``coalescence ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def compare_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """An exact run of :data:`compare_runs.MESSAGES` by sentence on the tiny model: ``run/`` (its
    archive) and ``exact.json`` (its ``--out`` document) in the directory returned. Tests write their
    own outputs under ``tmp_path``, never here."""
    where = tmp_path_factory.mktemp("compare")
    source = where / "chat.json"
    source.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    code, _, err = cli(["explain", str(source), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact",
                        "--archive", str(where / "run"), "--out", str(where / "exact.json"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    return where
