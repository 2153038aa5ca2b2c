"""The hot result store: LRU bounds by entries and bytes, thread safety, filled with what the archive reads."""

from __future__ import annotations

import hashlib
import threading

import pytest

import pyarrow.parquet as pq

from coalescence.archive import RunArchive, read_utilities
from coalescence.errors import ArchiveError, ConfigError
from coalescence.masking.codec import PackedMask
from coalescence.scheduler.store import ResultStore, entry_bytes


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def test_unbounded_get_put_contains_len():
    store = ResultStore()
    assert store.get(_key(0)) is None
    store.put(_key(0), -1.5)
    assert store.get(_key(0)) == -1.5
    assert _key(0) in store and _key(1) not in store
    assert len(store) == 1
    store.put(_key(0), -2.0)  # overwrite keeps one entry
    assert store.get(_key(0)) == -2.0 and len(store) == 1
    assert store.nbytes == entry_bytes(_key(0))


def test_zero_utility_is_a_hit():
    store = ResultStore()
    store.put(_key(0), 0.0)
    assert store.get(_key(0)) == 0.0


def test_lru_by_entries_evicts_least_recently_used():
    store = ResultStore(max_entries=3)
    for i in range(3):
        store.put(_key(i), float(i))
    assert store.get(_key(0)) == 0.0  # refresh 0: 1 is now the oldest
    store.put(_key(3), 3.0)
    assert _key(1) not in store
    assert [k in store for k in map(_key, (0, 2, 3))] == [True, True, True]
    assert len(store) == 3 and store.evictions == 1


def test_lru_by_bytes():
    one = entry_bytes(_key(0))
    store = ResultStore(max_bytes=3 * one + one // 2)  # room for three entries, not four
    for i in range(3):
        store.put(_key(i), float(i))
    store.get(_key(0))
    store.put(_key(3), 3.0)
    assert len(store) == 3 and _key(1) not in store and _key(0) in store
    assert store.nbytes == 3 * one <= store.max_bytes
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_both_bounds_the_tighter_wins():
    one = entry_bytes(_key(0))
    store = ResultStore(max_entries=10, max_bytes=2 * one)
    for i in range(5):
        store.put(_key(i), float(i))
    assert len(store) == 2 and _key(4) in store and _key(3) in store


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_entries": 0}, "max_entries"), ({"max_bytes": 10}, "max_bytes"), ({"max_entries": 1.5}, "max_entries")],
)
def test_bad_bounds_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ResultStore(**kwargs)
    assert info.value.field == field


def test_threads_hammering_put_and_get_keep_the_bounds_and_values():
    store = ResultStore(max_entries=500)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def hammer(seed: int) -> None:
        try:
            start.wait()
            for i in range(5000):
                k = (i * 7 + seed) % 1000
                store.put(_key(k), float(k))
                got = store.get(_key((k + 3) % 1000))
                assert got is None or got == float((k + 3) % 1000)
                assert len(store) <= 500
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store) == 500
    assert store.nbytes == sum(entry_bytes(_key(k)) for k in range(1000) if _key(k) in store)


def _write_archive(run_dir, rows):
    archive = RunArchive.create(run_dir, {"run": "test"}, flush_rows=2)
    for snapshot_id, i, utility in rows:
        mask = PackedMask.from_indices([i % 3], 3)
        archive.append(
            {
                "snapshot_id": snapshot_id,
                "coalition_key": _key(i),
                "mask": mask.words,
                "n_bits": 3,
                "absence_policy": "drop",
                "model_id": "tiny",
                "utility": utility,
                "elapsed_ms": 1.0,
                "cache_hit": False,
                "batch_size": 1,
            }
        )
    archive.close()


def test_fill_from_a_real_archive(tmp_path):
    run = tmp_path / "run"
    _write_archive(run, [("a" * 64, 0, -1.0), ("a" * 64, 1, -2.0), ("b" * 64, 2, -3.0)])
    store = ResultStore()
    assert store.fill(read_utilities(run)) == 3
    assert len(store) == 3
    assert [store.get(_key(i)) for i in range(3)] == [-1.0, -2.0, -3.0]

    only_b = ResultStore()
    assert only_b.fill(read_utilities(run, snapshot_id="b" * 64)) == 1
    assert _key(2) in only_b and _key(0) not in only_b

    bounded = ResultStore(max_entries=1)
    bounded.fill(read_utilities(run))
    assert len(bounded) == 1 and _key(2) in bounded  # the last row written stays


def test_fill_from_an_empty_archive_and_a_broken_part(tmp_path):
    run = tmp_path / "run"
    RunArchive.create(run, {}).close()
    assert ResultStore().fill(read_utilities(run)) == 0
    (run / "parts" / "part-000000.parquet").write_bytes(b"not parquet")
    with pytest.raises(ArchiveError):
        ResultStore().fill(read_utilities(run))


def test_the_archive_feeds_the_store_what_pyarrow_reads(tmp_path):
    """The archive package reads, the store takes pairs: the pairs equal an independent pyarrow read
    of the part files (part order, the first row of a repeated key), and the store holds exactly them."""
    run = tmp_path / "run"
    rows = [("a" * 64, 0, -1.0), ("b" * 64, 1, -2.5), ("a" * 64, 2, -0.25), ("b" * 64, 3, -4.0), ("b" * 64, 1, -9.0)]
    _write_archive(run, rows)
    parts = sorted((run / "parts").glob("*.parquet"))
    assert len(parts) >= 2  # flush_rows=2: the rows span several part files
    expected, seen = [], set()
    for part in parts:
        table = pq.read_table(part, columns=["snapshot_id", "coalition_key", "utility"])
        for sid, key, utility in zip(*(table[c].to_pylist() for c in ("snapshot_id", "coalition_key", "utility")), strict=True):
            if key not in seen:
                seen.add(key)
                expected.append((sid, key, utility))
    assert read_utilities(run) == [(k, u) for _, k, u in expected]
    assert read_utilities(run, snapshot_id="b" * 64) == [(k, u) for s, k, u in expected if s == "b" * 64] == [
        (_key(1), -2.5),
        (_key(3), -4.0),
    ]
    store = ResultStore()
    assert store.fill(read_utilities(run)) == 4  # the repeated key once, its first row
    assert {k: store.get(k) for k, _ in read_utilities(run)} == {_key(0): -1.0, _key(1): -2.5, _key(2): -0.25, _key(3): -4.0}
