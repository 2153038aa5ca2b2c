"""Fixtures of the application-layer tests: an exact run that the compare and evaluate tests share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.cli import run_cli as cli
from helpers.compare_runs import MESSAGES


@pytest.fixture(scope="session")
def compare_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """An exact run of :data:`helpers.compare_runs.MESSAGES` by sentence on the tiny model: ``run/`` (its
    archive) and ``exact.json`` (its ``--out`` document) in the directory returned. Tests write their
    own outputs under ``tmp_path``, never here."""
    where = tmp_path_factory.mktemp("compare")
    source = where / "chat.json"
    source.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    code, _, err = cli(["explain", str(source), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact",
                        "--archive", str(where / "run"), "--out", str(where / "exact.json"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    return where
