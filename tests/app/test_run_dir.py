"""The ``archive`` setting checked before the model loads agrees with the archive itself: a
directory that a creation killed before its manifest left behind (its lock file alone, or a
temporary manifest) becomes the new run, as :meth:`RunArchive.open` takes it; any other
directory without a manifest is refused, naming ``archive``."""

from __future__ import annotations

import pytest

from coalescence.app.outputs import check_run_dir
from coalescence.errors import ConfigError


@pytest.mark.parametrize("left", [[], [".lock"], [".lock", ".manifest.json.1234.tmp"]])
def test_a_directory_left_by_a_killed_creation_becomes_the_new_run(tmp_path, left):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in left:
        (run_dir / name).write_text("")
    assert check_run_dir(str(run_dir)) == run_dir


@pytest.mark.parametrize("left", [["notes.txt"], [".lock", "part-00000.parquet"]])
def test_a_directory_holding_anything_else_without_a_manifest_is_refused(tmp_path, left):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in left:
        (run_dir / name).write_text("x")
    with pytest.raises(ConfigError) as info:
        check_run_dir(str(run_dir))
    assert info.value.field == "archive" and "is not a run directory" in info.value.message


def test_a_file_is_refused(tmp_path):
    path = tmp_path / "run"
    path.write_text("x")
    with pytest.raises(ConfigError) as info:
        check_run_dir(str(path))
    assert info.value.field == "archive"


def test_the_killed_creation_is_then_opened_by_the_archive(tmp_path):
    from coalescence.archive.writer import RunArchive

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("")
    check_run_dir(str(run_dir))
    archive = RunArchive.open(run_dir, {"snapshot_ids": [], "model": {"id": "m"}, "utility": {}, "absence_policy": "drop"})
    assert not archive.resumed
    archive.close(status="complete")
    assert (run_dir / "manifest.json").is_file()
