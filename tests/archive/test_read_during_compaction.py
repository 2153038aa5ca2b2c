"""A plain pyarrow read of the live generation succeeds at every instant, also during compactions.

The rule: a reader that resolved ``parts`` to its generation and listed it can open every file it
listed, whatever a compaction does meanwhile, and sees each coalition key exactly once; the key
set it sees is one the writer had flushed at some instant (a prefix of the keys, in the order written).
Before the fix, a compaction removed the generation it replaced at once, so a read listing it
failed with FileNotFoundError. A plain read through the ``parts`` link itself cannot be made
immune: its paths resolve through the link again when opened (see docs/archive.md).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pyarrow.dataset as ds
from helpers.archive_rows import make_row

from coalescence.archive import RunArchive, compact

RUN = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}
ROUNDS = 12


def test_reads_of_the_resolved_generation_never_fail_during_compaction(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rounds = [[f"{r:02d}{i:062x}" for i in range(3)] for r in range(ROUNDS)]
    flat = [k for rnd in rounds for k in rnd]  # flushed one row per part, in this order
    states = [frozenset(flat[:j]) for j in range(len(flat) + 1)]
    stop = threading.Event()
    seen: list[list[str]] = []
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                if not os.path.lexists(run_dir / "parts"):
                    continue
                dataset = ds.dataset(os.path.realpath(run_dir / "parts"), format="parquet")
                if not dataset.files:  # the first writer's generation before its first flush
                    seen.append([])
                    continue
                seen.append(dataset.to_table(columns=["coalition_key"])["coalition_key"].to_pylist())
            except BaseException as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for r, keys in enumerate(rounds):
            archive = RunArchive.open(run_dir, RUN, flush_rows=1)
            for i, key in enumerate(keys):
                archive.append(make_row([i, r % 10], utility=-float(r), key=key))
            archive.close()
            compact(run_dir)
    finally:
        stop.set()
        thread.join()
    assert not errors, f"{len(errors)} reads failed, the first: {errors[0]!r}"
    assert len(seen) > ROUNDS
    for keys in seen:
        assert len(keys) == len(set(keys)), "a key seen twice"
        assert frozenset(keys) in states, "a key set the writer never had"
