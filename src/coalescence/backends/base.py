"""The backend protocol: score (prompt, target) token sequences with teacher forcing, and generate.

A backend is synchronous and is called from one worker thread at a time (the engine, and later
the collator, are its only callers). Each backend translates its library's exceptions into
:class:`~coalescence.errors.BackendError` subclasses.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import BackendError, BatchFailed, ConfigError

__all__ = (
    "DEFAULT_BATCH_SIZE",
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

_SEED_BOUND = 2**63
"""Seeds are non-negative and below this bound (fits a signed 64-bit integer; every torch generator accepts it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreRequest:
    """One teacher-forced scoring row.

    Args:
        prompt_ids: prompt token ids (at least one; the first target token is predicted from the
            last prompt token).
        target_ids: the token ids whose log-probabilities are summed (at least one).
        prefix_group: a hint, not part of the value: rows with the same group share a long prompt
            prefix (the scoring pipeline passes the conversation's snapshot id). A prefix-sharing
            backend scores a batch group by group, so rows of unrelated conversations batched
            together never widen each other's suffix tree or padding. ``""``: no hint.

    Raises:
        ConfigError: an empty prompt or target.
    """

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    prefix_group: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("a score request needs at least one prompt token", field="prompt_ids")
        if not self.target_ids:
            raise ConfigError("a score request needs at least one target token", field="target_ids")

    @property
    def n_tokens(self) -> int:
        """Total sequence length, prompt + target."""
        return len(self.prompt_ids) + len(self.target_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyScoreRequest:
    """One row of the shared-KV proxy game (issue 37; :mod:`coalescence.masking.proxy` builds them).

    Semantics (what a backend computes; the tests' reference is one plain forward with this 4-D
    mask): a causal forward over ``prompt_ids + target_ids[:-1]`` at the original positions in
    which a query at position ``p < tail_start`` sees every key ``q <= p`` (the shared KV, computed
    with every player present), and a query at ``p >= tail_start`` sees key ``q`` iff ``q <= p``
    and ``q`` is in no ``hidden`` range. The result is the :class:`ScoreResult` of the target
    read from that forward's logits (``token_logprobs`` ``[n_target]`` float32 nats).

    Args:
        prompt_ids: the full prompt (every player present).
        target_ids: the token ids whose log-probabilities are summed (at least one).
        tail_start: ``1 <= tail_start <= len(prompt_ids)``: positions before it are the shared KV.
        hidden: sorted, disjoint, non-empty half-open token ranges ``[a, b)`` of ``prompt_ids``
            (the absent players' tokens), masked out of the tail's attention, before or inside
            the tail; position 0 is never hidden (a query must see at least one key).
        prefix_group: the batching hint of :class:`ScoreRequest`.

    Raises:
        ConfigError: an empty prompt or target, ``tail_start`` out of range, or ``hidden`` not
            sorted disjoint non-empty ranges inside ``[1, len(prompt_ids))``.
    """

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    tail_start: int
    hidden: tuple[tuple[int, int], ...] = ()
    prefix_group: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("a proxy request needs at least one prompt token", field="prompt_ids")
        if not self.target_ids:
            raise ConfigError("a proxy request needs at least one target token", field="target_ids")
        n = len(self.prompt_ids)
        if isinstance(self.tail_start, bool) or not isinstance(self.tail_start, int) or not 1 <= self.tail_start <= n:
            raise ConfigError(f"must be an int in [1, {n}] (the prompt's length), got {self.tail_start!r}", field="tail_start")
        hidden = tuple((int(a), int(b)) for a, b in self.hidden)
        prev = 1
        for a, b in hidden:
            if not prev <= a < b <= n:
                raise ConfigError(
                    f"must be sorted, disjoint, non-empty token ranges inside [1, {n}), got {self.hidden!r}",
                    field="hidden",
                )
            prev = b
        object.__setattr__(self, "hidden", hidden)

    @property
    def n_tokens(self) -> int:
        """Total sequence length, prompt + target."""
        return len(self.prompt_ids) + len(self.target_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreResult:
    """The teacher-forced score of one row.

    Attributes:
        token_logprobs: ``[n_target]`` float32, log p(target_j | prompt, target_<j) in nats.
        utility: float64 sum of ``token_logprobs`` (nats): log p(target | prompt).
        tokens_computed: token positions the model ran for this row. With prefix sharing, a shared
            prefix run for a batch is counted in the batch's first row, so the rows of a batch sum
            to the positions the batch ran (padding excluded).
        tokens_reused: positions of this row served from a shared or cached prefix
            (``tokens_computed + tokens_reused == n_tokens``).
        padded_positions: pad positions run in this row's slot of the batch (computed, discarded).
    """

    token_logprobs: np.ndarray
    utility: float
    tokens_computed: int
    tokens_reused: int = 0
    padded_positions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """One prompt to continue, ``len(seeds)`` times.

    Greedy decoding (``temperature == 0``) takes the arg-max token at every step, so every sample
    is the same text: a backend decodes it once and repeats it. Sampling (``temperature > 0``)
    draws sample ``s`` with the random stream seeded by ``seeds[s]`` alone, so the same request
    gives the same texts whatever else is in its batch and whatever the global RNG state.
    Tokens are drawn from ``softmax(logits / temperature)`` restricted to the nucleus: the
    smallest set of most-likely tokens whose probability reaches ``top_p`` (Holtzman et al.
    2020, "The Curious Case of Neural Text Degeneration"); no other truncation (no top-k).

    Args:
        prompt_ids: prompt token ids (at least one).
        max_new_tokens: most new tokens per sample (>= 1); a sample stops earlier at an
            end-of-sequence / end-of-turn token, which it keeps.
        temperature: softmax temperature (>= 0, finite); 0 is greedy.
        top_p: nucleus mass in ``(0, 1]``; 1 keeps the whole vocabulary. Ignored when greedy.
        seeds: one seed per sample (at least one), each an int in ``[0, 2**63)``; the engine
            derives them from the run seed, the coalition key and the sample index. Greedy
            requests use only their number.

    Raises:
        ConfigError: an empty prompt (field ``prompt_ids``), ``max_new_tokens`` < 1
            (``--max-new-tokens``), a negative or non-finite temperature (``--temperature``),
            ``top_p`` outside ``(0, 1]`` (``--top-p``), no seeds (``--num-samples``) or a seed
            that is not an int in ``[0, 2**63)`` (``seeds``).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("a generate request needs at least one prompt token", field="prompt_ids")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"must be an int >= 1, got {self.max_new_tokens!r}", field="max_new_tokens")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(
                f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}", field="temperature"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"must be a number in (0, 1], got {self.top_p!r}", field="top_p")
        if isinstance(self.seeds, (str, bytes)) or not isinstance(self.seeds, Sequence):
            raise ConfigError(f"must be a sequence of ints, got {self.seeds!r}", field="seeds")
        if not self.seeds:
            raise ConfigError("must be >= 1: a generate request needs at least one seed", field="num_samples")
        seeds = []
        for seed in self.seeds:
            try:
                value = operator.index(seed) if not isinstance(seed, bool) else None
            except TypeError:
                value = None
            if value is None or not 0 <= value < _SEED_BOUND:
                raise ConfigError(f"each seed must be an int in [0, 2**63), got {seed!r}", field="seeds")
            seeds.append(value)
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "seeds", tuple(seeds))

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def n_samples(self) -> int:
        """Number of samples asked for, ``len(seeds)``."""
        return len(self.seeds)

    @property
    def n_tokens(self) -> int:
        """Longest sequence a sample can reach (tokens): prompt + ``max_new_tokens``."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateResult:
    """The samples generated for one :class:`GenerateRequest`.

    Attributes:
        token_ids: ``[n_samples][<= max_new_tokens]`` per sample (in ``seeds`` order), the new
            token ids, the end-of-sequence / end-of-turn token included when one was produced.
        tokens_computed: token positions the model ran for this request: per decode it ran, the
            prompt plus each new token that was fed back (a greedy request runs one decode
            whatever its number of samples).
    """

    token_ids: tuple[tuple[int, ...], ...]
    tokens_computed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoringStatistics:
    """A backend's scoring counters, as a frozen snapshot (all calls together).

    Attributes:
        batches: forward batches run (prefix forwards not counted).
        rows: rows scored.
        tokens: ``sum(n_tokens)`` of the rows scored (the work with no sharing and no padding).
        tokens_computed: real token positions run through the model (prefixes included).
        tokens_reused: positions served from a shared or cached prefix.
        padded_positions: pad positions run (computed and discarded).
        prefix_forwards: forwards that extended a prefix state (per batch or from the cache).
        decodes: generation decodes run (one per greedy request, one per sample otherwise).
        generated_tokens: new tokens those decodes produced.
        generation_tokens_computed: token positions those decodes ran through the model.
        redone_alone: rows of a batched decode decoded again alone because a decision came
            close to another (a greedy top-2 margin or a sampled draw's distance to a CDF
            boundary below the backend's guard).
        groups_shared: prefix groups (per batch, its rows of one
            :attr:`ScoreRequest.prefix_group`: one per batch of a single conversation) scored
            on the prefix-sharing path.
        groups_plain: prefix groups scored on the plain path (one right-padded forward of
            whole rows); a batch scored plainly as a whole counts each of its groups.
        proxy_rows: proxy-game rows scored (:meth:`ScoringBackend.score_proxy`); the counters
            above count exact rows only, but ``prefix_forwards`` counts the proxy's shared KV too.
        proxy_tokens_computed: token positions the proxy rows ran (their tails, and each shared
            KV's positions not served from the prefix cache).
        proxy_tokens_reused: shared KV positions the proxy rows read instead of running them.
    """

    batches: int = 0
    rows: int = 0
    tokens: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    padded_positions: int = 0
    prefix_forwards: int = 0
    decodes: int = 0
    generated_tokens: int = 0
    generation_tokens_computed: int = 0
    redone_alone: int = 0
    groups_shared: int = 0
    groups_plain: int = 0
    proxy_rows: int = 0
    proxy_tokens_computed: int = 0
    proxy_tokens_reused: int = 0


def _check_batch(requests: Sequence[Any], results: Any, kind: type, item: str) -> None:
    """One ``kind`` result per request, in a sequence (``BatchFailed`` naming the ``item`` otherwise)."""
    if isinstance(results, (str, bytes)) or not isinstance(results, Sequence):
        raise BatchFailed(f"the backend returned {type(results).__name__}, not a sequence of results")
    if len(results) != len(requests):
        raise BatchFailed(f"the backend returned {len(results)} results for {len(requests)} {item}s")
    for i, res in enumerate(results):
        if not isinstance(res, kind):
            raise BatchFailed(f"{item} {i}: the backend returned {type(res).__name__}, not a {kind.__name__}")


def validate_results(requests: Sequence[ScoreRequest], results: Sequence[Any]) -> list[ScoreResult]:
    """Check a whole batch's outputs before any of them is used.

    Args:
        requests: the batch's rows.
        results: what the backend returned for them.

    Returns:
        ``results`` as a list.

    Raises:
        BatchFailed: not exactly one :class:`ScoreResult` per request, a row without exactly
            ``len(target_ids)`` log-probabilities, or a non-finite one.
    """
    _check_batch(requests, results, ScoreResult, "row")
    for i, (req, res) in enumerate(zip(requests, results, strict=True)):
        lp = np.asarray(res.token_logprobs)
        if lp.shape != (len(req.target_ids),):
            raise BatchFailed(
                f"row {i}: {lp.shape} log-probabilities for {len(req.target_ids)} target tokens"
            )
        if not (np.isfinite(lp).all() and np.isfinite(res.utility)):
            raise BatchFailed(f"row {i}: non-finite log-probabilities in a batch of {len(requests)} rows")
    return list(results)


def validate_generations(requests: Sequence[GenerateRequest], results: Sequence[Any]) -> list[GenerateResult]:
    """Check a whole generation batch's outputs before any of them is used.

    Args:
        requests: the batch's requests.
        results: what the backend returned for them.

    Returns:
        ``results`` as a list.

    Raises:
        BatchFailed: not exactly one :class:`GenerateResult` per request, a result without
            exactly ``n_samples`` samples, a sample that is not a tuple of at most
            ``max_new_tokens`` non-negative ints, different samples for a greedy request, or a
            negative ``tokens_computed``.
    """
    _check_batch(requests, results, GenerateResult, "request")
    for i, (req, res) in enumerate(zip(requests, results, strict=True)):
        samples = res.token_ids
        if not isinstance(samples, tuple) or len(samples) != req.n_samples:
            n = len(samples) if isinstance(samples, Sequence) else type(samples).__name__
            raise BatchFailed(f"request {i}: {n} samples for {req.n_samples} seeds")
        for s, ids in enumerate(samples):
            if not isinstance(ids, tuple) or len(ids) > req.max_new_tokens:
                n = len(ids) if isinstance(ids, Sequence) else type(ids).__name__
                raise BatchFailed(
                    f"request {i}, sample {s}: {n} tokens, not a tuple of at most {req.max_new_tokens} token ids"
                )
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise BatchFailed(f"request {i}, sample {s}: token ids must be non-negative ints")
        if req.greedy and any(ids != samples[0] for ids in samples):
            raise BatchFailed(f"request {i}: greedy samples differ")
        if isinstance(res.tokens_computed, bool) or not isinstance(res.tokens_computed, int) or res.tokens_computed < 0:
            raise BatchFailed(f"request {i}: tokens_computed must be an int >= 0, got {res.tokens_computed!r}")
    return list(results)


def _is_real(x: Any) -> bool:
    """Whether ``x`` is an int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@runtime_checkable
class ScoringBackend(Protocol):
    """Everything the engine, the runs layer and the Ray layer read from a backend.

    Nothing is read through ``getattr``: a backend has every member below.
    :class:`BackendBase` gives the defaults of the optional ones (fingerprint, batch size,
    statistics, lanes, notes, records, shutdown, single-prompt ``generate``), so a backend
    writes only its identity, ``score`` and ``generate_batch``. ``isinstance(b,
    ScoringBackend)`` checks that every member is present (:func:`check_backend` names the
    missing ones). The collator calls ``score`` / ``generate_batch`` from one worker thread at a
    time per lane; each backend translates its library's exceptions into
    :class:`~coalescence.errors.BackendError` subclasses. The contract every backend passes is
    ``tests/backends/test_contract.py``.

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
        supports_proxy: whether :meth:`score_proxy` scores the shared-KV proxy game (issue 37);
            False (the default of :class:`BackendBase`): it raises ``BackendError``.
        shutdown_with_engine: whether :meth:`Engine.close` (and a run that fails to start)
            calls :meth:`shutdown`: ``True`` for a backend that owns processes or a cluster the
            run started (Ray workers, an in-process vLLM engine).
        supports_proxy: whether :meth:`score_proxy` scores the shared-KV proxy game (a backend
            that cannot says ``False``, and a run there uses exact rows only).
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


class BackendBase:
    """Defaults for the optional members of :class:`ScoringBackend`; subclass it and write the
    identity (``model_id``, ``revision``, ``dtype``, ``tokenizer``, ``max_context``),
    :meth:`score` and :meth:`generate_batch`.

    The defaults: no fingerprint (``""``), :data:`DEFAULT_BATCH_SIZE` rows per call, no
    shutdown with the engine, no proxy game (``supports_proxy`` False, :meth:`score_proxy`
    raises), zero statistics, one lane (the backend itself), no notes, the class's name as its
    identity, no run record, a no-op :meth:`shutdown`, and :meth:`generate` as one greedy
    :meth:`generate_batch` request.
    """

    fingerprint: str = ""
    max_batch_size: int = DEFAULT_BATCH_SIZE
    pads_rows: bool = True
    shutdown_with_engine: bool = False
    supports_proxy: bool = False

    def score_proxy(self, requests: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """No proxy game here (``supports_proxy`` False): a backend that can overrides both.

        Raises:
            BackendError: always, naming the backend.
        """
        raise BackendError(
            f"the {type(self).__name__} backend has no proxy game (shared-KV rows need the transformers "
            "backend); run the exact game only (--proxy-game none)"
        )

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """One greedy :class:`GenerateRequest` through :meth:`generate_batch`.

        Raises:
            ConfigError: ``max_new_tokens`` < 1 or an empty prompt.
            BatchFailed: what :meth:`generate_batch` raises.
        """
        request = GenerateRequest(prompt_ids=tuple(prompt_ids), max_new_tokens=max_new_tokens)
        [result] = validate_generations([request], self.generate_batch([request]))  # type: ignore[attr-defined]
        return list(result.token_ids[0])

    def statistics(self) -> ScoringStatistics:
        """Zero counters (a backend that counts overrides this)."""
        return ScoringStatistics()

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
