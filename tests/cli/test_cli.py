"""The ``coalescence`` command line: bad input fails cleanly, the tiny model runs end to end.

Every refused input must exit 2 with one line ``coalescence: error: FIELD: ...`` on stderr, before any
model is loaded and before anything is written (no archive, no ``runs/``, no ``--out`` file). The
happy paths run on the tiny random Llama saved by ``tiny_model_dir`` (never the real SmolLM2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pytest

from helpers.cli import run_cli

from coalescence.archive import read_manifest, read_pool
from coalescence.attribution.estimators import ExactShapley
from coalescence.cli import main
from coalescence.masking.codec import PackedMask

SYSTEM = "You are a helpful assistant."
USER = (
    "The Eiffel Tower was completed in 1889. Big Ben's clock tower in London was finished in 1859. "
    "When was the tower completed?"
)
ANSWER = "It was completed in 1889."
CONVERSATION = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": ANSWER},
    ]
}
LABELS = ["system[0].s0", "user[1].s0", "user[1].s1", "user[1].s2"]  # --unit sentence
N_PLAYERS = len(LABELS)

SEVENTEEN = " ".join(
    f"The tower has fact {w}."
    for w in (
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen"
    ).split()
)

DOCUMENTED_KEYS = {
    "method",
    "model_id",
    "snapshot_id",
    "unit",
    "absence_policy",
    "target",
    "v_empty",
    "v_full",
    "efficiency_gap",
    "n_evaluations",
    "wall_seconds",
    "players",
}
PLAYER_KEYS = {"index", "label", "role", "message_index", "start", "end", "text", "value", "stderr"}


def write_input(directory: Path, content: Any, name: str = "conversation.json") -> Path:
    """Write ``content`` (a str verbatim, anything else as JSON) to ``directory/name``."""
    path = directory / name
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory (a default archive would land in ``cwd/runs``)."""
    path = tmp_path / "cwd"
    path.mkdir()
    monkeypatch.chdir(path)
    return path


def assert_refused(
    argv: list[str], field: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run ``main`` with an archive and an --out path; check the exit-2 contract; return the message."""
    run_dir = tmp_path / "run"
    out = tmp_path / "out.json"
    code = main([*argv, "--archive", str(run_dir), "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"coalescence: error: {field}: "), lines[0]
    assert "Traceback" not in captured.err
    assert captured.out == ""
    assert not run_dir.exists()
    assert not out.exists()
    assert not (cwd / "runs").exists()
    assert list(cwd.iterdir()) == []
    return lines[0]


# -- refused input: the conversation file ---------------------------------------------------

BAD_INPUTS = [
    pytest.param('{"messages": [', "input", "not valid JSON", id="malformed-json"),
    pytest.param("[1, 2]", "input", "JSON object", id="not-an-object"),
    pytest.param({}, "messages", "missing", id="no-messages"),
    pytest.param({"messages": []}, "messages", "non-empty", id="empty-messages"),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "robot", "content": "Beep."}]},
        "messages[1].role",
        "'robot'",
        id="unknown-role",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "   "}]},
        "messages[1].content",
        "empty",
        id="empty-last-assistant",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi."}], "target": "   "},
        "target",
        "empty",
        id="empty-target-field",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi."}], "target": 3},
        "target",
        "string",
        id="non-string-target",
    ),
    pytest.param(
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "Yo."}]},
        "messages[0].content",
        "missing",
        id="missing-content",
    ),
    pytest.param(
        {
            "messages": [{"role": "user", "content": "Alpha. Beta."}, {"role": "assistant", "content": "Yo."}],
            "players": [{"message": 0, "start": 0, "end": 6, "label": "x"}, {"message": 0, "start": 7, "end": 12, "label": "x"}],
        },
        "players[1].label",
        "given twice",
        id="duplicate-label",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": ["Hi."]}, {"role": "assistant", "content": "Yo."}]},
        "messages[0].content",
        "string",
        id="non-string-content",
    ),
]


@pytest.mark.parametrize(("content", "field", "says"), BAD_INPUTS)
def test_bad_input_file_is_refused(
    content: Any,
    field: str,
    says: str,
    tmp_path: Path,
    cwd: Path,
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
) -> None:
    path = write_input(tmp_path, content)
    line = assert_refused(["explain", str(path), "--model", str(tiny_model_dir)], field, tmp_path, cwd, capsys)
    assert says in line


def test_missing_input_file_is_refused(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    missing = tmp_path / "nowhere.json"
    line = assert_refused(["explain", str(missing), "--model", str(tiny_model_dir)], "input", tmp_path, cwd, capsys)
    assert "no such file" in line
    assert "nowhere.json" in line


# -- refused settings -----------------------------------------------------------------------

BAD_SETTINGS = [
    pytest.param(["--roles", "tool"], "--roles", "no attributable players", id="roles-none-attributable"),
    pytest.param(["--roles", "user,robot"], "--roles", "'robot'", id="roles-unknown"),
    pytest.param(["--roles", " , "], "--roles", "at least one role", id="roles-empty"),
    pytest.param(["--model", "nosuchmodel"], "--model", "unknown model 'nosuchmodel'", id="model-unknown-alias"),
    pytest.param(["--model", "./no/such/dir"], "--model", "./no/such/dir", id="model-missing-path"),
    pytest.param(
        ["--unit", "sentence", "--method", "permutation", "--budget", "3"],
        "--budget",
        "minimum of 2n = 8",
        id="budget-below-minimum",
    ),
    pytest.param(["--method", "exact", "--budget", "50"], "--budget", "permutation", id="budget-with-exact"),
    pytest.param(
        ["--unit", "sentence", "--method", "lasso", "--budget", "8", "--proxy-game", "none"],
        "--budget",
        "minimum of 16 for the LASSO surrogate with 4 players on exact rows alone (8 where the proxy game is played "
        "with it); raise the budget (the proxy game is not played here: the proxy game is off",
        id="budget-8-without-the-proxy-game",
    ),
    pytest.param(
        ["--unit", "sentence", "--method", "lasso", "--budget", "8", "--absence-policy", "placeholder"],
        "--budget",
        "the proxy game is defined for the drop policy only",
        id="budget-8-with-placeholders",
    ),
    pytest.param(
        ["--unit", "sentence", "--method", "lasso", "--budget", "7"],
        "--budget",
        "minimum of 8 for the LASSO surrogate with 4 players with the proxy game as its control variate",
        id="budget-below-the-two-fidelity-floor",
    ),
    pytest.param(["--method", "exact", "--proxy-game", "last-turn"], "--proxy-game", "two-fidelity methods (lasso", id="proxy-game-with-exact"),
    pytest.param(
        ["--method", "kernelshap", "--budget", "64", "--proxy-game", "answer"], "--proxy-game", "method kernelshap", id="proxy-game-with-kernelshap"
    ),
    pytest.param(["--placeholder", "[gone]"], "--placeholder", "--absence-policy placeholder", id="placeholder-with-drop"),
    pytest.param(["--method", "loo", "--budget", "50"], "--budget", "permutation", id="budget-with-loo"),
]


@pytest.mark.parametrize(("options", "field", "says"), BAD_SETTINGS)
def test_bad_setting_is_refused(
    options: list[str],
    field: str,
    says: str,
    tmp_path: Path,
    cwd: Path,
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
) -> None:
    path = write_input(tmp_path, CONVERSATION)
    argv = ["explain", str(path), "--model", str(tiny_model_dir), *options]  # a later --model wins
    line = assert_refused(argv, field, tmp_path, cwd, capsys)
    assert says in line


@pytest.mark.parametrize(("workers", "says"), [("1000000000", "the most a run starts is 1024"), ("5", "this machine's 4 CPUs")])
def test_more_workers_than_a_run_can_host_are_refused_before_anything_starts(
    workers: str, says: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import sys

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # a local cluster: no Ray session of another test counts
    path = write_input(tmp_path, CONVERSATION)
    line = assert_refused(["explain", str(path), "--model", str(tmp_path / "never-loaded"), "--workers", workers], "--workers", tmp_path, cwd, capsys)
    assert says in line


def test_too_many_players_for_exact_is_refused(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    path = write_input(
        tmp_path,
        {"messages": [{"role": "user", "content": SEVENTEEN}, {"role": "assistant", "content": ANSWER}]},
    )
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact"]
    line = assert_refused(argv, "--method", tmp_path, cwd, capsys)
    assert "17 players" in line
    assert "method regression-msr with a budget" in line and "or method loo" in line


def test_out_pointing_to_a_directory_is_refused(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    path = write_input(tmp_path, CONVERSATION)
    out_dir = tmp_path / "outdir"
    out_dir.mkdir()
    run_dir = tmp_path / "run"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--out", str(out_dir), "--archive", str(run_dir)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [err.strip()]
    assert err.startswith("coalescence: error: --out: ")
    assert not run_dir.exists()
    assert list(out_dir.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["--out", "--html", "--archive"])
def test_an_output_where_no_file_can_be_made_is_refused_before_the_run(
    option: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    # /proc takes no new file, whatever its permission bits say (root "may write" there): refused
    # in one line before the model loads, not after the run with advice about free space
    path = write_input(tmp_path, CONVERSATION)
    target = "/proc/coalescence-out" + ("" if option == "--archive" else ".json" if option == "--out" else ".html")
    argv = ["explain", str(path), "--model", str(tiny_model_dir), option, target]
    if option != "--archive":
        argv += ["--archive", str(tmp_path / "run")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [err.strip()]
    assert err.startswith(f"coalescence: error: {option}: ")
    # as root (CI) the permission bits allow it, and the file system's own answer refuses it
    assert "no file can be created in '/proc'" in err or "'/proc' is not writable" in err, err
    assert not (tmp_path / "run").exists() and not Path(target).exists()


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"notes.txt": b"mine"}, "not a run directory"),
        ({"manifest.json": b'{"schema_version": 1, "runs": [], "snapshots": []}', "parts/part-000000.parquet": b"old bytes"}, "corrupt or truncated"),
        ({"manifest.json": b'{"schema_version": 99, "runs": [], "snapshots": []}'}, "newer"),
    ],
    ids=["not-a-run", "corrupt-part", "newer-schema"],
)
def test_unusable_archive_directory_is_refused_and_left_alone(
    files: dict[str, bytes], says: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    path = write_input(tmp_path, CONVERSATION)
    run_dir = tmp_path / "old-run"
    for name, data in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    before = {p.relative_to(run_dir): (p.read_bytes() if p.is_file() else None) for p in run_dir.rglob("*")}
    out = tmp_path / "out.json"

    code = main(["explain", str(path), "--model", str(tiny_model_dir), "--archive", str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [err.strip()]  # refused before the model is even loaded
    assert err.startswith(("coalescence: error: --archive: ", "coalescence: error: RUN_DIR: "))
    assert says in err
    after = {p.relative_to(run_dir): (p.read_bytes() if p.is_file() else None) for p in run_dir.rglob("*")}
    assert after == before
    assert not out.exists()
    assert not (cwd / "runs").exists()


@pytest.mark.parametrize("option", ["--batch-size", "--budget", "--max-new-tokens"])
def test_non_positive_integers_are_rejected_by_argparse(
    option: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_input(tmp_path, CONVERSATION)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["explain", str(path), option, "0", "--archive", str(run_dir)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert option in err
    assert "expected a positive integer, got 0" in err
    assert "Traceback" not in err
    assert not run_dir.exists()


# -- a real process -------------------------------------------------------------------------


def _run_module(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "coalescence", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_module_exits_2_without_traceback_on_malformed_json(tmp_path: Path, cwd: Path) -> None:
    path = write_input(tmp_path, '{"messages": [')
    run_dir = tmp_path / "run"
    # the default model (the smollm2-135m alias): input errors come before it is even located
    proc = _run_module(["explain", str(path), "--archive", str(run_dir)], cwd)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "coalescence: error: input: conversation.json is not valid JSON: "
        "Expecting value at line 1 column 15"
    ]
    assert proc.stdout == ""
    assert not run_dir.exists()
    assert list(cwd.iterdir()) == []


def test_module_exits_2_on_an_argparse_error(tmp_path: Path, cwd: Path) -> None:
    path = write_input(tmp_path, CONVERSATION)
    proc = _run_module(["explain", str(path), "--batch-size", "0"], cwd)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--batch-size" in proc.stderr
    assert list(cwd.iterdir()) == []


# -- happy paths on the tiny model ----------------------------------------------------------


def explain(tmp: Path, tiny_model_dir: Path, name: str, *options: str, conversation: Any = CONVERSATION):
    """Run ``explain`` on ``conversation`` with sentence players; return code, stdout, stderr, doc, run dir."""
    base = tmp / name
    base.mkdir()
    path = write_input(base, conversation)
    run_dir, out = base / "run", base / "out.json"
    argv = [
        "explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence",
        *options, "--archive", str(run_dir), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    code, stdout, stderr = run_cli(argv)
    doc = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
    return code, stdout, stderr, doc, run_dir


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    code, stdout, stderr, doc, run_dir = explain(
        tmp_path_factory.mktemp("cli-exact"), tiny_model_dir, "exact", "--method", "exact"
    )
    assert code == 0, stderr
    return stdout, doc, run_dir


def test_exact_document_has_the_documented_fields(exact_run, tiny_model_dir: Path) -> None:
    _, doc, run_dir = exact_run
    assert DOCUMENTED_KEYS <= doc.keys()
    assert doc["method"] == "exact"
    assert doc["model_id"] == str(tiny_model_dir)
    assert doc["unit"] == "sentence"
    assert doc["absence_policy"] == "drop"
    assert doc["target"] == ANSWER
    assert doc["target_source"] == "last_assistant"
    assert doc["value_unit"] == "nats"
    assert doc["archive"] == str(run_dir)
    # the snapshot id by its documented rule (ConversationSnapshot): SHA-256 of the canonical JSON
    # (sorted keys, no spaces, UTF-8) of the messages before the target, the target, the unit and
    # each player's span, written out here from the document's own fields
    payload = {
        "schema": 1,
        "messages": [[m["role"], m["content"]] for m in doc["messages"]],
        "target": doc["target"],
        "unit": doc["unit"],
        "players": [[p["message_index"], p["start"], p["end"]] for p in doc["players"]],
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert doc["snapshot_id"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert doc["wall_seconds"] > 0
    assert math.isfinite(doc["v_empty"]) and math.isfinite(doc["v_full"])
    assert doc["v_full"] < 0 and doc["v_empty"] < 0  # log-probabilities of a multi-token answer


def test_exact_players_are_the_sentences_in_order(exact_run) -> None:
    _, doc, _ = exact_run
    players = doc["players"]
    assert [p["label"] for p in players] == LABELS
    messages = CONVERSATION["messages"]
    for i, p in enumerate(players):
        assert set(p) == PLAYER_KEYS
        assert p["index"] == i
        assert p["role"] == messages[p["message_index"]]["role"]
        assert p["text"] == messages[p["message_index"]]["content"][p["start"] : p["end"]]
        assert p["stderr"] is None  # exact values have no sampling error
        assert isinstance(p["value"], float) and math.isfinite(p["value"])
    assert [p["text"] for p in players] == [
        SYSTEM,
        "The Eiffel Tower was completed in 1889.",
        "Big Ben's clock tower in London was finished in 1859.",
        "When was the tower completed?",
    ]


def test_exact_values_are_efficient(exact_run) -> None:
    _, doc, _ = exact_run
    values = [p["value"] for p in doc["players"]]
    span = doc["v_full"] - doc["v_empty"]
    assert sum(values) - span == pytest.approx(doc["efficiency_gap"], abs=1e-12)
    assert abs(doc["efficiency_gap"]) < 1e-9
    assert doc["n_evaluations"] == 2**N_PLAYERS
    assert doc["n_coalitions"] == 2**N_PLAYERS


def test_exact_archive_holds_every_coalition_once(exact_run) -> None:
    _, doc, run_dir = exact_run
    assert (run_dir / "manifest.json").is_file()
    manifest = read_manifest(run_dir)
    assert manifest["rows"] == 2**N_PLAYERS
    assert manifest["snapshots"][0]["snapshot_id"] == doc["snapshot_id"]
    assert manifest["runs"][0]["run_config"]["method"] == "exact"
    assert manifest["runs"][0]["statistics"]["executed"] == 2**N_PLAYERS

    table = ds.dataset(run_dir / "parts", format="parquet").to_table()
    assert table.num_rows == 2**N_PLAYERS
    rows = table.to_pylist()
    assert len({r["coalition_key"] for r in rows}) == 2**N_PLAYERS
    assert {r["snapshot_id"] for r in rows} == {doc["snapshot_id"]}
    by_mask = {}
    for r in rows:
        bools = PackedMask(r["mask"], r["n_bits"]).to_bools()
        assert bools.shape == (N_PLAYERS,)
        by_mask[tuple(bools.tolist())] = r["utility"]
    assert len(by_mask) == 2**N_PLAYERS
    assert by_mask[(True,) * N_PLAYERS] == doc["v_full"]
    assert by_mask[(False,) * N_PLAYERS] == doc["v_empty"]


def test_exact_values_can_be_recomputed_from_the_archive(exact_run) -> None:
    _, doc, run_dir = exact_run
    masks, utilities = read_pool(run_dir, doc["snapshot_id"])
    assert masks.shape == (2**N_PLAYERS, N_PLAYERS)
    estimate = ExactShapley().fit(masks, utilities)
    np.testing.assert_allclose(estimate.values, [p["value"] for p in doc["players"]], rtol=0, atol=1e-12)


def test_exact_table_is_printed(exact_run) -> None:
    stdout, doc, run_dir = exact_run
    for label in LABELS:
        assert label in stdout
    gap_lines = [line for line in stdout.splitlines() if "efficiency gap" in line]
    assert len(gap_lines) == 1
    # exact Shapley values are efficient: the sum's float rounding (the document keeps it) prints as 0
    assert abs(doc["efficiency_gap"]) < 1e-12 and "efficiency gap = 0 (0 of |v(full) - v(empty)|)" in gap_lines[0]
    assert f"archive: {run_dir}" in stdout
    # ranked by value, best first
    ranked = sorted(doc["players"], key=lambda p: (-p["value"], p["index"]))
    positions = [stdout.index(p["label"]) for p in ranked]
    assert positions == sorted(positions)


def test_permutation_is_deterministic_for_a_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    options = ("--method", "permutation", "--budget", "40", "--seed", "3")
    code1, _, err1, doc1, run1 = explain(tmp_path, tiny_model_dir, "first", *options)
    code2, _, err2, doc2, run2 = explain(tmp_path, tiny_model_dir, "second", *options)
    assert (code1, code2) == (0, 0), err1 + err2
    assert doc1["method"] == "permutation"
    assert [p["value"] for p in doc1["players"]] == [p["value"] for p in doc2["players"]]
    assert [p["stderr"] for p in doc1["players"]] == [p["stderr"] for p in doc2["players"]]
    for p in doc1["players"]:
        assert isinstance(p["stderr"], float) and p["stderr"] >= 0
    assert abs(doc1["efficiency_gap"]) < 1e-9
    assert 2 * N_PLAYERS <= doc1["n_evaluations"] <= min(40, 2**N_PLAYERS)
    assert read_manifest(run1)["rows"] == doc1["n_evaluations"]
    assert read_manifest(run2)["rows"] == doc2["n_evaluations"]
    assert read_manifest(run1)["runs"][0]["run_config"]["budget"] == 40


def test_loo_evaluates_n_plus_two_coalitions(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, stdout, stderr, doc, run_dir = explain(tmp_path, tiny_model_dir, "loo", "--method", "loo")
    assert code == 0, stderr
    assert doc["method"] == "loo"
    assert doc["n_evaluations"] == N_PLAYERS + 2
    assert read_manifest(run_dir)["rows"] == N_PLAYERS + 2
    values = [p["value"] for p in doc["players"]]
    assert sum(values) - (doc["v_full"] - doc["v_empty"]) == pytest.approx(doc["efficiency_gap"], abs=1e-12)
    assert all(p["stderr"] is None for p in doc["players"])
    # leave-one-out is not efficient: its gap is printed as it is, to 3 significant digits
    assert f"efficiency gap = {doc['efficiency_gap']:.3g} (" in stdout


def test_a_conversation_ending_on_a_user_turn_gets_a_generated_target(tmp_path: Path, tiny_model_dir: Path) -> None:
    conversation = {"messages": CONVERSATION["messages"][:2]}
    code, stdout, stderr, doc, run_dir = explain(
        tmp_path, tiny_model_dir, "generated", "--method", "loo", "--max-new-tokens", "5", conversation=conversation
    )
    if code == 0:
        assert doc["target_source"] == "generated"
        assert doc["target"].strip() != ""
        assert doc["n_evaluations"] == N_PLAYERS + 2
        (record,) = read_manifest(run_dir)["snapshots"]
        assert record["target_source"] == "generated" and record["target"] == doc["target"]
        assert 1 <= len(record["target_ids"]) <= 5  # the generated ids, scored as they are
    else:
        # the random model produced only special tokens: a clean refusal, nothing written
        assert code == 2, stderr
        assert stderr.splitlines() == [stderr.strip()]
        assert stderr.startswith("coalescence: error: target: ")
        assert doc is None
        assert not run_dir.exists()


@pytest.mark.parametrize("option", ["--out", "--archive"])
def test_path_under_a_file_is_refused_before_the_run(
    option: str, tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    path = write_input(tmp_path, CONVERSATION)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    other = "--archive" if option == "--out" else "--out"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), option, str(blocker / "x"), other, str(tmp_path / "y")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"coalescence: error: {option}: ") and "is a file" in err
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("method", ["kernelshap", "regression-msr", "banzhaf", "lasso"])
def test_sampling_methods_respect_the_budget(method: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    budget = 16 if method == "lasso" else 12
    # lasso with the proxy game named (auto would play it only where it measures that it pays)
    named = ["--proxy-game", "after-last-player"] if method == "lasso" else []
    code, stdout, stderr, doc, run_dir = explain(
        tmp_path, tiny_model_dir, method, "--method", method, "--budget", str(budget), "--seed", "1", *named
    )
    assert code == 0, stderr
    assert doc["method"] == method
    assert 2 <= doc["n_evaluations"] <= min(budget, 2**N_PLAYERS)
    # the archive holds the exact rows and, for a two-fidelity method (lasso), the proxy game's apart
    assert read_manifest(run_dir)["rows"] == doc["n_evaluations"] + (doc["proxy"] or {}).get("evaluations", 0)
    # lasso's 16 are all 2^4 coalitions of this game: no proxy game, even named (nothing left for a control variate)
    assert doc["proxy"] is None
    if method == "lasso":
        assert any(f"the budget covers all {2**N_PLAYERS} coalitions" in note for note in doc["notes"])
    values = [p["value"] for p in doc["players"]]
    assert sum(values) - (doc["v_full"] - doc["v_empty"]) == pytest.approx(doc["efficiency_gap"], abs=1e-9)
    if method in ("kernelshap", "regression-msr"):
        assert abs(doc["efficiency_gap"]) < 1e-9  # efficiency imposed exactly
    if method == "lasso":
        assert "lds" in doc["diagnostics"] and "diagnostics:" in stdout


@pytest.mark.parametrize(
    ("budget", "chosen", "method"), [(8, "lasso", "lasso"), (40, "lasso", "lasso"), (100, "regression-msr", "proxy-shapley-shrunk")]
)
def test_a_budget_without_a_method_runs_auto_and_says_which(budget: int, chosen: str, method: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    # 18 sentence players (the system prompt and 17 user sentences): auto takes the sparse surrogate
    # below 5 evaluations per player (90) and regression-msr from there (its docstring's rule); the
    # transformers backend plays the proxy game, so each runs in its two-fidelity form (proxy-shapley
    # is regression-msr with the proxy as a control variate; auto runs its shrunk form), the
    # surrogate down to 8 exact coalitions (16 on exact rows alone); the proxy game is named, so it
    # is played whatever its rows cost (--proxy-game auto plays it where it measures that it pays)
    conversation = {"messages": [CONVERSATION["messages"][0], {"role": "user", "content": SEVENTEEN}, CONVERSATION["messages"][2]]}
    code, stdout, stderr, doc, run_dir = explain(
        tmp_path, tiny_model_dir, "auto", "--budget", str(budget), "--proxy-game", "after-last-player", conversation=conversation
    )
    assert code == 0, stderr
    assert len(doc["players"]) == 18
    assert doc["method"] == f"auto:{method}"
    runs = {"lasso": "lasso with the proxy game as a control variate",
            "regression-msr": "proxy-shapley-shrunk (regression-msr with the proxy game as a control variate, blended toward its control)"}
    said = f"method auto ran {runs[chosen]}: {budget} evaluations for 18 players"
    assert any(note.startswith(said) for note in doc["notes"])
    assert said in stdout and doc["proxy"]["game"] == "kv-proxy-compact:after-last-player"
    assert 2 <= doc["n_evaluations"] <= budget
    if budget == 8:
        assert doc["n_evaluations"] == 8 and doc["diagnostics"]["proxy_used"] == 1.0
    # a replay with no model fits the same method from the archive
    code, out, err = run_cli(["replay", str(run_dir), "--method", "auto", "--out", str(tmp_path / "replayed.json")])
    assert code == 0, err
    [replayed] = json.loads((tmp_path / "replayed.json").read_text())["explanations"]
    assert replayed["method"] == f"auto:{method}"
    np.testing.assert_allclose([p["value"] for p in replayed["players"]], [p["value"] for p in doc["players"]], rtol=0, atol=1e-12)


@pytest.mark.parametrize("proxy", ["auto", "none"])
def test_no_method_and_no_budget_on_many_players_runs_the_default_plan(proxy: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    """No --method, no --budget, 18 sentence players (more than exact's 16): the default plan,
    auto at 8 exact coalitions with the proxy game (at 64 without it: --proxy-game none), says so,
    and replays to the same values with no model."""
    conversation = {"messages": [CONVERSATION["messages"][0], {"role": "user", "content": SEVENTEEN}, CONVERSATION["messages"][2]]}
    code, stdout, stderr, doc, run_dir = explain(tmp_path, tiny_model_dir, "default", "--proxy-game", proxy, conversation=conversation)
    assert code == 0, stderr
    assert len(doc["players"]) == 18 and doc["method"] == "auto:lasso"
    exact = 8 if proxy == "auto" else 64
    assert doc["n_evaluations"] == exact
    assert (doc["proxy"] is not None) == (proxy == "auto")
    if proxy == "auto":  # the evaluations line counts the proxy rows apart
        assert f"model evaluations = 8 exact + {doc['proxy']['evaluations']} proxy rows" in stdout
    said = f"no method or budget given: 18 players are more than the 16 exact Shapley values allow, so the default plan ran method auto at {exact} exact coalitions"
    assert any(note.startswith(said) for note in doc["notes"]) and said in stdout
    assert read_manifest(run_dir)["runs"][0]["run_config"]["method"] == "default"
    code, out, err = run_cli(["replay", str(run_dir), "--method", "default", "--out", str(tmp_path / "replayed.json")])
    assert code == 0, err
    [replayed] = json.loads((tmp_path / "replayed.json").read_text())["explanations"]
    assert replayed["method"] == "auto:lasso" and any(note.startswith(said) for note in replayed["notes"])
    np.testing.assert_allclose([p["value"] for p in replayed["players"]], [p["value"] for p in doc["players"]], rtol=0, atol=1e-12)


def test_no_method_and_no_budget_on_few_players_gives_what_exact_gives(exact_run, tmp_path: Path, tiny_model_dir: Path) -> None:
    """At most 16 players the default is exact Shapley values: the same document as --method exact
    (values, method, notes), all 2^n coalitions."""
    _, exact_doc, _ = exact_run
    code, stdout, stderr, doc, run_dir = explain(tmp_path, tiny_model_dir, "default")
    assert code == 0, stderr
    assert doc["method"] == "exact" and doc["n_evaluations"] == 2**N_PLAYERS and doc["proxy"] is None
    assert doc["notes"] == exact_doc["notes"]
    np.testing.assert_allclose([p["value"] for p in doc["players"]], [p["value"] for p in exact_doc["players"]], rtol=0, atol=1e-9)


def test_target_stderr_stops_and_says_why(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, stdout, stderr, doc, run_dir = explain(
        tmp_path, tiny_model_dir, "rounds", "--method", "kernelshap", "--budget", "12", "--target-stderr", "1e-9"
    )
    assert code == 0, stderr
    assert doc["stopping"]["reason"] in ("budget", "exact") and doc["n_evaluations"] <= 12
    assert "stopped after" in stdout


def test_target_stderr_needs_a_method_with_standard_errors(tmp_path: Path, cwd: Path, capsys, tiny_model_dir: Path) -> None:
    path = write_input(tmp_path, CONVERSATION)
    line = assert_refused(
        ["explain", str(path), "--model", str(tiny_model_dir), "--method", "loo", "--target-stderr", "0.1"],
        "--target-stderr", tmp_path, cwd, capsys,
    )
    assert "standard errors" in line


def test_auto_with_a_target_stderr_samples_with_the_estimator_it_chooses(tmp_path: Path, tiny_model_dir: Path) -> None:
    # 4 players at budget 12: auto's rule (at most 16 players) runs regression-msr, which reports
    # standard errors, so the rounds run with it instead of a refusal claiming there are none
    code, stdout, stderr, doc, _ = explain(tmp_path, tiny_model_dir, "auto", "--method", "auto", "--budget", "12", "--target-stderr", "1e-9")
    assert code == 0, stderr
    assert doc["method"] == "auto:regression-msr" and doc["stopping"]["reason"] in ("budget", "exact")
    assert doc["n_evaluations"] <= 12 and any(note.startswith("method auto ran regression-msr") for note in doc["notes"])


def test_auto_with_a_target_stderr_is_refused_where_it_chooses_lasso(tmp_path: Path, cwd: Path, capsys, tiny_model_dir: Path) -> None:
    # 18 players at budget 40 (below 5 per player): auto runs lasso, which reports no standard
    # errors; the refusal names that choice, before anything is written
    conversation = {"messages": [CONVERSATION["messages"][0], {"role": "user", "content": SEVENTEEN}, CONVERSATION["messages"][2]]}
    path = write_input(tmp_path, conversation)
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "auto", "--budget", "40", "--target-stderr", "0.1"]
    line = assert_refused(argv, "--target-stderr", tmp_path, cwd, capsys)
    assert "auto chooses lasso for 18 players at budget 40" in line and "reports no standard errors" in line


# -- utilities: per-token scores, answer sub-spans, kinds --------------------------------------


def test_subspan_replay_equals_a_subspan_run(exact_run, tmp_path: Path, tiny_model_dir: Path) -> None:
    _, whole, run_dir = exact_run
    code, _, stderr, fresh, _ = explain(tmp_path, tiny_model_dir, "span", "--method", "exact", "--target-substring", "1889")
    assert code == 0, stderr
    assert fresh["n_evaluations"] == 2**N_PLAYERS  # a new archive: evaluated with the model
    assert fresh["utility_detail"]["span_text"] == " 1889" and fresh["utility_detail"]["span_cuts_token"]
    out = tmp_path / "replay.json"
    code, stdout, stderr = run_cli(
        ["replay", str(run_dir), "--method", "exact", "--target-substring", "1889", "--out", str(out), "--no-progress"]
    )
    assert code == 0, stderr
    [replayed] = json.loads(out.read_text())["explanations"]
    assert "no model call" in stdout and "inside a token" in stdout
    assert replayed["utility_detail"]["target_tokens"] == fresh["utility_detail"]["target_tokens"]
    np.testing.assert_allclose(
        [p["value"] for p in replayed["players"]], [p["value"] for p in fresh["players"]], atol=1e-4
    )
    assert not np.allclose([p["value"] for p in replayed["players"]], [p["value"] for p in whole["players"]])


def test_replay_with_another_kind_needs_no_model(exact_run, tmp_path: Path) -> None:
    _, whole, run_dir = exact_run
    out = tmp_path / "mean.json"
    code, stdout, stderr = run_cli(["replay", str(run_dir), "--method", "exact", "--utility", "mean_logprob", "--out", str(out)])
    assert code == 0, stderr
    [doc] = json.loads(out.read_text())["explanations"]
    assert doc["utility"] == "mean_logprob" and doc["value_unit"] == "nats per token"
    assert "value (nats per token)" in stdout
    # no model ran: the printout gives no rate (it said "0.0 evaluations/s")
    assert "(no model evaluations in this session)" in stdout and "evaluations/s" not in stdout
    # a mean over the same tokens of every coalition: the values scale by 1 / n_target
    n = whole["target_token_count"]
    np.testing.assert_allclose([p["value"] for p in doc["players"]], [p["value"] / n for p in whole["players"]], rtol=1e-5)


def test_span_outside_the_target_is_refused(tmp_path: Path, cwd: Path, capsys, tiny_model_dir: Path) -> None:
    path = write_input(tmp_path, CONVERSATION)
    message = assert_refused(
        ["explain", str(path), "--model", str(tiny_model_dir), "--target-span", "3:400"], "--target-span", tmp_path, cwd, capsys
    )
    assert f"{len(ANSWER)} characters" in message


def test_replay_span_outside_the_target_is_refused(exact_run, capsys) -> None:
    _, _, run_dir = exact_run
    before = sorted(p.name for p in (run_dir / "parts").iterdir())
    code = main(["replay", str(run_dir), "--method", "exact", "--target-substring", "Paris"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("coalescence: error: --target-substring: ") and len(err.splitlines()) == 1
    assert sorted(p.name for p in (run_dir / "parts").iterdir()) == before


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (["--temperature", "0.7"], "--temperature"),
        (["--utility", "rouge_l", "--target-span", "0:4"], "--target-span"),
        (["--utility", "rouge_l", "--num-samples", "3"], "--num-samples"),
        (["--target-span", "4"], "--target-span"),
        (["--target-span", "0:4", "--target-substring", "It"], "--target-span"),
    ],
)
def test_bad_utility_settings_are_refused_before_the_model(options, field, tmp_path: Path, cwd: Path, capsys) -> None:
    path = write_input(tmp_path, CONVERSATION)
    assert_refused(["explain", str(path), "--model", "no-such-model", *options], field, tmp_path, cwd, capsys)


def test_argparse_errors_keep_the_one_line_contract(tmp_path: Path, cwd: Path, capsys) -> None:
    path = write_input(tmp_path, CONVERSATION)
    for argv, field in ((["--utility", "bleu"], "--utility"), (["--top-p", "abc"], "--top-p")):
        with pytest.raises(SystemExit) as info:
            main(["explain", str(path), *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"coalescence: error: {field}: ") and len(err.splitlines()) == 1, err
    assert list(cwd.iterdir()) == []


def test_a_batch_names_the_line_whose_target_lacks_the_substring(tmp_path: Path, cwd: Path, capsys) -> None:
    lines = [CONVERSATION, {"messages": [{"role": "user", "content": "Where?"}], "target": "In Paris."}]
    path = write_input(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n", name="batch.jsonl")
    message = assert_refused(
        ["explain", str(path), "--model", "no-such-model", "--target-substring", "1889"], "line 2: --target-substring", tmp_path, cwd, capsys
    )
    assert "'In Paris.'" in message


@pytest.mark.parametrize(
    ("second", "options", "field", "says"),
    [
        # too many players for exact Shapley (counted before anything loads)
        ({"messages": [{"role": "user", "content": SEVENTEEN}, {"role": "assistant", "content": ANSWER}]},
         ["--model", "no-such-model", "--unit", "sentence", "--method", "exact"], "line 2: --method", "unit sentence gives at least 17 players"),
        # a server kind generates no answer: line 2 has none
        ({"messages": [{"role": "user", "content": "Where is it?"}]},
         ["--model", "no-such-model", "--server-url", "http://127.0.0.1:9"], "line 2: target", "has no answer to explain"),
    ],
    ids=["player-limit", "server-without-answer"],
)
def test_a_batch_names_the_bad_line_as_its_reader_does(second, options, field, says, tmp_path: Path, cwd: Path, capsys) -> None:
    # one form for every per-line error of a batch: "line N: --OPTION: message" (the reader's own)
    lines = [CONVERSATION, second, CONVERSATION]
    path = write_input(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n", name="batch.jsonl")
    message = assert_refused(["explain", str(path), *options], field, tmp_path, cwd, capsys)
    assert says in message and "input line" not in message


def test_a_batch_names_the_line_whose_prompt_leaves_no_room_for_max_new_tokens(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    # line 2 has no answer: it is generated after the model loads, and --max-new-tokens past its
    # context is refused then, naming the line
    lines = [CONVERSATION, {"messages": [{"role": "user", "content": "Where is the Eiffel Tower?"}]}]
    path = write_input(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n", name="batch.jsonl")
    code = main(["explain", str(path), "--model", str(tiny_model_dir), "--max-new-tokens", "100000", "--archive",
                 str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("coalescence: error: line 2: --max-new-tokens: 100000 new tokens after a prompt of "), err
    assert not (tmp_path / "run").exists()


def test_replay_whole_answer_drops_the_runs_subspan(exact_run, tmp_path: Path, tiny_model_dir: Path) -> None:
    _, whole, _ = exact_run
    code, _, stderr, doc, run_dir = explain(tmp_path, tiny_model_dir, "span", "--method", "exact", "--target-substring", "1889")
    assert code == 0, stderr
    out = tmp_path / "whole.json"
    code, stdout, stderr = run_cli(["replay", str(run_dir), "--method", "exact", "--out", str(out)])
    [kept] = json.loads(out.read_text())["explanations"]
    assert code == 0 and kept["utility_detail"]["substring"] == "1889"  # the run's sub-span by default
    code, stdout, stderr = run_cli(["replay", str(run_dir), "--method", "exact", "--whole-answer", "--out", str(out)])
    assert code == 0, stderr
    [replayed] = json.loads(out.read_text())["explanations"]
    assert "substring" not in replayed["utility_detail"]
    np.testing.assert_allclose([p["value"] for p in replayed["players"]], [p["value"] for p in whole["players"]], atol=1e-4)


def test_prob_values_print_in_scientific_notation(exact_run) -> None:
    _, _, run_dir = exact_run
    code, stdout, stderr = run_cli(["replay", str(run_dir), "--method", "exact", "--utility", "prob"])
    assert code == 0, stderr
    v_full = next(line for line in stdout.splitlines() if line.startswith("v(empty)"))
    assert "e-" in v_full  # p of a whole answer is tiny: 0.0000 would say nothing


def test_resuming_with_another_utility_points_to_replay(exact_run, tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    _, _, run_dir = exact_run
    path = write_input(tmp_path, CONVERSATION)
    before = sorted(p.name for p in (run_dir / "parts").iterdir())
    code = main(["explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--utility", "mean_logprob",
                 "--archive", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "coalescence replay" in err and "--new-run" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in (run_dir / "parts").iterdir()) == before
    # refused before the weights load: with progress on, the run would say "loading ..." first
    code = main(["explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--utility", "mean_logprob",
                 "--archive", str(run_dir)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [err.strip()] and "loading" not in err, err
    assert err.startswith("coalescence: error: --archive: the archive holds a different run (utility: archive has ")


EIGHT_SENTENCES = {
    "messages": [
        {"role": "system", "content": "You answer questions about towers. Keep answers short."},
        {
            "role": "user",
            "content": "The Eiffel Tower was completed in 1889. It stands in Paris.\n"
            "Big Ben's clock tower was finished in 1859. It stands in London.\n"
            "- The Leaning Tower of Pisa took 199 years to build.\n"
            "When was the Eiffel Tower completed?",
        },
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}


def test_regression_msr_replays_from_a_kernelshap_archive_without_a_model(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """regression-msr plans KernelSHAP's coalitions: a kernelshap run's archive refits it with no
    model, to the values of a regression-msr run of its own (8 sentence players, budget 40)."""
    code, _, stderr, kernel_doc, kernel_run = explain(
        tmp_path, tiny_model_dir, "kernel", "--method", "kernelshap", "--budget", "40", conversation=EIGHT_SENTENCES
    )
    assert code == 0, stderr
    assert len(kernel_doc["players"]) == 8
    code, _, stderr, msr_doc, _ = explain(
        tmp_path, tiny_model_dir, "msr", "--method", "regression-msr", "--budget", "40", conversation=EIGHT_SENTENCES
    )
    assert code == 0, stderr
    assert msr_doc["method"] == "regression-msr" and msr_doc["n_evaluations"] == kernel_doc["n_evaluations"]
    assert abs(msr_doc["efficiency_gap"]) < 1e-9
    values = [p["value"] for p in msr_doc["players"]]
    assert values != [p["value"] for p in kernel_doc["players"]]  # the residual term moved them

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")

    monkeypatch.setattr("coalescence.backends.registry.load_backend", no_model)
    out = tmp_path / "replay.json"
    code, _, stderr = run_cli(["replay", str(kernel_run), "--method", "regression-msr", "--budget", "40", "--out", str(out)])
    assert code == 0, stderr
    replayed = json.loads(out.read_text())["explanations"][0]
    assert replayed["method"] == "regression-msr"
    np.testing.assert_allclose([p["value"] for p in replayed["players"]], values, rtol=0, atol=1e-4)


def test_replay_defaults_to_the_runs_budget_and_seed_for_the_runs_method(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """A one-input regression-msr run at budget 40, seed 3 replays as itself with no --budget or
    --seed, to its own values; another method still defaults to 32 x players and seed 0 is not
    assumed: with the run's numbers given, kernelshap refits from the same archive."""
    code, _, stderr, doc, run_dir = explain(
        tmp_path, tiny_model_dir, "msr", "--method", "regression-msr", "--budget", "40", "--seed", "3", conversation=EIGHT_SENTENCES
    )
    assert code == 0, stderr

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")

    monkeypatch.setattr("coalescence.backends.registry.load_backend", no_model)
    out = tmp_path / "replay.json"
    code, _, stderr = run_cli(["replay", str(run_dir), "--method", "regression-msr", "--out", str(out)])
    assert code == 0, stderr
    (replayed,) = json.loads(out.read_text())["explanations"]
    assert [p["value"] for p in replayed["players"]] == [p["value"] for p in doc["players"]]
    assert [p["stderr"] for p in replayed["players"]] == [p["stderr"] for p in doc["players"]]
    code, _, stderr = run_cli(["replay", str(run_dir), "--method", "regression-msr", "--seed", "4"])
    assert code == 2 and "pass --model" in stderr  # another seed plans other coalitions
    code, _, stderr = run_cli(["replay", str(run_dir), "--method", "kernelshap"])
    assert code == 2 and "lacks" in stderr and "pass --model" in stderr  # 32 x 8 = 256 planned
    code, _, stderr = run_cli(["replay", str(run_dir), "--method", "kernelshap", "--budget", "40", "--seed", "3"])
    assert code == 0, stderr


def test_an_infinite_target_stderr_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_input(tmp_path, CONVERSATION)
    run_dir = tmp_path / "run"
    for text in ("inf", "nan", "0"):
        with pytest.raises(SystemExit) as info:
            main(["explain", str(path), "--method", "regression-msr", "--budget", "20", "--target-stderr", text, "--archive", str(run_dir)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--target-stderr" in err and "expected a positive finite number" in err, err
        assert "Traceback" not in err and not run_dir.exists()


def test_an_unreachable_vllm_server_is_refused_before_any_coalition(
    tmp_path: Path, cwd: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_input(tmp_path, {"messages": [{"role": "user", "content": "Hi. Bye."}, {"role": "assistant", "content": "Yo."}]})
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--vllm-url", f"http://127.0.0.1:{port}"]
    line = assert_refused(argv, "--server-url", tmp_path, cwd, capsys)  # --vllm-url: the option's earlier name
    assert "cannot reach a vLLM server" in line


def _help_sections(command: str) -> dict[str, list[str]]:
    """``--help`` of a subcommand as section title -> the long options listed under it."""
    from coalescence.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    sections: dict[str, list[str]] = {}
    title = ""
    for line in sub.format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title and (m := re.match(r"\s{2}(?:-\w, )?(--[\w-]+)", line)):
            sections[title].append(m.group(1))
    return sections


@pytest.mark.parametrize("command", ["explain", "replay", "sweep"])
def test_help_sections_hold_the_options_of_their_kind(command: str) -> None:
    """--model is a model option in every run command (replay redeclares it with no default) and
    comes first there; the progress options are a section of their own, not argparse's generic one."""
    sections = _help_sections(command)
    assert sections["model"][0] == "--model"
    assert sections["progress and logging"] == ["--no-progress", "--progress-every", "--verbose"]
    assert sections["options"] == ["--help"]
    if command == "replay":
        assert "--model" not in sections["replay"]


@pytest.mark.parametrize(
    ("option", "typo", "meant"),
    [
        ("--method", "kernalshap", "kernelshap"),
        ("--utility", "logprb", "logprob"),
        ("--absence-policy", "plaecholder", "placeholder"),
        ("--unit", "sentense", "sentence"),
        ("--proxy-game", "last_turn", "last-turn"),
    ],
)
def test_a_misspelt_name_gets_a_suggestion(tmp_path: Path, capsys, option: str, typo: str, meant: str) -> None:
    # --method is checked by the estimator registry, the others are argparse choices: one hint for all
    path = write_input(tmp_path, CONVERSATION)
    try:
        code = main(["explain", str(path), "--model", str(tmp_path / "no-model"), option, typo, "--archive", str(tmp_path / "run")])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"coalescence: error: {option}: ") and err.count("\n") == 1, err
    assert f"did you mean {meant}?" in err and not (tmp_path / "run").exists()


def test_a_misspelt_name_gets_a_suggestion_in_python() -> None:
    from coalescence.attribution.estimators import make_estimator
    from coalescence.conversation import Conversation
    from coalescence.errors import CoalescenceError
    from coalescence.masking.policies import get_policy
    from coalescence.segmentation import segment_players
    from coalescence.utility import get_utility

    conversation = Conversation.from_dict(CONVERSATION)
    for call, meant in (
        (lambda: make_estimator("kernalshap", budget=64), "kernelshap"),
        (lambda: make_estimator("Banzhaf", budget=64), "banzhaf"),
        (lambda: get_utility("token-f1"), "token_f1"),
        (lambda: get_policy("plaecholder"), "placeholder"),
        (lambda: segment_players(conversation, unit="sentense"), "sentence"),
    ):
        with pytest.raises(CoalescenceError) as info:
            call()
        assert f"did you mean {meant}?" in str(info.value)
    with pytest.raises(CoalescenceError) as info:
        make_estimator("zzz", budget=64)
    assert "did you mean" not in str(info.value)  # nothing close: no guess


@pytest.mark.parametrize(("rounding", "printed"), [(7.105427357601002e-15, "0 (0 of"), (-3e-13, "0 (0 of"), (0.0125, "0.0125 (0.0005 of")])
def test_the_printed_efficiency_gap_is_0_when_only_float_rounding_is_left(exact_run, rounding: float, printed: str) -> None:
    # the exact run's explanation with its sum moved by `rounding` nats: below 1e-12 of the total
    # (25 nats here) a gap is the float rounding of an efficient sum and prints as 0; above, as it is
    from dataclasses import replace

    from coalescence.attribution.explanation import Explanation
    from coalescence.snapshot import ConversationSnapshot

    _, doc, run_dir = exact_run
    record = next(r for r in read_manifest(run_dir)["snapshots"] if r["snapshot_id"] == doc["snapshot_id"])
    explanation = Explanation.from_dict(doc, ConversationSnapshot.from_dict(record))
    est = explanation.estimate
    est = replace(est, v_full=est.v_empty + 25.0, values=est.values * (25.0 / est.values.sum()))
    values = est.values + np.eye(len(est.values))[0] * rounding
    est = replace(est, values=values, efficiency_gap=float(values.sum()) - 25.0)  # the gap: sum of values - (v(full) - v(empty))
    line = next(l for l in replace(explanation, estimate=est).format_table().splitlines() if "efficiency gap" in l)
    assert f"efficiency gap = {printed}" in line, line
