"""The backend protocol: score (prompt, target) token sequences with teacher forcing, and generate.

A backend is synchronous and is called from one worker thread at a time (the engine, and later
the collator, are its only callers). Each backend translates its library's exceptions into
:class:`~coalescence.errors.BackendError` subclasses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import BackendError, BatchFailed, CoalescenceError, ConfigError
from .rows import (
    GenerateRequest,
    GenerateResult,
    ProxyScoreRequest,
    ScoreRequest,
    ScoreResult,
    ScoringStatistics,
    validate_generations,
    validate_results,
)

__all__ = (
    "DEFAULT_BATCH_SIZE",
    "DTYPES",
    "VLLM_BATCH_SIZE",
    "BackendBase",
    "GenerateRequest",
    "PROTOCOL_MEMBERS",
    "GenerateResult",
    "ProxyScoreRequest",
    "ScoreRequest",
    "ScoreResult",
    "ScoringBackend",
    "ScoringStatistics",
    "check_backend",
    "check_dtype",
    "refuse_long_generations",
    "refuse_long_rows",
    "run_record_of",
    "validate_generations",
    "validate_results",
)

DEFAULT_BATCH_SIZE = 16
"""Rows per model call unless told otherwise: chosen from the sweep of ``benchmarks/compute_limit.py``
(benchmarks/RESULTS.md): with prefix sharing, 16 ran the demo game 1.40x faster than 4 and the
long-context RAG game as fast; larger batches gained nothing."""

VLLM_BATCH_SIZE = 512
"""Rows per call of the vLLM backends (in-process and server) unless told otherwise: vLLM
schedules the requests of a call itself (continuous batching within its token budget), so a
call takes a whole round of an estimator's coalitions, not 16 at a time (benchmarks/RESULTS.md,
"The vLLM backend")."""


@runtime_checkable
class ScoringBackend(Protocol):
    """Everything the engine, the runs layer and the Ray layer read from a backend.

    Nothing is read through ``getattr``: a backend has every member below.
    :class:`BackendBase` gives the defaults of the optional ones (fingerprint, batch size,
    statistics, lanes, notes, records, shutdown, single-prompt ``generate``) and the envelope of
    ``score``, ``score_proxy`` and ``generate_batch`` (the long-row refusal, the translation of
    the library's exceptions into :class:`~coalescence.errors.BatchFailed`, the validation and
    the statistics), so a backend writes only its identity and the model calls
    (``_score_batch``, ``_generate_batch``). ``isinstance(b, ScoringBackend)`` checks that every
    member is present (:func:`check_backend` names the missing ones). The collator calls
    ``score`` / ``generate_batch`` from one worker thread at a time per lane. The contract every
    backend passes is ``tests/backends/test_contract.py``.

    Attributes:
        model_id: the model's name (alias, directory or hub id), part of the coalition key.
        revision: a string that changes when the weights change, part of the coalition key.
        dtype: the compute dtype name (e.g. ``"float32"``), part of the coalition key.
        fingerprint: SHA-256 hex of the model's weight, tokenizer and template files, part of
            the coalition key; ``""`` for a model with no files (built in memory, a fake).
        tokenizer: a transformers tokenizer with a chat template (the engine renders and
            decodes with it; the backend scores the token ids it is given, never re-tokenises).
        max_context: the longest sequence (tokens, prompt + target or prompt + new tokens) the
            model accepts; longer rows are refused before any model call.
        max_batch_size: rows per model call (>= 1): the backend's own default (the batch it does
            best at: :data:`DEFAULT_BATCH_SIZE` for transformers, :data:`VLLM_BATCH_SIZE` for
            vLLM) unless the user set one; the engine's collator sends calls of at most this
            many rows, and the backend runs a call as one model call.
        pads_rows: whether the backend pads a call's rows to its longest (transformers): the
            engine then groups rows by length bucket under a padded-token budget. ``False``
            (vLLM: no padding) lets one call take rows of any length, up to ``max_batch_size``.
        shutdown_with_engine: whether :meth:`Engine.close` (and a run that fails to start)
            calls :meth:`shutdown`: ``True`` for a backend that owns processes or a cluster the
            run started (Ray workers).
        supports_proxy: whether :meth:`score_proxy` scores the shared-KV proxy game; ``False``
            (the default of :class:`BackendBase`: it raises ``BackendError``) and a run there
            uses exact rows only. A backend that refuses it for its model may say why in an
            attribute ``proxy_refusal_reason`` (a sentence fragment, quoted by the run's note;
            the transformers backend does: partial rotary, NoPE layers, interleaved RoPE, ...).
    """

    model_id: str
    revision: str
    dtype: str
    fingerprint: str
    tokenizer: Any
    max_context: int
    max_batch_size: int
    pads_rows: bool
    shutdown_with_engine: bool
    supports_proxy: bool

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score each request with teacher forcing; one result per request, in order.

        Args:
            requests: the rows (any number; the backend splits them into model calls).

        Returns:
            One :class:`ScoreResult` per request: ``token_logprobs`` ``[n_target]`` float32
            log p(target_j | prompt, target_<j) in nats, ``utility`` their float64 sum.

        Raises:
            BatchFailed: a row longer than ``max_context`` (refused before any model call: the
                statistics do not change), the model call failed, or it returned non-finite values.
        """
        ...

    def score_proxy(self, requests: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """Score rows of the shared-KV proxy game (:class:`ProxyScoreRequest` has the semantics);
        one result per request, in order. Only a backend whose ``supports_proxy`` is True can.

        Returns:
            One :class:`ScoreResult` per request: ``token_logprobs`` ``[n_target]`` float32 nats,
            ``utility`` their float64 sum, ``tokens_computed`` the positions run for the row,
            ``tokens_reused`` the shared KV positions it read.

        Raises:
            BackendError: the backend has no proxy game (``supports_proxy`` False).
            BatchFailed: a row longer than ``max_context`` (before any model call), or the model
                call failed.
        """
        ...

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """Greedy continuation token ids of ``prompt_ids`` (at most ``max_new_tokens``; the
        end-of-turn token kept when produced).

        Raises:
            ConfigError: ``max_new_tokens`` < 1 or an empty prompt.
            BatchFailed: the prompt plus ``max_new_tokens`` exceeds ``max_context``, or the model
                call failed.
        """
        ...

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples; one result per request, in order.

        Each result must be what the request gives alone: greedy samples are the model's
        arg-max continuation; sample ``s`` of a sampled request depends only on the request and
        ``seeds[s]`` (not on batch-mates, not on the global RNG, which is left as it was).

        Raises:
            BatchFailed: a sequence would exceed ``max_context`` (before any model call), or the
                model call failed.
        """
        ...

    def statistics(self) -> ScoringStatistics:
        """A frozen snapshot of the backend's counters over all its calls (see
        :class:`ScoringStatistics`; a refused row counts nothing)."""
        ...

    def acquire_lane(self, snapshot_id: str) -> Hashable | None:
        """The lane a conversation's calls go to, taken for one :meth:`Engine.evaluate`.

        The engine keeps one collator per lane (one call in flight per lane) and gives each
        lane's calls to :meth:`lane`. ``None``: the backend itself, one lane (the default).
        Every acquired lane other than ``None`` is given back with :meth:`release_lane`.

        Args:
            snapshot_id: the conversation (its snapshot id); a backend with several lanes keeps
                a conversation on one lane so that lane's prefix cache stays warm for it.
        """
        ...

    def lane(self, lane: Hashable | None) -> ScoringBackend:
        """The backend that serves ``lane``'s calls (``self`` for ``None``)."""
        ...

    def release_lane(self, lane: Hashable | None) -> None:
        """Give back a lane taken by :meth:`acquire_lane` (its evaluation ended)."""
        ...

    def run_notes(self, snapshot_id: str = "") -> tuple[str, ...]:
        """Sentences added to an explanation's notes (e.g. Ray workers lost); ``()`` for none.

        Args:
            snapshot_id: the explained conversation (the ``prefix_group`` of its requests), for
                notes that count its own requests; ``""``: the whole run's."""
        ...

    def identity(self) -> dict[str, str]:
        """The engine that computes the values, part of the run's identity (recorded in the
        archive manifest's run record as ``backend`` and in the ``--out`` document): at least
        ``{"backend": name}`` (``hf``, ``vllm``, ``vllm-server``; Ray workers name the backend
        they run), and for a server the model it serves (``served_model``). A run is never
        resumed on another identity: two engines of one model differ beyond float tolerance in
        bfloat16, and their samplers differ. Coalition keys do not include it (one archive holds
        one engine's values)."""
        ...

    def run_record(self) -> dict[str, Any]:
        """What the archive manifest's run record keeps of the backend, under keys of its own
        (:class:`~coalescence.distributed.RayBackend`: ``{"ray": {...}}``; never ``status``,
        ``statistics`` or ``backend``); ``{}`` for nothing. Read when the engine closes."""
        ...

    def shutdown(self) -> None:
        """Release what the backend holds (processes, connections); idempotent. A call in
        flight on another thread finishes first. Called by its owner, or by the engine when
        ``shutdown_with_engine``."""
        ...


_RESERVED_RECORD_KEYS = frozenset({"status", "statistics", "backend"})

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The compute dtypes a backend loads a model in (``--dtype``), float32 first (the default)."""

_STATISTICS_LOCK = threading.Lock()  # one statistics update at a time, whichever backend


def check_dtype(name: str) -> str:
    """``name`` when it is one of :data:`DTYPES`.

    Raises:
        ConfigError: another name (field ``dtype``), listing the choices.
    """
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}", field="dtype")
    return name


def refuse_long_rows(requests: Sequence[ScoreRequest | ProxyScoreRequest], max_context: int) -> None:
    """Refuse a call with a row longer than ``max_context`` tokens, before any model call.

    Raises:
        BatchFailed: the first such row, naming its length and the context.
    """
    for r in requests:
        if r.n_tokens > max_context:
            raise BatchFailed(f"a sequence of {r.n_tokens} tokens exceeds the model's context of {max_context}")


def refuse_long_generations(requests: Sequence[GenerateRequest], max_context: int) -> None:
    """Refuse a call with a prompt whose ``max_new_tokens`` would run past ``max_context``, before any model call.

    Raises:
        BatchFailed: the first such request, naming its prompt, its new tokens and the context.
    """
    for r in requests:
        if r.n_tokens > max_context:
            raise BatchFailed(
                f"a prompt of {len(r.prompt_ids)} tokens plus {r.max_new_tokens} new tokens exceeds "
                f"the model's context of {max_context}"
            )


class BackendBase:
    """The envelope of every call, and defaults for the optional members of :class:`ScoringBackend`.

    A backend subclasses it, writes its identity (``model_id``, ``revision``, ``dtype``,
    ``tokenizer``, ``max_context``) and the model calls: :meth:`_score_batch` (and
    :meth:`_generate_batch`; :meth:`_score_proxy_batch` where ``supports_proxy``). The public
    :meth:`score`, :meth:`score_proxy` and :meth:`generate_batch` are templates (httpx's
    transports translate errors in one place the same way) that, around that one method:

    1. refuse a row longer than ``max_context`` before any model call (nothing counted);
    2. run the method on each model call (:meth:`_score_calls`: the whole call unless the backend
       splits it), translating any exception that is not already a
       :class:`~coalescence.errors.CoalescenceError` into :class:`~coalescence.errors.BatchFailed`
       ("<:attr:`call_failed`> on a batch of <n> rows: <the error>");
    3. check the call's results as a whole (:func:`validate_results`, :func:`validate_generations`);
    4. count it once in :meth:`statistics`: rows, tokens and positions read from the requests and
       results, plus what the method noted with :meth:`_note` (e.g. prefix forwards). A call that
       fails counts nothing.

    The other defaults: no fingerprint (``""``), :data:`DEFAULT_BATCH_SIZE` rows per call, no
    shutdown with the engine, no proxy game (``supports_proxy`` False, :meth:`score_proxy`
    raises), one lane (the backend itself), no notes, the class's name as its identity, no run
    record, a no-op :meth:`shutdown`, and :meth:`generate` as one greedy :meth:`generate_batch`
    request. A backend may still override a template whole (the Ray layer forwards each call to
    a worker whose own backend runs the envelope).

    Attributes:
        call_failed: how a failed model call's message starts (``"model call failed"``).
        generation_failed: the same for a generation call (``"generation failed"``).
    """

    fingerprint: str = ""
    max_batch_size: int = DEFAULT_BATCH_SIZE
    pads_rows: bool = True
    shutdown_with_engine: bool = False
    supports_proxy: bool = False
    call_failed: str = "model call failed"
    generation_failed: str = "generation failed"
    _stats: ScoringStatistics = ScoringStatistics()

    # -- the templates -------------------------------------------------------------------------------
    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score each request with teacher forcing (:meth:`ScoringBackend.score`) through :meth:`_score_batch`.

        Returns:
            One :class:`ScoreResult` per request, in order (each model call validated as a whole).

        Raises:
            BatchFailed: a row longer than ``max_context`` (before any model call: nothing
                counted), the model call failed, or its results failed :func:`validate_results`.
            CoalescenceError: any other error of ours that the method raised, unchanged.
        """
        refuse_long_rows(requests, self.max_context)  # type: ignore[attr-defined]
        results: list[ScoreResult] = []
        for batch in self._score_calls(requests):
            noted = self._begin_call()
            with self._translated(f"{self.call_failed} on a batch of {len(batch)} rows"):
                out = self._score_batch(batch)
            out = validate_results(batch, out)
            self._count(
                noted,
                batches=1,
                rows=len(batch),
                tokens=sum(r.n_tokens for r in batch),
                tokens_computed=sum(x.tokens_computed for x in out),
                tokens_reused=sum(x.tokens_reused for x in out),
                padded_positions=sum(x.padded_positions for x in out),
            )
            results.extend(out)
        return results

    def score_proxy(self, requests: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """Score rows of the shared-KV proxy game (:meth:`ScoringBackend.score_proxy`) through
        :meth:`_score_proxy_batch`, one model call per :meth:`_proxy_calls` group.

        Returns:
            One :class:`ScoreResult` per request, in order; counted as ``proxy_rows``,
            ``proxy_tokens_computed`` and ``proxy_tokens_reused``.

        Raises:
            BackendError: the backend has no proxy game (``supports_proxy`` False).
            BatchFailed: a row longer than ``max_context`` (before any model call), the model
                call failed, or its results failed :func:`validate_results`.
        """
        if not self.supports_proxy:
            raise BackendError(self._no_proxy_game())
        refuse_long_rows(requests, self.max_context)  # type: ignore[attr-defined]
        out: list[Any] = [None] * len(requests)
        noted = self._begin_call()
        for rows in self._proxy_calls(requests):
            group = [requests[i] for i in rows]
            with self._translated(f"{self.call_failed} on {len(rows)} proxy rows"):
                results = self._score_proxy_batch(group)
            for i, result in zip(rows, validate_results(group, results), strict=True):
                out[i] = result
        results = validate_results(requests, out)
        self._count(
            noted,
            proxy_rows=len(results),
            proxy_tokens_computed=sum(x.tokens_computed for x in results),
            proxy_tokens_reused=sum(x.tokens_reused for x in results),
        )
        return results

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples (:meth:`ScoringBackend.generate_batch`) through :meth:`_generate_batch`.

        Returns:
            One :class:`GenerateResult` per request, in order (validated as a whole); counted as
            ``decodes`` (one per greedy request, one per sample otherwise), ``generated_tokens``
            (their new tokens) and ``generation_tokens_computed`` (the results' ``tokens_computed``).

        Raises:
            BatchFailed: a prompt plus ``max_new_tokens`` longer than ``max_context`` (before any
                model call), the model call failed, or its results failed :func:`validate_generations`.
        """
        refuse_long_generations(requests, self.max_context)  # type: ignore[attr-defined]
        if not requests:
            return []
        noted = self._begin_call()
        with self._translated(f"{self.generation_failed} on a batch of {len(requests)} requests"):
            out = self._generate_batch(requests)
        out = validate_generations(requests, out)
        runs = [ids for r, x in zip(requests, out, strict=True) for ids in (x.token_ids[:1] if r.greedy else x.token_ids)]
        self._count(
            noted,
            decodes=len(runs),
            generated_tokens=sum(map(len, runs)),
            generation_tokens_computed=sum(x.tokens_computed for x in out),
        )
        return out

    # -- what a backend implements -------------------------------------------------------------------
    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """One model call's scores (the rows fit the context; the envelope does the rest)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither score nor _score_batch")

    def _score_proxy_batch(self, batch: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """One model call's proxy scores (a backend whose ``supports_proxy`` is True implements it)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither score_proxy nor _score_proxy_batch")

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """One generation call's results (the requests fit the context)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither generate_batch nor _generate_batch")

    def _score_calls(self, requests: Sequence[ScoreRequest]) -> list[Sequence[ScoreRequest]]:
        """The model calls a :meth:`score` call is run as: the whole call (none when empty)."""
        return [requests] if requests else []

    def _proxy_calls(self, requests: Sequence[ProxyScoreRequest]) -> list[list[int]]:
        """The model calls a :meth:`score_proxy` call is run as, by request index: the whole call."""
        return [list(range(len(requests)))] if requests else []

    def _no_proxy_game(self) -> str:
        """The message of :meth:`score_proxy` on a backend without the proxy game."""
        return (
            f"the {type(self).__name__} backend has no proxy game (shared-KV rows need the transformers "
            "backend); run the exact game only (--proxy-game none)"
        )

    # -- the envelope's parts ------------------------------------------------------------------------
    def _translated(self, message: str) -> contextlib.AbstractContextManager[None]:
        """A context that turns any exception but ours into ``BatchFailed("<message>: <error>")``
        (``raise ... from``: the library's error stays the cause)."""
        return _Translated(message)

    def _begin_call(self) -> dict[str, int]:
        """This thread's counters for the call beginning, empty (what :meth:`_note` adds to)."""
        pending = self.__dict__.setdefault("_pending_counts", {})
        noted: dict[str, int] = {}
        pending[threading.get_ident()] = noted
        return noted

    def _note(self, **counts: int) -> None:
        """Add counters of :class:`ScoringStatistics` to the call in progress on this thread:
        kept when the call succeeds, dropped when it fails."""
        noted = self.__dict__.setdefault("_pending_counts", {}).setdefault(threading.get_ident(), {})
        for name, n in counts.items():
            noted[name] = noted.get(name, 0) + int(n)

    def _count(self, noted: dict[str, int], **counts: int) -> None:
        """Add a successful call's counters (``counts`` and what it noted) to the statistics, once."""
        for name, n in noted.items():
            counts[name] = counts.get(name, 0) + n
        noted.clear()
        self.__dict__.get("_pending_counts", {}).pop(threading.get_ident(), None)
        with _STATISTICS_LOCK:
            s = self._stats
            self._stats = dataclasses.replace(s, **{name: getattr(s, name) + n for name, n in counts.items()})

    # -- the defaults --------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """One greedy :class:`GenerateRequest` through :meth:`generate_batch`.

        Raises:
            ConfigError: ``max_new_tokens`` < 1 or an empty prompt.
            BatchFailed: what :meth:`generate_batch` raises.
        """
        request = GenerateRequest(prompt_ids=tuple(prompt_ids), max_new_tokens=max_new_tokens)
        [result] = validate_generations([request], self.generate_batch([request]))
        return list(result.token_ids[0])

    def statistics(self) -> ScoringStatistics:
        """A snapshot of the counters over every call the envelope counted (zero for none)."""
        return self._stats

    def acquire_lane(self, snapshot_id: str) -> Hashable | None:
        """``None``: one lane, the backend itself."""
        return None

    def lane(self, lane: Hashable | None) -> Any:
        """``self`` (one lane)."""
        return self

    def release_lane(self, lane: Hashable | None) -> None:
        """Nothing to give back (one lane)."""

    def run_notes(self, snapshot_id: str = "") -> tuple[str, ...]:
        """No notes."""
        return ()

    def identity(self) -> dict[str, str]:
        """``{"backend": "<module>.<class>"}``: the backend's class names its engine (a backend
        registered by name overrides it with that name)."""
        return {"backend": f"{type(self).__module__}.{type(self).__qualname__}"}

    def run_record(self) -> dict[str, Any]:
        """Nothing recorded."""
        return {}

    def shutdown(self) -> None:
        """Nothing to release."""


class _Translated:
    """The context of :meth:`BackendBase._translated`."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, CoalescenceError):
            return False
        raise BatchFailed(f"{self.message}: {exc}") from exc


PROTOCOL_MEMBERS: tuple[str, ...] = tuple(
    sorted({*ScoringBackend.__annotations__, *(n for n, v in vars(ScoringBackend).items() if callable(v) and not n.startswith("_"))})
)
"""The names every backend has: the attributes and methods of :class:`ScoringBackend`."""


def check_backend(backend: Any) -> None:
    """Refuse an object that lacks a member of :class:`ScoringBackend`, naming them all.

    Raises:
        ConfigError: a member is missing (field ``backend``; the fix: subclass
            :class:`BackendBase` for the defaults).
    """
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(backend, name)]
    if missing:
        raise ConfigError(
            f"{type(backend).__name__} is not a scoring backend: it lacks {', '.join(missing)}; "
            "subclass coalescence.backends.base.BackendBase for the defaults",
            field="backend",
        )


def run_record_of(backend: ScoringBackend) -> dict[str, Any]:
    """``backend.run_record()`` checked: a dict whose keys are not the run record's own.

    Raises:
        BackendError: a key the archive's run record owns (``status``, ``statistics``).
    """
    record = dict(backend.run_record())
    clash = sorted(_RESERVED_RECORD_KEYS & set(record))
    if clash:
        raise BackendError(f"{type(backend).__name__}.run_record() returned the run record's own keys {clash}")
    return record
