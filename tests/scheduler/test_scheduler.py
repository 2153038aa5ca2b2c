"""The coalition scheduler on real event loops (asyncio and trio) with deterministic test evaluators."""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
import anyio.lowlevel
import pytest

from helpers.datasets import RecordingProgress

from coalescence.archive import RunArchive, read_rows
from coalescence.errors import ArchiveError, BatchFailed, ConfigError, MaskError
from coalescence.masking.codec import PackedMask
from coalescence.scheduler.dedup import SingleFlight
from coalescence.scheduler.scheduler import (
    CoalitionJob,
    CoalitionScheduler,
    EvalOutcome,
    JobResult,
    SchedulerStatistics,
)
from coalescence.scheduler.store import ResultStore

pytestmark = pytest.mark.anyio

MASK = PackedMask.from_indices([0, 2], 3)
# the million-job stream runs on asyncio (about 30 s on 2 cores); trio, ~30% slower per job,
# runs a fifth of it with the same bounds
STREAM_JOBS = {"asyncio": 1_000_000, "trio": 200_000}


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def job(i: int, *, request: object = None) -> CoalitionJob:
    return CoalitionJob(
        coalition_key=key(i),
        snapshot_id="s" * 64,
        request=request if request is not None else i,
        absence_policy="drop",
        mask=MASK,
        model_id="tiny",
    )


def value(i: int) -> float:
    return -float(i) - 0.5


class Evaluator:
    """A deterministic evaluator: utility -(i + 0.5) for job i; records calls and concurrency.

    ``gate`` (an anyio.Event) holds every call until set; ``fail`` is a set of job indices that raise.
    """

    def __init__(self, *, gate: anyio.Event | None = None, fail: set[int] = frozenset(), kv: int = 0):
        self.gate = gate
        self.fail = set(fail)
        self.kv = kv
        self.calls: list[int] = []
        self.running = 0
        self.peak = 0

    async def __call__(self, job: CoalitionJob) -> EvalOutcome:
        i = job.request
        self.calls.append(i)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await anyio.lowlevel.checkpoint()
            if i in self.fail:
                raise BatchFailed(f"job {i} failed")
            return EvalOutcome(utility=value(i), batch_size=2, kv_cache_hits=self.kv)
        finally:
            self.running -= 1


class ListArchive:
    """The smallest archive: a list of rows."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def append(self, row: dict) -> None:
        self.rows.append(dict(row))


def invariant(stats: SchedulerStatistics) -> bool:
    return stats.requested == stats.executed + stats.deduplicated + stats.cache_hits + stats.failed


# -- construction and validation ----------------------------------------------------------------


async def test_config_is_validated():
    ev = Evaluator()
    with pytest.raises(ConfigError, match="max_inflight"):
        CoalitionScheduler(ev, max_inflight=0)
    with pytest.raises(ConfigError, match="pending_limit"):
        CoalitionScheduler(ev, max_inflight=4, pending_limit=3)
    with pytest.raises(ConfigError, match="archive"):
        CoalitionScheduler(ev, archive=object())
    assert CoalitionScheduler(ev, max_inflight=3).pending_limit == 12


def test_job_and_outcome_are_validated_and_frozen():
    with pytest.raises(ConfigError, match="coalition_key"):
        CoalitionJob(coalition_key="", snapshot_id="s", request=None, absence_policy="p", mask=MASK, model_id="m")
    with pytest.raises(MaskError):
        CoalitionJob(coalition_key="k", snapshot_id="s", request=None, absence_policy="p", mask=b"\x01", model_id="m")
    with pytest.raises(ConfigError, match="batch_size"):
        EvalOutcome(utility=1.0, batch_size=0)
    with pytest.raises(ConfigError, match="kv_cache_hits"):
        EvalOutcome(utility=1.0, kv_cache_hits=-1)
    with pytest.raises(ConfigError, match="utility"):
        EvalOutcome(utility="1.0")
    with pytest.raises(ConfigError):
        JobResult(job=job(0), utility=0.0, elapsed_s=0.0, cache_hit=True, deduplicated=True)
    with pytest.raises(AttributeError):
        job(0).coalition_key = "x"  # type: ignore[misc]


# -- run: order, store, archive, counters -------------------------------------------------------


async def test_run_returns_input_order_stores_and_archives_with_elapsed():
    ev, store, archive = Evaluator(kv=3), ResultStore(), ListArchive()
    sched = CoalitionScheduler(ev, store=store, archive=archive, max_inflight=2)
    results = await sched.run([job(i) for i in range(10)])
    assert [r.utility for r in results] == [value(i) for i in range(10)]
    assert [r.job.request for r in results] == list(range(10))
    assert all(r.ok and not r.cache_hit and not r.deduplicated and r.batch_size == 2 for r in results)
    assert all(r.kv_cache_hits == 3 and r.elapsed_s >= 0 for r in results)
    assert sorted(ev.calls) == list(range(10))
    assert all(store.get(key(i)) == value(i) for i in range(10))
    assert sorted(row["coalition_key"] for row in archive.rows) == sorted(key(i) for i in range(10))
    row = archive.rows[0]
    assert row["cache_hit"] is False and row["batch_size"] == 2 and row["elapsed_ms"] >= 0
    assert row["mask"] == MASK.words and row["n_bits"] == 3 and row["model_id"] == "tiny"
    assert sched.statistics() == SchedulerStatistics(requested=10, executed=10, kv_cache_hits=30)


async def test_run_of_nothing():
    sched = CoalitionScheduler(Evaluator())
    assert await sched.run([]) == []
    assert sched.statistics() == SchedulerStatistics()


async def test_store_hit_skips_evaluation_and_is_archived_as_cache_hit():
    ev, store, archive = Evaluator(), ResultStore(), ListArchive()
    store.put(key(1), 42.0)
    sched = CoalitionScheduler(ev, store=store, archive=archive)
    results = await sched.run([job(0), job(1)])
    assert ev.calls == [0]
    hit = results[1]
    assert hit.cache_hit and hit.utility == 42.0 and hit.elapsed_s == 0.0 and hit.batch_size == 0
    hit_rows = [r for r in archive.rows if r["cache_hit"]]
    assert len(hit_rows) == 1 and hit_rows[0]["elapsed_ms"] == 0.0 and hit_rows[0]["utility"] == 42.0
    assert sched.statistics().cache_hits == 1 and sched.statistics().executed == 1


async def test_rows_go_to_a_real_run_archive(tmp_path):
    archive = RunArchive.create(tmp_path / "run", {"run": "scheduler"})
    store = ResultStore()
    store.put(key(99), -9.0)
    sched = CoalitionScheduler(Evaluator(), store=store, archive=archive)
    await sched.run([job(0), job(1), job(99)])
    archive.close()
    table = read_rows(tmp_path / "run").to_pydict()
    got = dict(zip(table["coalition_key"], zip(table["utility"], table["cache_hit"], strict=True), strict=True))
    assert got == {key(0): (value(0), False), key(1): (value(1), False), key(99): (-9.0, True)}


async def test_bounded_inflight_evaluations():
    gate = anyio.Event()
    ev = Evaluator(gate=gate)
    sched = CoalitionScheduler(ev, max_inflight=3, pending_limit=12)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run, [job(i) for i in range(20)])
        await anyio.wait_all_tasks_blocked()
        assert ev.running == 3 and sched.live_jobs == 12  # 3 evaluating, 9 waiting for a slot
        gate.set()
    assert ev.peak == 3 and sched.peak_inflight == 3 and sched.peak_live_jobs == 12
    assert sched.statistics().executed == 20


# -- single flight ------------------------------------------------------------------------------


async def test_duplicates_in_flight_share_one_evaluation():
    gate = anyio.Event()
    ev, archive = Evaluator(gate=gate), ListArchive()
    sched = CoalitionScheduler(ev, archive=archive, max_inflight=4)
    results: list[JobResult] = []

    async def go():
        results.extend(await sched.run([job(7, request=7) for _ in range(10)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await anyio.wait_all_tasks_blocked()
        assert ev.calls == [7]  # one evaluation in flight, nine waiting on it
        gate.set()
    assert len(results) == 10 and all(r.utility == value(7) for r in results)
    assert sum(r.deduplicated for r in results) == 9
    assert all(r.elapsed_s == results[0].elapsed_s for r in results)  # the leader's time
    assert ev.calls == [7] and len(archive.rows) == 1
    assert sched.statistics() == SchedulerStatistics(requested=10, executed=1, deduplicated=9)


async def test_duplicates_across_concurrent_runs_share_one_evaluation():
    gate = anyio.Event()
    ev = Evaluator(gate=gate)
    sched = CoalitionScheduler(ev)
    out: dict[str, list[JobResult]] = {}

    async def go(name):
        out[name] = await sched.run([job(1)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(go, "a")
        tg.start_soon(go, "b")
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert ev.calls == [1]
    assert out["a"][0].utility == out["b"][0].utility == value(1)
    assert {out["a"][0].deduplicated, out["b"][0].deduplicated} == {True, False}


async def test_a_failure_reaches_every_follower_and_is_not_cached():
    gate = anyio.Event()
    ev, store, archive = Evaluator(gate=gate, fail={3}), ResultStore(), ListArchive()
    sched = CoalitionScheduler(ev, store=store, archive=archive)
    results: list[JobResult] = []

    async def go():
        async with aclosing(sched.run_iter([job(3) for _ in range(4)])) as stream:
            async for r in stream:
                results.append(r)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert ev.calls == [3]
    assert len(results) == 4 and all(isinstance(r.error, BatchFailed) and math.isnan(r.utility) for r in results)
    assert sum(r.deduplicated for r in results) == 3
    assert key(3) not in store and archive.rows == []
    assert sched.statistics() == SchedulerStatistics(requested=4, deduplicated=3, failed=1)
    # not cached: a later job with the key evaluates again (and now succeeds)
    ev.fail.clear()
    (again,) = await sched.run([job(3)])
    assert again.ok and again.utility == value(3) and ev.calls == [3, 3]


async def test_run_raises_the_first_failure_in_input_order_after_the_others_finish():
    ev, archive = Evaluator(fail={2, 5}), ListArchive()
    sched = CoalitionScheduler(ev, archive=archive, max_inflight=2)
    with pytest.raises(BatchFailed, match="job 2 failed"):
        await sched.run([job(i) for i in range(8)])
    assert sorted(ev.calls) == list(range(8))
    assert len(archive.rows) == 6  # every success archived
    stats = sched.statistics()
    assert stats.failed == 2 and stats.executed == 6 and invariant(stats)


async def test_evaluate_returning_the_wrong_type_is_a_job_error():
    async def bad(job):
        return 1.0

    sched = CoalitionScheduler(bad)
    with pytest.raises(TypeError, match="EvalOutcome"):
        await sched.run([job(0)])
    assert sched.statistics().failed == 1


async def test_counters_satisfy_the_invariant_after_hits_duplicates_and_failures():
    gate = anyio.Event()
    ev, store = Evaluator(gate=gate, fail={4}, kv=5), ResultStore()
    for i in (0, 1):
        store.put(key(i), value(i))
    sched = CoalitionScheduler(ev, store=store, max_inflight=2, pending_limit=16)
    jobs = [job(i) for i in (0, 1, 0, 2, 2, 2, 3, 4, 4, 5)]
    results: list[JobResult] = []

    async def go():
        async for r in sched.run_iter(jobs):
            results.append(r)

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    stats = sched.statistics()
    assert invariant(stats)
    assert stats == SchedulerStatistics(
        requested=10, executed=3, deduplicated=3, cache_hits=3, kv_cache_hits=15, failed=1
    )
    assert sum(r.error is not None for r in results) == 2  # job 4 and its follower


# -- iterables, streams, bounded memory ---------------------------------------------------------


async def test_run_iter_is_lazy_and_bounded_over_many_jobs(anyio_backend):
    pending_limit = 16
    produced = consumed = 0
    max_ahead = 0
    live_eval = peak_eval = 0

    async def evaluate(job):
        nonlocal live_eval, peak_eval
        live_eval += 1
        peak_eval = max(peak_eval, live_eval)
        await anyio.lowlevel.checkpoint()
        live_eval -= 1
        return EvalOutcome(utility=0.0)

    def jobs():
        nonlocal produced
        for i in range(STREAM_JOBS[anyio_backend]):
            produced += 1
            yield CoalitionJob(
                coalition_key=str(i), snapshot_id="s", request=i, absence_policy="p", mask=MASK, model_id="m"
            )

    def tasks_alive() -> int:
        if anyio_backend == "trio":
            import trio

            return trio.lowlevel.current_statistics().tasks_living
        import asyncio

        return len(asyncio.all_tasks())

    sched = CoalitionScheduler(evaluate, max_inflight=4, pending_limit=pending_limit)
    base_tasks = tasks_alive()
    peak_tasks = 0
    async for _ in sched.run_iter(jobs()):
        consumed += 1
        max_ahead = max(max_ahead, produced - consumed)
        if consumed % 997 == 0:
            peak_tasks = max(peak_tasks, tasks_alive() - base_tasks)
    assert consumed == STREAM_JOBS[anyio_backend]
    assert sched.peak_live_jobs <= pending_limit and peak_eval <= 4 and sched.peak_inflight <= 4
    # workers + the pump task; no task per job
    assert peak_tasks <= pending_limit + 1
    # jobs pulled ahead of the consumer: alive ones plus the bounded result buffer
    assert max_ahead <= 2 * pending_limit + 1
    assert sched.statistics().executed == STREAM_JOBS[anyio_backend]


async def test_run_stream_from_an_async_generator_with_progress():
    progress = RecordingProgress()

    async def source() -> AsyncIterator[CoalitionJob]:
        for i in range(30):
            await anyio.lowlevel.checkpoint()
            yield job(i % 20)

    ev = Evaluator()
    sched = CoalitionScheduler(ev, store=ResultStore(), progress=progress, max_inflight=3)
    results = [r async for r in sched.run_stream(source(), total=30)]
    assert sorted(r.job.request for r in results) == sorted(i % 20 for i in range(30))
    assert all(r.utility == value(r.job.request) for r in results)
    assert progress.planned == [30] and progress.finished[-1] == (30, 30)
    assert [d for d, _ in progress.finished] == list(range(1, 31))
    assert invariant(sched.statistics()) and sched.statistics().requested == 30


async def test_a_failing_source_is_raised_after_the_jobs_in_progress():
    ev, archive = Evaluator(), ListArchive()
    sched = CoalitionScheduler(ev, archive=archive, max_inflight=2)

    def source():
        yield from (job(i) for i in range(5))
        raise RuntimeError("source broke")

    seen = []
    with pytest.raises(RuntimeError, match="source broke"):
        async for r in sched.run_iter(source()):
            seen.append(r)
    assert len(seen) == 5 and len(archive.rows) == 5


async def test_a_non_job_is_refused():
    sched = CoalitionScheduler(Evaluator())
    with pytest.raises(ConfigError, match="CoalitionJob"):
        await sched.run([job(0), "not a job"])  # type: ignore[list-item]


async def test_an_archive_failure_stops_the_run():
    archive = RunArchive.__new__(RunArchive)  # a closed archive refuses rows
    archive.closed = True
    sched = CoalitionScheduler(Evaluator(), archive=archive)
    with pytest.raises(ArchiveError, match="closed"):
        await sched.run([job(i) for i in range(3)])


# -- cancellation -------------------------------------------------------------------------------


async def test_a_cancelled_leader_hands_the_key_to_its_follower():
    gate = anyio.Event()
    ev = Evaluator(gate=gate)
    sched = CoalitionScheduler(ev, store=ResultStore())
    follower: list[JobResult] = []
    leader_scope = anyio.CancelScope()

    async def leader():
        with leader_scope:
            await sched.run([job(1)])

    async def follow():
        follower.extend(await sched.run([job(1)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(leader)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(follow)
        await anyio.wait_all_tasks_blocked()
        assert ev.calls == [1]
        leader_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert ev.calls == [1, 1]  # the follower took over
        gate.set()
    assert follower[0].ok and follower[0].utility == value(1) and not follower[0].deduplicated
    stats = sched.statistics()
    assert stats == SchedulerStatistics(requested=1, executed=1) and invariant(stats)
    assert sched.live_jobs == 0


async def test_breaking_out_of_run_iter_cancels_the_jobs_in_progress():
    gate = anyio.Event()
    ev, store, archive = Evaluator(gate=gate), ResultStore(), ListArchive()
    sched = CoalitionScheduler(ev, store=store, archive=archive, max_inflight=2, pending_limit=4)
    store.put(key(0), 1.0)  # job 0 is a hit; the rest block
    async with aclosing(sched.run_iter(job(i) for i in range(100))) as stream:
        async for r in stream:
            assert r.cache_hit
            await anyio.wait_all_tasks_blocked()
            break
    assert sched.live_jobs == 0 and len(ev.calls) == 2
    assert [r["cache_hit"] for r in archive.rows] == [True]
    assert len(store) == 1
    stats = sched.statistics()
    assert stats == SchedulerStatistics(requested=1, cache_hits=1) and invariant(stats)


async def test_cancelling_a_run_leaves_no_flight_behind():
    gate = anyio.Event()
    ev = Evaluator(gate=gate)
    sched = CoalitionScheduler(ev)
    with anyio.move_on_after(0.05):
        await sched.run([job(0), job(0), job(1)])
    assert len(sched._flights) == 0 and sched.live_jobs == 0
    gate.set()
    assert (await sched.run([job(0)]))[0].utility == value(0)


async def test_single_flight_do_raises_for_leader_and_followers():
    flights: SingleFlight[int] = SingleFlight()
    gate = anyio.Event()
    outcomes: list[object] = []

    async def work():
        await gate.wait()
        raise ValueError("boom")

    async def call():
        try:
            outcomes.append(await flights.do("k", work))
        except ValueError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert "k" in flights and len(flights) == 1
        gate.set()
    assert len(outcomes) == 3 and all(isinstance(o, ValueError) for o in outcomes)
    assert len(flights) == 0

    async def ok():
        return 5

    assert await flights.do("k", ok) == (5, False)
