"""Prefix-split attention (coalescence.backends.attention) equals one softmax over all the keys,
written here in float64 from its definition, and scoring with it equals the plain path on tiny
Llama and Qwen2 models."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.models import build_model

import coalescence.backends.attention as attention
from coalescence.backends.attention import PrefixSplit, install, prefix_split_attention
from coalescence.backends.base import ScoreRequest
from coalescence.backends.hf import HFBackend


def softmax_attention(q, k, v, visible, scale):
    """softmax(q k^T * scale, over the visible keys) v, float64; key/value heads repeated for
    grouped-query attention. q [B, H, N, d], k/v [B, H_kv, K, d], visible bool [B, N, K] ->
    [B, N, H, d]."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhnd,bhkd->bhnk", q.double(), k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhnk,bhkd->bhnd", torch.softmax(scores, dim=-1), v).transpose(1, 2)


def random_tree(rng, n: int) -> np.ndarray:
    """visible[i, j]: node j is node i or one of its ancestors, in a random tree whose parents
    come before their children (a flattened trie)."""
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    visible = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parent[j]
    return visible


CASES = [  # batch, query heads, key/value heads, prefix keys, local keys (= queries), causal
    pytest.param(1, 4, 2, 40, 9, True, id="continuation-gqa"),
    pytest.param(3, 4, 2, 33, 7, True, id="padded-rows-gqa"),
    pytest.param(1, 6, 6, 50, 12, True, id="continuation-mha"),
    pytest.param(1, 9, 3, 64, 20, False, id="tree-gqa"),
    pytest.param(1, 4, 4, 30, 30, False, id="tree-as-long-as-its-prefix"),
]


@pytest.mark.parametrize(("b", "h", "h_kv", "p", "n", "causal"), CASES)
def test_the_split_equals_one_softmax_over_all_keys(b, h, h_kv, p, n, causal):
    rng = np.random.default_rng(p * n)
    gen = torch.Generator().manual_seed(p + n)
    d, scale = 16, 16**-0.5
    q = torch.randn(b, h, n, d, generator=gen) * 2
    k = torch.randn(b, h_kv, p + n, d, generator=gen) * 2
    v = torch.randn(b, h_kv, p + n, d, generator=gen)
    local = np.tril(np.ones((n, n), dtype=bool)) if causal else random_tree(rng, n)
    visible = torch.from_numpy(np.concatenate([np.ones((n, p), dtype=bool), local], axis=1))[None].expand(b, n, p + n)
    mask = None
    if not causal:  # the backend's tree mask: 0 where visible, the dtype's min elsewhere
        mask = torch.zeros(1, 1, n, p + n).masked_fill_(~visible[:1, None], torch.finfo(torch.float32).min)
    before = attention.split_calls
    out, _ = prefix_split_attention(
        SimpleNamespace(num_key_value_groups=h // h_kv), q, k, v, mask, scaling=scale, prefix_split=PrefixSplit(p, causal)
    )
    assert attention.split_calls == before + 1
    assert out.shape == (b, n, h, d) and out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), softmax_attention(q, k, v, visible, scale).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("p", "lengths", "block"), [(60, (8, 8, 8), 8), (60, (9, 5, 7), 0), (20, (9, 9, 9, 9), 9)])
def test_the_split_with_per_query_prefix_columns_equals_one_softmax(p, lengths, block):
    """Proxy rows side by side: each row hides some prefix keys and some of its own, a query may
    see none of its local keys (a hidden first position); block-diagonal local part as a batch."""
    rng = np.random.default_rng(p + sum(lengths))
    gen = torch.Generator().manual_seed(p)
    h, h_kv, d, scale = 6, 2, 16, 16**-0.5
    n = sum(lengths)
    q = torch.randn(1, h, n, d, generator=gen) * 2
    k = torch.randn(1, h_kv, p + n, d, generator=gen) * 2
    v = torch.randn(1, h_kv, p + n, d, generator=gen)
    visible = np.zeros((n, p + n), dtype=bool)
    at = 0
    for t in lengths:
        hidden = rng.random(p + t) < 0.3
        hidden[0] = False
        hidden[p] = True  # the row's first own position is hidden: its queries see it never
        visible[at : at + t, :p] = ~hidden[None, :p]
        visible[at : at + t, p + at : p + at + t] = np.tril(np.ones((t, t), dtype=bool)) & ~hidden[None, p:]
        at += t
    visible_t = torch.from_numpy(visible)
    mask = torch.zeros(1, 1, n, p + n).masked_fill_(~visible_t[None, None], torch.finfo(torch.float32).min)
    before = attention.split_calls
    out, _ = prefix_split_attention(
        SimpleNamespace(num_key_value_groups=h // h_kv), q, k, v, mask, scaling=scale,
        prefix_split=PrefixSplit(p, False, prefix_masked=True, block=block),
    )
    assert attention.split_calls == before + 1
    want = softmax_attention(q, k, v, visible_t[None], scale)
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_without_a_split_or_on_a_sliding_window_layer_it_is_sdpa_bit_for_bit():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = torch.randn(1, 4, 10, 8, generator=gen), torch.randn(1, 2, 15, 8, generator=gen), torch.randn(1, 2, 15, 8, generator=gen)
    mask = torch.zeros(1, 1, 10, 15)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    before = attention.split_calls
    # nothing cached, no local keys, or a tree longer than its prefix (10 nodes on 5 prefix keys)
    for split in (None, PrefixSplit(0, False), PrefixSplit(15, False), PrefixSplit(5, False)):
        got, _ = prefix_split_attention(module, q, k, v, mask, scaling=0.3, prefix_split=split)
        assert torch.equal(got, want)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=4)
    got, _ = prefix_split_attention(module, q, k, v, mask, scaling=0.3, prefix_split=PrefixSplit(5, False), sliding_window=4)
    assert torch.equal(got, want) and attention.split_calls == before


def tiny_qwen2(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def requests(seed: int) -> list[ScoreRequest]:
    """Rows behind a 60-token common prefix with short branches: the prefix is long against each
    suffix forward, as in a RAG game."""
    rng = np.random.default_rng(seed)

    def ids(n):
        return tuple(int(x) for x in rng.integers(5, 300, n))

    base, mid = ids(60), ids(6)
    return [
        ScoreRequest(prompt_ids=base + (mid if branch else ()) + ids(tail), target_ids=ids(t))
        for branch, tail, t in [(0, 3, 2), (1, 8, 4), (1, 0, 3), (0, 9, 1), (1, 5, 5), (0, 1, 2)]
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree_mask_limit", [2**22, 0], ids=["tree", "padded"])
def test_scoring_with_the_split_equals_the_plain_path(chatml_tokenizer, arch, tree_mask_limit):
    model = build_model(chatml_tokenizer, seed=4) if arch == "llama" else tiny_qwen2(chatml_tokenizer)
    plain = HFBackend(model, chatml_tokenizer, model_id="tiny", prefix_sharing=False)
    want = [plain.score([r])[0] for r in requests(1) + requests(2)]  # one row at a time, no cache
    shared = HFBackend(model, chatml_tokenizer, model_id="tiny", tree_mask_limit=tree_mask_limit, path="shared")
    assert shared.split_attention and model.config._attn_implementation == attention.NAME
    before = attention.split_calls
    got = shared.score(requests(1)) + shared.score(requests(2)[:3]) + shared.score(requests(2)[3:])
    assert attention.split_calls > before  # the split ran (later batches resume the cached prefix)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)
    # rows one at a time (what long rows' batches are split into): each one forward on its
    # longest cached prefix, the split on that prefix
    alone = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=1, tree_mask_limit=tree_mask_limit, path="shared")
    before = attention.split_calls
    got = alone.score(requests(1) + requests(2))
    assert attention.split_calls > before and alone.statistics().tokens_reused > 0
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)
    # every other call is sdpa's: the plain backend on the switched model gives its values again
    again = [plain.score([r])[0] for r in requests(1)]
    assert [r.utility for r in again] == [r.utility for r in want[:6]]


def test_it_is_not_installed_where_it_cannot_run(chatml_tokenizer):
    from transformers import LlamaForCausalLM

    model = build_model(chatml_tokenizer)
    eager = LlamaForCausalLM._from_config(model.config, attn_implementation="eager").eval()
    assert install(eager) is False and eager.config._attn_implementation == "eager"
    assert HFBackend(eager, chatml_tokenizer, model_id="tiny").split_attention is False
    off = build_model(chatml_tokenizer)
    assert HFBackend(off, chatml_tokenizer, model_id="tiny", split_attention=False).split_attention is False
    assert off.config._attn_implementation == "sdpa"
    assert HFBackend(off, chatml_tokenizer, model_id="tiny", prefix_sharing=False).split_attention is False


def sliding_models(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    gemma = Gemma3TextConfig(**common, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    return {"mistral": MistralForCausalLM(MistralConfig(**common, sliding_window=8)).eval(), "gemma3": Gemma3ForCausalLM(gemma).eval()}


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize("tree_mask_limit", [2**22, 0], ids=["tree", "padded"])
def test_a_sliding_window_model_scores_its_own_game(chatml_tokenizer, arch, tree_mask_limit):
    """A window of 8 tokens under rows of 36-42: each row's log-probabilities are those of one
    forward of the row through transformers (its own sliding-window masks), not of a row that sees
    the whole prefix; rows shorter than the window still share their prefix."""
    model = sliding_models(chatml_tokenizer)[arch]
    rng = np.random.default_rng(7)

    def ids(n):
        return tuple(int(x) for x in rng.integers(5, 300, n))

    base = ids(30)
    long_rows = [ScoreRequest(prompt_ids=base + ids(t), target_ids=ids(3)) for t in (2, 5, 9)]
    short = ids(3)
    short_rows = [ScoreRequest(prompt_ids=short + ids(t), target_ids=ids(1)) for t in (1, 2)]  # 5 and 6 tokens
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", tree_mask_limit=tree_mask_limit, path="shared")
    assert backend.sliding_window == 8
    with torch.no_grad():
        for r, got in zip(long_rows + short_rows, backend.score(long_rows) + backend.score(short_rows), strict=True):
            logits = model(input_ids=torch.tensor([r.prompt_ids + r.target_ids])).logits[0].double()
            p = len(r.prompt_ids)
            want = torch.log_softmax(logits[p - 1 : -1], dim=-1).gather(1, torch.tensor(r.target_ids)[:, None])[:, 0]
            np.testing.assert_allclose(got.token_logprobs, want.numpy(), atol=1e-4)
    assert backend.statistics().tokens_reused >= len(short)  # the short batch shared its prefix
