"""An archive written by coalescence 0.1.0 before content fingerprints (coalition keys of schema 1,
old whitespace rule): it replays with the values it holds and is never extended with a model.

``tests/data/legacy-v1-run`` was written by the previous version (commit e836cd8) on a tiny random
model: ``explain chat.json --unit sentence --method exact`` over 4 players.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from helpers.cli import run_cli_quiet as run

from coalescence.masking.codec import PackedMask

LEGACY = Path(__file__).parents[1] / "data" / "legacy-v1-run"


def test_legacy_archive_replays_its_exact_values_without_a_model(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(LEGACY, run_dir)
    code, _, err = run(["replay", str(run_dir), "--method", "exact", "--out", str(tmp_path / "r.json")])
    assert code == 0, err
    doc = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["explanations"][0]
    # the reference: Shapley's formula on the archived utilities, read straight from Parquet
    table = pq.read_table(next((LEGACY / "parts").glob("*.parquet")))
    n = doc_n = len(doc["players"])
    v = {}
    for words, bits, u in zip(table["mask"].to_pylist(), table["n_bits"].to_pylist(), table["utility"].to_pylist(), strict=True):
        v[tuple(PackedMask(words, bits).to_bools())] = u
    assert len(v) == 2**n == 16 and doc_n == 4
    for i in range(n):
        phi = 0.0
        for others in itertools.product([False, True], repeat=n - 1):
            s = list(others[:i]) + [False] + list(others[i:])
            k = sum(s)
            w = math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
            with_i = s.copy()
            with_i[i] = True
            phi += w * (v[tuple(with_i)] - v[tuple(s)])
        assert abs(doc["players"][i]["value"] - phi) < 1e-9


def test_legacy_archive_is_not_resumed_with_a_model(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(LEGACY, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    snapshot = manifest["snapshots"][0]
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": snapshot["messages"], "target": snapshot["target"]}), encoding="utf-8")
    before = sorted(p.name for p in (run_dir / "parts").iterdir())
    argv = ["explain", str(chat), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact", "--archive", str(run_dir)]
    code, out, err = run(argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "another model" in err and "--new-run" in err
    assert sorted(p.name for p in (run_dir / "parts").iterdir()) == before
    assert json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")) == manifest
    # --new-run adds a run with this version's keys: nothing of the old game is served to it
    code, out, err = run([*argv, "--new-run"])
    assert code == 0, err
    runs = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))["runs"]
    assert len(runs) == 2 and runs[1]["statistics"]["executed"] == 16
    np.testing.assert_equal(len(before), 1)
