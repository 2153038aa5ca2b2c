"""The per-batch choice between prefix sharing and a plain batched forward (``path="auto"``).

Real tiny random Llama models; the rates are injected where a test checks a decision (so it does
not depend on this machine's timings), and measured by the real calibration where a test checks
the calibration itself.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers.models import build_model

from coalescence.backends.base import ScoreRequest
from coalescence.backends.cost import PathRates, forward_flops, model_shape
from coalescence.backends.hf import HFBackend
from coalescence.errors import ConfigError

EQUAL = PathRates(causal=((1e6, 1e9),), tree=((1e6, 1e9),))
"""Both kinds of forward at one rate: the choice is by the FLOPs of the forwards alone."""


@pytest.fixture(scope="module")
def model(chatml_tokenizer):
    return build_model(chatml_tokenizer, seed=3)


@pytest.fixture(scope="module")
def reference(model):
    """log p(target_j | prompt, target_<j) from one unpadded float64 forward of the row alone."""
    m64 = copy.deepcopy(model).double().eval()

    def logprobs(r: ScoreRequest) -> np.ndarray:
        with torch.no_grad():
            logits = m64(input_ids=torch.tensor([list(r.prompt_ids + r.target_ids)])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)[len(r.prompt_ids) - 1 : -1]
        return logp.gather(1, torch.tensor(r.target_ids)[:, None])[:, 0].numpy()

    return logprobs


def auto(model, tok, **kw) -> HFBackend:
    kw.setdefault("path_rates", EQUAL)
    return HFBackend(model, tok, model_id="tiny", path="auto", **kw)


def ids(rng, n) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(5, 300, n))


def no_common_prefix(seed: int = 0, rows: int = 6) -> list[ScoreRequest]:
    """Rows that share only their first token (a BOS) and differ from the second on."""
    rng = np.random.default_rng(seed)
    return [ScoreRequest(prompt_ids=(1, 5 + b) + ids(rng, 36), target_ids=ids(rng, 3)) for b in range(rows)]


def keep_half(seed: int = 0, rows: int = 16, players: int = 8) -> list[ScoreRequest]:
    """ContextCite's design on a conversation of ``players`` 10-token players after a 10-token
    header: each player kept with probability 1/2, so the first one is absent from about half the
    rows and the rows share little more than the header."""
    rng = np.random.default_rng(seed)
    header, question, target = ids(rng, 10), ids(rng, 5), ids(rng, 3)
    spans = [ids(rng, 10) for _ in range(players)]
    out = []
    for _ in range(rows):
        keep = rng.random(players) < 0.5
        body = tuple(t for k, span in zip(keep, spans, strict=True) if k for t in span)
        out.append(ScoreRequest(prompt_ids=header + body + question, target_ids=target))
    return out


def leave_one_out(seed: int = 0, players: int = 6) -> list[ScoreRequest]:
    """The full conversation and each player left out, after an 80-token system prompt."""
    rng = np.random.default_rng(seed)
    system, question, target = ids(rng, 80), ids(rng, 4), ids(rng, 3)
    spans = [ids(rng, 8) for _ in range(players)]
    out = []
    for left in [None, *range(players)]:
        body = tuple(t for i, span in enumerate(spans) if i != left for t in span)
        out.append(ScoreRequest(prompt_ids=system + body + question, target_ids=target))
    return out


def assert_reference(results, requests, reference) -> None:
    for r, x in zip(requests, results, strict=True):
        want = reference(r)
        np.testing.assert_allclose(x.token_logprobs, want, atol=1e-4)
        assert abs(x.utility - float(want.sum())) < 1e-4


@pytest.mark.parametrize("rows", ["no common prefix", "keep half"])
def test_rows_sharing_little_take_the_plain_path(model, chatml_tokenizer, reference, rows):
    reqs = no_common_prefix() if rows == "no common prefix" else keep_half()
    backend = auto(model, chatml_tokenizer, max_batch_size=len(reqs))
    got = backend.score(reqs)
    stats = backend.statistics()
    assert (stats.groups_plain, stats.groups_shared) == (1, 0)
    assert stats.tokens_reused == 0 and stats.prefix_forwards == 0
    assert_reference(got, reqs, reference)
    # the choice is the cost model's, not a shortcut: the shared path's forwards cost more FLOPs
    shape = model_shape(model)
    shared = sum(forward_flops(shape, t, p) for _, t, p in backend._shared_forwards(reqs, []))
    plain = sum(forward_flops(shape, t, p) for _, t, p in backend._plain_forwards(reqs))
    assert shared > plain


def test_a_leave_one_out_plan_takes_the_sharing_path(model, chatml_tokenizer, reference):
    reqs = leave_one_out()
    backend = auto(model, chatml_tokenizer, max_batch_size=len(reqs), prefix_cache_bytes=0)
    got = backend.score(reqs)
    stats = backend.statistics()
    assert (stats.groups_shared, stats.groups_plain) == (1, 0)
    assert stats.prefix_forwards == 1 and stats.tokens_reused >= 80 * (len(reqs) - 1)
    assert stats.padded_positions == 0  # one tree row
    assert_reference(got, reqs, reference)


def test_a_tree_row_costlier_per_flop_turns_the_choice(model, chatml_tokenizer):
    # the same leave-one-out batch, with tree forwards measured 100 times slower than causal ones
    slow_tree = PathRates(causal=((1e6, 1e9),), tree=((1e6, 1e7),))
    reqs = leave_one_out()
    backend = auto(model, chatml_tokenizer, max_batch_size=len(reqs), path_rates=slow_tree)
    backend.score(reqs)
    assert (backend.statistics().groups_shared, backend.statistics().groups_plain) == (0, 1)


@pytest.mark.parametrize("rates", ["equal", "measured"])
def test_auto_equals_the_plain_path_on_every_kind_of_batch(model, chatml_tokenizer, reference, rates):
    a, b, c = leave_one_out(seed=1), keep_half(seed=2, rows=8), no_common_prefix(seed=3, rows=4)
    mixed = [ScoreRequest(prompt_ids=r.prompt_ids, target_ids=r.target_ids, prefix_group=g)
             for g, part in (("loo", a[:4]), ("half", b[:4])) for r in part]  # fmt: skip
    batches = [a, b, c, mixed, a[:1]]
    kw = {"path_rates": EQUAL} if rates == "equal" else {"path_rates": None}
    backend = auto(model, chatml_tokenizer, max_batch_size=8, **kw)
    plain = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8, path="plain")
    for batch in batches:
        got, want = backend.score(batch), plain.score(batch)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4)
            assert abs(x.utility - y.utility) < 1e-4
        assert_reference(got, batch, reference)
    stats = backend.statistics()
    groups = sum(len({r.prefix_group for r in batch[i : i + 8]}) for batch in batches for i in range(0, len(batch), 8))
    assert stats.groups_shared + stats.groups_plain == groups
    if rates == "equal":
        assert stats.groups_shared >= 1 and stats.groups_plain >= 1  # both paths were compared
    assert plain.statistics().groups_plain == groups and plain.statistics().groups_shared == 0


def test_the_real_calibration_measures_positive_rates_and_touches_nothing(model, chatml_tokenizer, tmp_path):
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", fingerprint="f" * 64, calibration_dir=tmp_path)
    rates = backend.calibrate()
    assert len(rates.causal) == 2 and len(rates.tree) == 2
    assert all(f > 0 and r > 0 for f, r in rates.causal + rates.tree)
    assert backend.calibrate() is rates and backend.path_rates is rates  # measured once
    assert backend.statistics().batches == 0 and backend.statistics().tokens_computed == 0
    assert len(backend.prefix_cache) == 0 and backend.prefix_cache.statistics().hits == 0
    # kept on disk for this model and machine: another backend reads it instead of measuring
    (stored,) = tmp_path.glob("*.json")
    again = HFBackend(model, chatml_tokenizer, model_id="tiny", fingerprint="f" * 64, calibration_dir=tmp_path)
    assert again.calibrate() == rates
    other = HFBackend(model, chatml_tokenizer, model_id="tiny", fingerprint="e" * 64, calibration_dir=tmp_path)
    assert other.calibrate() != rates and len(list(tmp_path.glob("*.json"))) == 2
    stored.write_text("not json")  # a damaged file is measured again
    assert HFBackend(model, chatml_tokenizer, model_id="tiny", fingerprint="f" * 64, calibration_dir=tmp_path).calibrate()
    # a model built in memory (no fingerprint) keeps its rates in memory only
    HFBackend(model, chatml_tokenizer, model_id="tiny", calibration_dir=tmp_path / "none").calibrate()
    assert not (tmp_path / "none").exists()


def test_a_single_row_and_the_forced_paths_need_no_calibration(model, chatml_tokenizer):
    reqs = keep_half(seed=5, rows=4)
    one = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=1)
    one.score(reqs)
    assert one.path_rates is None and one.statistics().groups_shared == 4
    for kw, counts in (({"path": "shared"}, (1, 0)), ({"path": "plain"}, (0, 1)), ({"prefix_sharing": False}, (0, 1))):
        b = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4, **kw)
        b.score(reqs)
        assert b.path_rates is None
        assert (b.statistics().groups_shared, b.statistics().groups_plain) == counts


def test_bad_options_and_rates_are_refused(model, chatml_tokenizer):
    with pytest.raises(ConfigError, match="unknown path 'fast'"):
        HFBackend(model, chatml_tokenizer, model_id="tiny", path="fast")
    with pytest.raises(ConfigError):
        HFBackend(model, chatml_tokenizer, model_id="tiny", path_rates={"causal": [(1, 1)]})
    for bad in ((), ((1.0, 0.0),), ((float("nan"), 1.0),), "x"):
        with pytest.raises(ConfigError):
            PathRates(causal=bad, tree=((1.0, 1.0),))


def test_rates_interpolate_in_log_flops_and_clamp_outside():
    rates = PathRates(causal=((1e8, 4e9), (1e6, 1e9)), tree=((1e6, 2e9),))
    assert rates.causal == ((1e6, 1e9), (1e8, 4e9))  # sorted by size
    assert rates.rate("causal", 1e5) == 1e9 and rates.rate("causal", 1e9) == 4e9
    assert rates.rate("causal", 1e7) == pytest.approx(2.5e9)  # halfway in log(flops)
    assert rates.rate("tree", 1e12) == 2e9
    shape = (10.0, 2.0)  # 10 FLOPs a token, 2 a pair
    assert forward_flops(shape, 3, 5) == 40.0
    # seconds: the sum over forwards of flops / rate(flops)
    assert rates.seconds((1e5, 0.0), [("causal", 10, 0), ("tree", 10, 0)]) == pytest.approx(1e6 / 1e9 + 1e6 / 2e9)
    with pytest.raises(ConfigError):
        rates.rate("padded", 1.0)


def test_a_sliding_window_model_calibrates_within_its_window(chatml_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    config = MistralConfig(vocab_size=len(chatml_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           pad_token_id=chatml_tokenizer.pad_token_id, sliding_window=8)  # fmt: skip
    model = MistralForCausalLM(config).eval()
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8)
    rng = np.random.default_rng(2)
    base = ids(rng, 3)
    # 5 tokens each, their tree (3 prefix + 4 nodes) within the window too: a tree of rows shorter
    # than the window whose prefix and nodes are not fails in the cache gather (as before this change)
    rows = [ScoreRequest(prompt_ids=base + ids(rng, 1), target_ids=ids(rng, 1)) for _ in range(2)]
    got = backend.score(rows)
    with torch.no_grad():
        for r, x in zip(rows, got, strict=True):
            logits = model(input_ids=torch.tensor([r.prompt_ids + r.target_ids])).logits[0].double()
            want = torch.log_softmax(logits[len(r.prompt_ids) - 1 : -1], dim=-1).gather(1, torch.tensor(r.target_ids)[:, None])
            np.testing.assert_allclose(x.token_logprobs, want[:, 0].numpy(), atol=1e-4)
    rates = backend.path_rates  # measured for the choice, within the 8-token window: the plain batch only
    assert rates is not None and rates.tree == rates.causal and all(r > 0 for _, r in rates.causal)
    assert backend.statistics().groups_shared + backend.statistics().groups_plain == 1


@pytest.mark.parametrize("tree_mask_limit", [2**22, 4000, 0], ids=["tree", "halves", "padded"])
@pytest.mark.parametrize("cache", [0, 2**24], ids=["no cache", "cache"])
def test_the_estimated_forwards_are_the_positions_the_sharing_path_runs(model, chatml_tokenizer, tree_mask_limit, cache):
    reqs = leave_one_out(seed=4) + keep_half(seed=4, rows=5)
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=len(reqs), path="shared",
                        prefix_cache_bytes=cache, tree_mask_limit=tree_mask_limit)  # fmt: skip
    for batch in (reqs, reqs[::-1]):  # the second time on a warm cache
        estimated = sum(t for _, t, _ in backend._shared_forwards(batch, []))
        before = backend.statistics()
        backend.score(batch)
        after = backend.statistics()
        ran = after.tokens_computed + after.padded_positions - before.tokens_computed - before.padded_positions
        assert ran == estimated


def test_peek_finds_what_longest_finds_and_counts_nothing():
    from coalescence.backends.prefix import PrefixCache

    cache = PrefixCache(100)
    cache.put((1, 2, 3), "abc", 10)
    cache.put((1, 2, 9, 9), "ab99", 10)
    assert cache.peek((1, 2, 9, 4)) == ((1, 2, 9, 9), 3) and cache.peek((7,)) == ((), 0)
    s = cache.statistics()
    assert s.hits == 0 and s.misses == 0
    assert cache.longest((1, 2, 9, 4))[::2] == cache.peek((1, 2, 9, 4))
