"""Crash safety: kill -9 then resume, crash debris, refusals that leave the archive alone, replay;
damaged and foreign archives, a full disk, and the exit codes of every command.

Real parts throughout: the real CLI in a real subprocess killed with SIGKILL, the tiny random Llama,
real Parquet parts. The injected pieces: a slow step (each backend call sleeps) so that the kill
lands mid-run, patched into the child process by the test, never into the library; and a full
disk or a denied permission, answered by wrapped OS calls (``tests/helpers/archive_faults.py``:
neither can be produced for real here, as root with no mounts).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.archive_faults import DiskFault
from helpers.children import kill_when, parts_written, slow_child

from coalescence import cli
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


def snapshot_files(run_dir: Path) -> dict[str, bytes | str]:
    """Every file's bytes (the lock's aside) and every link's target under ``run_dir``."""
    out: dict[str, bytes | str] = {}
    for root, dirs, names in os.walk(run_dir):
        for name in dirs + names:
            path = Path(root) / name
            if path.is_symlink():
                out[str(path.relative_to(run_dir))] = "-> " + os.readlink(path)
            elif path.is_file() and name != ".lock":
                out[str(path.relative_to(run_dir))] = path.read_bytes()
    return out


def values(doc: dict) -> list[float]:
    return [p["value"] for p in doc["players"]]


# A resumed run re-evaluates the lost coalitions with a cold prefix cache: a coalition the
# uninterrupted run scored on 45 reused prefix tokens is then scored on 60 computed ones, and fp32
# sums in another order (5e-7 nats seen on one utility, 1e-8 on the values). ARCHITECTURE allows
# 1e-4 nats for that. 1e-5 still catches a lost or misplaced utility: this game's utilities differ
# by 0.005-0.06 nats and every coalition's Shapley weight is at least 1/60, so >= 8e-5 on a value.
VALUE_TOL = 1e-5


def same_values(doc: dict, reference: dict) -> bool:
    return values(doc) == pytest.approx(values(reference), rel=0, abs=VALUE_TOL)


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
    returncode = kill_when(argv(conversation, tiny_model_dir, run_dir), parts_written(run_dir, 3), timeout=60)
    assert returncode == -signal.SIGKILL
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
    resumed = dict(zip(rows["coalition_key"].to_pylist(), rows["utility"].to_pylist(), strict=True))
    uninterrupted = dict(zip(ref_rows["coalition_key"].to_pylist(), ref_rows["utility"].to_pylist(), strict=True))
    assert resumed.keys() == uninterrupted.keys()
    assert [resumed[k] for k in uninterrupted] == pytest.approx(list(uninterrupted.values()), rel=0, abs=VALUE_TOL)
    assert same_values(doc, ref_doc)
    manifest = read_manifest(run_dir)
    assert len(manifest["runs"]) == 1 and manifest["runs"][0]["status"] == "complete"
    assert manifest["rows"] == 2**N
    # a replay's note counts the run's evaluations over both sessions (the manifest's statistics are the last one's)
    replayed = tmp_path / "replayed.json"
    assert main(["replay", str(run_dir), "--method", "exact", "--out", str(replayed)]) == 0
    [again] = json.loads(replayed.read_text())["explanations"]
    assert any(f"the run evaluated {2**N} exact coalitions with the model" in note for note in again["notes"])


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
    assert same_values(doc, reference[0])


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
    assert same_values(doc, reference[0])


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
        [sys.executable, "-c", slow_child(0.04, then="print('scored', flush=True)"),
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
    assert same_values(doc, reference[0])


# -- damaged and foreign archives, full disks, exit codes --------------------------------------------


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def every_command(run_dir: Path, conversation: Path, model: Path) -> dict[str, list[str]]:
    return {
        "explain": argv(conversation, model, run_dir),
        "replay": ["replay", str(run_dir), "--method", "exact"],
        "info": ["archive", "info", str(run_dir)],
        "compact": ["archive", "compact", str(run_dir)],
    }


def flip_a_bit(part: Path) -> None:
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x04
    part.write_bytes(bytes(data))


def test_a_flipped_bit_is_refused_by_every_command_until_a_skip_corrupt_resume_quarantines_it(
    tmp_path, conversation, tiny_model_dir, reference, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[1], run_dir, symlinks=True)
    victim = list_parts(run_dir)[5]
    lost = pq.read_table(victim).num_rows
    flip_a_bit(victim)
    before = snapshot_files(run_dir)
    for name, args in every_command(run_dir, conversation, tiny_model_dir).items():
        code, out, err = run_cli(args, capsys)
        assert code == 2, (name, err)
        assert err.splitlines() == [err.strip()] and victim.name in err and "--skip-corrupt" in err, (name, err)
        assert out == "" and snapshot_files(run_dir) == before, name
    out_path = tmp_path / "out.json"
    code, _, err = run_cli(argv(conversation, tiny_model_dir, run_dir, "--skip-corrupt", "--out", str(out_path)), capsys)
    assert code == 0, err
    doc = json.loads(out_path.read_text())
    assert doc["n_evaluations"] == lost and same_values(doc, reference[0])
    assert (run_dir / "quarantine" / victim.name).is_file()
    assert [q["part"] for q in read_manifest(run_dir)["quarantine"]] == [victim.name]
    # later commands need no flag
    for name, args in every_command(run_dir, conversation, tiny_model_dir).items():
        code, out, err = run_cli(args, capsys)
        assert code == 0, (name, err)
    assert f"quarantined     1 parts in quarantine/: {victim.name}" in run_cli(["archive", "info", str(run_dir)], capsys)[1]
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == 2**N == len(set(rows["coalition_key"].to_pylist()))


def _damage_manifest(run_dir: Path) -> str:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    del manifest["runs"][0]["run_id"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return "runs[0].run_id is missing"


def _manifest_runs_not_a_list(run_dir: Path) -> str:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["runs"] = {"0": manifest["runs"][0]}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return "runs must be a list of objects"


def _integer_keys(run_dir: Path) -> str:
    table = read_rows(run_dir).slice(0, 3)
    foreign = table.set_column(1, "coalition_key", pa.array([1, 2, 3], pa.int64()))
    pq.write_table(foreign, run_dir / "parts" / "part-000099.parquet")
    return "part-000099.parquet was not written by coalescence"


def _stray_file(run_dir: Path) -> str:
    (run_dir / "parts" / "notes.csv").write_text("a,b\n")
    return "notes.csv is not a part of this archive"


def _parts_link_elsewhere(run_dir: Path) -> str:
    (run_dir / "parts").unlink()
    os.symlink("/tmp", run_dir / "parts")
    return "not to a generation directory"


@pytest.mark.parametrize("damage", [_damage_manifest, _manifest_runs_not_a_list, _integer_keys, _stray_file, _parts_link_elsewhere])
def test_a_damaged_or_foreign_archive_exits_2_naming_the_file_and_changes_nothing(
    tmp_path, conversation, tiny_model_dir, reference, capsys, damage
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[1], run_dir, symlinks=True)
    says = damage(run_dir)
    before = snapshot_files(run_dir)
    for name, args in every_command(run_dir, conversation, tiny_model_dir).items():
        code, out, err = run_cli(args, capsys)
        assert code == 2, (name, err)
        assert err.splitlines() == [err.strip()] and says in err and "Traceback" not in err, (name, err)
        assert snapshot_files(run_dir) == before, name


@pytest.mark.parametrize("once", [True, False], ids=["one-write-fails", "disk-stays-full"])
def test_a_full_disk_during_a_run_exits_3_and_the_same_command_resumes(tmp_path, conversation, tiny_model_dir, reference, capsys, monkeypatch, once):
    probe = tmp_path / "probe"
    with monkeypatch.context() as m:
        counter = DiskFault(m, probe, after=None)
        assert run_cli(argv(conversation, tiny_model_dir, probe), capsys)[0] == 0
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        DiskFault(m, run_dir, after=counter.calls // 2, once=once)  # mid-run: some parts are flushed
        code, _, err = run_cli(argv(conversation, tiny_model_dir, run_dir), capsys)
    assert code == 3, err
    assert err.splitlines() == [err.strip()] and "No space left on device" in err and "Traceback" not in err
    flushed = read_rows(run_dir, dedupe=False)
    assert 0 < flushed.num_rows < 2**N and flushed.num_rows == len(set(flushed["coalition_key"].to_pylist()))
    run = read_manifest(run_dir)["runs"][0]
    if once:  # the manifest could be written after the failed part: it says what happened
        assert run["status"] == "failed" and "No space left on device" in run["error"]
    else:
        assert run["status"] == "running"  # it could not be written either
    out = tmp_path / "out.json"
    code, _, err = run_cli(argv(conversation, tiny_model_dir, run_dir, "--out", str(out)), capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == 2**N - flushed.num_rows and same_values(doc, reference[0])
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == 2**N == len(set(rows["coalition_key"].to_pylist()))
    run = read_manifest(run_dir)["runs"][0]
    assert run["status"] == "complete" and "error" not in run


@pytest.mark.parametrize(("error", "code"), [(errno.ENOSPC, 3), (errno.EIO, 3), (errno.EACCES, 2), (errno.EROFS, 2)])
def test_compact_that_cannot_write_exits_3_or_2_and_leaves_the_parts(tmp_path, reference, capsys, monkeypatch, error, code):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[1], run_dir, symlinks=True)
    before = snapshot_files(run_dir)
    with monkeypatch.context() as m:
        DiskFault(m, run_dir, after=4, error=error)  # after the lock: the new generation cannot be made
        got, out, err = run_cli(["archive", "compact", str(run_dir)], capsys)
    assert got == code and err.splitlines() == [err.strip()] and os.strerror(error) in err, err
    assert snapshot_files(run_dir) == before


def test_an_archive_place_that_cannot_be_written_exits_2_and_leaves_nothing(tmp_path, conversation, tiny_model_dir, capsys, monkeypatch):
    place = tmp_path / "place"
    place.mkdir()
    with monkeypatch.context() as m:
        DiskFault(m, place, after=0, error=errno.EACCES)
        code, _, err = run_cli(argv(conversation, tiny_model_dir, place / "run"), capsys)
    assert code == 2 and err.splitlines() == [err.strip()] and "Permission denied" in err
    assert os.listdir(place) == []


def test_the_exit_code_table_is_one_and_the_same_in_the_docs_and_every_help():
    # the table moved with the README's "Exit codes" to docs/runs.md (the README is a quick start)
    page = (Path(__file__).parents[2] / "docs" / "runs.md").read_text(encoding="utf-8")
    section = page.split("## Exit codes", 1)[1].split("\n#", 1)[0]
    docs_codes = [int(c) for c in re.findall(r"^\| (\d+) \|", section, re.M)]
    help_codes = [int(c) for c in re.findall(r"^    (\d+) ", cli.EXIT_CODES, re.M)]
    assert docs_codes == help_codes == [0, 1, 2, 3, 4, 130, 141, 143]
    parser = cli.build_parser()
    assert parser.format_help().rstrip().endswith(cli.EXIT_CODES.splitlines()[-1].rstrip())
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert cli.EXIT_CODES.splitlines()[3] in sub.format_help(), name


def test_every_error_is_one_line_even_when_what_it_names_holds_a_newline(tmp_path, capsys):
    odd = tmp_path / "run\nwith a newline"
    odd.mkdir()
    for args in (["archive", "info", str(odd)], ["archive", "compact", str(odd)], ["replay", str(odd), "--method", "exact"]):
        code, out, err = run_cli(args, capsys)
        assert code == 2 and err.count("\n") == 1 and "not a run directory" in err, (args, err)
