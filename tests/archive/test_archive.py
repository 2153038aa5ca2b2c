"""The run archive on real Parquet files: round trips, parts, manifest, pools and refusals."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.archive_rows import N_BITS, make_legacy, make_row, seven_rows

from coalescence.archive import ROW_SCHEMA, SCHEMA_VERSION, RunArchive, read_manifest, read_pool, read_rows
from coalescence.archive.reader import archive_info, corrupt_parts, format_archive_info
from coalescence.errors import ArchiveError, CoalescenceError
from coalescence.masking.codec import PackedMask


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def closed_run(run_dir: Path) -> tuple[Path, list[dict]]:
    """A run of seven rows written with ``flush_rows=3`` and closed."""
    rows = seven_rows()
    archive = RunArchive.create(run_dir, {"run_config": {"method": "exact"}}, flush_rows=3)
    for row in rows:
        archive.append(row)
    archive.close(statistics={"executed": 7})
    return run_dir, rows


# -- writing: parts ---------------------------------------------------------------------------


def test_parts_are_written_every_flush_rows_and_on_close(run_dir: Path) -> None:
    archive = RunArchive.create(run_dir, {}, flush_rows=3)
    parts = run_dir / "parts"
    for i, row in enumerate(seven_rows()):
        archive.append(row)
        assert len(list(parts.glob("part-*.parquet"))) == (i + 1) // 3
    assert archive.rows_written == 6
    archive.close()
    assert archive.rows_written == 7
    # each name carries the SHA-256 of the file's bytes
    names = sorted(p.name for p in parts.iterdir())
    assert names == [f"part-{i:06d}-{hashlib.sha256((parts / n).read_bytes()).hexdigest()}.parquet" for i, n in enumerate(names)]
    assert len(names) == 3
    assert [pq.ParquetFile(p).metadata.num_rows for p in sorted(parts.iterdir())] == [3, 3, 1]


def test_no_temporary_files_are_left(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    assert [p.name for p in (run_dir / "parts").iterdir() if p.name.startswith(".")] == []
    # the writer lock and the live generation of parts, which parts links to
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == [".lock", ".parts-000000"]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", ".parts-000000", "manifest.json", "parts"]
    assert os.readlink(run_dir / "parts") == ".parts-000000"


def test_parts_are_zstd_compressed(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    for part in sorted((run_dir / "parts").glob("part-*.parquet")):
        meta = pq.ParquetFile(part).metadata
        for c in range(meta.num_columns):
            assert meta.row_group(0).column(c).compression == "ZSTD", (part.name, c)


def test_flush_without_rows_writes_no_part(run_dir: Path) -> None:
    archive = RunArchive.create(run_dir, {}, flush_rows=3)
    archive.flush()
    archive.close()
    assert list((run_dir / "parts").iterdir()) == []
    assert read_rows(run_dir).num_rows == 0
    assert read_rows(run_dir).schema.equals(ROW_SCHEMA)
    assert read_manifest(run_dir)["rows"] == 0


# -- reading rows back ------------------------------------------------------------------------


def test_round_trip_keeps_values_exactly_and_in_order(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, rows = closed_run
    table = read_rows(run_dir)
    assert table.num_rows == 7
    assert table.schema.equals(ROW_SCHEMA)
    back = table.to_pylist()
    for written, read in zip(rows, back, strict=True):
        for name in ("snapshot_id", "coalition_key", "mask", "n_bits", "absence_policy", "model_id"):
            assert read[name] == written[name], name
        assert read["token_logprobs"] is None and read["generated_texts"] is None
        assert read["cache_hit"] is False
        assert read["batch_size"] == 3
        assert read["elapsed_ms"] == 1.5
        assert read["created_at"] == written["created_at"]
    # float64 utilities bit for bit, including -0.0 and a subnormal-adjacent value
    got = table["utility"].to_numpy()
    want = np.array([r["utility"] for r in rows], dtype=np.float64)
    assert got.dtype == np.float64
    assert got.tobytes() == want.tobytes()
    # masks decode to the coalitions written
    assert PackedMask(back[3]["mask"], back[3]["n_bits"]).to_bools().nonzero()[0].tolist() == [2, 3, 4]
    assert PackedMask(back[6]["mask"], back[6]["n_bits"]).to_bools().all()


def test_created_at_is_utc(run_dir: Path) -> None:
    plus_two = timezone(timedelta(hours=2))
    archive = RunArchive.create(run_dir, {}, flush_rows=10)
    archive.append(make_row([1], utility=-1.0, created_at=datetime(2024, 1, 1, 12, 0, 0, 7, tzinfo=plus_two)))
    before = datetime.now(UTC)
    archive.append(make_row([2], utility=-2.0, created_at=None))  # defaults to now, UTC
    after = datetime.now(UTC)
    archive.close()
    table = read_rows(run_dir)
    assert table.schema.field("created_at").type == pa.timestamp("us", tz="UTC")
    first, second = table["created_at"].to_pylist()
    assert first.utcoffset() == timedelta(0)
    assert first == datetime(2024, 1, 1, 10, 0, 0, 7, tzinfo=UTC)  # the same instant, shown in UTC
    assert second.utcoffset() == timedelta(0)
    assert before - timedelta(microseconds=1) <= second <= after


def test_measurements_round_trip(run_dir: Path) -> None:
    archive = RunArchive.create(run_dir, {})
    lp = np.array([-0.5, -1e-8, -30.25], dtype=np.float32)
    archive.append({**make_row([0], utility=-3.0), "evaluation_key": "e" * 64, "token_logprobs": lp.tolist()})
    archive.append({**make_row([1], utility=0.5), "generated_texts": ["Paris, 1889 \u2014 ok", ""]})
    archive.close()
    rows = read_rows(run_dir)
    assert rows["evaluation_key"].to_pylist() == ["e" * 64, None]
    back = rows["token_logprobs"].to_pylist()
    assert np.array_equal(np.array(back[0], dtype=np.float32), lp) and back[1] is None  # float32 bit for bit
    assert rows["generated_texts"].to_pylist() == [None, ["Paris, 1889 \u2014 ok", ""]]


def test_parts_of_schema_version_1_read_with_the_new_columns_null(run_dir: Path) -> None:
    archive = RunArchive.create(run_dir, {})
    archive.append(make_row([0], utility=-3.0))
    archive.close()
    # rewrite the part as version 1 wrote it: no measurement columns, the never-used generation_text
    part = next((run_dir / "parts").glob("part-*.parquet"))
    old = pq.read_table(part).drop_columns(["evaluation_key", "token_logprobs", "generated_texts"])
    old = old.append_column("generation_text", pa.array([None], type=pa.string()))
    make_legacy(run_dir, {0: old}, schema_version=1)
    assert corrupt_parts(run_dir) == []
    rows = read_rows(run_dir)
    assert rows.schema.equals(ROW_SCHEMA)
    assert rows["utility"].to_pylist() == [-3.0]
    assert rows["token_logprobs"].to_pylist() == [None]
    # a resumed version-1 archive is written on as version 3
    RunArchive.open(run_dir, {}).close()
    assert read_manifest(run_dir)["schema_version"] == SCHEMA_VERSION == 3
    assert read_rows(run_dir)["utility"].to_pylist() == [-3.0]


def test_parts_read_as_one_pyarrow_dataset(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, rows = closed_run
    # a crashed writer's temporary part must not break the dataset either
    (run_dir / "parts" / ".part-000009.parquet.tmp").write_bytes(b"not parquet at all")
    table = ds.dataset(run_dir / "parts", format="parquet").to_table()
    assert table.num_rows == 7
    assert sorted(table["coalition_key"].to_pylist()) == sorted(r["coalition_key"] for r in rows)
    assert table.schema.field("utility").type == pa.float64()


def test_read_rows_ignores_a_stray_temporary_part(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, rows = closed_run
    (run_dir / "parts" / ".part-000009.parquet.tmp").write_bytes(b"PAR1 garbage garbage")
    table = read_rows(run_dir)
    assert table.num_rows == 7
    assert table["coalition_key"].to_pylist() == [r["coalition_key"] for r in rows]


def test_read_rows_of_a_corrupt_part_raises_archive_error(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    victim = sorted((run_dir / "parts").iterdir())[1]
    victim.write_bytes(b"garbage")
    with pytest.raises(ArchiveError, match=victim.name):
        read_rows(run_dir)


@settings(max_examples=25, deadline=None)
@given(
    utilities=st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=9),
    flush_rows=st.integers(1, 4),
)
def test_any_float64_utilities_round_trip_in_order(utilities: list[float], flush_rows: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        archive = RunArchive.create(run_dir, {}, flush_rows=flush_rows)
        for i, u in enumerate(utilities):
            archive.append(make_row([i], utility=u))
        archive.close()
        n_parts = len(list((run_dir / "parts").glob("part-*.parquet")))
        assert n_parts == math.ceil(len(utilities) / flush_rows)
        got = read_rows(run_dir)["utility"].to_numpy()
        assert got.tobytes() == np.array(utilities, dtype=np.float64).tobytes()


# -- manifest ---------------------------------------------------------------------------------


def test_manifest_after_create_and_after_close(run_dir: Path) -> None:
    run = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "run_config": {"method": "exact"}}
    archive = RunArchive.create(run_dir, run, flush_rows=3)
    created = read_manifest(run_dir)
    assert created["schema_version"] == SCHEMA_VERSION
    [entry] = created["runs"]
    assert entry["run_config"] == {"method": "exact"} and entry["status"] == "running"
    assert entry["run_id"] == archive.run_id
    assert created["rows"] == 0
    for row in seven_rows():
        archive.append(row)
    archive.close(statistics={"executed": 7})
    manifest = read_manifest(run_dir)
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["rows"] == 7
    [entry] = manifest["runs"]
    assert entry["statistics"] == {"executed": 7} and entry["status"] == "complete"
    assert entry["run_config"] == {"method": "exact"}
    assert manifest["created_at"] == created["created_at"]
    created_at = datetime.fromisoformat(manifest["created_at"])
    updated_at = datetime.fromisoformat(manifest["updated_at"])
    assert created_at.utcoffset() == timedelta(0)
    assert updated_at.utcoffset() == timedelta(0)
    assert created_at <= updated_at
    # the file is plain JSON with the same content
    assert json.loads((run_dir / "manifest.json").read_text(encoding="utf-8")) == manifest


def test_a_newer_schema_version_is_refused(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**manifest, "schema_version": 999}), encoding="utf-8")
    with pytest.raises(ArchiveError, match="999") as info:
        read_manifest(run_dir)
    assert info.value.field == "RUN_DIR"


def test_a_missing_or_broken_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="not a run directory"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{", encoding="utf-8")
    with pytest.raises(ArchiveError, match="cannot read"):
        read_manifest(tmp_path)


# -- create: refusing existing runs -----------------------------------------------------------


def test_create_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(ArchiveError) as info:
        RunArchive.create(run_dir, {})
    assert info.value.field == "archive"
    assert isinstance(info.value, CoalescenceError)
    assert str(info.value).startswith("archive: ")
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert (run_dir / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_create_refuses_an_existing_run(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    before = (run_dir / "manifest.json").read_bytes()
    with pytest.raises(ArchiveError):
        RunArchive.create(run_dir, {"other": True})
    assert (run_dir / "manifest.json").read_bytes() == before
    assert read_rows(run_dir).num_rows == 7


def test_create_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "run"
    path.write_text("x", encoding="utf-8")
    with pytest.raises(ArchiveError) as info:
        RunArchive.create(path, {})
    assert info.value.field == "archive"


def test_create_accepts_an_empty_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    archive = RunArchive.create(run_dir, {"k": 1})
    archive.append(make_row([0, 1], utility=-4.25))
    archive.close()
    assert read_manifest(run_dir)["rows"] == 1
    assert read_rows(run_dir)["utility"].to_pylist() == [-4.25]


def test_create_makes_missing_parents(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "b" / "run"
    RunArchive.create(run_dir, {}).close()
    assert (run_dir / "manifest.json").is_file()
    assert (run_dir / "parts").is_dir()


# -- closing ----------------------------------------------------------------------------------


def test_append_after_close_raises(run_dir: Path) -> None:
    archive = RunArchive.create(run_dir, {})
    archive.append(make_row([0], utility=-1.0))
    archive.close()
    with pytest.raises(ArchiveError, match="closed") as info:
        archive.append(make_row([1], utility=-2.0))
    assert info.value.field == "archive"
    archive.close()  # a second close is a no-op
    assert read_rows(run_dir).num_rows == 1
    assert read_manifest(run_dir)["rows"] == 1


# -- pools ------------------------------------------------------------------------------------


def test_read_pool_selects_one_snapshot_and_first_duplicate_wins(run_dir: Path) -> None:
    s1, s2 = "1" * 64, "2" * 64
    archive = RunArchive.create(run_dir, {}, flush_rows=2)
    archive.append(make_row([], utility=-10.0, snapshot_id=s1))
    archive.append(make_row([0, 9], utility=-8.5, snapshot_id=s1))
    archive.append(make_row([0, 9], utility=-99.0, snapshot_id=s2))  # other snapshot, same mask
    archive.append(make_row([0, 9], utility=-7.0, snapshot_id=s1))  # duplicate key: ignored
    archive.append(make_row(list(range(N_BITS)), utility=-1.25, snapshot_id=s1))
    archive.close()

    masks, utilities = read_pool(run_dir, s1)
    assert masks.dtype == np.bool_
    assert utilities.dtype == np.float64
    assert masks.shape == (3, N_BITS)
    assert utilities.tolist() == [-10.0, -8.5, -1.25]
    assert not masks[0].any()
    assert masks[1].nonzero()[0].tolist() == [0, 9]
    assert masks[2].all()

    masks2, utilities2 = read_pool(run_dir, s2)
    assert masks2.shape == (1, N_BITS)
    assert masks2[0].nonzero()[0].tolist() == [0, 9]
    assert utilities2.tolist() == [-99.0]


def test_read_pool_of_an_unknown_snapshot_is_empty(closed_run: tuple[Path, list[dict]]) -> None:
    run_dir, _ = closed_run
    masks, utilities = read_pool(run_dir, "f" * 64)
    assert masks.shape[0] == 0 and masks.dtype == np.bool_
    assert utilities.shape == (0,) and utilities.dtype == np.float64


def test_a_bad_row_is_refused_at_append_and_does_not_jam_the_archive(tmp_path):
    archive = RunArchive.create(tmp_path / "run", {}, flush_rows=2)
    with pytest.raises(ArchiveError, match="missing"):
        archive.append({"snapshot_id": "s"})
    archive.close()
    assert archive.manifest["rows"] == 0


def test_a_deleted_parts_link_is_refused_and_nothing_is_deleted(tmp_path: Path) -> None:
    """A new user's `rm RUN/parts`: readers reported 0 coalitions and a resume deleted the parts
    as crash debris. Every reader and writer must refuse, naming the fix, and leave the parts."""
    run_dir = tmp_path / "run"
    run = {"snapshot_ids": ["a" * 64], "model": {}, "utility": {}, "absence_policy": {}}
    archive = RunArchive.open(run_dir, run)
    for k in range(3):
        archive.append(make_row([k], utility=-1.0 - k))
    archive.close()
    generation = os.readlink(run_dir / "parts")
    (run_dir / "parts").unlink()
    before = sorted(os.listdir(run_dir / generation))
    assert len(before) == 1
    for attempt in (lambda: read_rows(run_dir), lambda: RunArchive.open(run_dir, run)):
        with pytest.raises(ArchiveError) as info:
            attempt()
        assert f"ln -s {generation}" in info.value.message
    assert sorted(os.listdir(run_dir / generation)) == before
    (run_dir / "parts").symlink_to(generation)  # the fix the message names
    assert read_rows(run_dir).num_rows == 3


@pytest.mark.parametrize("edit", ["message", "target", "players"])
def test_an_edited_snapshot_record_is_refused_by_every_reader_and_writer(tmp_path: Path, edit: str) -> None:
    from coalescence.conversation import Conversation, Message
    from coalescence.snapshot import ConversationSnapshot

    snap = ConversationSnapshot.build(
        Conversation(messages=(Message(role="user", content="Alpha is first. Beta is second."),), target="Ok."),
        unit="sentence",
    )
    run_dir = tmp_path / "run"
    run = {"snapshot_ids": [snap.snapshot_id], "model": {}, "utility": {}, "absence_policy": {}, "snapshots": [snap.to_dict()]}
    archive = RunArchive.open(run_dir, run)
    archive.append(make_row([0], utility=-1.0, snapshot_id=snap.snapshot_id, n_bits=2))
    archive.close()
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    record = manifest["snapshots"][0]
    if edit == "message":
        record["messages"][0]["content"] = "Alpha is first. Gamma is second."
    elif edit == "target":
        record["target"] = "No."
    else:
        record["players"] = None
    (run_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    before = (run_dir / "manifest.json").read_bytes()
    for attempt in (lambda: read_manifest(run_dir), lambda: RunArchive.open(run_dir, run | {"snapshots": []})):
        with pytest.raises(ArchiveError) as info:
            attempt()
        assert "snapshots[0]" in info.value.message and "\n" not in str(info.value)
    assert (run_dir / "manifest.json").read_bytes() == before


def test_archive_info_tells_a_killed_run_from_a_running_one(tmp_path: Path) -> None:
    # a real writer in a child process: while it lives it holds the archive's lock and the run is
    # running; killed (SIGKILL: no handler runs, the manifest still says running), the lock dies
    # with it and `archive info` says the run was interrupted, not that it runs
    import signal
    import subprocess
    import sys

    from coalescence.cli import main

    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from coalescence.archive import RunArchive; "
         f"a = RunArchive.create({str(run_dir)!r}, {{'run_config': {{'method': 'exact'}}}}); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        assert main(["archive", "info", str(run_dir)]) == 0
        assert archive_info(run_dir)["runs"][-1]["status"] == "running"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert json.loads((run_dir / "manifest.json").read_text())["runs"][-1]["status"] == "running"  # what the manifest says
    run = archive_info(run_dir)["runs"][-1]
    assert run["status"] == "interrupted" and run["killed"] is True
    assert "[interrupted: killed" in format_archive_info(archive_info(run_dir)) and "[running]" not in format_archive_info(archive_info(run_dir))
