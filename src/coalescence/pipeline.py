"""The scoring pipeline: one coalition from its mask to its outcome.

For each :class:`~coalescence.scheduler.scheduler.CoalitionJob` the scheduler does not serve from
the hot store or a flight in progress, :class:`ScoringPipeline` runs five steps:

1. **known?** a measurement of the same model evaluation (same evaluation key, e.g. under another
   utility or answer sub-span) is reduced with no model call (a cache hit);
2. **render** the coalition (:meth:`~ScoringPipeline.request`): the absence policy's messages,
   the chat template, the tokenizer: a :class:`~coalescence.backends.base.ScoreRequest` (prompt
   up to the answer, the answer's token ids) or a
   :class:`~coalescence.backends.base.GenerateRequest` (generation prompt, per-sample seeds);
3. **collate**: the request goes to the lock-leader
   :class:`~coalescence.scheduler.collator.Collator`, which batches compatible requests into one
   synchronous backend call (:class:`BackendCall`: validated as a whole batch, timed, numbered);
4. **decode** the result into a measurement (:meth:`~ScoringPipeline.decode`): ``[n_target]``
   float32 per-token log-probabilities (nats), or the generated texts;
5. **reduce** it to v(S) (:meth:`~ScoringPipeline.reduce`) under the utility, carrying the
   measurement to the archive.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
import numpy as np

from .backends.base import GenerateRequest, ProxyScoreRequest, ScoreRequest, validate_generations, validate_results
from .snapshot import ConversationSnapshot
from .errors import TemplateRefused
from .masking.policies import AbsencePolicy
from .masking.render import ChatRenderer, TargetTokens
from .preflight import refusal
from .scheduler.collator import Collator
from .scheduler.scheduler import CoalitionJob, EvalOutcome
from .utility import ResolvedUtility, item_seed

__all__ = ("BackendCall", "CoalitionRequest", "Measurement", "ScoringPipeline")

Measurement = Any
"""``[n_target]`` float32 per-token log-probabilities (nats), or a tuple of generated texts."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CoalitionRequest:
    """What a coalition job carries through the scheduler to the pipeline.

    Attributes:
        snapshot: the conversation and its players.
        policy: the absence policy.
        present: ``[n_players]`` bool, the coalition.
        evaluation_key: the key of its model evaluation (its measurement, whatever the reduction).
        game: ``"exact"`` (the coalition rendered and scored as it is), or the name of the
            shared-KV proxy game (:func:`~coalescence.engine.proxy_game_name`) whose row
            it is (the full conversation's KV, the tail's attention masked).
    """

    snapshot: ConversationSnapshot
    policy: AbsencePolicy
    present: np.ndarray  # [n_players] bool
    evaluation_key: str
    game: str = "exact"


class BackendCall:
    """The collator's synchronous function: one backend call for a batch of requests.

    The whole batch is validated before any result is used (row count, widths, finite values;
    batch keys keep scoring and generation apart). Each result comes back as ``(result,
    batch_size, batch_id, seconds)``: batch ids number the calls of the engine, seconds are the
    call's model time.

    Scoring rows are scored once per distinct token sequence (prompt and target) for as long as
    the call lives (the collator's: every evaluation in flight on a lane): coalitions that render
    to the same tokens (a player whose text repeats another's, one whose removal leaves the prompt
    as it was) get the first one's result bit for bit, with no model positions
    (``tokens_computed=0``). Scored apart, twins differ by float rounding (a few 1e-6 nats: another
    share of the row resumed from the prefix cache), which breaks the symmetry and null-player
    axioms exactly where they should hold exactly.

    Args:
        backend: the scoring backend.
        batch_ids: the source of batch ids (shared across an engine's calls).
    """

    def __init__(self, backend: Any, batch_ids: Iterator[int] | None = None) -> None:
        self.backend = backend
        self.batch_ids = batch_ids if batch_ids is not None else itertools.count()
        self._scored: dict[bytes, Any] = {}  # sequence digest -> its ScoreResult

    def __call__(self, prompts: list[Any], call_kwargs: dict[str, Any], row_kwargs: list[dict[str, Any]]) -> list[Any]:
        batch_id = next(self.batch_ids)
        t0 = time.perf_counter()
        if isinstance(prompts[0], GenerateRequest):
            results: list[Any] = validate_generations(prompts, self.backend.generate_batch(prompts))
        elif isinstance(prompts[0], ProxyScoreRequest):
            results = self._score(prompts, self.backend.score_proxy)
        else:
            results = self._score(prompts, self.backend.score)
        seconds = time.perf_counter() - t0
        return [(r, len(prompts), batch_id, seconds) for r in results]

    def _score(self, prompts: list[Any], score: Callable[[list[Any]], Any]) -> list[Any]:
        """Each distinct sequence (of the exact or the proxy game) scored once by ``score``: new
        ones in one backend call, repeats (in this batch or an earlier one) from the first's result."""
        keys = [_sequence_digest(p) for p in prompts]
        new: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key not in self._scored and key not in new:
                new[key] = i
        if new:
            rows = [prompts[i] for i in new.values()]
            for key, result in zip(new, validate_results(rows, score(rows)), strict=True):
                self._scored[key] = result
        firsts = set(new.values())
        return [
            self._scored[key]
            if i in firsts
            else replace(self._scored[key], tokens_computed=0, tokens_reused=prompts[i].n_tokens, padded_positions=0)
            for i, key in enumerate(keys)
        ]


def _call_kind(request: Any) -> str:
    """The batch key part that keeps scoring, proxy scoring and generation in separate calls."""
    if isinstance(request, GenerateRequest):
        return "generate"
    return "proxy" if isinstance(request, ProxyScoreRequest) else "score"


def _sequence_digest(request: ScoreRequest | ProxyScoreRequest) -> bytes:
    """A 32-byte BLAKE2b digest of a scoring row's prompt and target ids (the prompt's length
    included: the same tokens split elsewhere score other positions); a digest, not the tuples,
    so a long game's memo stays small."""
    h = hashlib.blake2b(digest_size=32)
    if isinstance(request, ProxyScoreRequest):  # another game: its tail start and hidden ranges are the row
        h.update(b"proxy")
        h.update(np.asarray([request.tail_start, *itertools.chain.from_iterable(request.hidden)], dtype=np.int64).tobytes())
    h.update(len(request.prompt_ids).to_bytes(8, "little"))
    h.update(np.asarray(request.prompt_ids + request.target_ids, dtype=np.int64).tobytes())
    return h.digest()


class ScoringPipeline:
    """One coalition job from mask to outcome (module docs); the scheduler's ``evaluate``.

    Args:
        backend: the scoring backend (its ``model_id`` keys the batches, its tokenizer decodes).
        renderer: the chat renderer.
        collator: the lock-leader collator in front of :class:`BackendCall`.
        target_tokens: ``(snapshot, policy) -> TargetTokens``, the scored answer tokens.
        resolved_utility: ``(snapshot, policy) -> ResolvedUtility``, the utility fixed for the answer.
        measurements: measurements by evaluation key: read for known evaluations, written with
            every new one.
        proxy_layout: ``(snapshot, policy) -> ProxyLayout``, the proxy game's layout of the full
            conversation (rows of a proxy game are requested from it); ``None`` when the engine
            plays no proxy game.
    """

    def __init__(
        self,
        *,
        backend: Any,
        renderer: ChatRenderer,
        collator: Collator,
        target_tokens: Callable[[ConversationSnapshot, AbsencePolicy], TargetTokens],
        resolved_utility: Callable[[ConversationSnapshot, AbsencePolicy], ResolvedUtility],
        measurements: dict[str, Measurement],
        proxy_layout: Callable[[ConversationSnapshot, AbsencePolicy], Any] | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.collator = collator
        self.target_tokens = target_tokens
        self.resolved_utility = resolved_utility
        self.measurements = measurements
        self.proxy_layout = proxy_layout

    def request(self, req: CoalitionRequest, resolved: ResolvedUtility) -> ScoreRequest | GenerateRequest | ProxyScoreRequest:
        """Render one coalition into a backend request.

        Returns:
            A :class:`ScoreRequest` (teacher-forced utilities: the prompt is the coalition's full
            rendering with the answer, cut where the answer's first scored token starts) or a
            :class:`GenerateRequest` (regenerate utilities: the generation prompt, one seed per
            sample from ``item_seed(seed, evaluation key, i)``), or for a row of the proxy game a
            :class:`ProxyScoreRequest` (the full prompt, the coalition's absent players hidden).

        Raises:
            TemplateRefused: the chat template refuses this coalition (naming it).
        """
        snapshot, policy, row = req.snapshot, req.policy, req.present
        if req.game != "exact":
            assert self.proxy_layout is not None, "a proxy row reached a pipeline without a proxy game"
            return self.proxy_layout(snapshot, policy).request(row, prefix_group=snapshot.snapshot_id)
        messages = policy.render(snapshot, row)
        try:
            if resolved.spec.teacher_forced:
                target = self.target_tokens(snapshot, policy)
                prompt_ids = tuple(self.renderer.encode(self.renderer.scoring_prompt(messages, target)))
                return ScoreRequest(prompt_ids=prompt_ids, target_ids=target.ids, prefix_group=snapshot.snapshot_id)
            prompt_ids = tuple(self.renderer.encode_prompt(messages))
        except TemplateRefused as exc:  # a coalition the preflight's subset did not hold
            raise refusal(snapshot, policy, row, messages, exc, during=True) from None
        gen = resolved.spec.generation
        assert gen is not None
        return GenerateRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=gen.max_new_tokens,
            temperature=float(gen.temperature),
            top_p=float(gen.top_p),
            seeds=tuple(item_seed(gen.seed, req.evaluation_key, i) for i in range(gen.num_samples)),
        )

    def decode(self, resolved: ResolvedUtility, result: Any) -> Measurement:
        """A backend result as a measurement: ``[n_target]`` float32 log-probabilities (nats), or
        each sample's text (decoded without special tokens, stripped)."""
        if resolved.spec.teacher_forced:
            return np.asarray(result.token_logprobs, dtype=np.float32)
        tokenizer = self.backend.tokenizer
        return tuple(tokenizer.decode(list(ids), skip_special_tokens=True).strip() for ids in result.token_ids)

    async def reduce(
        self, snapshot: ConversationSnapshot, resolved: ResolvedUtility, evaluation_key: str, measurement: Measurement, *, cache_hit: bool
    ) -> EvalOutcome:
        """v(S) reduced from a measurement, as an outcome that carries the measurement to the
        archive (similarity models run in a worker thread, off the event loop)."""
        if resolved.spec.teacher_forced:
            value = resolved.from_token_logprobs(measurement)
            return EvalOutcome(
                utility=value, cache_hit=cache_hit, batch_size=0 if cache_hit else 1,
                evaluation_key=evaluation_key, token_logprobs=measurement,
            )  # fmt: skip
        value = await anyio.to_thread.run_sync(resolved.from_generations, measurement, snapshot.target)
        return EvalOutcome(
            utility=value, cache_hit=cache_hit, batch_size=0 if cache_hit else 1,
            evaluation_key=evaluation_key, generated_texts=tuple(measurement),
        )  # fmt: skip

    async def __call__(self, job: CoalitionJob) -> EvalOutcome:
        req: CoalitionRequest = job.request
        resolved = self.resolved_utility(req.snapshot, req.policy)
        known = self.measurements.get(req.evaluation_key)
        if known is not None:  # the same evaluation under another utility: no model call
            return await self.reduce(req.snapshot, resolved, req.evaluation_key, known, cache_hit=True)
        request = self.request(req, resolved)
        result, batch_size, batch_id, seconds = await self.collator.submit(
            request,
            key_extra=(self.backend.model_id, _call_kind(request)),
            n_tokens=request.n_tokens,
            # a proxy row is counted by its tail, its shared KV once per call (scheduler.buckets)
            shared_tokens=request.shared_tokens if isinstance(request, ProxyScoreRequest) else 0,
        )
        measurement = self.decode(resolved, result)
        self.measurements[req.evaluation_key] = measurement
        outcome = await self.reduce(req.snapshot, resolved, req.evaluation_key, measurement, cache_hit=False)
        reused = int(getattr(result, "tokens_reused", 0))
        return replace(
            outcome,
            batch_size=batch_size,
            batch_id=batch_id,
            batch_seconds=seconds,
            kv_cache_hits=reused,
            tokens_computed=int(result.tokens_computed),
            tokens_reused=reused,
        )
