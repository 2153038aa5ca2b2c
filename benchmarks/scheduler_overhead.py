"""Overhead of the engine's own machinery: planner -> scheduler -> collator -> store -> archive.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/scheduler_overhead.py [--players 14] [--sizes 1,16,64,256] [--profile]

The backend returns instantly, so the figures are the engine's cost per coalition: planning (exact
Shapley plan), coalition keys (SHA-256), jobs, the scheduler (store lookup, single flight, bounded
concurrency), the lock-leader collator (batching, one worker-thread call per batch) and the Parquet
archive. All batch sizes run in one process on asyncio, interleaved over repeats; the table gives
coalitions/s, microseconds per coalition, the ratio to batch size 1, and the process's CPU time
per coalition (main and worker thread; less sensitive than wall time to other jobs on a shared
machine, where waiting for a core inflates wall time but not CPU time).

``--profile`` adds counts that do not depend on the machine's load, for one run per batch size
under cProfile (after an unprofiled run, so imports and memos are not counted): Python function
calls per coalition (cProfile's count, C functions and coroutine resumptions included), asyncio
event-loop handles made per coalition (callbacks scheduled: task wake-ups, mostly) and event-loop
iterations per run.
"""

from __future__ import annotations

import argparse
import asyncio.base_events
import asyncio.events
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import anyio

from coalescence.archive import RunArchive
from coalescence.attribution.estimators import ExactShapley
from coalescence.masking.codec import PackedMask, coalition_key
from coalescence.scheduler import CoalitionJob, CoalitionScheduler, Collator, CollatorBackend, EvalOutcome, ResultStore


def instant(prompts, call_kwargs, row_kwargs):
    return [-float(len(p)) for p in prompts]


async def one_run(n_players: int, batch: int, run_dir: Path) -> float:
    t0 = time.perf_counter()
    archive = RunArchive.open(run_dir, {"snapshot_ids": ["s"], "model": {"id": "instant"}, "utility": {}, "absence_policy": {}})
    collator = Collator(CollatorBackend(fn=instant), max_batch_size=batch)

    async def evaluate(job: CoalitionJob) -> EvalOutcome:
        return EvalOutcome(utility=await collator.submit(job.request), batch_size=batch)

    # as the engine makes it (Engine.evaluate): two batches in flight, no job alive beyond them
    scheduler = CoalitionScheduler(evaluate, store=ResultStore(), archive=archive, max_inflight=2 * batch, pending_limit=2 * batch)
    jobs = []
    for row in ExactShapley().plan(n_players):
        mask = PackedMask.from_bools(row)
        key = coalition_key(
            snapshot_id="s", mask=mask, policy_id="drop", policy_params={}, model_id="instant",
            model_revision="0", dtype="float32", utility={"kind": "logprob"},
        )  # fmt: skip
        jobs.append(CoalitionJob(coalition_key=key, snapshot_id="s", request=mask.words, absence_policy="drop", mask=mask, model_id="instant"))
    results = await scheduler.run(jobs)
    collator.close()
    archive.close()
    assert len(results) == 2**n_players
    return time.perf_counter() - t0


def profile_counts(n_players: int, batch: int, run_dir: Path) -> tuple[float, float, int]:
    """``(calls per coalition, event-loop handles per coalition, event-loop iterations)`` of one
    run under cProfile (asyncio)."""
    anyio.run(one_run, n_players, batch, run_dir / "unprofiled")
    profiler = cProfile.Profile()
    profiler.enable()
    anyio.run(one_run, n_players, batch, run_dir / "profiled")
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, first line, name) -> (calls, ncalls, ...)

    def count(fn: object) -> int:
        code = fn.__code__  # type: ignore[attr-defined]
        return sum(v[1] for k, v in stats.items() if k == (code.co_filename, code.co_firstlineno, code.co_name))

    m = 2**n_players
    calls = sum(v[1] for v in stats.values())
    return calls / m, count(asyncio.events.Handle.__init__) / m, count(asyncio.base_events.BaseEventLoop._run_once)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--players", type=int, default=14)
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print load-independent counts per coalition (cProfile)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    m = 2**args.players
    best = {b: float("inf") for b in sizes}
    cpu = {b: float("inf") for b in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for b in sizes:
                c0 = time.process_time()
                seconds = anyio.run(one_run, args.players, b, Path(tmp) / f"run-{r}-{b}")
                cpu[b] = min(cpu[b], time.process_time() - c0)
                best[b] = min(best[b], seconds)
    print(f"{m} coalitions (exact plan, {args.players} players), instant backend, best of {args.repeats}")
    print(f"{'batch':>5}  {'coalitions/s':>12}  {'us/coalition':>12}  {'speed vs ' + str(sizes[0]):>11}  {'CPU us/coalition':>16}")
    for b in sizes:
        print(
            f"{b:>5}  {m / best[b]:>12.0f}  {best[b] / m * 1e6:>12.1f}  {best[sizes[0]] / best[b]:>11.2f}  "
            f"{cpu[b] / m * 1e6:>16.1f}"
        )
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{'batch':>5}  {'calls/coalition':>15}  {'handles/coalition':>17}  {'loop iterations':>15}")
            for b in sizes:
                calls, handles, iterations = profile_counts(args.players, b, Path(tmp) / f"profile-{b}")
                print(f"{b:>5}  {calls:>15.1f}  {handles:>17.2f}  {iterations:>15,}")


if __name__ == "__main__":
    main()
