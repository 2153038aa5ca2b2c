"""The data of a backend call: the rows it takes (score, proxy and generate requests), what it
gives back (results), the checks a whole batch's results pass before any is used, and the
backend's counters (:class:`ScoringStatistics`). :mod:`coalescence.backends.base` re-exports them."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BatchFailed, ConfigError

__all__ = (
    "GenerateRequest",
    "GenerateResult",
    "ProxyScoreRequest",
    "ScoreRequest",
    "ScoreResult",
    "ScoringStatistics",
    "validate_generations",
    "validate_results",
)

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

    Semantics (what a backend computes; the tests' reference writes it out): the shared KV, the
    keys and values of ``prompt_ids[:shared_tokens]``, is computed once with every player present
    at the original positions. The rest, ``prompt_ids[shared_tokens:] + target_ids[:-1]``, runs
    causally on it with **positions compacted** as the exact game lays them out: a position p is
    placed at ``p - h(p)``, ``h(p)`` the hidden tokens before p, and each cached key at j is moved
    to ``j - h(j)`` (for RoPE, rotated by ``-h(j)``); a query at ``p >= tail_start`` sees key ``q``
    iff ``q <= p`` and ``q`` is in no ``hidden`` range, one at ``p < tail_start`` every key
    ``q <= p``. So a coalition whose absent players all follow its present ones in the shared KV
    scores as the exact game on the same tokens; elsewhere the visible keys still carry what the
    absent players wrote into them. The result is the :class:`ScoreResult` of the target read
    from that forward's logits (``token_logprobs`` ``[n_target]`` float32 nats).

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

    @property
    def shared_tokens(self) -> int:
        """The shared KV's length in tokens, ``min(tail_start, len(prompt_ids) - 1)``: the prompt
        positions computed once with every player present (cached, shared by every row of the
        conversation; the last prompt token always runs in the row, as it predicts the target)."""
        return min(self.tail_start, len(self.prompt_ids) - 1)

    @property
    def tail_tokens(self) -> int:
        """The positions the row computes itself, ``n_tokens - 1 - shared_tokens``: the prompt
        after the shared KV and the target but its last token (whose logits are never needed), as
        :attr:`~coalescence.masking.proxy.ProxyLayout.tail_tokens`."""
        return len(self.prompt_ids) + len(self.target_ids) - 1 - self.shared_tokens


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
