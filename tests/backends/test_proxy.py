"""The shared-KV proxy game on the transformers backend (issue 37), against an independent reference.

The reference is written here from the semantics of :class:`ProxyScoreRequest`, through a second
copy of the tiny model (same seed, eager attention): one plain forward of the shared KV with every
player present; its keys moved to their compacted positions by a rotary rotation written out here
from RoPE's definition (pairs ``(x_f, x_{f + d/2})`` turned by ``-h(j) theta^(-2f/d)``, ``h(j)``
the hidden tokens before j); then the rest of ``prompt + target[:-1]`` at its compacted positions
under a hand-built 4-D mask (a query in the tail sees the earlier keys in no hidden range);
log-softmax in float64. A second check needs no reference at all: a coalition whose absent players
all follow its present ones scores as the exact game on the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import build_model
from helpers.proxy_reference import reference_at_original_positions
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


def _turned(keys: torch.Tensor, offsets: np.ndarray, theta: float) -> torch.Tensor:
    """``keys`` ``[1, H, J, d]`` each moved by ``offsets[j]`` positions: RoPE's rotation, written out."""
    d = keys.shape[-1]
    freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    angle = torch.from_numpy(offsets[:, None] * freq[None, :])  # [J, d/2]
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    x, y = keys[..., : d // 2], keys[..., d // 2 :]
    return torch.cat([x * cos - y * sin, y * cos + x * sin], dim=-1)


def reference(model, r: ProxyScoreRequest) -> np.ndarray:
    """``[n_target]`` log-probabilities of the semantics, computed as the module docs say."""
    from transformers import DynamicCache

    seq = list(r.prompt_ids) + list(r.target_ids[:-1])
    n, s = len(seq), r.shared_tokens
    hidden = np.zeros(n, dtype=bool)
    for a, b in r.hidden:
        hidden[a:b] = True
    before = np.cumsum(hidden) - hidden  # hidden tokens before each position
    theta = getattr(model.config, "rope_theta", None) or model.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        full = DynamicCache()
        model(input_ids=torch.tensor([seq[:s]]), position_ids=torch.arange(s)[None], cache=full, use_cache=True)
        moved = DynamicCache()
        for i, layer in enumerate(full.layers):
            moved.update(_turned(layer.keys, -before[:s].astype(np.float64), theta), layer.values, i)
        allowed = np.tril(np.ones((n, n), dtype=bool))[s:]  # queries s.. n-1
        tail = np.arange(s, n) >= r.tail_start
        allowed[tail] &= ~hidden[None, :]
        mask = torch.zeros((1, 1, n - s, n))
        mask[0, 0][~torch.from_numpy(allowed)] = torch.finfo(torch.float32).min
        positions = torch.from_numpy((np.arange(n) - before)[s:])[None]
        logits = model(input_ids=torch.tensor([seq[s:]]), attention_mask=mask, position_ids=positions, cache=moved, use_cache=True).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = len(r.prompt_ids)
    return np.array([logp[p - 1 - s + j, t].item() for j, t in enumerate(r.target_ids)])


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
    # on the CPU with the split the rows run side by side, each reading the prefix keys rotated to its
    # own positions inside the split attention; without it, as a batch with their own rotated keys
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


@pytest.mark.parametrize("split", [True, False], ids=["prefix-split", "batched"])
def test_rows_split_into_forwards_within_the_mask_limit(game, split):
    tokenizer, renderer, snapshot, target, model, ref = game
    layout = proxy_layout(renderer, snapshot, target, tail="answer")
    requests = [layout.request(r) for r in coalitions(snapshot.n_players)]
    total = requests[0].n_tokens - 1
    s = requests[0].shared_tokens
    t = total - s
    # room for two rows per forward: side by side the mask is N x (s + N) with N = 2T; as a batch 2 x T x (s + T)
    limit = 2 * t * (s + 2 * t) if split else 2 * t * total
    backend = HFBackend(model, tokenizer, model_id="tiny", tree_mask_limit=limit, split_attention=split)
    backend.parallel_forwards = False  # the calls as the mask limit cuts them (a call split per thread: the test below)
    calls = []
    name = "_proxy_forward_split" if split else "_proxy_forward_compact"
    original = getattr(backend, name)
    setattr(backend, name, lambda rows, *a: calls.append(len(rows)) or original(rows, *a))
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


def test_a_hidden_span_that_ends_at_the_tail_scores_as_the_exact_game(game):
    """No reference needed: when the hidden tokens are one span running up to the tail, every
    visible key was computed without them, so the compacted proxy row is the exact game on the
    prompt without that span (spans from each player's start to the tail; a player's own range
    alone is not enough: the separators after it are visible and saw it)."""
    tokenizer, renderer, snapshot, target, model, _ = game
    backend = HFBackend(model, tokenizer, model_id="tiny")
    layout = proxy_layout(renderer, snapshot, target, tail="after-last-player")
    starts = sorted({a for ranges in layout.player_ranges for a, _ in ranges if a < layout.tail_start})
    assert len(starts) >= 3
    contrast = []
    for a in starts:
        r = ProxyScoreRequest(
            prompt_ids=layout.prompt_ids, target_ids=layout.target_ids, tail_start=layout.tail_start,
            hidden=((a, layout.tail_start),),
        )
        kept = layout.prompt_ids[:a] + layout.prompt_ids[layout.tail_start :]
        [exact] = backend.score([ScoreRequest(prompt_ids=kept, target_ids=layout.target_ids)])
        [proxy] = backend.score_proxy([r])
        np.testing.assert_allclose(proxy.token_logprobs, exact.token_logprobs, atol=2e-5)  # fp32 rounding
        contrast.append(abs(exact.utility - reference_at_original_positions(model, r)))
    # at the full conversation's positions (the first proxy game) the long spans would not score so
    assert max(contrast) > 1e-4, contrast  # 4.8e-4 and 1.4e-3 on these tiny models (nearly position-blind at random init)


@pytest.mark.parametrize("mode", ["spans", "gather", "rotated-keys"])
def test_row_prefix_modes_equal_the_reference(game, mode, monkeypatch):
    """Each way of running a row's prefix on the CPU (``backends/row_prefix.py``: the queries turned
    per span of one offset, the visible keys gathered and turned; or each row's rotated copy of the
    keys) gives the reference's rows."""
    from coalescence.backends import row_prefix
    from coalescence.backends.hf import proxy

    tokenizer, renderer, snapshot, target, model, ref = game
    backend = HFBackend(model, tokenizer, model_id="tiny")
    monkeypatch.setattr(proxy, "SPAN_LIMIT", 10**6 if mode == "spans" else 0)
    monkeypatch.setattr(backend, "rotated_key_rows", mode == "rotated-keys")
    seen: list[str] = []
    run = row_prefix.row_prefix_attention

    def spy(query, key, value, rows, scaling, *by_position):
        seen.extend("gather" if r.gather else "spans" for r in rows)
        return run(query, key, value, rows, scaling, *by_position)

    monkeypatch.setattr(row_prefix, "row_prefix_attention", spy)
    from coalescence.backends import attention

    apart_keys: list[int] = []  # the key lengths the row-wise attention saw: the forward's own only
    rows_apart = attention._rows_apart

    def spy_apart(module, query, key, *rest):
        apart_keys.append(key.shape[-2] - query.shape[-2])
        return rows_apart(module, query, key, *rest)

    monkeypatch.setattr(attention, "_rows_apart", spy_apart)
    layout = proxy_layout(renderer, snapshot, target, tail="after-last-player")
    requests = [layout.request(row) for row in coalitions(snapshot.n_players)]
    for r, x in zip(requests, backend.score_proxy(requests), strict=True):
        np.testing.assert_allclose(x.token_logprobs, reference(ref, r), atol=ATOL)
    assert set(seen) == (set() if mode == "rotated-keys" else {mode})
    # row by row, the prefix is held apart: no layer concatenates the cached keys behind the forward's
    assert (not apart_keys) if mode == "rotated-keys" else (apart_keys and set(apart_keys) == {0})


@pytest.mark.parametrize("parallel", [True, False], ids=["forwards-side-by-side", "one-forward"])
def test_proxy_forwards_side_by_side_equal_the_reference(game, parallel, monkeypatch):
    """A call's rows split into one forward per thread, run at once in Python threads on one
    PyTorch thread each (``parallel_forwards``), give the reference's rows in the call's order,
    the shared prefix's computed tokens counted once; PyTorch's thread count is restored after."""
    import threading

    from coalescence.backends.hf.proxy import ProxyScoring

    tokenizer, renderer, snapshot, target, model, ref = game
    backend = HFBackend(model, tokenizer, model_id="tiny")
    monkeypatch.setattr(backend, "parallel_forwards", parallel)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    ran_in: list[tuple[str, int, int]] = []
    run = ProxyScoring._proxy_forward_split

    def spy(self, rows, cache, shared, computed_prefix, *apart):
        ran_in.append((threading.current_thread().name, len(rows), torch.get_num_threads()))
        return run(self, rows, cache, shared, computed_prefix, *apart)

    monkeypatch.setattr(ProxyScoring, "_proxy_forward_split", spy)
    try:
        layout = proxy_layout(renderer, snapshot, target, tail="after-last-player")
        requests = [layout.request(row) for row in coalitions(snapshot.n_players)]
        got = backend.score_proxy(requests)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads_before)
    for r, x in zip(requests, got, strict=True):
        np.testing.assert_allclose(x.token_logprobs, reference(ref, r), atol=ATOL)
    if parallel:  # two forwards of about half the rows each, each on one thread, off the caller's thread
        assert len(ran_in) == 2 and all(name.startswith("proxy-forward") and t == 1 for name, _, t in ran_in), ran_in
        assert sorted(n for _, n, _ in ran_in) == [len(requests) // 2, len(requests) - len(requests) // 2]
    else:
        assert len(ran_in) == 1 and ran_in[0][1] == len(requests) and ran_in[0][2] == 2, ran_in
    shared, t = requests[0].shared_tokens, requests[0].n_tokens - 1 - requests[0].shared_tokens
    assert all(x.tokens_computed + x.tokens_reused == shared + t for x in got)
    assert sum(x.tokens_computed for x in got) == len(got) * t + shared  # a fresh backend computes the prefix once
