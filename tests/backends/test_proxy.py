"""The shared-KV proxy game on the transformers backend (issue 37), against an independent reference.

The reference is written here from the semantics of :class:`ProxyScoreRequest`: one plain forward
of ``prompt + target[:-1]`` through a second copy of the tiny model (same seed, eager attention),
with a hand-built 4-D mask (a query before ``tail_start`` sees every earlier key; a query in the
tail sees the earlier keys that are in no hidden range), log-softmax in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import build_model
from helpers.snapshots import LANDMARKS, conversation_of, render_for

from coalescence.backends import attention
from coalescence.backends.base import ProxyScoreRequest, ScoreRequest
from coalescence.backends.hf import HFBackend
from coalescence.backends.testing import FakeBackend
from coalescence.conversation import Conversation
from coalescence.errors import BackendError
from coalescence.masking.policies import DropPolicy
from coalescence.masking.proxy import TAIL_RULES, proxy_layout

ATOL = 1e-4  # nats, fp32


def reference(model, r: ProxyScoreRequest) -> np.ndarray:
    """``[n_target]`` log-probabilities from one plain forward with the semantics' 4-D mask."""
    seq = list(r.prompt_ids) + list(r.target_ids[:-1])
    n = len(seq)
    visible = np.ones(n, dtype=bool)
    for a, b in r.hidden:
        visible[a:b] = False
    allowed = np.tril(np.ones((n, n), dtype=bool))
    allowed[r.tail_start :] &= visible[None, :]
    mask = torch.zeros((1, 1, n, n))
    mask[0, 0][~torch.from_numpy(allowed)] = torch.finfo(torch.float32).min
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = len(r.prompt_ids)
    return np.array([logp[p - 1 + j, t].item() for j, t in enumerate(r.target_ids)])


def conversation() -> Conversation:
    return conversation_of(
        "Some facts: It is 330 m tall. It was designed by Gustave Eiffel's company. It was completed in 1889.\n\nWhen was it completed?",
        system=LANDMARKS,
    )


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def game(request):
    """A family's tokenizer, renderer, snapshot, target, backend model and reference model."""
    tokenizer, renderer, snapshot, target = render_for(request.param, conversation())
    model = build_model(tokenizer, seed=2)
    ref = build_model(tokenizer, seed=2)
    ref.set_attn_implementation("eager")
    return tokenizer, renderer, snapshot, target, model, ref


def coalitions(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    rows = [np.ones(n, dtype=bool), np.zeros(n, dtype=bool)] + [rng.random(n) < 0.5 for _ in range(6)]
    rows.append(np.arange(n) != n - 1)  # the question (last player) absent
    return rows


@pytest.mark.parametrize("split", [True, False], ids=["prefix-split", "dense-mask"])
def test_proxy_rows_equal_the_reference_batched_and_alone(game, split):
    tokenizer, renderer, snapshot, target, model, ref = game
    backend = HFBackend(model, tokenizer, model_id="tiny", split_attention=split)
    assert backend.supports_proxy and backend.split_attention == split
    before = attention.split_calls
    for rule in TAIL_RULES:  # last-turn: every player inside the tail, hidden there
        layout = proxy_layout(renderer, snapshot, target, tail=rule)
        requests = [layout.request(row) for row in coalitions(snapshot.n_players)]
        assert any(a >= layout.tail_start for r in requests for a, _ in r.hidden) == (rule == "last-turn")
        batched = backend.score_proxy(requests)
        alone = [backend.score_proxy([r])[0] for r in requests]
        for r, x, y in zip(requests, batched, alone, strict=True):
            expected = reference(ref, r)
            np.testing.assert_allclose(x.token_logprobs, expected, atol=ATOL)
            np.testing.assert_allclose(y.token_logprobs, expected, atol=ATOL)
            assert x.utility == pytest.approx(float(np.sum(x.token_logprobs, dtype=np.float64)))
        # the coalitions differ: masking changed the values
        assert np.ptp([x.utility for x in batched]) > 1e-3
    assert (attention.split_calls > before) == split


def test_full_coalition_equals_the_exact_game(game):
    tokenizer, renderer, snapshot, target, model, _ = game
    backend = HFBackend(model, tokenizer, model_id="tiny")
    ones = np.ones(snapshot.n_players, dtype=bool)
    exact_prompt = tuple(renderer.coalition_prompt(snapshot, DropPolicy(), ones, target))
    [exact] = backend.score([ScoreRequest(prompt_ids=exact_prompt, target_ids=target.ids)])
    for rule in TAIL_RULES:
        layout = proxy_layout(renderer, snapshot, target, tail=rule)
        assert layout.prompt_ids == exact_prompt
        [full] = backend.score_proxy([layout.request(ones)])
        np.testing.assert_allclose(full.token_logprobs, exact.token_logprobs, atol=ATOL)


def test_shared_kv_once_and_rows_of_unequal_length(game):
    tokenizer, renderer, snapshot, target, model, ref = game
    backend = HFBackend(model, tokenizer, model_id="tiny")
    layout = proxy_layout(renderer, snapshot, target, tail="after-last-player")
    rows = coalitions(snapshot.n_players)
    # a second answer on the same shared KV: rows of two tail lengths in one forward
    shorter = ProxyScoreRequest(
        prompt_ids=layout.prompt_ids, target_ids=layout.target_ids[:3], tail_start=layout.tail_start,
        hidden=layout.request(rows[2]).hidden,
    )
    requests = [layout.request(r) for r in rows[:4]] + [shorter]
    out = backend.score_proxy(requests)
    for r, x in zip(requests, out, strict=True):
        np.testing.assert_allclose(x.token_logprobs, reference(ref, r), atol=ATOL)
    stats = backend.statistics()
    assert stats.prefix_forwards == 1  # the shared KV ran once
    p = layout.tail_start
    # counts: each row its tail; the first row also the shared KV's positions
    assert [x.tokens_computed for x in out] == [r.n_tokens - 1 - p + (p if i == 0 else 0) for i, r in enumerate(requests)]
    assert [x.tokens_reused for x in out] == [0] + [p] * (len(out) - 1)
    assert stats.proxy_rows == len(out) and stats.proxy_tokens_computed == sum(x.tokens_computed for x in out)
    assert stats.rows == 0  # exact-game counters untouched
    again = backend.score_proxy(requests[:2])  # the shared KV from the prefix cache
    assert backend.statistics().prefix_forwards == 1
    assert [x.tokens_reused for x in again] == [p, p]
    np.testing.assert_allclose(again[1].token_logprobs, out[1].token_logprobs, atol=ATOL)
    # what a request says it shares and computes (the collator's batch accounting) is what ran
    assert [(r.shared_tokens, r.tail_tokens) for r in requests[:2]] == [(x.tokens_reused, x.tokens_computed) for x in again]


def test_rows_split_into_forwards_within_the_mask_limit(game):
    tokenizer, renderer, snapshot, target, model, ref = game
    layout = proxy_layout(renderer, snapshot, target, tail="answer")
    requests = [layout.request(r) for r in coalitions(snapshot.n_players)]
    t = requests[0].n_tokens - 1 - layout.tail_start
    # room for two rows per forward: N x (P + N) with N = 2T
    limit = 2 * t * (layout.tail_start + 2 * t)
    backend = HFBackend(model, tokenizer, model_id="tiny", tree_mask_limit=limit)
    calls = []
    original = backend._proxy_forward
    backend._proxy_forward = lambda rows, *a: calls.append(len(rows)) or original(rows, *a)
    out = backend.score_proxy(requests)
    assert calls == [2] * (len(requests) // 2) + [1] * (len(requests) % 2)
    for r, x in zip(requests, out, strict=True):
        np.testing.assert_allclose(x.token_logprobs, reference(ref, r), atol=ATOL)


def test_a_backend_without_the_proxy_game_refuses(chatml_tokenizer):
    backend = FakeBackend(chatml_tokenizer, supports_proxy=False)
    assert backend.supports_proxy is False
    request = ProxyScoreRequest(prompt_ids=(1, 2, 3), target_ids=(4,), tail_start=2)
    with pytest.raises(BackendError, match="FakeBackend backend has no proxy game"):
        backend.score_proxy([request])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_proxy_rows_on_cuda_equal_the_reference():
    """device='cuda': the block mask, ids and positions go to the model's device (dense-mask sdpa)."""
    tokenizer, renderer, snapshot, target = render_for("chatml", conversation())
    model = build_model(tokenizer, seed=2).to("cuda")
    ref = build_model(tokenizer, seed=2)
    ref.set_attn_implementation("eager")
    backend = HFBackend(model, tokenizer, model_id="tiny")
    assert backend.device.type == "cuda" and not backend.split_attention
    for rule in TAIL_RULES:
        layout = proxy_layout(renderer, snapshot, target, tail=rule)
        requests = [layout.request(row) for row in coalitions(snapshot.n_players)]
        for r, x in zip(requests, backend.score_proxy(requests), strict=True):
            np.testing.assert_allclose(x.token_logprobs, reference(ref, r), atol=ATOL)
