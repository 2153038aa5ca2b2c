"""The backend contract: every backend passes this suite, through the real collator and engine
on real asyncio and trio event loops.

Each backend is a :class:`Subject` factory in :data:`SUBJECTS` (adding a backend is one entry):
given a template family's tokenizer and a tiny model, it returns the backend and the float64
reference its values must equal. A model-backed backend's reference is written here (a
transformers forward of the same weights in float64, log-softmax gathered at the target ids);
the fake backend's is its game's rule, written out again here.

The contract:

- it is a :class:`~coalescence.backends.base.ScoringBackend` (every member present);
- values equal the float64 reference within fp32 tolerance (1e-4 nats) on several chat-template
  families, through the engine and called directly, per token; batched as alone;
- twins score alike: the same row alone and twice in a batch; symmetric players get exactly
  equal values, each distinct token sequence reaching the backend once;
- a failed batch isolates the poisoned row (the collator's serial poison-isolation pass): only
  that row fails, its batch-mates get their reference values;
- closing the collator lets the in-flight call finish, serves what was queued, refuses the rest;
- max-context refusals happen before the model (nothing counted in the backend's statistics).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
import torch
from anyio import wait_all_tasks_blocked
from helpers.chat_templates import FAMILIES, Family, conversation
from helpers.family_models import CONTEXT, model_for, tokenizer_for
from helpers.vllm_engines import vllm_backend

from coalescence.archive import RunArchive, read_rows
from coalescence.attribution.estimators import ExactShapley
from coalescence.backends.base import (
    PROTOCOL_MEMBERS,
    ProxyScoreRequest,
    GenerateRequest,
    ScoreRequest,
    ScoringBackend,
    check_backend,
    run_record_of,
)
from coalescence.backends.hf import HFBackend
from coalescence.backends.testing import FakeBackend, presence_game
from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.engine import Engine
from coalescence.errors import BackendError, BatchFailed, ConfigError, EngineClosed, InputError
from coalescence.inputs import conversation_from_input
from coalescence.masking.policies import DropPolicy
from coalescence.pipeline import BackendCall
from coalescence.scheduler.collator import Collator, CollatorBackend

TOLERANCE = 1e-4
"""fp32 tolerance in nats (the project's batching invariant)."""

CONTRACT_FAMILIES = tuple(f for f in FAMILIES if f.name in ("chatml", "qwen3", "llama3", "llama2", "gemma"))


def float64_reference(model) -> Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray]:
    """log p(target_j | prompt, target_<j) from one unpadded float64 forward of ``model``'s weights."""
    m64 = copy.deepcopy(model).double().eval()

    def reference(prompt: tuple[int, ...], target: tuple[int, ...]) -> np.ndarray:
        ids = torch.tensor([list(prompt) + list(target)])
        with torch.no_grad():
            logits = m64(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(target)]
        return rows.gather(1, torch.tensor(target)[:, None])[:, 0].numpy()

    return reference


@dataclass
class Subject:
    """A backend under contract and the float64 reference of its per-token log-probabilities."""

    backend: ScoringBackend
    reference: Callable[[tuple[int, ...], tuple[int, ...]], np.ndarray]


def hf_subject(family: str, *, max_batch_size: int = 4) -> Subject:
    model, tok = model_for(family), tokenizer_for(family)
    return Subject(HFBackend(model, tok, model_id=f"tiny-{family}", max_batch_size=max_batch_size), float64_reference(model))


FAKE_BASE = -0.25


def fake_weight(token_id: int) -> float:
    return 0.05 * (1 + token_id % 5)


def fake_subject(family: str, *, max_batch_size: int = 4) -> Subject:
    tok = tokenizer_for(family)
    weights = {i: fake_weight(i) for i in range(len(tok))}
    backend = FakeBackend(
        tok, game=presence_game(weights, base=FAKE_BASE), model_id=f"fake-{family}", max_context=CONTEXT, max_batch_size=max_batch_size
    )

    def reference(prompt, target):  # the rule: each token id absent from the prompt costs its weight, per target token
        absent = set(range(len(tok))) - set(prompt)
        return np.full(len(target), FAKE_BASE - sum(fake_weight(i) for i in absent), dtype=np.float64)

    return Subject(backend, reference)


def vllm_subject(family: str, *, max_batch_size: int = 4) -> Subject:
    """The in-process vLLM backend on :func:`model_for`'s weights (one engine per family for the
    session; skipped without vLLM or for a family without an engine, see ``helpers.vllm_engines``)."""
    model = model_for(family)
    backend = vllm_backend(family, model, tokenizer_for(family))
    backend.max_batch_size = max_batch_size
    return Subject(backend, float64_reference(model))


SUBJECTS: dict[str, Callable[..., Subject]] = {"hf": hf_subject, "fake": fake_subject, "vllm": vllm_subject}
"""Every backend under contract: ``name -> factory(family, *, max_batch_size) -> Subject``; a
model-backed backend runs :func:`model_for` ``(family)``'s weights with :func:`tokenizer_for`
``(family)`` (a context of :data:`CONTEXT` tokens) and takes :func:`float64_reference` of them."""


@pytest.fixture(params=list(SUBJECTS))
def make(request) -> Callable[..., Subject]:
    return SUBJECTS[request.param]


def game_of(fam: Family) -> tuple[ConversationSnapshot, DropPolicy]:
    """The family's multi-turn chat (line breaks, a Markdown list) by turns; templates that enforce
    alternating roles keep a removed turn as an empty message (else they refuse the coalition)."""
    snap = ConversationSnapshot.build(conversation_from_input(conversation(fam)), unit="turn")
    return snap, DropPolicy(empty_turns="empty") if fam.alternates else DropPolicy()


def all_coalitions(n: int) -> list[np.ndarray]:
    return [np.array(bits, dtype=bool) for bits in itertools.product([True, False], repeat=n)]


def rows(n: int, vocab: int, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for prompt_len, target_len in [(5, 3), (17, 3), (1, 4), (30, 2), (9, 6), (2, 1), (12, 5)][:n]:
        out.append(
            ScoreRequest(
                prompt_ids=tuple(int(x) for x in rng.integers(5, vocab, prompt_len)),
                target_ids=tuple(int(x) for x in rng.integers(5, vocab, target_len)),
            )
        )
    return out


# ---- the protocol ----------------------------------------------------------------------------------


def test_every_backend_has_every_member_of_the_protocol(make):
    backend = make("chatml").backend
    assert isinstance(backend, ScoringBackend)
    check_backend(backend)
    assert {"fingerprint", "max_batch_size", "acquire_lane", "run_record", "shutdown", "statistics"} <= set(PROTOCOL_MEMBERS)
    assert {"supports_proxy", "score_proxy"} <= set(PROTOCOL_MEMBERS)
    # the proxy game (issue 37): the transformers backend has it, and the public fake plays one (its
    # proxy_game); every other one (vLLM, a server) says so and refuses
    from coalescence.backends.testing import FakeBackend

    assert isinstance(backend.supports_proxy, bool) and backend.supports_proxy == isinstance(backend, (HFBackend, FakeBackend))
    if not backend.supports_proxy:
        with pytest.raises(BackendError, match="no proxy game"):
            backend.score_proxy([ProxyScoreRequest(prompt_ids=(5, 6, 7), target_ids=(8,), tail_start=2)])
    # identity entering coalition keys is text; one lane is the backend itself
    assert all(isinstance(getattr(backend, name), str) for name in ("model_id", "revision", "dtype", "fingerprint"))
    assert backend.max_context == CONTEXT and backend.max_batch_size == 4
    lane = backend.acquire_lane("snapshot")
    assert isinstance(backend.lane(lane), ScoringBackend)
    backend.release_lane(lane)
    assert all(isinstance(note, str) for note in backend.run_notes())
    assert all(isinstance(note, str) for note in backend.run_notes("snapshot"))  # one conversation's notes
    assert not {"status", "statistics", "backend"} & set(run_record_of(backend))  # the run record's own keys stay its own
    # the engine that computes the values (recorded with each run) is the backend's name under contract
    identity = backend.identity()
    assert identity["backend"] == next(name for name, factory in SUBJECTS.items() if factory is make)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in identity.items())


def test_an_object_missing_members_is_refused_naming_them(chatml_tokenizer):
    class Partial:  # a user's backend written against an older protocol
        model_id, revision, dtype, tokenizer, max_context = "m", "", "float32", chatml_tokenizer, 64

        def score(self, requests):
            return []

    with pytest.raises(ConfigError) as info:
        Engine(Partial())
    assert info.value.field == "backend"
    for name in ("fingerprint", "max_batch_size", "generate_batch", "acquire_lane", "run_record", "shutdown"):
        assert name in str(info.value)
    assert "score" not in str(info.value).split("lacks")[1].split(";")[0].split(", ")


# ---- values --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("fam", CONTRACT_FAMILIES, ids=[f.name for f in CONTRACT_FAMILIES])
async def test_values_equal_the_float64_reference(make, fam, anyio_backend):
    subject = make(fam.name)
    backend = subject.backend
    snap, policy = game_of(fam)
    engine = Engine(backend, batch_size=3)
    target = engine.target_tokens(snap, policy)
    coalitions = all_coalitions(snap.n_players)
    masks, utilities = await engine.evaluate(snap, policy, coalitions)
    assert masks.shape == (2**snap.n_players, snap.n_players) and snap.n_players >= 3
    requests = []
    for row, utility in zip(masks, utilities, strict=True):
        prompt = tuple(engine.renderer.encode(engine.renderer.scoring_prompt(policy.render(snap, row), target)))
        requests.append(ScoreRequest(prompt_ids=prompt, target_ids=target.ids))
        assert abs(utility - subject.reference(prompt, target.ids).sum()) < TOLERANCE
    # called directly, in one call of every row: each token's log-probability
    for request, result in zip(requests, backend.score(requests), strict=True):
        assert result.token_logprobs.dtype == np.float32 and result.token_logprobs.shape == (len(target.ids),)
        np.testing.assert_allclose(result.token_logprobs, subject.reference(request.prompt_ids, request.target_ids), atol=TOLERANCE)
        assert result.tokens_computed + result.tokens_reused == request.n_tokens
        assert np.all(result.token_logprobs <= 0)


def test_batched_equals_one_at_a_time_and_the_reference(make):
    # rows of different lengths padded or packed together give what each gives alone
    reqs = rows(7, len(tokenizer_for("chatml")))
    batched, single = make("chatml", max_batch_size=len(reqs)), make("chatml", max_batch_size=1)
    for r, b, s in zip(reqs, batched.backend.score(reqs), single.backend.score(reqs), strict=True):
        ref = batched.reference(r.prompt_ids, r.target_ids)
        np.testing.assert_allclose(b.token_logprobs, ref, atol=TOLERANCE)
        np.testing.assert_allclose(s.token_logprobs, ref, atol=TOLERANCE)
        assert abs(b.utility - ref.sum()) < TOLERANCE and abs(b.utility - s.utility) < TOLERANCE
        assert b.tokens_computed + b.tokens_reused == r.n_tokens


def test_twin_rows_score_alike_alone_and_in_one_batch(make):
    subject = make("chatml", max_batch_size=8)
    a, b, c = rows(3, len(tokenizer_for("chatml")), seed=4)
    alone = subject.backend.score([a])[0]
    together = subject.backend.score([a, b, a, c, a])
    for twin in (together[0], together[2], together[4]):
        np.testing.assert_allclose(twin.token_logprobs, alone.token_logprobs, atol=1e-5)
        np.testing.assert_allclose(twin.token_logprobs, subject.reference(a.prompt_ids, a.target_ids), atol=TOLERANCE)


@pytest.mark.anyio
async def test_symmetric_players_get_exactly_equal_values(make, tmp_path, anyio_backend):
    # two identical sentences: dropping either renders the same prompt, so the symmetry axiom
    # says their Shapley values are equal, exactly. Scored apart (batch size 1: each row resumes
    # another share of its prompt from a prefix cache) twins can differ by float rounding; the
    # engine scores each distinct token sequence once, so they are equal bit for bit, and the
    # backend sees no sequence twice
    backend = make("chatml", max_batch_size=1).backend
    c = Conversation(
        messages=(
            Message(role="system", content="Be brief. Be brief."),
            Message(role="user", content="Paris is in France. Paris is in France. Where is Paris?"),
        ),
        target="In France.",
    )
    snap = ConversationSnapshot.build(c, unit="sentence")
    texts = [p.text for p in snap.players]
    assert texts.count("Be brief.") == 2 and texts.count("Paris is in France.") == 2
    n = snap.n_players
    archive = RunArchive.create(tmp_path / "run", {"test": True}, flush_rows=8)
    engine = Engine(backend, archive=archive, batch_size=1)
    target = engine.target_tokens(snap, DropPolicy())
    distinct = {
        tuple(engine.renderer.encode(engine.renderer.scoring_prompt(DropPolicy().render(snap, row), target)))
        for row in all_coalitions(n)
    }
    before = backend.statistics().rows
    explanation = await engine.explain(snap, ExactShapley(), DropPolicy())
    engine.close()
    values = explanation.values.tolist()
    for text in ("Be brief.", "Paris is in France."):
        i, j = (k for k, t in enumerate(texts) if t == text)
        assert values[i] == values[j]
    assert backend.statistics().rows - before == len(distinct) < 2**n
    archived = read_rows(tmp_path / "run")
    assert archived.num_rows == 2**n  # every coalition is still archived, repeats with no positions
    assert archived["tokens_computed"].to_pylist().count(0) == 2**n - len(distinct)


# ---- failures ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_failed_batch_isolates_the_poisoned_row(make, anyio_backend):
    # a row longer than the context fails every call it is in; the collator then runs each member
    # of the failed call alone, once: only that row fails
    subject = make("chatml", max_batch_size=8)
    good = rows(6, len(tokenizer_for("chatml")), seed=7)
    poisoned = ScoreRequest(prompt_ids=(5,) * CONTEXT, target_ids=(6,))
    submitted = good[:3] + [poisoned] + good[3:]
    collator = Collator(CollatorBackend(fn=BackendCall(subject.backend)), max_batch_size=8)
    outcomes: dict[int, tuple[str, object]] = {}

    async def one(i, request):
        try:
            outcomes[i] = ("ok", await collator.submit(request))
        except BatchFailed as exc:
            outcomes[i] = ("err", exc)

    async with anyio.create_task_group() as tg:
        for i, request in enumerate(submitted):
            tg.start_soon(one, i, request)
    kind, err = outcomes[3]
    assert kind == "err" and "context" in str(err)
    for i, request in enumerate(submitted):
        if i == 3:
            continue
        kind, (result, *_) = outcomes[i]
        assert kind == "ok"
        np.testing.assert_allclose(result.token_logprobs, subject.reference(request.prompt_ids, request.target_ids), atol=TOLERANCE)
    stats = collator.statistics()
    assert stats.failed_rows == 1 and stats.poison_reruns >= 1


@pytest.mark.anyio
async def test_close_lets_the_in_flight_call_finish(make, anyio_backend):
    subject = make("chatml", max_batch_size=64)
    backend = subject.backend
    vocab = len(tokenizer_for("chatml"))
    rng = np.random.default_rng(11)
    big = [
        ScoreRequest(prompt_ids=tuple(int(x) for x in rng.integers(5, vocab, 200)), target_ids=tuple(int(x) for x in rng.integers(5, vocab, 4)))
        for _ in range(16)
    ]
    [queued_row, late_row] = rows(2, vocab, seed=12)
    collator = Collator(CollatorBackend(fn=BackendCall(backend)), max_batch_size=64)
    outcomes: dict = {}

    async def one(name, request):
        outcomes[name] = await collator.submit(request)

    async with anyio.create_task_group() as tg:
        for i, request in enumerate(big):
            tg.start_soon(one, ("inflight", i), request)
        await wait_all_tasks_blocked()  # the leader has taken the batch into a worker thread
        tg.start_soon(one, "queued", queued_row)
        await wait_all_tasks_blocked()
        collator.close()
        with pytest.raises(EngineClosed):
            await collator.submit(late_row)
    for i, request in enumerate(big):
        result = outcomes[("inflight", i)][0]
        np.testing.assert_allclose(result.token_logprobs, subject.reference(request.prompt_ids, request.target_ids), atol=TOLERANCE)
    np.testing.assert_allclose(
        outcomes["queued"][0].token_logprobs, subject.reference(queued_row.prompt_ids, queued_row.target_ids), atol=TOLERANCE
    )
    assert collator.statistics().failed_rows == 0


def test_max_context_refusals_happen_before_the_model(make):
    backend = make("chatml").backend
    fits, too_long = rows(1, 50)[0], ScoreRequest(prompt_ids=(5,) * (CONTEXT - 1), target_ids=(6, 7))
    before = backend.statistics()
    with pytest.raises(BatchFailed, match=f"context of {CONTEXT}"):
        backend.score([fits, too_long])
    with pytest.raises(BatchFailed, match=f"context of {CONTEXT}"):
        backend.generate_batch([GenerateRequest(prompt_ids=(5,) * (CONTEXT - 3), max_new_tokens=4)])
    assert backend.statistics() == before  # nothing ran
    # a conversation too long for the context is refused by the engine before any backend call
    long = " ".join(["The tower is tall."] * 200)
    snap = ConversationSnapshot.build(Conversation(messages=(Message(role="user", content=long),), target="Yes."), unit="turn")
    with pytest.raises(InputError, match=f"context of {CONTEXT}") as info:
        Engine(backend).target_tokens(snap)
    assert info.value.field == "messages" and backend.statistics() == before
    # the longest sequence that fits is scored
    [edge] = backend.score([ScoreRequest(prompt_ids=(5,) * (CONTEXT - 2), target_ids=(6, 7))])
    assert edge.token_logprobs.shape == (2,)
