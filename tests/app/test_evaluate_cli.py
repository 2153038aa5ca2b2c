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


def files_of(run_dir):
    return sorted((str(p.relative_to(run_dir)), p.stat().st_size) for p in run_dir.rglob("*") if p.is_file())


def test_an_exact_runs_archive_holds_no_coalition_to_hold_out(compare_run, tmp_path):
    """An exact run's plan is every coalition (2^5 = 32 here): none is left outside it, so its archive
    is refused (one line naming the way out, nothing written); its document in a new archive
    re-creates the game there, where no plan is, and is scored on coalitions drawn by the rule."""
    before = files_of(compare_run / "run")
    code, out, err = cli(["evaluate", str(compare_run / "run"), "--out", str(tmp_path / "a.json"), "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("coalescence: error: RUN_OR_DOC: the archive's plans hold 32 of the 32 coalitions"), err
    assert "0 are left to hold out, fewer than the 10" in err and "--archive NEW_DIR" in err
    assert files_of(compare_run / "run") == before and not (tmp_path / "a.json").exists()
    code, out, err = cli(["evaluate", str(compare_run / "exact.json"), "--archive", str(tmp_path / "new"), "--out", str(tmp_path / "b.json"), "--no-progress"])
    assert code == 0, err
    assert "LDS (Spearman, 32 keep-half coalitions)" in out
    # 32 asked of a game of 32 coalitions, none in a plan: every one of them, each once
    assert "held out: every one of the 32 coalitions of the game outside the 0 coalitions in the archive's plans" in out
    b = json.loads((tmp_path / "b.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert b["results"][0]["held_out"] == {"asked": 32, "fresh": 32, "capped": False, "plan_coalitions": 0, "skipped_in_plans": 0, "skipped_repeats": 0}
    # the LDS against an independent computation: every coalition of the 5 players (bit i = player i
    # present), the document's values, the v(S) archived in the new archive
    doc = json.loads((compare_run / "exact.json").read_text())
    phi = np.array([p["value"] for p in doc["players"]])
    n = len(phi)
    held = [np.array([(i >> k) & 1 for k in range(n)], dtype=bool) for i in range(2**n)]
    table = read_rows(tmp_path / "new")
    by_mask = {tuple(np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little")[:n].astype(bool)): u
               for m, u in zip(table["mask"].to_pylist(), table["utility"].to_pylist(), strict=True)}  # fmt: skip
    rho = spearmanr(np.array(held).astype(float) @ phi, [by_mask[tuple(s)] for s in held]).statistic
    assert b["results"][0]["lds"]["estimate"] == pytest.approx(rho, abs=1e-9)


def test_another_models_archive_is_one_line_exit_2(compare_run, tmp_path):
    doc = json.loads((compare_run / "exact.json").read_text())
    doc["model_id"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    before = files_of(compare_run / "run")
    code, out, err = cli(["evaluate", str(tmp_path / "doc.json"), "--out", str(tmp_path / "e.json"), "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("coalescence: error: --archive: the explanation's model HuggingFaceTB/SmolLM2-135M-Instruct "), err
    assert "is not the archive's model " in err and "give the archive of the explanation's own run" in err
    assert files_of(compare_run / "run") == before and not (tmp_path / "e.json").exists()


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


@pytest.mark.parametrize("count", ["2", "9"])
def test_too_few_coalitions_names_the_option_and_the_minimum(compare_run, count):
    """Two coalitions printed LDS +1.000 [+1.000, +1.000]: below 10 the interval means nothing."""
    code, out, err = cli(["evaluate", str(compare_run / "run"), "--coalitions", count, "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"coalescence: error: --coalitions: must be an integer >= 10, got {count}: "), err


def test_more_coalitions_than_the_most_are_refused_before_anything_runs(compare_run):
    """10**8 held-out coalitions on a 21-player game started two million model evaluations: above
    4,096 the count is refused, naming the option and the most."""
    code, out, err = cli(["evaluate", str(compare_run / "run"), "--coalitions", "100000000", "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("coalescence: error: --coalitions: must be at most 4096, got 100000000: "), err


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
    code, first, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "12"])
    assert code == 0, err
    assert err.count("coalescence: loading ") == 1  # it says which model it loads, as explain does
    evaluated = int(first.rsplit("coalitions: ", 1)[1].split(" evaluated")[0])
    assert evaluated > 0 and read_rows(tmp_path / "run").num_rows == before + evaluated
    code, second, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "12"])
    assert code == 0, err
    assert "coalitions: 0 evaluated with the model" in second and "loading" not in err
    assert first.rsplit("\n", 2)[0] == second.rsplit("\n", 2)[0]  # the same numbers, from the archive


def test_a_damaged_archive_names_skip_corrupt_and_evaluate_honours_it(tmp_path, tiny_model_dir):
    """evaluate said "rerun with --skip-corrupt", then refused the same way with it (replay honours
    it): now the part that fails is left out, its coalitions evaluated again and it is quarantined."""
    from helpers.compare_runs import MESSAGES

    source = tmp_path / "chat.json"
    source.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    code, _, err = cli(["explain", str(source), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo",
                        "--archive", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    code, first, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "12", "--no-progress"])
    assert code == 0, err
    evaluated = int(first.rsplit("coalitions: ", 1)[1].split(" evaluated")[0])
    victim = sorted((tmp_path / "run" / "parts").glob("*.parquet"))[-1]  # the part evaluate wrote
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x04
    victim.write_bytes(bytes(data))
    code, out, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "12", "--no-progress"])
    assert code == 2 and out == "" and err.count("\n") == 1 and victim.name in err and "--skip-corrupt" in err, err
    code, again, err = cli(["evaluate", str(tmp_path / "run"), "--coalitions", "12", "--skip-corrupt", "--no-progress"])
    assert code == 0, err
    assert f"coalitions: {evaluated} evaluated with the model" in again  # the lost part's, again
    assert again.split("\ndrops in")[0] == first.split("\ndrops in")[0]
    assert [q["part"] for q in json.loads((tmp_path / "run" / "manifest.json").read_text())["quarantine"]] == [victim.name]
