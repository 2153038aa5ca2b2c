"""One seed rule for every method: any non-negative integer, checked before the model loads.

numpy's ``Generator`` takes seeds of any size; sklearn (lasso's cross-validation folds, shapiq's
tree models) takes ``[0, 2**32)`` only, so a seed at or above ``2**32`` reaches those libraries as
the first 32-bit word of ``numpy.random.SeedSequence(seed)`` and a smaller one unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import run_cli

from coalescence.archive import read_manifest
from coalescence.attribution.estimators.base import library_seed

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Paris is in France.\nRome is in Italy.\n- Oslo is in Norway.\nWhere is Rome?"},
        {"role": "assistant", "content": "Rome is in Italy."},
    ]
}
SAMPLING = ("permutation", "kernelshap", "regression-msr", "banzhaf", "lasso")
BIG_SEEDS = (4294967296, 2**70)


def test_library_seed_keeps_small_seeds_and_derives_large_ones() -> None:
    # the rule: identity below 2**32 (plans of seeds that worked before stay the same), above it the
    # first uint32 word of numpy's SeedSequence, which sklearn's random_state accepts
    assert [library_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    for seed in (2**32, 2**32 + 1, 2**64, 2**70):
        expected = int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])
        assert library_seed(seed) == expected
        assert 0 <= library_seed(seed) < 2**32
    assert library_seed(2**32) != library_seed(2**32 + 1)


@pytest.mark.parametrize("seed", BIG_SEEDS, ids=["2**32", "2**70"])
@pytest.mark.parametrize("method", SAMPLING)
def test_every_sampling_method_runs_at_a_large_seed(method: str, seed: int, tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    argv = [
        "explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", method,
        "--budget", "20", "--seed", str(seed), "--archive", str(run_dir), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    code, _, stderr = run_cli(argv)
    assert code == 0, stderr
    assert stderr == ""
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert all(np.isfinite(p["value"]) for p in doc["players"])
    run = read_manifest(run_dir)["runs"][-1]
    assert run["status"] == "complete"
    assert run["run_config"]["seed"] == seed  # recorded exactly, not wrapped


@pytest.mark.parametrize("method", ["exact", "loo", *SAMPLING])
@pytest.mark.parametrize("seed", ["-1", "1.5", "seven"])
def test_a_bad_seed_is_refused_before_the_model(method: str, seed: str, tmp_path: Path) -> None:
    # no such model: the refusal must come before any model (or tokenizer) is loaded
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    run_dir = tmp_path / "run"
    argv = ["explain", str(path), "--model", str(tmp_path / "no-model"), "--method", method, "--seed", seed, "--archive", str(run_dir)]
    code, stdout, stderr = run_cli(argv)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("coalescence: error: --seed: "), stderr
    assert "non-negative integer" in stderr and "Traceback" not in stderr
    assert stdout == "" and not run_dir.exists()


def test_a_negative_seed_is_refused_by_replay_and_the_python_settings(tmp_path: Path) -> None:
    from coalescence.errors import ConfigError
    from coalescence.app.settings import ReplaySettings, RunSettings

    code, _, stderr = run_cli(["replay", str(tmp_path / "missing"), "--seed", "-3"])
    assert code == 2 and stderr.startswith("coalescence: error: --seed: "), stderr
    for make in (lambda: RunSettings(model="m", method="exact", seed=-1), lambda: ReplaySettings(methods=("exact",), seed=-1)):
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.field == "seed" and "-1" in info.value.message
