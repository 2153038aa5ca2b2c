"""Write faults: a full disk at every write point, places that cannot be written.

Fault injection at the OS boundary (see ``helpers.archive_faults``): a real full disk needs a small
file system of its own, and root mounts are not available here; a real permission denial needs a
user other than root. Everything else is real: the archive's own code, real Parquet parts on disk.

The rules checked after every fault: the error is one :class:`ArchiveError` line (an
:class:`ArchiveWriteError` for a full disk), never a raw ``OSError``; the manifest still parses and
every part still verifies; a plain dataset read sees each key once; nothing flushed before is lost;
and once space is freed, the same run resumes and completes with every key exactly once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from helpers.archive_faults import DiskFault
from helpers.archive_rows import make_row

from coalescence.archive import RunArchive, compact, list_parts, read_manifest, read_rows
from coalescence.archive.writer import write_json_atomic
from coalescence.errors import ArchiveError, ArchiveWriteError

RUN = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}
ROWS = [make_row([i % 10, (i * 7) % 10], utility=-1.0 - i / 8, key=f"{i:064x}") for i in range(9)]
WANT = {r["coalition_key"]: r["utility"] for r in ROWS}


def run_rows(run_dir: Path, *, flush_rows: int = 2, create: bool = False) -> RunArchive:
    """Open (or create) the run, append every row (those on disk are skipped), close it."""
    archive = (RunArchive.create if create else RunArchive.open)(run_dir, RUN, flush_rows=flush_rows)
    try:
        for row in ROWS:
            archive.append(row)
    finally:
        archive.close()
    return archive


def on_disk(run_dir: Path) -> dict[str, float]:
    """The rows every part holds, verified, each key checked to appear once (plain read too)."""
    table = read_rows(run_dir, dedupe=False)
    keys = table["coalition_key"].to_pylist()
    assert len(keys) == len(set(keys))
    if os.path.lexists(run_dir / "parts"):
        plain = ds.dataset(run_dir / "parts", format="parquet").to_table()
        assert sorted(plain["coalition_key"].to_pylist() if plain.num_rows else []) == sorted(keys)
    return dict(zip(keys, table["utility"].to_pylist(), strict=True))


@pytest.fixture
def template(tmp_path: Path) -> Path:
    """A run interrupted after four rows (two parts)."""
    path = tmp_path / "template"
    archive = RunArchive.create(path, RUN, flush_rows=2)
    for row in ROWS[:4]:
        archive.append(row)
    archive.close(status="interrupted")
    return path


def count_calls(monkeypatch: pytest.MonkeyPatch, root: Path, action) -> int:
    with monkeypatch.context() as m:
        counter = DiskFault(m, root, after=None)
        action()
    return counter.calls


@pytest.mark.parametrize("once", [False, True], ids=["disk-stays-full", "one-write-fails"])
def test_a_full_disk_at_every_write_point_of_a_resume(template: Path, tmp_path: Path, monkeypatch, once: bool) -> None:
    probe = tmp_path / "probe"
    shutil.copytree(template, probe, symlinks=True)
    total = count_calls(monkeypatch, probe, lambda: run_rows(probe))
    assert total > 10
    failures = 0
    for k in range(total):
        run_dir = tmp_path / f"k{k}"
        shutil.copytree(template, run_dir, symlinks=True)
        error = None
        with monkeypatch.context() as m:
            fault = DiskFault(m, run_dir, after=k, once=once)
            try:
                run_rows(run_dir)
            except ArchiveError as exc:
                error = exc
            if error is not None:
                failures += 1
                assert isinstance(error, ArchiveWriteError), error
                assert "No space left on device" in str(error) and "\n" not in str(error)
                # with the fault still there: the manifest parses, the parts verify, nothing flushed is lost
                rows = on_disk(run_dir)
                assert {k_: WANT[k_] for k_ in list(WANT)[:4]}.items() <= rows.items()
                assert rows.items() <= WANT.items()
                run = read_manifest(run_dir)["runs"][0]
                manifest = (run_dir / "manifest.json").read_bytes()
                if run["status"] == "complete":  # only the sync after the last rename failed
                    assert rows == WANT
                elif once and manifest != (template / "manifest.json").read_bytes():
                    # the manifest could be written after the one failed write: it says what happened
                    assert run["status"] == "failed" and "No space left on device" in run["error"], (k, run)
                elif once:  # the failed write was the first change, the manifest's: nothing changed
                    assert run["status"] == "interrupted"
                else:  # before the manifest was rewritten, or it could not record the failure
                    assert run["status"] in ("interrupted", "running", "failed")
            else:  # failures that cost nothing: creating a directory that exists, the lock's note
                assert fault.failed and set(fault.failed) <= {"mkdir", "ftruncate", "pwrite"}, fault.failed
        # space is freed: the same run resumes and completes, every key once
        run_rows(run_dir)
        assert on_disk(run_dir) == WANT
        run = read_manifest(run_dir)["runs"][0]
        assert run["status"] == "complete" and "error" not in run
        assert read_manifest(run_dir)["rows"] == len(WANT)
        shutil.rmtree(run_dir)
    assert failures > total / 2


def test_a_full_disk_at_every_write_point_of_a_new_run(tmp_path: Path, monkeypatch) -> None:
    total = count_calls(monkeypatch, tmp_path / "probe", lambda: run_rows(tmp_path / "probe", create=True))
    for k in range(total):
        run_dir = tmp_path / f"k{k}" / "run"
        with monkeypatch.context() as m:
            DiskFault(m, tmp_path / f"k{k}", after=k)
            with pytest.raises(ArchiveWriteError):
                run_rows(run_dir, create=True)
        # either nothing is left, or a run directory that resumes
        if (run_dir / "manifest.json").exists():
            assert set(on_disk(run_dir).items()) <= set(WANT.items())
        else:
            assert not run_dir.exists() or os.listdir(run_dir) == []
        run_rows(run_dir)
        assert on_disk(run_dir) == WANT


def test_a_full_disk_at_every_write_point_of_a_compaction(template: Path, tmp_path: Path, monkeypatch) -> None:
    run_rows(template, flush_rows=2)  # nine rows in five parts
    assert len(list_parts(template)) == 5
    probe = tmp_path / "probe"
    shutil.copytree(template, probe, symlinks=True)
    total = count_calls(monkeypatch, probe, lambda: compact(probe))
    for k in range(total):
        run_dir = tmp_path / f"k{k}"
        shutil.copytree(template, run_dir, symlinks=True)
        live = {p.name: p.read_bytes() for p in list_parts(run_dir)}
        with monkeypatch.context() as m:
            fault = DiskFault(m, run_dir, after=k)
            try:
                compact(run_dir)
            except ArchiveWriteError as exc:
                assert "\n" not in str(exc) and "No space left on device" in str(exc)
            else:  # only the lock's note failed (released after the work)
                assert set(fault.failed) <= {"ftruncate", "pwrite"}, fault.failed
        after = list_parts(run_dir)
        if len(after) == 1:  # failed after the switch (syncing the run directory): merged, complete
            assert on_disk(run_dir) == WANT
        else:  # the live parts as they were, and no other generation left
            assert {p.name: p.read_bytes() for p in after} == live
            assert [n for n in os.listdir(run_dir) if n.startswith(".parts")] == [os.readlink(run_dir / "parts")]
        assert on_disk(run_dir) == WANT
        compact(run_dir)
        assert len(list_parts(run_dir)) == 1 and on_disk(run_dir) == WANT
        shutil.rmtree(run_dir)


def test_an_output_file_that_does_not_fit(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out.json"
    out.write_text('{"old": true}')
    with monkeypatch.context() as m:
        DiskFault(m, tmp_path, after=1)  # the temporary file is created, its bytes do not fit
        with pytest.raises(ArchiveWriteError, match="--out: cannot write .*out.json: No space left on device"):
            write_json_atomic(out, {"new": True}, field="--out")
    assert json.loads(out.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left


# -- places that cannot be written (a setting: exit 2, nothing changed) ----------------------------


def files(run_dir: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock's (it holds the holder's pid while locked)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_a_run_directory_that_cannot_be_created(tmp_path: Path, monkeypatch) -> None:
    with monkeypatch.context() as m:
        DiskFault(m, tmp_path, after=0, error=errno.EACCES)
        with pytest.raises(ArchiveError) as refused:
            RunArchive.create(tmp_path / "a" / "run", RUN)
    assert not isinstance(refused.value, ArchiveWriteError)
    assert "cannot create run directory" in str(refused.value) and "Permission denied; choose a writable place" in str(refused.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [errno.EACCES, errno.EROFS])
def test_an_archive_that_cannot_be_written_is_refused_unchanged(template: Path, monkeypatch, error: int) -> None:
    before = files(template)
    for after in range(4):  # the lock file, then the manifest: each refused
        with monkeypatch.context() as m:
            DiskFault(m, template, after=after, error=error)
            with pytest.raises(ArchiveError) as refused:
                run_rows(template)
        assert not isinstance(refused.value, ArchiveWriteError), refused.value
        assert "choose a writable place" in str(refused.value)
        assert files(template) == before
        with monkeypatch.context() as m:
            DiskFault(m, template, after=after, error=error)
            with pytest.raises(ArchiveError) as refused:
                compact(template)
        assert not isinstance(refused.value, ArchiveWriteError)
        assert files(template) == before
