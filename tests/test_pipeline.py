"""The scoring pipeline on its own: render, collate, decode, reduce; known evaluations never reach
the model; the backend call validates whole batches. Real parts: the tiny tokenizer and Llama,
real collators on asyncio and trio."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.models import build_model
from helpers.snapshots import snapshot_of

from coalescence.backends.base import BackendBase, ScoreRequest, ScoreResult, ScoringBackend
from coalescence.backends.hf import HFBackend
from coalescence.snapshot import ConversationSnapshot
from coalescence.errors import BatchFailed
from coalescence.masking.codec import PackedMask
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer
from coalescence.pipeline import BackendCall, CoalitionRequest, ScoringPipeline
from coalescence.scheduler.collator import Collator, CollatorBackend
from coalescence.scheduler.scheduler import CoalitionJob
from coalescence.utility import UtilitySpec

ANSWER = "It was completed in 1889."


def snapshot() -> ConversationSnapshot:
    return snapshot_of("The Eiffel Tower was completed in 1889.\nWhen was the tower completed?", target=ANSWER)


def make(backend, calls=None):
    renderer = ChatRenderer(backend.tokenizer)
    policy = DropPolicy()
    snap = snapshot()
    target = renderer.target_tokens(snap, policy)
    resolved = UtilitySpec().resolve(snap.target, target.offsets)
    fn = BackendCall(backend)
    if calls is not None:
        inner = fn

        def fn(prompts, call_kwargs, row_kwargs):  # counts the real backend calls
            calls.append(len(prompts))
            return inner(prompts, call_kwargs, row_kwargs)

    collator = Collator(CollatorBackend(fn=fn), max_batch_size=4)
    measurements: dict = {}
    pipeline = ScoringPipeline(
        backend=backend,
        renderer=renderer,
        collator=collator,
        target_tokens=lambda s, p: target,
        resolved_utility=lambda s, p: resolved,
        measurements=measurements,
    )
    return pipeline, snap, policy, target, resolved, measurements


def job(snap, policy, row, key):
    return CoalitionJob(
        coalition_key=key, snapshot_id=snap.snapshot_id, mask=PackedMask.from_bools(row), absence_policy=policy.id,
        model_id="tiny", request=CoalitionRequest(snapshot=snap, policy=policy, present=row, evaluation_key=key),
    )  # fmt: skip


def test_the_request_is_the_template_rendering_cut_before_the_answer(tiny_backend):
    pipeline, snap, policy, target, resolved, _ = make(tiny_backend)
    tok = tiny_backend.tokenizer
    for bits in itertools.product([False, True], repeat=snap.n_players):
        row = np.array(bits)
        request = pipeline.request(CoalitionRequest(snapshot=snap, policy=policy, present=row, evaluation_key="k"), resolved)
        # reference: the template applied to the masked messages and the answer, cut at the answer
        messages = [m.as_dict() for m in policy.render(snap, row)] + [{"role": "assistant", "content": ANSWER}]
        full = tok.apply_chat_template(messages, tokenize=False)
        expected = tok(full[: full.rindex(ANSWER)], add_special_tokens=False).input_ids
        assert isinstance(request, ScoreRequest) and list(request.prompt_ids) == expected
        assert request.target_ids == target.ids


@pytest.mark.anyio
async def test_a_known_evaluation_never_reaches_the_model(tiny_backend, anyio_backend):
    calls: list[int] = []
    pipeline, snap, policy, target, resolved, measurements = make(tiny_backend, calls)
    row = np.ones(snap.n_players, dtype=bool)
    measurements["known"] = np.array([-1.5, -0.25] + [0.0] * (len(target.ids) - 2), dtype=np.float32)
    outcome = await pipeline(job(snap, policy, row, "known"))
    assert calls == [] and outcome.cache_hit and outcome.utility == pytest.approx(-1.75)
    fresh = await pipeline(job(snap, policy, row, "fresh"))
    assert calls == [1] and not fresh.cache_hit and fresh.batch_size == 1
    # decode + reduce: v(S) is the sum of the measured per-token log-probabilities (nats)
    assert fresh.utility == pytest.approx(float(np.sum(measurements["fresh"], dtype=np.float64)), abs=1e-6)
    assert len(measurements["fresh"]) == len(target.ids) and fresh.tokens_computed > 0


def test_the_backend_call_numbers_times_and_validates_whole_batches(chatml_tokenizer):
    class Short(BackendBase):  # a backend that returns one result too few: the whole batch is refused
        model_id, revision, dtype, tokenizer, max_context = "short", "", "float32", chatml_tokenizer, 64

        def score(self, requests):
            return [ScoreResult(utility=-1.0, token_logprobs=tuple(-1.0 for _ in r.target_ids), tokens_computed=1) for r in requests[1:]]

        def generate_batch(self, requests):
            raise BatchFailed("this test backend only scores")

    assert isinstance(Short(), ScoringBackend)

    ids = itertools.count(7)  # one engine's batch numbers, shared by its calls
    call = BackendCall(Short(), ids)
    requests = [ScoreRequest(prompt_ids=(1, 2), target_ids=(3,)), ScoreRequest(prompt_ids=(1,), target_ids=(3,))]
    with pytest.raises(BatchFailed):
        call(requests, {}, [{}, {}])
    backend = HFBackend(build_model(chatml_tokenizer), chatml_tokenizer, model_id="tiny")
    call = BackendCall(backend, ids)
    out = call(requests, {}, [{}, {}])
    assert [(size, batch) for _, size, batch, _ in out] == [(2, 8), (2, 8)]  # the 7 went to the refused batch
    assert all(seconds >= 0 for *_, seconds in out)
