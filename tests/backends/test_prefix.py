"""Prefix-sharing scoring equals the plain path; the prefix cache, trie bound and batch validation."""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest
from helpers.models import build_model

from coalescence.archive import RunArchive, read_rows
from coalescence.backends.base import ScoreRequest, ScoreResult, validate_results
from coalescence.backends.hf import HFBackend
from coalescence.backends.prefix import PrefixCache, common_prefix_length, trie_nodes
from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.engine import Engine
from coalescence.errors import BatchFailed, ConfigError
from coalescence.masking.policies import DropPolicy


@pytest.fixture(scope="module")
def model(chatml_tokenizer):
    return build_model(chatml_tokenizer, seed=2)


def plain(model, tok, **kw) -> HFBackend:
    return HFBackend(model, tok, model_id="tiny", prefix_sharing=False, **kw)


def shared(model, tok, **kw) -> HFBackend:
    return HFBackend(model, tok, model_id="tiny", prefix_sharing=True, path="shared", **kw)


TREE = {"padded": 0, "tree": 2**22}
"""``tree_mask_limit`` values: suffixes right-padded on a repeated cache, or one tree-attention row."""


def ids(rng, n) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(5, 300, n))


def family(seed: int = 0) -> list[ScoreRequest]:
    """Rows sharing a 24-token prefix, then a branch point, with different lengths."""
    rng = np.random.default_rng(seed)
    base = ids(rng, 24)
    mid = ids(rng, 7)
    out = []
    for extra, tail, tgt in [(0, 3, 2), (1, 11, 4), (1, 0, 3), (0, 17, 1), (1, 5, 6), (0, 1, 2)]:
        prompt = base + (mid if extra else ()) + ids(rng, tail)
        out.append(ScoreRequest(prompt_ids=prompt, target_ids=ids(rng, tgt)))
    return out


def assert_same(a: list[ScoreResult], b: list[ScoreResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)
        assert abs(x.utility - y.utility) < 1e-4


def check_accounting(backend: HFBackend, reqs, results) -> None:
    for r, x in zip(reqs, results, strict=True):
        assert x.tokens_computed + x.tokens_reused == r.n_tokens
        assert x.tokens_computed >= 0 and x.tokens_reused >= 0 and x.padded_positions >= 0


@pytest.mark.parametrize("suffixes", list(TREE))
def test_rows_of_different_lengths_equal_plain_and_compute_less(model, chatml_tokenizer, suffixes):
    reqs = family()
    ref = plain(model, chatml_tokenizer, max_batch_size=len(reqs)).score(reqs)
    b = shared(model, chatml_tokenizer, max_batch_size=len(reqs), prefix_cache_bytes=0, tree_mask_limit=TREE[suffixes])
    got = b.score(reqs)
    assert_same(got, ref)
    check_accounting(b, reqs, got)
    stats = b.statistics()
    assert stats.prefix_forwards == 1
    assert stats.padded_positions == sum(x.padded_positions for x in got)
    if suffixes == "padded":
        # the 24-token common prefix (capped before the shortest prompt's last token) runs once
        assert stats.tokens_reused == 24 * (len(reqs) - 1)
        assert stats.tokens_computed == sum(r.n_tokens for r in reqs) - 24 * (len(reqs) - 1)
    else:  # every distinct prefix once: exactly the trie lower bound, no padding
        assert stats.tokens_computed == trie_nodes(r.prompt_ids + r.target_ids for r in reqs)
        assert stats.padded_positions == 0
    # one row at a time, cache off: no sharing at all, same values
    solo = shared(model, chatml_tokenizer, max_batch_size=1, prefix_cache_bytes=0)
    assert_same(solo.score(reqs), ref)
    assert solo.statistics().tokens_reused == 0


@pytest.mark.parametrize("suffixes", list(TREE))
def test_a_prompt_that_is_a_strict_token_prefix_of_another(model, chatml_tokenizer, suffixes):
    rng = np.random.default_rng(1)
    long_prompt = ids(rng, 30)
    reqs = [
        ScoreRequest(prompt_ids=long_prompt[:12], target_ids=long_prompt[12:15]),  # sequence inside the other
        ScoreRequest(prompt_ids=long_prompt, target_ids=ids(rng, 3)),
        ScoreRequest(prompt_ids=long_prompt[:12], target_ids=ids(rng, 4)),
    ]
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(reqs)
    for bs, cache in [(3, 0), (1, 2**20), (3, 2**20)]:
        b = shared(model, chatml_tokenizer, max_batch_size=bs, prefix_cache_bytes=cache, tree_mask_limit=TREE[suffixes])
        got = b.score(reqs)
        assert_same(got, ref)
        check_accounting(b, reqs, got)
        assert b.statistics().tokens_reused > 0


@pytest.mark.parametrize("suffixes", list(TREE))
def test_order_and_warm_cache_do_not_change_values(model, chatml_tokenizer, suffixes):
    a, b_, c = family(seed=4)[:3]
    ref = {r: x.utility for r, x in zip((a, b_, c), plain(model, chatml_tokenizer).score([a, b_, c]), strict=True)}
    backend = shared(model, chatml_tokenizer, max_batch_size=1)
    first = [backend.score([r])[0].utility for r in (a, b_, c)]
    assert backend.prefix_cache.statistics().hits >= 2  # B and C resumed from A's prefix
    again = [backend.score([r])[0].utility for r in (c, b_, a)]  # cache warm, reverse order
    for r, u in zip((a, b_, c), first, strict=True):
        assert abs(u - ref[r]) < 1e-4
    for r, u in zip((c, b_, a), again, strict=True):
        assert abs(u - ref[r]) < 1e-4
    batched = shared(model, chatml_tokenizer, max_batch_size=3, tree_mask_limit=TREE[suffixes])
    for order in itertools.permutations((a, b_, c)):
        for r, x in zip(order, batched.score(list(order)), strict=True):
            assert abs(x.utility - ref[r]) < 1e-4


@pytest.mark.parametrize("suffixes", list(TREE))
def test_cache_evicted_mid_run(model, chatml_tokenizer, suffixes):
    rng = np.random.default_rng(7)
    roots = [ids(rng, 40), ids(rng, 40), ids(rng, 40)]
    reqs = [
        ScoreRequest(prompt_ids=roots[(i // 2) % 3] + ids(rng, 1 + (i % 4)), target_ids=ids(rng, 2))
        for i in range(12)
    ]
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(reqs)
    probe = shared(model, chatml_tokenizer, max_batch_size=1, tree_mask_limit=0)  # stores one entry
    probe.score(reqs[:1])
    one_entry = probe.prefix_cache.statistics().bytes
    assert one_entry > 0
    backend = shared(
        model, chatml_tokenizer, max_batch_size=2, prefix_cache_bytes=int(1.5 * one_entry), tree_mask_limit=TREE[suffixes]
    )
    got = backend.score(reqs)
    assert_same(got, ref)
    check_accounting(backend, reqs, got)
    stats = backend.prefix_cache.statistics()
    # batches of 2 cycle through roots 0, 1, 2, 0, 1, 2: each root's entry is evicted before it returns
    assert stats.evictions >= 5 and stats.entries == 1 and stats.bytes <= 1.5 * one_entry
    assert backend.statistics().tokens_reused == 6 * 40


def test_plain_switch_and_bad_cache_bound(model, chatml_tokenizer):
    reqs = family(seed=9)
    b = plain(model, chatml_tokenizer, max_batch_size=3)
    got = b.score(reqs)
    assert all(x.tokens_reused == 0 and x.tokens_computed == r.n_tokens for r, x in zip(reqs, got, strict=True))
    assert b.statistics().padded_positions == sum(x.padded_positions for x in got) > 0
    with pytest.raises(ConfigError):
        HFBackend(model, chatml_tokenizer, model_id="tiny", prefix_cache_bytes=-1)
    with pytest.raises(ConfigError):
        HFBackend(model, chatml_tokenizer, model_id="tiny", tree_mask_limit=-1)


def test_prefix_cache_lru_and_longest_match():
    cache = PrefixCache(100)
    assert cache.put((1, 2, 3), "abc", 40)
    assert cache.put((1, 2, 9, 9), "ab99", 40)
    assert cache.longest((1, 2, 3, 4)) == ((1, 2, 3), "abc", 3)  # also marks (1,2,3) recent
    assert cache.longest((1, 2, 9)) == ((1, 2, 9, 9), "ab99", 3)
    assert cache.longest((7,)) == ((), None, 0)
    assert cache.put((5,), "five", 40)  # evicts the least recently used: (1, 2, 3)
    assert cache.longest((1, 2, 3)) == ((1, 2, 9, 9), "ab99", 2)
    assert not cache.put((6,), "big", 101)
    s = cache.statistics()
    assert s.entries == 2 and s.bytes == 80 and s.evictions == 1 and s.misses == 1
    with pytest.raises(ConfigError):
        PrefixCache(-5)


def test_trie_nodes_is_the_distinct_prefix_count():
    rng = np.random.default_rng(0)
    seqs = [tuple(int(x) for x in rng.integers(0, 3, int(rng.integers(1, 7)))) for _ in range(40)]
    brute = len({s[:k] for s in seqs for k in range(1, len(s) + 1)})
    assert trie_nodes(seqs) == brute
    assert trie_nodes([]) == 0
    assert common_prefix_length((1, 2, 3), (1, 2)) == 2


def test_validate_results_refuses_malformed_batches():
    reqs = [ScoreRequest(prompt_ids=(1,), target_ids=(2, 3)), ScoreRequest(prompt_ids=(1,), target_ids=(4,))]
    ok = [
        ScoreResult(token_logprobs=np.array([-1.0, -2.0], dtype=np.float32), utility=-3.0, tokens_computed=3),
        ScoreResult(token_logprobs=np.array([-1.0], dtype=np.float32), utility=-1.0, tokens_computed=2),
    ]
    assert validate_results(reqs, ok) == ok
    with pytest.raises(BatchFailed, match="1 results for 2 rows"):
        validate_results(reqs, ok[:1])
    with pytest.raises(BatchFailed, match="target tokens"):
        validate_results(reqs, [ok[1], ok[0]])  # wrong widths
    nan = ScoreResult(token_logprobs=np.array([np.nan], dtype=np.float32), utility=float("nan"), tokens_computed=2)
    with pytest.raises(BatchFailed, match="non-finite"):
        validate_results(reqs, [ok[0], nan])


def test_engine_archives_token_counts_and_kv_hits(tiny_backend, tmp_path):
    snap = ConversationSnapshot.build(
        Conversation(
            messages=(
                Message(role="system", content="You are a helpful assistant."),
                Message(role="user", content="The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. When?"),
            ),
            target="It was completed in 1889.",
        ),
        unit="sentence",
    )
    archive = RunArchive.create(tmp_path / "run", {"test": True})
    engine = Engine(tiny_backend, archive=archive, batch_size=4)
    masks = list(itertools.product([False, True], repeat=snap.n_players))
    got_masks, utilities = anyio.run(engine.evaluate, snap, DropPolicy(), [np.array(m) for m in masks])
    engine.close()
    assert [tuple(m) for m in got_masks.tolist()] == masks  # first-seen order kept
    rows = read_rows(tmp_path / "run")
    computed = rows["tokens_computed"].to_pylist()
    reused = rows["tokens_reused"].to_pylist()
    assert None not in computed and None not in reused
    assert sum(reused) > 0
    assert engine.statistics().kv_cache_hits == sum(reused)


def test_tree_rows_follow_a_cached_entry_past_the_batch_prefix(model, chatml_tokenizer):
    reqs = family(seed=11)  # rows 1, 2, 4 continue the 24-token base with the same 7 tokens
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(reqs)
    warm = shared(model, chatml_tokenizer, max_batch_size=8)
    warm.score([reqs[1], reqs[4]])  # caches base + those 7 tokens (and more)
    before = warm.statistics().tokens_computed
    got = warm.score(reqs)  # batch prefix: the 24-token base only
    assert_same(got, ref)
    check_accounting(warm, reqs, got)
    cold = shared(model, chatml_tokenizer, max_batch_size=8, prefix_cache_bytes=0)
    cold.score(reqs)
    # the warm run took the base and the shared tokens from the cached entry (all 7 but the last,
    # which row 2 scores from: a scored position's logits are always computed)
    assert cold.statistics().tokens_computed - (warm.statistics().tokens_computed - before) >= 24 + 6


@pytest.mark.parametrize("suffixes", list(TREE))
def test_a_batch_of_two_conversations_is_scored_group_by_group(model, chatml_tokenizer, suffixes):
    # two conversations' rows interleaved in one batch (as when several conversations are in
    # flight): each group's own prefix runs once and its suffixes form a tree of their own, so the
    # batch computes exactly what the two groups' batches compute apart, with the plain values
    first = [replace_group(r, "a") for r in family(0)]
    second = [replace_group(r, "b") for r in family(1)]
    mixed = [r for pair in itertools.zip_longest(first, second) for r in pair if r is not None]
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(mixed)
    b = shared(model, chatml_tokenizer, max_batch_size=len(mixed), prefix_cache_bytes=0, tree_mask_limit=TREE[suffixes])
    got = b.score(mixed)
    assert_same(got, ref)
    check_accounting(b, mixed, got)
    apart = shared(model, chatml_tokenizer, max_batch_size=len(first), prefix_cache_bytes=0, tree_mask_limit=TREE[suffixes])
    apart.score(first)
    apart.score(second)
    assert b.statistics().tokens_computed == apart.statistics().tokens_computed
    assert b.statistics().prefix_forwards == 2 and b.statistics().batches == 1
    if suffixes == "tree":  # the two families' tries, each once: the trie bound of the whole batch
        assert b.statistics().tokens_computed == trie_nodes(r.prompt_ids + r.target_ids for r in mixed)


def replace_group(request: ScoreRequest, group: str) -> ScoreRequest:
    return ScoreRequest(prompt_ids=request.prompt_ids, target_ids=request.target_ids, prefix_group=group)


def test_a_batch_too_big_for_one_tree_row_is_split_not_padded(model, chatml_tokenizer):
    # long rows: the suffix trie of the whole batch exceeds the mask limit, so the batch is scored
    # in halves (each its own longer common prefix and tree) instead of right-padded suffixes on a
    # repeated cache; the values stay the plain ones and nothing is padded
    reqs = family()
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(reqs)
    whole = trie_nodes(r.prompt_ids + r.target_ids for r in reqs) - 24  # the batch's suffix nodes
    limit = whole * (24 + whole) - 1  # one node too many for one tree row
    split = shared(model, chatml_tokenizer, max_batch_size=len(reqs), prefix_cache_bytes=2**24, tree_mask_limit=limit)
    padded = shared(model, chatml_tokenizer, max_batch_size=len(reqs), prefix_cache_bytes=2**24, tree_mask_limit=0)
    got = split.score(reqs)
    assert_same(got, ref)
    check_accounting(split, reqs, got)
    padded.score(reqs)
    assert split.statistics().padded_positions == 0 < padded.statistics().padded_positions
    assert split.statistics().batches == 1
    # the halves resume their prefixes from the cache: fewer positions run than padded suffixes
    assert split.statistics().tokens_computed < padded.statistics().tokens_computed


class ForwardCounter:
    """Counts the model's forward calls and the tokens each one ran (wraps ``model.forward``)."""

    def __init__(self, model) -> None:
        self.calls: list[int] = []
        self.model, self.inner = model, model.forward

        def forward(*args, **kwargs):
            self.calls.append(kwargs["input_ids"].shape[1])
            return self.inner(*args, **kwargs)

        model.forward = forward

    def close(self) -> None:
        self.model.forward = self.inner


@pytest.mark.parametrize("suffixes", list(TREE))
def test_a_row_alone_runs_in_one_forward_on_its_longest_cached_prefix(model, chatml_tokenizer, suffixes):
    # a batch of one row (what the halving of long rows' batches ends in) runs the rest of its
    # prompt and its target in one forward; the next row resumes from its prompt's states
    rng = np.random.default_rng(12)
    base = ids(rng, 30)
    a = ScoreRequest(prompt_ids=base + ids(rng, 9), target_ids=ids(rng, 4))
    b = ScoreRequest(prompt_ids=a.prompt_ids + ids(rng, 5), target_ids=ids(rng, 3))  # continues a's prompt
    c = ScoreRequest(prompt_ids=base + ids(rng, 2), target_ids=ids(rng, 2))  # leaves it after the base
    d = ScoreRequest(prompt_ids=a.prompt_ids, target_ids=ids(rng, 5))  # a's prompt, another target
    reqs = [a, b, c, d]
    ref = plain(model, chatml_tokenizer, max_batch_size=1).score(reqs)
    backend = shared(model, chatml_tokenizer, max_batch_size=1, tree_mask_limit=TREE[suffixes])
    counter = ForwardCounter(model)
    try:
        got = [backend.score([r])[0] for r in reqs]
    finally:
        counter.close()
    assert_same(got, ref)
    # the rule: a row reuses the longest prompt prefix cached before it, at most all of its prompt
    # but the last token (whose logits score the first target token), and computes the rest once
    seen: list[tuple[int, ...]] = []
    for r, x, ran in zip(reqs, got, counter.calls, strict=True):
        reuse = max((common_prefix_length(p, r.prompt_ids) for p in seen), default=0)
        reuse = min(reuse, len(r.prompt_ids) - 1)
        assert (x.tokens_reused, x.tokens_computed, ran) == (reuse, r.n_tokens - reuse, r.n_tokens - reuse)
        seen.append(r.prompt_ids)
    assert len(counter.calls) == len(reqs)  # one forward per row
    assert [x.tokens_reused for x in got] == [0, 39, 30, 38]


def test_a_cached_entry_is_untouched_by_the_rows_that_resume_from_it(model, chatml_tokenizer):
    # entries are forks sharing tensors with the forward that made them (no copies): whatever
    # later forwards do on top (extend, crop, repeat for padded suffixes, trees), the stored
    # states stay those of the entry's own tokens
    import torch

    reqs = family(seed=13)
    backend = shared(model, chatml_tokenizer, max_batch_size=1)
    backend.score(reqs[:1])
    (key,) = list(backend.prefix_cache._entries)
    state = backend.prefix_cache._entries[key][0]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in state.layers]
    for suffixes in TREE.values():
        backend.tree_mask_limit = suffixes
        backend.max_batch_size = 3
        backend.score(reqs[1:4])
        backend.max_batch_size = 1
        backend.score(reqs[4:])
    assert key in backend.prefix_cache._entries
    for layer, (k, v) in zip(state.layers, before, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    # and those states are the states of a forward of the entry's tokens alone
    with torch.no_grad():
        fresh = model(input_ids=torch.tensor([key]), use_cache=True).past_key_values
    for layer, (k, _) in zip(fresh.layers, before, strict=True):
        torch.testing.assert_close(layer.keys, k, atol=1e-5, rtol=0)


def test_a_fork_shares_dynamic_layers_and_deep_copies_any_other_kind(model):
    import torch
    from transformers import DynamicCache, StaticCache

    from coalescence.backends.hf import _fork

    with torch.no_grad():
        cache = model(input_ids=torch.tensor([list(range(5, 17))]), use_cache=True).past_key_values
    assert isinstance(cache, DynamicCache)
    fork = _fork(cache)
    assert fork is not cache and all(f is not c for f, c in zip(fork.layers, cache.layers, strict=True))
    assert all(f.keys.data_ptr() == c.keys.data_ptr() for f, c in zip(fork.layers, cache.layers, strict=True))
    keys = [layer.keys.clone() for layer in cache.layers]
    fork.crop(-4)
    with torch.no_grad():
        model(input_ids=torch.tensor([[40, 41, 42]]), position_ids=torch.tensor([[8, 9, 10]]), cache=fork, use_cache=True)
    fork.batch_repeat_interleave(3)
    assert fork.get_seq_length() == 11 and cache.get_seq_length() == 12
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys, strict=True))
    static = StaticCache(config=model.config, max_cache_len=16)
    copied = _fork(static)
    assert copied is not static and copied.layers[0] is not static.layers[0]
    assert type(copied.layers[0]) is type(static.layers[0])
