"""Integrity on real Parquet parts: flipped bits, foreign files, damaged manifests, quarantine, old archives.

The rule every test here checks: a part's values are used only if the part is exactly what the
writer wrote. Anything else is refused with one line naming the file, or, under ``skip_corrupt``,
left out (a writer moves it to ``quarantine/``), and never decoded into numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from helpers.archive_rows import make_legacy, make_row, seven_rows

from coalescence.archive import ROW_SCHEMA, RunArchive, archive_info, list_parts, read_manifest, read_rows
from coalescence.archive.reader import check_parts
from coalescence.errors import ArchiveError, ArchiveWriteError

RUN = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}


def files(run_dir: Path) -> dict[str, bytes | str]:
    """Every entry under ``run_dir`` but the lock: file bytes, link targets."""
    out: dict[str, bytes | str] = {}
    for root, dirs, names in os.walk(run_dir):
        for name in dirs + names:
            path = Path(root) / name
            rel = str(path.relative_to(run_dir))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file() and name != ".lock":
                out[rel] = path.read_bytes()
    return out


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A closed run of seven rows in three parts (3, 3, 1), with per-token scores."""
    path = tmp_path / "run"
    archive = RunArchive.create(path, RUN, flush_rows=3)
    for i, row in enumerate(seven_rows()):
        archive.append({**row, "evaluation_key": f"{i:064x}", "token_logprobs": [-0.25 * i, -1.5]})
    archive.close()
    return path


def utilities(table: pa.Table) -> dict[str, float]:
    return dict(zip(table["coalition_key"].to_pylist(), table["utility"].to_pylist(), strict=True))


# -- flipped bits -----------------------------------------------------------------------------


def test_a_flipped_bit_at_any_offset_of_a_part_is_refused_never_decoded(run_dir: Path) -> None:
    written = utilities(read_rows(run_dir))
    victim = list_parts(run_dir)[0]
    original = victim.read_bytes()
    footer = len(original) - 8 - int.from_bytes(original[-8:-4], "little")
    kept = {k: v for k, v in written.items() if k not in set(pq.read_table(victim)["coalition_key"].to_pylist())}
    assert len(kept) == 4 and 0 < footer < len(original)
    for offset in range(len(original)):  # data pages, page headers, footer, magic bytes: every byte
        damaged = bytearray(original)
        damaged[offset] ^= 1 << (offset % 8)
        victim.write_bytes(bytes(damaged))
        with pytest.raises(ArchiveError, match=victim.name) as refused:
            read_rows(run_dir)
        assert "\n" not in str(refused.value) and "--skip-corrupt" in str(refused.value)
        if offset % 61 == 0:  # the other paths, on a sample of offsets (each decodes the other parts)
            with pytest.raises(ArchiveError, match=victim.name):
                check_parts(run_dir)
            # skipped, the part contributes nothing: the other parts' values, exactly
            assert utilities(read_rows(run_dir, skip_corrupt=True)) == kept, offset
    victim.write_bytes(original)
    assert utilities(read_rows(run_dir)) == written


def test_the_issue_case_a_flipped_bit_in_a_utility_value(run_dir: Path) -> None:
    """One bit flip that pyarrow alone decodes to a different utility (what the issue saw) is refused."""
    victim = list_parts(run_dir)[0]
    original = victim.read_bytes()
    column = pq.ParquetFile(victim).metadata.row_group(0).column(ROW_SCHEMA.get_field_index("utility"))
    start = column.dictionary_page_offset or column.data_page_offset
    before = pq.read_table(victim)["utility"].to_pylist()
    silent = None
    for offset in range(start, start + column.total_compressed_size):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[offset] ^= 1 << bit
            try:
                after = pq.read_table(pa.BufferReader(bytes(damaged)))["utility"].to_pylist()
            except (pa.ArrowException, OSError):
                continue
            if after != before:
                silent = damaged
                break
        if silent is not None:
            break
    assert silent is not None, "no bit of the utility column decodes to another value: the test lost its point"
    victim.write_bytes(bytes(silent))
    with pytest.raises(ArchiveError, match="do not match the SHA-256"):
        read_rows(run_dir)
    with pytest.raises(ArchiveError, match=victim.name):
        archive_info(run_dir)
    with pytest.raises(ArchiveError, match=victim.name):
        RunArchive.open(run_dir, RUN)


def test_parts_carry_parquet_page_checksums_too(run_dir: Path) -> None:
    # for readers that verify pages themselves (page_checksum_verification=True); the digest in
    # the name is what covers the footer and the page headers
    for part in list_parts(run_dir):
        meta = pq.ParquetFile(part).metadata
        assert meta.num_rows > 0
        table = pq.read_table(part, page_checksum_verification=True)
        assert table.num_rows == meta.num_rows
        assert part.name == f"{part.name[:11]}-{hashlib.sha256(part.read_bytes()).hexdigest()}.parquet"


# -- quarantine ---------------------------------------------------------------------------------


def test_skip_corrupt_resume_quarantines_the_part_and_later_reads_need_no_flag(run_dir: Path) -> None:
    victim = list_parts(run_dir)[1]
    lost = set(pq.read_table(victim)["coalition_key"].to_pylist())
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    victim.write_bytes(bytes(damaged))
    before = files(run_dir)
    with pytest.raises(ArchiveError, match=victim.name):
        RunArchive.open(run_dir, RUN)
    assert files(run_dir) == before  # refused: nothing changed

    archive = RunArchive.open(run_dir, RUN, skip_corrupt=True)
    assert archive.quarantined == (victim.name,)
    assert lost.isdisjoint(archive.loaded["coalition_key"].to_pylist())
    assert archive.loaded.num_rows == 7 - len(lost)
    # the resumed run evaluates the lost coalitions again
    for row in seven_rows():
        archive.append(row)
    archive.close()
    assert (run_dir / "quarantine" / victim.name).read_bytes() == bytes(damaged)
    assert victim.name not in [p.name for p in list_parts(run_dir)]
    [entry] = read_manifest(run_dir)["quarantine"]
    assert entry["part"] == victim.name and "SHA-256" in entry["reason"] and entry["run_id"] == archive.run_id
    # later commands, without the flag, read every coalition once
    table = read_rows(run_dir, dedupe=False)
    assert sorted(table["coalition_key"].to_pylist()) == sorted(r["coalition_key"] for r in seven_rows())
    info = archive_info(run_dir)
    assert info["quarantined_parts"] == [victim.name] and info["coalitions"] == 7
    RunArchive.open(run_dir, RUN).close()


def test_read_only_skipping_changes_nothing(run_dir: Path) -> None:
    victim = list_parts(run_dir)[2]
    victim.write_bytes(victim.read_bytes()[:-3])
    before = files(run_dir)
    assert read_rows(run_dir, skip_corrupt=True).num_rows == 6
    assert archive_info(run_dir, skip_corrupt=True)["skipped_parts"] == [victim.name]
    assert files(run_dir) == before


# -- foreign files ------------------------------------------------------------------------------


def _integer_key_table() -> pa.Table:
    return pa.table(
        {
            "snapshot_id": ["a" * 64] * 2,
            "coalition_key": pa.array([1, 2], pa.int64()),
            "mask": [b"\x01\x00", b"\x02\x00"],
            "n_bits": pa.array([10, 10], pa.int32()),
            "absence_policy": ["drop"] * 2,
            "model_id": ["m"] * 2,
            "utility": [-1.0, -2.0],
            "elapsed_ms": [1.0, 1.0],
            "cache_hit": [False, False],
            "batch_size": pa.array([1, 1], pa.int32()),
            "created_at": pa.array([0, 0], pa.timestamp("us", tz="UTC")),
        }
    )


def test_a_foreign_parquet_named_like_a_part_is_refused_not_counted(run_dir: Path) -> None:
    generation = list_parts(run_dir)[0].parent
    stray = generation / "part-000009.parquet"  # no digest: not written by coalescence 3+
    pq.write_table(_integer_key_table(), stray)
    before = files(run_dir)
    for read in (read_rows, archive_info, check_parts, lambda d: RunArchive.open(d, RUN)):
        with pytest.raises(ArchiveError, match="part-000009.parquet was not written by coalescence"):
            read(run_dir)
    assert files(run_dir) == before
    # even with a digest in its name, its integer keys are refused by the schema check
    stray.unlink()
    data = _integer_key_table()
    sink = pa.BufferOutputStream()
    pq.write_table(data, sink)
    named = generation / f"part-000009-{hashlib.sha256(sink.getvalue()).hexdigest()}.parquet"
    named.write_bytes(sink.getvalue().to_pybytes())
    with pytest.raises(ArchiveError, match="its column coalition_key is int64, not string"):
        read_rows(run_dir)
    assert read_rows(run_dir, skip_corrupt=True).num_rows == 7


def test_a_foreign_part_in_an_old_archive_is_refused_by_its_schema(run_dir: Path) -> None:
    make_legacy(run_dir, {0: read_rows(run_dir)})
    pq.write_table(_integer_key_table(), run_dir / "parts" / "part-000001.parquet")
    before = files(run_dir)
    with pytest.raises(ArchiveError, match="part-000001.parquet is not a coalescence part: its column coalition_key is int64"):
        read_rows(run_dir)
    with pytest.raises(ArchiveError, match="part-000001.parquet"):
        RunArchive.open(run_dir, RUN)
    assert files(run_dir) == before


@pytest.mark.parametrize("entry", ["notes.txt", "data.parquet", "subdir", "part-000001.parquet.bak"])
def test_anything_a_plain_dataset_read_would_take_for_data_is_refused(run_dir: Path, entry: str) -> None:
    generation = list_parts(run_dir)[0].parent
    if entry == "subdir":
        (generation / entry).mkdir()
    else:
        (generation / entry).write_bytes(b"x")
    with pytest.raises(ArchiveError, match=f"{entry} is not a part of this archive"):
        read_rows(run_dir)
    # hidden names are skipped, by pyarrow and by us
    shutil.rmtree(generation / entry) if entry == "subdir" else (generation / entry).unlink()
    (generation / "_SUCCESS").write_bytes(b"")
    (generation / ".notes").write_bytes(b"x")
    assert read_rows(run_dir).num_rows == 7
    assert ds.dataset(run_dir / "parts", format="parquet").to_table().num_rows == 7


def test_a_parts_link_out_of_the_run_is_refused(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(list_parts(run_dir)[0].parent, elsewhere)
    (run_dir / "parts").unlink()
    os.symlink(elsewhere, run_dir / "parts")
    with pytest.raises(ArchiveError, match="not to a generation directory of this run"):
        read_rows(run_dir)


# -- damaged manifests ----------------------------------------------------------------------------


def _set(path: str, value: object):
    def edit(manifest: dict) -> None:
        *parents, last = path.split(".")
        target = manifest
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        if value is _DELETE:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = value

    return edit


class _Delete:
    """The edit that removes a field (its repr names it, so that test ids are the same in every run)."""

    def __repr__(self) -> str:
        return "<delete>"


_DELETE = _Delete()
MANIFEST_DAMAGE = [
    ("runs", _DELETE, "runs is missing"),
    ("runs", {"a": 1}, "runs must be a list of objects"),
    ("runs", [1], "runs must be a list of objects"),
    ("snapshots", "none", "snapshots must be a list of objects"),
    ("runs.0.run_id", _DELETE, "runs[0].run_id is missing"),
    ("runs.0.run_id", 7, "runs[0].run_id must be a string, got 7"),
    ("runs.0.status", ["done"], "runs[0].status must be a string"),
    ("runs.0.statistics", [1], "runs[0].statistics must be an object"),
    ("runs.0.error", 3, "runs[0].error must be a string"),
    ("rows", -1, "rows must be a count"),
    ("rows", True, "rows must be a count"),
    ("quarantine", [{"reason": "x"}], "quarantine[0].part is missing"),
    ("schema_version", "3", "has no valid schema_version"),
]


@pytest.mark.parametrize(("where", "value", "says"), MANIFEST_DAMAGE, ids=[f"{w}={v!r}"[:40] for w, v, _ in MANIFEST_DAMAGE])
def test_a_manifest_with_a_missing_or_odd_field_is_refused_naming_it(run_dir: Path, where: str, value: object, says: str) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["snapshots"] = [{"snapshot_id": "a" * 64}]
    _set(where, value)(manifest)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    before = files(run_dir)
    for call in (read_manifest, archive_info, lambda d: RunArchive.open(d, RUN), lambda d: RunArchive.open(d, RUN, new_run=True)):
        with pytest.raises(ArchiveError) as refused:
            call(run_dir)
        message = str(refused.value)
        assert says in message and "manifest.json" in message and "\n" not in message, message
        assert not isinstance(refused.value, ArchiveWriteError)
    assert files(run_dir) == before


def test_a_manifest_that_is_not_an_object_or_not_utf8_is_refused(run_dir: Path) -> None:
    for content in (b"[]", b"\xff\xfe{}", b'{"schema_version": 2, "rows": 1' + b"0" * 5000 + b"}", b"[" * 100000):
        (run_dir / "manifest.json").write_bytes(content)
        with pytest.raises(ArchiveError, match="manifest.json") as refused:
            read_manifest(run_dir)
        assert "\n" not in str(refused.value)


# -- archives written before schema version 3 -------------------------------------------------------


def test_an_old_archive_reads_as_it_is_and_its_first_writer_moves_it_to_the_new_layout(run_dir: Path) -> None:
    written = read_rows(run_dir)
    make_legacy(run_dir, {0: written.slice(0, 4), 1: written.slice(4)})
    old_parts = sorted((run_dir / "parts").iterdir())
    inodes = {p.stat().st_ino for p in old_parts}
    # read-only commands change nothing and say the parts carry no digest
    before = files(run_dir)
    assert utilities(read_rows(run_dir)) == utilities(written)
    assert archive_info(run_dir)["unverified_parts"] == 2
    assert files(run_dir) == before
    # a writer hard-links the same files into a generation under digest names
    archive = RunArchive.open(run_dir, RUN)
    archive.append(make_row([0, 1, 2, 3], utility=-0.5))
    archive.close()
    assert (run_dir / "parts").is_symlink()
    parts = list_parts(run_dir)
    assert [p.name[:11] for p in parts] == ["part-000000", "part-000001", "part-000002"]
    for part in parts:
        assert part.name == f"{part.name[:11]}-{hashlib.sha256(part.read_bytes()).hexdigest()}.parquet"
    assert {p.stat().st_ino for p in parts[:2]} == inodes  # the same bytes, not rewritten
    assert read_manifest(run_dir)["schema_version"] == 3
    assert archive_info(run_dir)["unverified_parts"] == 0
    assert read_rows(run_dir).num_rows == 8
    assert not (run_dir / ".parts-legacy").exists()


def test_a_damaged_part_of_an_old_archive_is_caught_only_if_its_structure_breaks(run_dir: Path) -> None:
    """What an old archive's missing digest costs, stated as a test: a truncated part is refused,
    while nothing can tell a flipped bit in a value from the value (no record of what was written)."""
    make_legacy(run_dir, {0: read_rows(run_dir)})
    part = run_dir / "parts" / "part-000000.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArchiveError, match="part-000000.parquet is corrupt or truncated"):
        read_rows(run_dir)


REPLAY_DAMAGE = [
    ("snapshot_ids", "abc", "snapshot_ids must be a list of strings"),
    ("snapshot_ids", ["b" * 64], "snapshot bbbbbbbbbbbbbbbb has no record in snapshots"),
    ("model", "m", "model must be an object"),
    ("model", {"id": "m"}, "model.revision is missing"),
    ("absence_policy", {"id": "drop"}, "absence_policy.params is missing"),
    ("utility", None, "does not record its utility"),
    ("target_token_ids", {"a": [1, "2"]}, "target_token_ids must be an object of integer lists"),
    ("target_token_offsets", {"a": [[1]]}, "target_token_offsets must be an object of [start, end] lists"),
]


@pytest.mark.parametrize(("field", "value", "says"), REPLAY_DAMAGE, ids=[f"{f}={v!r}"[:40] for f, v, _ in REPLAY_DAMAGE])
def test_what_replay_needs_of_a_run_is_checked(tmp_path: Path, field: str, value: object, says: str) -> None:
    from coalescence.archive.manifest import check_replayable

    run = {
        "snapshot_ids": ["a" * 64],
        "model": {"id": "m", "revision": "r", "dtype": "float32"},
        "utility": {"kind": "logprob"},
        "absence_policy": {"id": "drop", "params": {}},
        "target_token_ids": {"a" * 64: [1, 2]},
        "target_token_offsets": {"a" * 64: [[0, 2], [2, 3]]},
    }
    path = tmp_path / "run"
    RunArchive.create(path, run | {"snapshots": [{"snapshot_id": "a" * 64}]}).close()
    manifest = read_manifest(path)
    check_replayable(path, manifest, manifest["runs"][0])  # as written: fine
    manifest["runs"][0][field] = value
    with pytest.raises(ArchiveError, match=re.escape(says)) as refused:
        check_replayable(path, manifest, manifest["runs"][0])
    assert "manifest.json" in str(refused.value) and "\n" not in str(refused.value)
