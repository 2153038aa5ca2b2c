"""The coalition scheduler: hot store, single-flight dedup and bounded concurrency for evaluations.

A :class:`CoalitionJob` is resolved in this order:

1. **Hot store.** A key in the :class:`~coalescence.scheduler.store.ResultStore` returns at once,
   without a model call, and is archived with ``cache_hit=True``, elapsed 0 and batch size 0.
2. **Single flight** (:mod:`coalescence.scheduler.dedup`). A key already being evaluated waits for
   that evaluation and shares its value or exception; it is counted as deduplicated, not archived.
3. **Evaluation.** At most ``max_inflight`` calls of ``evaluate`` run at once (a semaphore); the
   value is put in the store, then archived with its elapsed time.

Jobs come from a sequence (:meth:`CoalitionScheduler.run`, results in input order), a lazy iterable
(:meth:`~CoalitionScheduler.run_iter`) or an async iterator (:meth:`~CoalitionScheduler.run_stream`),
results in completion order. A run has ``pending_limit`` worker tasks that pull the next job only
when they are free, so at most ``pending_limit`` jobs are alive at once and neither jobs nor tasks
are ever materialised: the producer waits, and a million-job stream runs in bounded memory.

Failure contract: a failing ``evaluate`` never stops a run. Its job (and every job that shared the
flight) ends as a :class:`JobResult` with ``error`` set and ``utility`` NaN; nothing is stored or
archived for it, and a later job with the same key evaluates again. :meth:`run` re-raises the error
of the first failed job in input order once every job has finished; ``run_iter``/``run_stream``
yield the failed results and never raise for them. Errors of the run itself (the job source raises,
the archive cannot be written) stop the workers from taking new jobs; the jobs in progress finish,
and the error is raised at the end.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import aclosing
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from ..errors import ConfigError
from .dedup import SingleFlight
from .jobs import CoalitionJob, EvalOutcome, Evaluate, JobResult, SchedulerStatistics
from .progress import NullProgress, Progress, ProgressTally
from .store import ResultStore

__all__ = (
    "CoalitionJob",
    "CoalitionScheduler",
    "EvalOutcome",
    "Evaluate",
    "JobResult",
    "SchedulerStatistics",
)

logger = logging.getLogger(__name__)


class _RunState:
    """Per-run bookkeeping shared by the workers of one run."""

    __slots__ = ("done", "fatal", "stop", "total")

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.done = 0
        self.fatal: BaseException | None = None
        self.stop = False

    def fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.stop = True


_END: Any = object()


class CoalitionScheduler:
    """Runs coalition jobs through the hot store, single-flight dedup and bounded evaluation.

    Args:
        evaluate: ``async (job) -> EvalOutcome``; the only caller of the model.
        store: the hot result store, or ``None`` for none (dedup still applies in flight).
        archive: an object with ``append(row: dict)`` (e.g. a
            :class:`~coalescence.archive.writer.RunArchive`), or ``None``.
        progress: progress callbacks (no-op by default); called once per finished job, with the
            counts summed over this scheduler's runs, or a :class:`ProgressTally` shared with other
            schedulers (an engine's: one count over all its evaluations).
        max_inflight: the most ``evaluate`` calls running at once (>= 1).
        pending_limit: the most jobs alive at once per run, i.e. worker tasks (default
            ``4 * max_inflight``; >= ``max_inflight``).

    Raises:
        ConfigError: ``max_inflight`` < 1 or ``pending_limit`` < ``max_inflight``.
    """

    def __init__(
        self,
        evaluate: Evaluate,
        *,
        store: ResultStore | None = None,
        archive: Any = None,
        progress: Progress | ProgressTally | None = None,
        max_inflight: int = 8,
        pending_limit: int | None = None,
    ) -> None:
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ConfigError(f"must be an int >= 1, got {max_inflight!r}", field="max_inflight")
        if pending_limit is None:
            pending_limit = 4 * max_inflight
        if not isinstance(pending_limit, int) or pending_limit < max_inflight:
            raise ConfigError(
                f"must be an int >= max_inflight ({max_inflight}), got {pending_limit!r}",
                field="pending_limit",
            )
        if archive is not None and not callable(getattr(archive, "append", None)):
            raise ConfigError("the archive needs an append(row) method", field="archive")
        self.evaluate = evaluate
        self.store = store
        self.archive = archive
        self.progress: Progress | ProgressTally = progress if progress is not None else NullProgress()
        # one count for every run of this scheduler; an engine passes its own tally, shared by the
        # schedulers of all its evaluations (conversations in flight at once)
        self._tally = progress if isinstance(progress, ProgressTally) else ProgressTally(self.progress)
        self.max_inflight = max_inflight
        self.pending_limit = pending_limit
        self._limiter = anyio.Semaphore(max_inflight)
        self._flights: SingleFlight[tuple[EvalOutcome, float]] = SingleFlight()
        # counters (mutable inside; statistics() returns a frozen snapshot)
        self._requested = self._executed = self._deduplicated = 0
        self._cache_hits = self._kv_cache_hits = self._failed = 0
        self._live = 0
        self._peak_live = 0
        self._inflight = 0
        self._peak_inflight = 0

    # -- observation ----------------------------------------------------------------------------
    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of the counters (see :class:`SchedulerStatistics`)."""
        return SchedulerStatistics(
            requested=self._requested,
            executed=self._executed,
            deduplicated=self._deduplicated,
            cache_hits=self._cache_hits,
            kv_cache_hits=self._kv_cache_hits,
            failed=self._failed,
        )

    @property
    def live_jobs(self) -> int:
        """Jobs taken from their source and not yet finished (all runs together)."""
        return self._live

    @property
    def peak_live_jobs(self) -> int:
        """The most jobs alive at once so far (per run it never exceeds ``pending_limit``)."""
        return self._peak_live

    @property
    def peak_inflight(self) -> int:
        """The most ``evaluate`` calls running at once so far (never above ``max_inflight``)."""
        return self._peak_inflight

    # -- entry points ---------------------------------------------------------------------------
    async def run(self, jobs: Sequence[CoalitionJob]) -> list[JobResult]:
        """Resolve every job; results in input order.

        Args:
            jobs: the jobs (duplicates allowed).

        Returns:
            One :class:`JobResult` per job, ``results[i]`` for ``jobs[i]``.

        Raises:
            Exception: the ``evaluate`` error of the first failed job in input order, raised after
                every job has finished (successful ones are stored and archived).
            ArchiveError: the archive could not take a row (raised after the jobs in progress).
        """
        results: list[JobResult | None] = [None] * len(jobs)
        state = _RunState(len(jobs))
        indexed = iter(enumerate(jobs))

        def take() -> Any:
            return next(indexed, _END)

        def deliver(item: tuple[int, CoalitionJob], result: JobResult) -> None:
            results[item[0]] = result

        await self._drive(take, deliver, state, n_workers=min(self.pending_limit, len(jobs)), sync=True)
        if state.fatal is not None:
            raise state.fatal
        for result in results:
            assert result is not None
            if result.error is not None:
                raise result.error
        return results  # type: ignore[return-value]

    async def run_iter(
        self, jobs: Iterable[CoalitionJob], *, total: int | None = None
    ) -> AsyncIterator[JobResult]:
        """Resolve jobs pulled lazily from an iterable; yield results in completion order.

        At most ``pending_limit`` jobs are pulled ahead of their results; the iterable is advanced
        only when a worker is free. Failed jobs are yielded with ``error`` set (never raised).
        Closing the generator early (``break`` inside ``async with contextlib.aclosing(...)``)
        cancels the jobs in progress; nothing of theirs is stored or archived.

        Args:
            jobs: the jobs (any iterable; a generator stays lazy).
            total: the number of jobs, for progress (default ``len(jobs)`` when it has one).

        Yields:
            One :class:`JobResult` per job.

        Raises:
            Exception: what the iterable raised, or ArchiveError, after the jobs in progress.
        """
        it = iter(jobs)
        if total is None and hasattr(jobs, "__len__"):
            total = len(jobs)  # type: ignore[arg-type]

        async def take() -> Any:
            return next(it, _END)

        async with aclosing(self._stream(take, total)) as results:
            async for result in results:
                yield result

    async def run_stream(
        self, jobs: AsyncIterable[CoalitionJob], *, total: int | None = None
    ) -> AsyncIterator[JobResult]:
        """Like :meth:`run_iter`, for an async iterator of jobs (pulled one at a time, under a lock).

        Args:
            jobs: the jobs.
            total: the number of jobs, for progress, or ``None`` when unknown.

        Yields:
            One :class:`JobResult` per job, in completion order.

        Raises:
            Exception: what the iterator raised, or ArchiveError, after the jobs in progress.
        """
        ait = aiter(jobs)
        lock = anyio.Lock()

        async def take() -> Any:
            async with lock:
                try:
                    return await anext(ait)
                except StopAsyncIteration:
                    return _END

        async with aclosing(self._stream(take, total)) as results:
            async for result in results:
                yield result

    # -- machinery --------------------------------------------------------------------------------
    async def _stream(
        self, take: Callable[[], Awaitable[Any]], total: int | None
    ) -> AsyncIterator[JobResult]:
        state = _RunState(total)
        send, receive = anyio.create_memory_object_stream[JobResult](self.pending_limit)

        async def deliver(item: Any, result: JobResult) -> None:
            try:
                send.send_nowait(result)
            except anyio.WouldBlock:
                await send.send(result)

        async def pump() -> None:
            async with send:
                await self._drive(take, deliver, state, n_workers=self.pending_limit)

        async with anyio.create_task_group() as tg, receive:
            tg.start_soon(pump)
            try:
                async for result in receive:
                    yield result
            except GeneratorExit:
                # closed early by the consumer: cancel the jobs in progress, then finish quietly
                tg.cancel_scope.cancel()
                return
        if state.fatal is not None:
            raise state.fatal

    async def _drive(
        self,
        take: Callable[[], Any],
        deliver: Callable[[Any, JobResult], Any],
        state: _RunState,
        *,
        n_workers: int,
        sync: bool = False,
    ) -> None:
        """Run ``n_workers`` workers over the jobs ``take`` gives; ``sync``: ``take`` and ``deliver``
        are plain functions (a list's jobs and results: no coroutine per job), else coroutines."""
        if state.total is not None:
            self._tally.plan(state.total)
        async with anyio.create_task_group() as tg:
            for _ in range(n_workers):
                tg.start_soon(self._worker, take, deliver, state, sync)

    async def _worker(
        self,
        take: Callable[[], Any],
        deliver: Callable[[Any, JobResult], Any],
        state: _RunState,
        sync: bool = False,
    ) -> None:
        while not state.stop:
            try:
                item = take() if sync else await take()
            except Exception as exc:
                state.fail(exc)
                return
            if item is _END:
                return
            # run's items are (index, job) pairs; a stream's are jobs
            job = item[1] if sync or isinstance(item, tuple) else item
            if type(job) is not CoalitionJob and not isinstance(job, CoalitionJob):
                state.fail(ConfigError(f"expected a CoalitionJob, got {type(job).__name__}", field="jobs"))
                return
            self._live += 1
            if self._live > self._peak_live:
                self._peak_live = self._live
            try:
                result = await self._resolve(job)
            except Exception as exc:  # archive failure: stop the run, keep the results so far
                state.fail(exc)
                return
            finally:
                self._live -= 1
            state.done += 1
            self._tally.advance()
            if sync:
                deliver(item, result)
                continue
            try:
                await deliver(item, result)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the consumer closed the results early

    async def _resolve(self, job: CoalitionJob) -> JobResult:
        key = job.coalition_key
        if self.store is not None:
            hit = self.store.get(key)
            if hit is not None:
                await anyio.lowlevel.checkpoint()
                self._requested += 1
                self._cache_hits += 1
                self._archive(job, hit, elapsed_s=0.0, cache_hit=True, batch_size=0)
                return JobResult(
                    job=job, utility=hit, elapsed_s=0.0, cache_hit=True, deduplicated=False, batch_size=0
                )

        # single flight (dedup): a job whose key is in flight shares that evaluation; the leader
        # evaluates inline (no coroutine frames of the single flight's or a closure per job)
        flights = self._flights
        while True:
            flight, leading = flights.join(key)
            if leading:
                break
            await flight.wait()
            if not flight.abandoned:  # else the leader was cancelled: claim the key again
                break
        shared = not leading
        if shared:
            value, error = flight.value, flight.error
        else:
            value = error = None
            try:
                # fast path without a checkpoint when a slot is free (evaluate is the checkpoint)
                try:
                    self._limiter.acquire_nowait()
                except anyio.WouldBlock:
                    await self._limiter.acquire()
                self._inflight += 1
                if self._inflight > self._peak_inflight:
                    self._peak_inflight = self._inflight
                try:
                    t0 = time.perf_counter()
                    outcome = await self.evaluate(job)
                    elapsed = time.perf_counter() - t0
                finally:
                    self._inflight -= 1
                    self._limiter.release()
                if not isinstance(outcome, EvalOutcome):
                    raise TypeError(f"evaluate must return an EvalOutcome, got {type(outcome).__name__}")
                if self.store is not None:
                    self.store.put(key, outcome.utility)  # before the flight lands: later jobs hit
                value = (outcome, elapsed)
            except Exception as exc:
                error = exc
            except BaseException:
                # cancellation or interrupt: hand the key to a follower, record nothing
                flights.land(key, flight, None, None, abandoned=True)
                raise
            flights.land(key, flight, value, error)
        if error is not None:
            self._requested += 1
            if shared:
                self._deduplicated += 1
            else:
                self._failed += 1
                logger.debug("evaluation of %s failed: %s", key, error)
            return JobResult(
                job=job, utility=math.nan, elapsed_s=0.0, cache_hit=False, deduplicated=shared,
                batch_size=0, error=error,
            )
        assert value is not None
        outcome, elapsed = value
        self._requested += 1
        utility = float(outcome.utility)
        if shared:
            self._deduplicated += 1
            return JobResult(
                job=job, utility=utility, elapsed_s=elapsed, cache_hit=False, deduplicated=True,
                batch_size=outcome.batch_size,
            )
        if outcome.cache_hit:  # derived without a model call
            self._cache_hits += 1
            self._archive(job, utility, elapsed_s=0.0, cache_hit=True, batch_size=0, outcome=outcome)
            return JobResult(
                job=job, utility=utility, elapsed_s=0.0, cache_hit=True, deduplicated=False, batch_size=0
            )
        self._executed += 1
        self._kv_cache_hits += outcome.kv_cache_hits
        self._archive(
            job, utility, elapsed_s=elapsed if outcome.batch_seconds is None else outcome.batch_seconds,
            cache_hit=False, batch_size=outcome.batch_size, outcome=outcome,
        )
        return JobResult(
            job=job, utility=utility, elapsed_s=elapsed, cache_hit=False, deduplicated=False,
            kv_cache_hits=outcome.kv_cache_hits, batch_size=outcome.batch_size,
        )

    def _archive(
        self, job: CoalitionJob, utility: float, *, elapsed_s: float, cache_hit: bool, batch_size: int,
        outcome: EvalOutcome | None = None,
    ) -> None:
        if self.archive is None:
            return
        self.archive.append(
            {
                "tokens_computed": None if outcome is None else outcome.tokens_computed,
                "tokens_reused": None if outcome is None else outcome.tokens_reused,
                "batch_id": None if outcome is None else outcome.batch_id,
                "evaluation_key": None if outcome is None else outcome.evaluation_key,
                "token_logprobs": None if outcome is None or outcome.token_logprobs is None else outcome.token_logprobs.tolist(),
                "generated_texts": None if outcome is None or outcome.generated_texts is None else list(outcome.generated_texts),
                "snapshot_id": job.snapshot_id,
                "coalition_key": job.coalition_key,
                "mask": job.mask.words,
                "n_bits": job.mask.n_bits,
                "absence_policy": job.absence_policy,
                "model_id": job.model_id,
                "utility": utility,
                "elapsed_ms": elapsed_s * 1e3,
                "cache_hit": cache_hit,
                "batch_size": batch_size,
                "game": job.game,
            }
        )
