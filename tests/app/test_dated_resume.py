"""One date per run: a run killed on day 1 and resumed on day 2 renders every coalition under
day 1's date (issue 24, item 3).

"Today" is faked with the ``COALESCENCE_TODAY`` environment variable (the documented way), set in
the child process's environment and with ``monkeypatch.setenv`` here; nothing of ours is patched.
Real parts: the CLI in a subprocess killed with SIGKILL (each backend call made slow there so
that the kill lands mid-run, as in tests/app/test_resume.py), the tiny random Llama with a Llama-3.1
template that writes ``strftime_now("%d %b %Y")``, real Parquet parts.
"""

from __future__ import annotations

import json
import shutil

import pytest

from helpers.chat_templates import DATED_FAMILIES, build_family_tokenizer
from helpers.children import kill_when, parts_written
from helpers.models import build_model

from coalescence.archive import read_manifest, read_rows
from coalescence.cli import main

USER = "The Eiffel Tower was completed in 1889. It is 330 m tall. It is in Paris. It was designed by Gustave Eiffel's company."
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You answer questions about landmarks."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}
N = 5  # players with --unit sentence: 1 system sentence, 4 user sentences
DAY1, DAY2 = "2024-07-26", "2024-07-27"
TOL = 1e-5  # the resume test's tolerance (tests/app/test_resume.py): a cold prefix cache sums in another order


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dated")
    family = next(f for f in DATED_FAMILIES if f.name == "llama31_date")
    tok = build_family_tokenizer(family)
    build_model(tok).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    (tmp / "input.json").write_text(json.dumps(CONVERSATION), encoding="utf-8")
    return tmp


def argv(tmp, run_dir, *extra):
    return [
        "explain", str(tmp / "input.json"), "--model", str(tmp / "model"), "--unit", "sentence", "--method", "exact",
        "--batch-size", "1", "--flush-rows", "4", "--archive", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


def run_on(day, tmp, run_dir, monkeypatch, *extra):
    monkeypatch.setenv("COALESCENCE_TODAY", day)
    out = run_dir.parent / f"{run_dir.name}-{day}.json"
    assert main(argv(tmp, run_dir, *extra, "--out", str(out))) == 0
    return json.loads(out.read_text())


def utilities(run_dir, run_id=None):
    rows = read_rows(run_dir)
    runs = rows["run_id"].to_pylist()
    return {m: u for m, u, r in zip(rows["mask"].to_pylist(), rows["utility"].to_pylist(), runs, strict=True) if run_id in (None, r)}


@pytest.fixture(scope="module")
def day1(setup, tmp_path_factory):
    """An uninterrupted run on day 1: its document and archive."""
    with pytest.MonkeyPatch.context() as mp:
        run_dir = tmp_path_factory.mktemp("day1") / "run"
        return run_on(DAY1, setup, run_dir, mp), run_dir


@pytest.fixture(scope="module")
def day2(setup, day1, tmp_path_factory):
    """The day-1 archive, and a --new-run on day 2 added to it: its document, and its utilities."""
    run_dir = tmp_path_factory.mktemp("day2") / "run"
    shutil.copytree(day1[1], run_dir)
    with pytest.MonkeyPatch.context() as mp:
        doc = run_on(DAY2, setup, run_dir, mp, "--new-run")
    second = read_manifest(run_dir)["runs"][1]["run_id"]
    return doc, run_dir, utilities(run_dir, second)


def test_a_new_run_on_another_day_is_a_game_of_its_own(day1, day2):
    """--new-run on day 2 pins day 2: no coalition archived under day 1 is served to it, and the
    date changes every coalition's value (its prompt holds the date)."""
    doc, run_dir, ref2 = day2
    assert doc["n_evaluations"] == 2**N
    assert "the template renders a date: pinned to 2024-07-27" in doc["notes"]
    assert [r["template_now"] for r in read_manifest(run_dir)["runs"]] == ["2024-07-26T00:00:00", "2024-07-27T00:00:00"]
    ref1 = utilities(day1[1])
    assert ref2.keys() == ref1.keys() and all(abs(ref1[m] - ref2[m]) > 1e-3 for m in ref1)
    assert "the template renders a date: pinned to 2024-07-26" in day1[0]["notes"]


def test_a_run_resumed_on_another_day_keeps_its_first_day(setup, day1, tmp_path, monkeypatch):
    ref1 = utilities(day1[1])
    run_dir = tmp_path / "killed"
    kill_when(argv(setup, run_dir), parts_written(run_dir, 2), timeout=90, env={"COALESCENCE_TODAY": DAY1})
    on_disk = read_rows(run_dir).num_rows
    assert 8 <= on_disk < 2**N

    resumed = run_on(DAY2, setup, run_dir, monkeypatch)  # the next day
    assert resumed["n_evaluations"] == 2**N - on_disk
    got = utilities(run_dir)
    assert got.keys() == ref1.keys()
    assert all(abs(got[m] - ref1[m]) <= TOL for m in ref1)  # every coalition under day 1's date
    assert [p["value"] for p in resumed["players"]] == pytest.approx([p["value"] for p in day1[0]["players"]], rel=0, abs=TOL)
    assert "the template renders a date: pinned to 2024-07-26" in resumed["notes"]
    (run,) = read_manifest(run_dir)["runs"]
    assert run["template_now"] == "2024-07-26T00:00:00" and run["template_renders_date"] is True
    assert run["status"] == "complete"

    # replay on day 2 reads the run's date: its notes and values are day 1's
    replayed = tmp_path / "replay.json"
    assert main(["replay", str(run_dir), "--method", "exact", "--out", str(replayed)]) == 0
    (doc,) = json.loads(replayed.read_text())["explanations"]
    assert [p["value"] for p in doc["players"]] == pytest.approx([p["value"] for p in day1[0]["players"]], rel=0, abs=TOL)
    assert "the template renders a date: pinned to 2024-07-26" in doc["notes"]
