"""Compaction is atomic for readers: killed at every step, a plain dataset read sees each key once.

Each crash is a real SIGKILL of a real ``archive compact`` process: the child counts the OS calls
that change the file system (``os.open``, ``write``, ``fsync``, ``replace``, ``rename``, ``mkdir``,
``symlink``, ``link``, ``unlink``, ``rmdir``) and kills itself with SIGKILL just before call ``k``;
the test runs it for k = 1, 2, ... until one run completes, so every state between two calls is
one that a reader could have met.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from helpers.archive_rows import make_legacy, make_row

from coalescence.archive import RunArchive, compact, list_parts, read_manifest, read_rows
from coalescence.archive.layout import RETIRED_SECONDS
from coalescence.archive.reader import parts_of

RUN = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}
ROWS = [make_row([i % 10, (i * 3) % 10], utility=-float(i) - 0.125, key=f"{i:064x}") for i in range(10)]
WANT = {r["coalition_key"]: r["utility"] for r in ROWS}

KILLED_CHILD = """
import os, signal, sys
limit, count = int(sys.argv[2]), 0
def counted(function):
    def call(*args, **kwargs):
        global count
        count += 1
        if count == limit:
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)
    return call
from coalescence.archive import compact
for name in ("open", "write", "fsync", "replace", "rename", "mkdir", "symlink", "link", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
compact(sys.argv[1])
print(count)
"""


def build(run_dir: Path) -> None:
    """Ten rows in four parts (3, 3, 3, 1)."""
    archive = RunArchive.create(run_dir, RUN, flush_rows=3)
    for row in ROWS:
        archive.append(row)
    archive.close()


def rows_seen(run_dir: Path) -> list[tuple[str, float]]:
    """What docs/archive.md's plain pyarrow read of ``parts`` sees: (key, utility) rows, sorted."""
    table = ds.dataset(run_dir / "parts", format="parquet").to_table()
    return sorted(zip(table["coalition_key"].to_pylist(), table["utility"].to_pylist(), strict=True))


def plain_read(run_dir: Path) -> dict[str, float]:
    """The plain read, each key checked to appear once."""
    rows = rows_seen(run_dir)
    assert len(rows) == len(dict(rows)), "a key seen twice"
    return dict(rows)


def kill_at_every_step(template: Path, tmp_path: Path, *, legacy: bool) -> int:
    """Kill ``archive compact`` of a copy of ``template`` before each of its file-system calls.

    Every state left must show a plain reader the parts as they were before the compaction or the
    merged part (each key once), never a mix of the two."""
    before = rows_seen(template)
    steps = 0
    windows: list[int] = []
    for limit in range(1, 200):
        run_dir = tmp_path / f"k{limit}"
        shutil.copytree(template, run_dir, symlinks=True)
        child = subprocess.run(
            [sys.executable, "-c", KILLED_CHILD, str(run_dir), str(limit)], capture_output=True, text=True, timeout=120
        )
        if child.returncode == 0:
            steps = int(child.stdout)
            assert limit > steps  # the run that was not killed made fewer calls than the limit
            assert plain_read(run_dir) == WANT
            break
        assert child.returncode == -9, child.stderr
        # the state the kill left, as a plain reader meets it
        if legacy and not os.path.lexists(run_dir / "parts"):
            # the one-time switch of an old archive stopped between its two renames: a plain read
            # fails loudly (never a double count); our reader and the next writer finish the switch
            assert (run_dir / ".parts.next").is_symlink()
            windows.append(limit)
            with pytest.raises(FileNotFoundError):
                ds.dataset(run_dir / "parts", format="parquet")
        elif rows_seen(run_dir) != before:
            assert plain_read(run_dir) == WANT
        assert dict(zip(*(read_rows(run_dir)[c].to_pylist() for c in ("coalition_key", "utility")), strict=True)) == WANT
        # the next compaction clears the debris and completes
        compact(run_dir)
        assert len(list_parts(run_dir)) == 1
        assert plain_read(run_dir) == WANT
        live = os.readlink(run_dir / "parts")
        # debris (a generation never switched to, .parts.next, the legacy directory) is gone; what
        # remains besides the live generation are generations it replaced, kept for readers
        left = sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".parts") and p.name != live)
        assert all(re.fullmatch(r"\.parts-\d{6}", n) and n < live for n in left), (left, live)
        shutil.rmtree(run_dir)
    assert steps > 5
    assert len(windows) == (1 if legacy else 0)  # the legacy switch's one state without parts
    return steps


def test_compaction_killed_at_every_step_never_shows_a_key_twice(tmp_path: Path) -> None:
    template = tmp_path / "template"
    build(template)
    assert len(list_parts(template)) == 4
    assert plain_read(template) == WANT
    kill_at_every_step(template, tmp_path, legacy=False)


def test_compaction_of_an_old_archive_killed_at_every_step(tmp_path: Path) -> None:
    template = tmp_path / "template"
    build(template)
    table = read_rows(template)
    # an old archive, left with duplicates by an old compaction that was killed before its deletes
    make_legacy(template, {0: table.slice(0, 5), 1: table.slice(5), 2: table})
    assert ds.dataset(template / "parts", format="parquet").to_table().num_rows == 20  # the double count
    kill_at_every_step(template, tmp_path, legacy=True)


def test_compaction_merges_into_one_part_of_a_new_generation(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    build(run_dir)
    before = os.readlink(run_dir / "parts")
    assert compact(run_dir) == (4, 10)
    assert os.readlink(run_dir / "parts") != before
    # the replaced generation stays RETIRED_SECONDS for reads that listed it, then goes
    assert sorted(p.name for p in (run_dir / before).iterdir()) != []
    retired = time.time() - RETIRED_SECONDS - 1
    os.utime(run_dir / before, (retired, retired))
    [part] = parts_of(run_dir)
    assert part.index == 4  # indices go on: a part name is never reused for other rows
    assert read_rows(run_dir).to_pylist() == sorted(read_rows(run_dir).to_pylist(), key=lambda r: list(WANT).index(r["coalition_key"]))
    # one part already: nothing to do, nothing changed
    assert compact(run_dir) == (1, 10)
    assert parts_of(run_dir)[0].path == part.path
    assert not (run_dir / before).exists()
    assert read_manifest(run_dir)["runs"][0]["status"] == "complete"
