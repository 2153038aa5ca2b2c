"""The public fake backend: its games, injected failures, pause and shutdown, and generation
(the contract it shares with every backend is tests/backends/test_contract.py)."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked

from helpers.presence import additive_presence_game, eiffel

from coalescence.attribution.estimators import ExactShapley
from coalescence.backends.base import GenerateRequest, ScoreRequest
from coalescence.backends.testing import FakeBackend, hashed_game, presence_game
from coalescence.conversation import Conversation, Message
from coalescence.engine import Engine
from coalescence.errors import BatchFailed, ConfigError, EngineClosed
from coalescence.masking.policies import DropPolicy
from coalescence.scheduler.collator import Collator, scoring_backend


@pytest.mark.anyio
async def test_a_presence_game_gives_each_player_the_weight_of_the_tokens_only_it_holds(chatml_tokenizer, anyio_backend):
    snap = eiffel()
    engine, expected, n_target = additive_presence_game(chatml_tokenizer, snap)
    explanation = await engine.explain(snap, ExactShapley(), DropPolicy())
    np.testing.assert_allclose(explanation.values, expected, atol=1e-4)
    assert explanation.estimate.v_full == pytest.approx(-0.5 * n_target, abs=1e-5)


def test_the_hashed_game_depends_on_every_earlier_token_only():
    game = hashed_game(seed=1)
    base = game((1, 2, 3), (4, 5, 6))
    assert all(-4.01 <= x <= -0.01 for x in base)
    assert game((1, 2, 3), (4, 5, 6)) == base  # a function of the ids
    assert game((1, 2, 3), (4, 5)) == base[:2]  # a later token changes nothing before it (causal)
    assert game((1, 2, 3, 4), (5, 6)) == base[1:]  # where the prompt ends does not matter
    assert game((9, 2, 3), (4, 5, 6))[0] != base[0] and hashed_game(seed=2)((1, 2, 3), (4,))[0] != base[0]


def test_failures_injected_on_given_calls_and_by_a_poisoned_row(chatml_tokenizer):
    fake = FakeBackend(chatml_tokenizer, fail_calls={2}, poison=lambda ids: 99 in ids)
    row, bad = ScoreRequest(prompt_ids=(5, 6), target_ids=(7,)), ScoreRequest(prompt_ids=(5, 99), target_ids=(7,))
    first = fake.score([row])
    with pytest.raises(BatchFailed, match="call 2"):
        fake.score([row])
    assert fake.score([row])[0].utility == first[0].utility
    with pytest.raises(BatchFailed, match="row 1 poisons its batch of 2"):
        fake.score([row, bad])
    with pytest.raises(BatchFailed, match="poisons"):
        fake.generate_batch([GenerateRequest(prompt_ids=(99,), max_new_tokens=2)])
    assert fake.calls == [1, 1, 1, 2, 1]
    assert fake.statistics().rows == 2  # failed calls count nothing


@pytest.mark.anyio
async def test_a_poisoned_row_fails_alone_in_the_collator(chatml_tokenizer, anyio_backend):
    fake = FakeBackend(chatml_tokenizer, poison=lambda ids: 99 in ids)
    fake.pause()  # the first call waits, the rest queue behind it and form one batch
    collator = Collator(scoring_backend(fake), max_batch_size=8)
    reqs = [ScoreRequest(prompt_ids=(5, p), target_ids=(7, 8)) for p in (1, 2, 99, 3)]
    outcomes = {}

    async def one(i):
        try:
            outcomes[i] = (await collator.submit(reqs[i])).utility
        except BatchFailed as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        await anyio.to_thread.run_sync(fake.wait_for_call)
        for i in (1, 2, 3):
            tg.start_soon(one, i)
            await wait_all_tasks_blocked()
        fake.resume()
    assert fake.calls == [1, 3, 1, 1, 1]  # the batch, then each member alone, once
    assert isinstance(outcomes[2], BatchFailed)
    game = hashed_game()
    for i in (0, 1, 3):
        assert outcomes[i] == pytest.approx(sum(game(reqs[i].prompt_ids, reqs[i].target_ids)), abs=1e-5)


def test_shutdown_lets_the_held_call_finish_and_refuses_later_ones(chatml_tokenizer):
    fake = FakeBackend(chatml_tokenizer)
    fake.pause()
    out = []
    worker = threading.Thread(target=lambda: out.extend(fake.score([ScoreRequest(prompt_ids=(5,), target_ids=(6,))])))
    worker.start()
    assert fake.wait_for_call(10)
    fake.shutdown()
    fake.resume()
    worker.join(10)
    assert len(out) == 1 and out[0].token_logprobs.shape == (1,)
    with pytest.raises(EngineClosed):
        fake.score([ScoreRequest(prompt_ids=(5,), target_ids=(6,))])


def test_generation_replies_greedy_and_seeded(chatml_tokenizer):
    tok = chatml_tokenizer
    fake = FakeBackend(tok, replies=("Paris.", "Lisbon.", "London.", "Rome."))
    eos = tok.eos_token_id
    assert fake.generate([5, 6], max_new_tokens=50) == tok.encode("Paris.", add_special_tokens=False) + [eos]
    assert fake.generate([5, 6], max_new_tokens=1) == tok.encode("Paris.", add_special_tokens=False)[:1]
    req = GenerateRequest(prompt_ids=(5, 6), max_new_tokens=50, temperature=1.0, seeds=tuple(range(12)))
    mate = GenerateRequest(prompt_ids=(9,), max_new_tokens=3, temperature=0.5, seeds=(4,))
    [alone] = fake.generate_batch([req])
    _, with_mate = fake.generate_batch([mate, req])
    assert alone.token_ids == with_mate.token_ids  # a sample depends on its request and seed only
    texts = {tok.decode(ids, skip_special_tokens=True) for ids in alone.token_ids}
    assert texts <= {"Paris.", "Lisbon.", "London.", "Rome."} and len(texts) > 1
    # the engine generates a missing answer with the greedy reply
    snap = Engine(fake).prepare(Conversation(messages=(Message(role="user", content="Where?"),), target=None), unit="turn")
    assert snap.target == "Paris." and snap.conversation.target_source == "generated"


def test_bad_settings_name_their_field(chatml_tokenizer):
    for kwargs, field in (
        ({"max_context": 0}, "max_context"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"delay": -1}, "delay"),
        ({"replies": ()}, "replies"),
    ):
        with pytest.raises(ConfigError) as info:
            FakeBackend(chatml_tokenizer, **kwargs)
        assert info.value.field == field
    with pytest.raises(ConfigError, match="token 3") as info:
        presence_game({3: -1.0})
    assert info.value.field == "weights"
    with pytest.raises(ConfigError) as info:
        presence_game({}, base=0.5)
    assert info.value.field == "base"
