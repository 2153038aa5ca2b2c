"""``coalescence evaluate`` on the command line: a tiny real model's exact run (the compare tests'
fixture; every coalition archived, so no model call), its archive and its ``--out`` document alike,
and bad input as one line with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import spearmanr

from helpers.cli import run_cli as cli

from coalescence.archive import read_rows


def test_archive_and_its_document_give_one_evaluation(compare_run, tmp_path):
    code, out, err = cli(["evaluate", str(compare_run / "run"), "--out", str(tmp_path / "a.json"), "--no-progress"])
    assert code == 0, err
    assert "LDS (Spearman, 32 keep-half coalitions)" in out and "0 evaluated with the model" in out
    a = json.loads((tmp_path / "a.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    code, _, err = cli(["evaluate", str(compare_run / "exact.json"), "--out", str(tmp_path / "b.json"), "--no-progress"])
    assert code == 0, err
    b = json.loads((tmp_path / "b.json").read_text())
    assert a["results"] == b["results"] and a["model_evaluations"] == b["model_evaluations"] == 0
    # the LDS against an independent computation: the document's values, the archived v(S)
    doc = json.loads((compare_run / "exact.json").read_text())
    phi = np.array([p["value"] for p in doc["players"]])
    n = len(phi)
    held = np.random.default_rng([0, 0x68656C64]).random((32, n)) < 0.5
    table = read_rows(compare_run / "run")
    by_mask = {tuple(np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little")[:n].astype(bool)): u
               for m, u in zip(table["mask"].to_pylist(), table["utility"].to_pylist(), strict=True)}  # fmt: skip
    rho = spearmanr(held.astype(float) @ phi, [by_mask[tuple(s)] for s in held]).statistic
    assert a["results"][0]["lds"]["estimate"] == pytest.approx(rho, abs=1e-9)


@pytest.mark.parametrize("kind", ["no run", "empty file"])
def test_bad_source_is_one_line_exit_2(tmp_path, kind):
    if kind == "no run":
        source = tmp_path / "some-dir"
        source.mkdir()
    else:
        source = tmp_path / "empty.json"
        source.write_text("")
    code, out, err = cli(["evaluate", str(source), "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("coalescence: error: RUN_OR_DOC: "), err


def test_too_few_coalitions_names_the_option(compare_run):
    code, out, err = cli(["evaluate", str(compare_run / "run"), "--coalitions", "1", "--no-progress"])
    assert code == 2 and out == "" and err.startswith("coalescence: error: --coalitions: must be an integer >= 2"), err


def test_missing_coalitions_are_evaluated_with_the_runs_model_once(tmp_path, tiny_model_dir):
    """A leave-one-out run holds n + 1 coalitions: evaluate loads the run's model (no --model given)
    for the rest and archives them; the same command again makes no model evaluation."""
    from helpers.compare_runs import MESSAGES

    source = tmp_path / "chat.json"
    source.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    code, _, err = cli(["explain", str(source), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo",
                        "--archive", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    before = read_rows(tmp_path / "run").num_rows
    code, first, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "8"])
    assert code == 0, err
    assert err.count("coalescence: loading ") == 1  # it says which model it loads, as explain does
    evaluated = int(first.rsplit("coalitions: ", 1)[1].split(" evaluated")[0])
    assert evaluated > 0 and read_rows(tmp_path / "run").num_rows == before + evaluated
    code, second, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "8"])
    assert code == 0, err
    assert "coalitions: 0 evaluated with the model" in second and "loading" not in err
    assert first.rsplit("\n", 2)[0] == second.rsplit("\n", 2)[0]  # the same numbers, from the archive
