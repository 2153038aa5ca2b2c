"""The lock-leader collator: concurrent async requests become batched synchronous backend calls.

There is no background task and no timer. :meth:`Collator.serve` appends the request's record to
a queue and acquires one :class:`anyio.Lock`. The task that holds it (the *leader*) takes its own
record plus the compatible queued records (same batch key, in queue order, up to
``max_batch_size``), runs one backend call in a worker thread (``anyio.to_thread.run_sync``,
shielded so a cancelled leader never abandons it) and fills every member's result slot on the
event-loop thread. A request that finds the lock held sleeps until the call that takes its record is
delivered (each member's task is woken then, once), and returns its filled slot without a call;
when the lock is released with records still queued, the task of the oldest one is woken too, and
takes the free lock and leads the next batch unless another request took it first. Whoever holds
the lock leads the batch of the oldest queued record, so batches form in queue order on every event
loop, and a request's task wakes once per call it waits for in the common case rather than at the
end of every call. The lock holder is the only caller of the backend, so one
call is in flight at a time by construction; requests that arrive while a call runs accumulate,
so the running call is the collation window. ``max_batch_size=1`` is strict serialisation through
the same code path.

Batch keys (:mod:`~coalescence.scheduler.batch_keys`): only records of one key share a call; with
:class:`~coalescence.scheduler.buckets.LengthBuckets` a request admitted with ``n_tokens`` is
bucketed and its calls take at most the rows the padded-token budget holds (a row that shares
cached tokens with its batch-mates, the proxy game's, counts its own tokens, the shared ones once).

Runtime kwargs and scopes: the backend declares the runtime kwargs it consumes, each ``"row"`` or
``"call"``. Static (whole-run) kwargs: call-scoped pass through to every call, row-scoped are
broadcast to every row. Per-request runtime kwargs (``row_kwargs``): row-scoped are collated row by
row, call-scoped are rejected at admission. A key given both statically and per request is
rejected. An undeclared key is inert: dropped from the call and the key, recorded in
:attr:`Collator.inert_runtime_kwargs` and logged once. ``call_kwargs`` are per-request generation
settings (seed, stop strings, temperature...): they are not runtime kwargs, enter the batch key
and go to the backend as call kwargs, so requests that differ in them never share a call.

Poison isolation: when a multi-row call fails (it raises, or returns other than exactly one
output per row), its members are re-run one by one, once, so each gets its own result or its own
exception. If every member then succeeds, one warning is logged per distinct batch-level error
message (a batching bug in the backend, not a bad sample).

Reproducibility: a per-item seed must derive from (run seed, coalition key), never from batch
position, so a sampled generation is the same whatever its batch-mates. A backend that honours
per-row seeds declares ``seed`` row-scoped and the caller passes it in ``row_kwargs``. A backend
that cannot takes the seed in ``call_kwargs`` instead: it then enters the batch key, so rows with
different seeds never share a call and such rows run one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from ..errors import BatchFailed, CoalescenceError, ConfigError, EngineClosed
from .batch_keys import BatchKeyMemo, batch_key, canonical
from .buckets import LengthBuckets
from .records import (
    EMPTY,
    RESERVED,
    BatchFn,
    CallReport,
    CollatorBackend,
    CollatorRecord,
    CollatorStatistics,
    frozen_mapping,
    scoring_backend,
)

__all__ = (
    "BatchFn",
    "Collator",
    "CollatorBackend",
    "CollatorRecord",
    "CollatorStatistics",
    "batch_key",
    "scoring_backend",
)

logger = logging.getLogger(__name__)

_QUEUED, _TAKEN, _DONE, _CANCELLED = "queued", "taken", "done", "cancelled"


class Collator:
    """Lock-leader batching of concurrent requests into synchronous backend calls.

    Args:
        backend: the batch function and its runtime-kwarg scopes.
        max_batch_size: the most rows per backend call (>= 1; 1 serialises strictly).
        static_kwargs: whole-run runtime kwargs: call-scoped pass through, row-scoped are broadcast
            to every row, undeclared ones are inert.
        buckets: length buckets and padded-token budget (see
            :class:`~coalescence.scheduler.buckets.LengthBuckets`); requests admitted with
            ``n_tokens`` are bucketed, others are not.

    Raises:
        ConfigError: ``max_batch_size`` < 1, or a static kwarg named ``"n_candidates"`` or without
            a canonical encoding.
    """

    def __init__(
        self,
        backend: CollatorBackend,
        *,
        max_batch_size: int = 8,
        static_kwargs: Mapping[str, Any] | None = None,
        buckets: LengthBuckets | None = None,
    ) -> None:
        if not isinstance(backend, CollatorBackend):
            raise ConfigError(f"must be a CollatorBackend, got {backend!r}", field="backend")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="max_batch_size")
        if buckets is not None and not isinstance(buckets, LengthBuckets):
            raise ConfigError(f"must be a LengthBuckets, got {buckets!r}", field="buckets")
        self._backend = backend
        self._max = max_batch_size
        self._buckets = buckets
        self._lock = anyio.Lock()
        self._queues: dict[str, dict[int, CollatorRecord]] = {}
        self._fifo: dict[int, CollatorRecord] = {}  # every queued record, oldest first
        self._closed = False
        self._inert: set[str] = set()
        self._warned: set[str] = set()
        self._batch_key = BatchKeyMemo()
        self._stats = CollatorStatistics()
        static = frozen_mapping(static_kwargs, "static_kwargs")
        if RESERVED in static:
            raise ConfigError(f"{RESERVED!r} is set per request (admit's n_candidates)", field="static_kwargs")
        scopes = backend.runtime_kwargs
        self._static = static
        self._static_call = {k: v for k, v in static.items() if scopes.get(k) == "call"}
        self._static_row = {k: v for k, v in static.items() if scopes.get(k) == "row"}
        canonical(self._static_call, "static_kwargs")
        for name in static:
            if name not in scopes:
                self._note_inert(name, "static_kwargs")

    @property
    def max_batch_size(self) -> int:
        """The most rows per backend call."""
        return self._max

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def inert_runtime_kwargs(self) -> frozenset[str]:
        """Names of runtime kwargs given but not declared by the backend (dropped, logged once)."""
        return frozenset(self._inert)

    def statistics(self) -> CollatorStatistics:
        """A snapshot of the counters (see :class:`CollatorStatistics`)."""
        return self._stats

    def close(self) -> None:
        """Refuse new work; records already queued and the in-flight batch still complete.

        Later :meth:`admit` and :meth:`serve` calls raise :class:`~coalescence.errors.EngineClosed`.
        Idempotent.
        """
        self._closed = True

    def _note_inert(self, name: str, where: str) -> None:
        if name not in self._inert:
            self._inert.add(name)
            logger.warning(
                "runtime kwarg %r (%s) is not consumed by this backend; it is dropped from every call "
                "and from the batch key", name, where,
            )

    def admit(
        self,
        prompt: Any,
        *,
        call_kwargs: Mapping[str, Any] | None = None,
        row_kwargs: Mapping[str, Any] | None = None,
        n_candidates: int = 1,
        key_extra: tuple[Any, ...] = (),
        n_tokens: int | None = None,
        shared_tokens: int = 0,
    ) -> CollatorRecord:
        """Validate a request and build its record (nothing is queued).

        Args:
            prompt: the row's prompt as the backend takes it.
            call_kwargs: per-request generation kwargs (seed, stop strings...); they enter the batch
                key and reach the backend as call kwargs. Names the backend declares as runtime
                kwargs are refused here.
            row_kwargs: per-request runtime kwargs; row-scoped ones are collated row by row,
                undeclared ones are inert.
            n_candidates: candidates asked for (>= 1); above 1 the request dispatches alone and the
                backend receives ``call_kwargs["n_candidates"]``.
            key_extra: hashable, canonically encodable tuple of what else makes rows batchable
                (e.g. ``(model_id, utility)``).
            n_tokens: the row's length in tokens; with ``buckets`` its bucket ceiling enters the
                batch key and bounds the rows of its calls by the padded-token budget.
            shared_tokens: of ``n_tokens``, the leading tokens that every row of its calls shares,
                computed once per call (a proxy row's cached KV,
                :attr:`~coalescence.backends.rows.ProxyScoreRequest.shared_tokens`); with
                ``buckets`` the count enters the batch key, the row is bucketed by its other
                ``n_tokens - shared_tokens`` and its calls take at most
                ``(padded_token_budget - shared_tokens) // ceiling`` rows. The whole row must
                still fit the largest bucket and the context.

        Returns:
            The frozen :class:`CollatorRecord`, to pass to :meth:`serve`.

        Raises:
            EngineClosed: the collator is closed.
            ConfigError: a call-scoped runtime kwarg given per request, a key given both statically
                and per request (or in both ``call_kwargs`` and ``row_kwargs``), the reserved
                ``"n_candidates"`` in ``call_kwargs``, a bad ``n_candidates``, or a value without a
                canonical encoding, or ``shared_tokens`` not in ``[0, n_tokens)``. The message
                names the key.
            InputError: ``n_tokens`` exceeds the largest bucket or the model's context (nothing
                is queued, no model call is made).
        """
        if self._closed:
            raise EngineClosed("the collator is closed; no new requests are admitted")
        if call_kwargs is None and row_kwargs is None and not self._static_call and not self._static_row and (
            self._buckets is None or n_tokens is None
        ):
            # no kwargs anywhere (the scoring path): the checks below have nothing to check
            if type(key_extra) is not tuple and not isinstance(key_extra, tuple):
                raise ConfigError(f"must be a tuple, got {key_extra!r}", field="key_extra")
            if type(n_candidates) is not int and (isinstance(n_candidates, bool) or not isinstance(n_candidates, int)) or n_candidates < 1:
                raise ConfigError(f"must be a positive integer, got {n_candidates!r}", field="n_candidates")
            record = CollatorRecord(
                prompt=prompt, call_kwargs=EMPTY, row_kwargs=EMPTY, n_candidates=n_candidates,
                batch_key=self._batch_key({}, {}, n_candidates == 1, key_extra),
            )
            record._slot.owner = self
            return record
        max_rows = 0
        if self._buckets is not None and n_tokens is not None:
            if shared_tokens:
                shared_ok = isinstance(shared_tokens, int) and not isinstance(shared_tokens, bool)
                if not (shared_ok and 0 < shared_tokens < n_tokens):
                    raise ConfigError(
                        f"must be an int in [0, {n_tokens}) (n_tokens), got {shared_tokens!r}", field="shared_tokens"
                    )
                self._buckets.bucket(n_tokens)  # the whole row fits the largest bucket and the context
            ceiling = self._buckets.bucket(n_tokens - shared_tokens)
            max_rows = self._buckets.max_rows(ceiling, self._max, shared_tokens=shared_tokens)
            shared = ("shared_tokens", shared_tokens) if shared_tokens else ()
            key_extra = (*key_extra, "length_bucket", ceiling, *shared) if isinstance(key_extra, tuple) else key_extra
        calls = frozen_mapping(call_kwargs, "call_kwargs")
        rows = frozen_mapping(row_kwargs, "row_kwargs")
        if not isinstance(key_extra, tuple):
            raise ConfigError(f"must be a tuple, got {key_extra!r}", field="key_extra")
        scopes = self._backend.runtime_kwargs
        if RESERVED in calls or RESERVED in rows:
            raise ConfigError(f"{RESERVED!r} is reserved; pass admit(..., n_candidates=...)", field="call_kwargs")
        for name in (*calls, *rows):
            if name in self._static:
                raise ConfigError(
                    f"{name!r} is given both statically and per request; give it in one place",
                    field=f"kwargs.{name}",
                )
        for name in calls:
            if name in rows:
                raise ConfigError(f"{name!r} is in both call_kwargs and row_kwargs", field=f"call_kwargs.{name}")
            if scopes.get(name) == "row":
                raise ConfigError(
                    f"{name!r} is a row-scoped runtime kwarg of this backend; pass it in row_kwargs",
                    field=f"call_kwargs.{name}",
                )
            if scopes.get(name) == "call":
                raise ConfigError(
                    f"{name!r} is a call-scoped runtime kwarg of this backend and cannot vary per request; "
                    "set it once in static_kwargs",
                    field=f"call_kwargs.{name}",
                )
        per_row: dict[str, Any] = {}
        for name, value in rows.items():
            scope = scopes.get(name)
            if scope == "call":
                raise ConfigError(
                    f"{name!r} is a call-scoped runtime kwarg of this backend and cannot vary per request; "
                    "set it once in static_kwargs",
                    field=f"row_kwargs.{name}",
                )
            if scope is None:
                self._note_inert(name, "row_kwargs")
                continue
            per_row[name] = value
        eff_call = {**self._static_call, **calls}
        eff_row = {**self._static_row, **per_row}
        if isinstance(n_candidates, bool) or not isinstance(n_candidates, int) or n_candidates < 1:
            raise ConfigError(f"must be a positive integer, got {n_candidates!r}", field="n_candidates")
        key = self._batch_key(eff_call, eff_row, n_candidates == 1, key_extra)
        record = CollatorRecord(
            prompt=prompt, call_kwargs=eff_call, row_kwargs=eff_row, n_candidates=n_candidates, batch_key=key,
            max_rows=max_rows,
        )
        record._slot.owner = self
        return record

    async def submit(
        self,
        prompt: Any,
        *,
        call_kwargs: Mapping[str, Any] | None = None,
        row_kwargs: Mapping[str, Any] | None = None,
        n_candidates: int = 1,
        key_extra: tuple[Any, ...] = (),
        n_tokens: int | None = None,
        shared_tokens: int = 0,
    ) -> Any:
        """``serve(admit(...))``: see :meth:`admit` and :meth:`serve`."""
        record = self.admit(
            prompt, call_kwargs=call_kwargs, row_kwargs=row_kwargs, n_candidates=n_candidates, key_extra=key_extra,
            n_tokens=n_tokens, shared_tokens=shared_tokens,
        )
        return await self.serve(record)

    async def serve(self, record: CollatorRecord) -> Any:
        """Queue ``record``, batch it with compatible requests, and return its row's output.

        If cancelled while the record is still queued, the record is withdrawn; if it is already
        part of a running call, that call completes and its batch-mates get their results.

        Args:
            record: a record from this collator's :meth:`admit`, served at most once.

        Returns:
            The backend's output for this row.

        Raises:
            EngineClosed: the collator was closed before this record was queued.
            ConfigError: the record comes from another collator or was already served.
            BatchFailed: this row failed (a backend error that is not a
                :class:`~coalescence.errors.CoalescenceError` is wrapped, with ``__cause__`` set).
            CoalescenceError: the backend's own error for this row.
        """
        slot = record._slot
        if slot.owner is not self:
            raise ConfigError("this record was admitted by another collator", field="record")
        if slot.state is not None:
            raise ConfigError(f"this record was already served (state {slot.state})", field="record")
        if self._closed:
            raise EngineClosed("the collator is closed; no new requests are served")
        # queue and wait in one step (no checkpoint in between), then take the lock: the holder
        # leads a batch unless its record was already served by an earlier leader
        slot.state = _QUEUED
        self._queues.setdefault(record.batch_key, {})[id(record)] = record
        self._fifo[id(record)] = record
        held = False  # whether this task took the lock (and so may have led, shielded)
        try:
            while slot.state != _DONE:
                if self._lock.locked():
                    # a call is running: sleep until this record's batch is delivered, or until
                    # the lock is free with this record the oldest queued (no checkpoint between
                    # the check and the wait, so neither wake-up can be missed)
                    event = slot.event = anyio.Event()
                    await event.wait()
                    slot.event = None
                    continue
                held = True
                try:
                    async with self._lock:
                        if slot.state == _QUEUED:  # lead the oldest queued record's batch
                            await self._lead(next(iter(self._fifo.values())))
                finally:
                    self._end_round()
        except BaseException:
            if slot.state == _QUEUED:
                self._withdraw(record)
                slot.state = _CANCELLED
                self._end_round()  # this record may have been the one woken to lead
            raise
        # whichever waiter takes the lock leads the oldest record's batch, shielded, so a cancelled
        # task may have led (and served) its batch: it still raises its cancellation, never returns
        # (a task that only slept was cancellable there: its wait was the checkpoint)
        if held:
            await anyio.lowlevel.checkpoint_if_cancelled()
        if slot.ok:
            return slot.value
        raise slot.value

    def _end_round(self) -> None:
        """With the lock free, wake the task of the oldest queued record: it leads the next batch
        unless another request takes the lock first (whose call then ends with this again). The
        members of a call are woken when it is delivered; the other queued records sleep on."""
        if self._fifo and not self._lock.locked():
            event = next(iter(self._fifo.values()))._slot.event
            if event is not None:
                event.set()

    def _withdraw(self, record: CollatorRecord) -> None:
        self._fifo.pop(id(record), None)
        queue = self._queues.get(record.batch_key)
        if queue is not None:
            queue.pop(id(record), None)
            if not queue:
                del self._queues[record.batch_key]

    def _take(self, record: CollatorRecord) -> list[CollatorRecord]:
        """The batch led for ``record``: it, then compatible queued ones in queue order."""
        self._withdraw(record)
        batch = [record]
        if record.n_candidates == 1:
            queue = self._queues.get(record.batch_key, {})
            limit = record.max_rows or self._max
            for rid in list(queue)[: limit - 1]:
                batch.append(queue.pop(rid))
                del self._fifo[rid]
            if not queue:
                self._queues.pop(record.batch_key, None)
        for member in batch:
            member._slot.state = _TAKEN
        return batch

    async def _lead(self, record: CollatorRecord) -> None:
        batch = self._take(record)
        report: CallReport | None = None
        try:
            with anyio.CancelScope(shield=True):
                report = await anyio.to_thread.run_sync(self._execute, batch)
        finally:
            if report is None:  # the worker call itself could not run: fail every member
                msg = f"the backend call for a batch of {len(batch)} rows did not complete"
                report = CallReport([(False, BatchFailed(msg)) for _ in batch], 0, False, None)
            self._deliver(batch, report)

    def _deliver(self, batch: list[CollatorRecord], report: CallReport) -> None:
        failed = sum(1 for ok, _ in report.outcomes if not ok)
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            calls=s.calls + report.calls,
            rows=s.rows + len(batch),
            largest_batch=max(s.largest_batch, len(batch) if report.calls else 0),
            poison_reruns=s.poison_reruns + int(report.poisoned),
            failed_rows=s.failed_rows + failed,
        )
        if report.batch_message is not None and report.batch_message not in self._warned:
            self._warned.add(report.batch_message)
            logger.warning(
                "a batch of %d rows failed but every row succeeded alone, which points at a batching "
                "bug in the backend (not a bad sample): %s",
                len(batch), report.batch_message,
            )
        for member, (ok, value) in zip(batch, report.outcomes, strict=True):
            slot = member._slot
            slot.ok, slot.value, slot.state = ok, value, _DONE
            if slot.event is not None:  # its task sleeps (not the leader's own): wake it
                slot.event.set()

    def _invoke(self, batch: list[CollatorRecord]) -> list[Any]:
        """One backend call (worker thread); checks one output per row."""
        first = batch[0]
        call_kwargs = dict(first.call_kwargs)
        if first.n_candidates > 1:
            call_kwargs[RESERVED] = first.n_candidates
        outputs = self._backend.fn([r.prompt for r in batch], call_kwargs, [dict(r.row_kwargs) for r in batch])
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
            raise BatchFailed(
                f"the backend returned {type(outputs).__name__} instead of a sequence of {len(batch)} outputs"
            )
        if len(outputs) != len(batch):
            raise BatchFailed(f"the backend returned {len(outputs)} outputs for {len(batch)} rows")
        return list(outputs)

    @staticmethod
    def _translate(exc: Exception, rows: int) -> Exception:
        if isinstance(exc, CoalescenceError):
            return exc
        err = BatchFailed(f"backend call failed on a batch of {rows} rows: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _execute(self, batch: list[CollatorRecord]) -> CallReport:
        """The batch call plus, on failure of a multi-row call, one serial re-run per member."""
        try:
            outputs = self._invoke(batch)
        except Exception as exc:
            batch_exc = exc
        else:
            return CallReport([(True, out) for out in outputs], 1, False, None)
        if len(batch) == 1:
            return CallReport([(False, self._translate(batch_exc, 1))], 1, False, None)
        outcomes: list[tuple[bool, Any]] = []
        for member in batch:
            try:
                outcomes.append((True, self._invoke([member])[0]))
            except Exception as exc:
                outcomes.append((False, self._translate(exc, 1)))
        all_ok = all(ok for ok, _ in outcomes)
        message = f"{type(batch_exc).__name__}: {batch_exc}" if all_ok else None
        return CallReport(outcomes, 1 + len(batch), True, message)
