"""Crash safety: kill -9 then resume, crash debris, refusals that leave the archive alone, replay.

Real parts throughout: the real CLI in a real subprocess killed with SIGKILL, the tiny random Llama,
real Parquet parts. The only injected piece is a slow step (each backend call sleeps) so that the
kill lands mid-run; it is patched into the child process by the test, never into the library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from coalescence.archive import RunArchive, list_parts, read_manifest, read_rows
from coalescence.cli import main

USER = (
    "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. The Colosseum opened in 80. "
    "The Opera House opened in 1973. The bridge opened in 1937."
)
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}
N = 6  # players with --unit sentence
SLOW_CHILD = """
import sys, time
from coalescence.backends.hf import HFBackend
_score = HFBackend.score
def slow(self, requests):
    time.sleep(0.04)
    return _score(self, requests)
HFBackend.score = slow
from coalescence.cli import main
sys.exit(main(sys.argv[1:]))
"""


def argv(input_path: Path, model: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "explain", str(input_path), "--model", str(model), "--unit", "sentence", "--method", "exact",
        "--batch-size", "1", "--flush-rows", "4", "--archive", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture
def conversation(tmp_path: Path) -> Path:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    return path


def snapshot_files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def values(doc: dict) -> list[float]:
    return [p["value"] for p in doc["players"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted run: its JSON document and archive."""
    tmp = tmp_path_factory.mktemp("reference")
    path = tmp / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    out = tmp / "out.json"
    assert main(argv(path, tiny_model_dir, tmp / "run", "--out", str(out))) == 0
    return json.loads(out.read_text()), tmp / "run"


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD, *argv(conversation, tiny_model_dir, run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 60
    while len(list_parts(run_dir)) < 3:
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    on_disk = read_rows(run_dir).num_rows
    assert 12 <= on_disk < 2**N  # some complete parts, not the whole run
    assert read_manifest(run_dir)["runs"][0]["status"] == "running"  # never closed

    out = tmp_path / "out.json"
    assert main(argv(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    ref_doc, _ = reference
    # the model evaluated only what was not in complete parts
    assert doc["n_evaluations"] == 2**N - on_disk
    # every coalition exactly once, the same utilities and identical attributions
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == 2**N == len(set(rows["coalition_key"].to_pylist()))
    ref_rows = read_rows(reference[1])
    assert dict(zip(rows["coalition_key"].to_pylist(), rows["utility"].to_pylist(), strict=True)) == dict(
        zip(ref_rows["coalition_key"].to_pylist(), ref_rows["utility"].to_pylist(), strict=True)
    )
    assert values(doc) == values(ref_doc)
    manifest = read_manifest(run_dir)
    assert len(manifest["runs"]) == 1 and manifest["runs"][0]["status"] == "complete"
    assert manifest["rows"] == 2**N


def test_a_part_left_unrenamed_is_discarded_and_recomputed(tmp_path, conversation, tiny_model_dir, reference, caplog):
    run_dir = tmp_path / "run"
    assert main(argv(conversation, tiny_model_dir, run_dir)) == 0
    last = list_parts(run_dir)[-1]
    lost = pq.read_table(last).num_rows
    # a crash between writing the part's data and renaming it
    last.rename(last.parent / f".{last.name}.tmp")
    out = tmp_path / "out.json"
    with caplog.at_level("WARNING"):
        assert main(argv(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    assert "discarding" in caplog.text
    assert not list((run_dir / "parts").glob(".*.tmp"))
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == lost
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == 2**N == len(set(rows["coalition_key"].to_pylist()))
    assert values(doc) == values(reference[0])


def test_resume_with_other_settings_is_refused_and_the_archive_left_alone(tmp_path, conversation, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    assert main(argv(conversation, tiny_model_dir, run_dir)) == 0
    before = snapshot_files(run_dir)
    capsys.readouterr()
    code = main(argv(conversation, tiny_model_dir, run_dir, "--absence-policy", "placeholder"))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("coalescence: error: --archive: the archive holds a different run")
    assert "absence_policy" in err and "--new-run" in err
    assert snapshot_files(run_dir) == before
    # --new-run adds the second run to the same archive
    assert main(argv(conversation, tiny_model_dir, run_dir, "--absence-policy", "placeholder", "--new-run")) == 0
    manifest = read_manifest(run_dir)
    assert [r["absence_policy"]["id"] for r in manifest["runs"]] == ["drop", "placeholder"]
    assert read_rows(run_dir).num_rows == 2 * 2**N


def test_second_writer_is_refused_naming_the_holder(tmp_path, conversation, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    holder = RunArchive.open(run_dir, {"snapshot_ids": ["x"], "model": {}, "utility": {}, "absence_policy": {}})
    try:
        before = snapshot_files(run_dir)
        code = main(argv(conversation, tiny_model_dir, run_dir))
        err = capsys.readouterr().err
        assert code == 2
        assert f"pid {os.getpid()}" in err and "--archive" in err
        assert snapshot_files(run_dir) == before
    finally:
        holder.close()


def test_truncated_part_is_refused_then_skipped_and_recomputed(tmp_path, conversation, tiny_model_dir, capsys, reference):
    run_dir = tmp_path / "run"
    assert main(argv(conversation, tiny_model_dir, run_dir)) == 0
    victim = list_parts(run_dir)[1]
    lost = pq.read_table(victim).num_rows
    victim.write_bytes(victim.read_bytes()[:50])
    before = snapshot_files(run_dir)
    capsys.readouterr()
    assert main(argv(conversation, tiny_model_dir, run_dir)) == 2
    err = capsys.readouterr().err
    assert victim.name in err and "--skip-corrupt" in err
    assert snapshot_files(run_dir) == before
    out = tmp_path / "out.json"
    assert main(argv(conversation, tiny_model_dir, run_dir, "--skip-corrupt", "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == lost
    assert values(doc) == values(reference[0])


def test_replay_reproduces_the_run_without_a_model(tmp_path, reference, monkeypatch, capsys):
    ref_doc, run_dir = reference

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")

    monkeypatch.setattr("coalescence.backends.registry.load_backend", no_model)
    out = tmp_path / "replay.json"
    assert main(["replay", str(run_dir), "--method", "exact,loo", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    exact, loo = doc["explanations"]
    assert values(exact) == values(ref_doc)
    assert exact["v_full"] == ref_doc["v_full"] and exact["n_evaluations"] == 0
    assert loo["method"] == "loo" and loo["n_coalitions"] == N + 2
    # a plan the archive does not cover needs --model
    capsys.readouterr()
    code = main(["replay", str(run_dir), "--method", "kernelshap", "--budget", "100"])
    assert code == 0  # 100 >= 2^6 = 64: full enumeration, covered by the exact run
    code = main(["replay", str(run_dir), "--method", "permutation", "--seed", "1", "--budget", "12", "--snapshot", "zzz"])
    assert code == 2 and "--snapshot" in capsys.readouterr().err


def test_replay_with_a_model_evaluates_only_what_is_missing(tmp_path, conversation, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    assert main(argv(conversation, tiny_model_dir, run_dir, "--method", "loo")) == 0
    capsys.readouterr()
    assert main(["replay", str(run_dir), "--method", "exact"]) == 2
    assert "lacks" in capsys.readouterr().err
    out = tmp_path / "replay.json"
    args = ["replay", str(run_dir), "--method", "exact", "--model", str(tiny_model_dir), "--no-progress", "--out", str(out)]
    assert main(args) == 0
    [doc] = json.loads(out.read_text())["explanations"]
    assert doc["n_evaluations"] == 2**N - (N + 2)
    assert read_rows(run_dir).num_rows == 2**N


def test_archive_info_and_compact(tmp_path, conversation, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    assert main(argv(conversation, tiny_model_dir, run_dir)) == 0
    parts = len(list_parts(run_dir))
    assert parts == 2**N // 4
    capsys.readouterr()
    assert main(["archive", "info", str(run_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["coalitions"] == 2**N and info["parts"] == parts and info["cache_hit_rate"] == 0.0
    assert info["snapshots"][0]["coalitions"] == 2**N and info["model_seconds"] > 0
    before = read_rows(run_dir)
    assert main(["archive", "compact", str(run_dir)]) == 0
    assert len(list_parts(run_dir)) == 1
    after = read_rows(run_dir)
    assert after.to_pylist() == before.to_pylist()
    assert main(["archive", "info", str(run_dir)]) == 0
    assert f"{2**N} in 1 parts" in capsys.readouterr().out


def test_sigterm_flushes_the_archive_and_a_rerun_resumes(tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD.replace("time.sleep(0.04)", "time.sleep(0.04); print('scored', flush=True)"),
         *argv(conversation, tiny_model_dir, run_dir, "--flush-rows", "1000")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    for _ in range(6):  # six model calls done: some rows are buffered, none flushed (1000 per part)
        assert child.stdout.readline().strip() == b"scored", child.stderr.read().decode()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143, err.decode()
    assert "terminated; evaluated coalitions are in" in err.decode()
    saved = read_rows(run_dir).num_rows
    assert 0 < saved < 2**N  # nothing buffered was lost: flushed on the way out
    assert read_manifest(run_dir)["runs"][0]["status"] == "interrupted"
    out = tmp_path / "out.json"
    assert main(argv(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == 2**N - saved
    assert values(doc) == values(reference[0])
