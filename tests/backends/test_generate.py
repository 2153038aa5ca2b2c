"""Batched, per-item-seeded generation on a tiny random Llama: a row never depends on its batch-mates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import build_model

from coalescence.backends.base import GenerateRequest, GenerateResult, ScoreRequest, validate_generations
from coalescence.backends.hf import HFBackend
from coalescence.errors import BatchFailed, ConfigError

PROMPTS = [(5, 9, 11, 40), (7, 30, 2, 61, 99, 12, 8, 150, 33), (44,)]


@pytest.fixture(scope="module")
def model(chatml_tokenizer):
    return build_model(chatml_tokenizer, seed=2)


@pytest.fixture()
def backend(model, chatml_tokenizer):
    return HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4)


def hf_generate(model, prompt, max_new_tokens, pad_token_id, **kwargs):
    """The library's own ``generate`` on one prompt alone; the new token ids."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, **kwargs
        )
    return tuple(out[0, ids.shape[1] :].tolist())


def reference_sample(model, prompt, max_new_tokens, eos, *, seed, temperature, top_p, top_k=None):
    """The documented sampler, written out without KV cache, batching or ``generate``: per step
    ``softmax(top_p(logits / T))``, one uniform draw from a generator seeded by ``seed``, the first
    token whose cumulative probability exceeds it; stops at ``eos`` (kept)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1].float()  # [1, V]
        warped = logits / temperature
        if top_k is not None:
            warped = TopKLogitsWarper(top_k=top_k)(None, warped)
        if top_p < 1:
            warped = TopPLogitsWarper(top_p=top_p)(None, warped)
        cdf = torch.softmax(warped, dim=-1).cumsum(-1)[0]
        cdf = cdf / cdf[-1]
        u = torch.rand(1, generator=g)
        token = int(torch.searchsorted(cdf, u, right=True).clamp(max=len(cdf) - 1))
        ids.append(token)
        new.append(token)
        if token in eos:
            break
    return tuple(new)


def test_greedy_batch_equals_generate_on_each_prompt_alone(model, backend):
    reqs = [
        GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=8),
        GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=5, seeds=(3, 1, 4)),
        GenerateRequest(prompt_ids=PROMPTS[2], max_new_tokens=12),
    ]
    results = backend.generate_batch(reqs)
    assert len(results) == 3
    for r, res in zip(reqs, results, strict=True):
        ref = hf_generate(model, r.prompt_ids, r.max_new_tokens, backend.pad_token_id, do_sample=False)
        assert res.token_ids == (ref,) * r.n_samples
        # one decode per greedy request: the prompt, then every new token but the last
        assert res.tokens_computed == len(r.prompt_ids) + len(ref) - 1
    assert results[0].token_ids[0] != results[2].token_ids[0][:8]
    assert backend.generate(PROMPTS[0], max_new_tokens=8) == list(results[0].token_ids[0])
    stats = backend.statistics()
    assert stats.decodes == 4
    assert stats.generated_tokens == sum(len(x.token_ids[0]) for x in results) + len(results[0].token_ids[0])
    assert stats.generation_tokens_computed == sum(x.tokens_computed for x in results) + len(PROMPTS[0]) + 7


def test_sampled_row_is_the_same_alone_beside_neighbours_and_after_reseeding(model, backend):
    row = GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=16, temperature=1.5, top_p=0.9, seeds=(123,))
    alone = backend.generate_batch([row])[0].token_ids[0]
    ref = reference_sample(model, PROMPTS[0], 16, backend.eos_token_ids, seed=123, temperature=1.5, top_p=0.9)
    assert alone == ref
    seeded_mate = GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=16, temperature=1.5, top_p=0.9, seeds=(7,))
    greedy_mate = GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=16)
    same_prompt_mate = GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=16, temperature=1.5, top_p=0.9, seeds=(8,))
    assert backend.generate_batch([seeded_mate, row])[1].token_ids[0] == alone
    assert backend.generate_batch([row, greedy_mate, same_prompt_mate])[0].token_ids[0] == alone
    torch.manual_seed(999)
    torch.rand(1234)  # advance the global RNG arbitrarily
    assert backend.generate_batch([row])[0].token_ids[0] == alone
    # the seed belongs to the sample, not to its index: seed 123 as a second sample gives the same text
    two = GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=16, temperature=1.5, top_p=0.9, seeds=(5, 123))
    res = backend.generate_batch([two])[0]
    assert res.token_ids[1] == alone and res.token_ids[0] != alone
    assert res.tokens_computed == sum(len(PROMPTS[0]) + len(ids) - 1 for ids in res.token_ids)


def test_generate_batch_leaves_the_global_rng_state_alone(backend):
    torch.manual_seed(31)
    before = torch.get_rng_state()
    reqs = [
        GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=6, temperature=1.0, seeds=(1, 2, 3)),
        GenerateRequest(prompt_ids=PROMPTS[2], max_new_tokens=6),
    ]
    backend.generate_batch(reqs)
    assert torch.equal(torch.get_rng_state(), before)
    expected_next = torch.rand(4)
    torch.set_rng_state(before)
    assert torch.equal(torch.rand(4), expected_next)


def test_only_temperature_and_top_p_truncate(model, backend):
    """The model's generation defaults (e.g. top_k=50) never apply: the samples are the documented sampler's."""
    seeds = (0, 1, 2, 3)
    req = GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=16, temperature=2.0, seeds=seeds)
    got = backend.generate_batch([req])[0].token_ids
    eos = backend.eos_token_ids
    assert got == tuple(reference_sample(model, PROMPTS[1], 16, eos, seed=s, temperature=2.0, top_p=1.0) for s in seeds)
    top50 = tuple(reference_sample(model, PROMPTS[1], 16, eos, seed=s, temperature=2.0, top_p=1.0, top_k=50) for s in seeds)
    assert got != top50


def test_different_seeds_give_different_samples(backend):
    seeds = (0, 1, 2, 3, 2**63 - 1)
    req = GenerateRequest(prompt_ids=PROMPTS[2], max_new_tokens=16, temperature=2.0, seeds=seeds)
    samples = backend.generate_batch([req])[0].token_ids
    assert len(samples) == len(seeds)
    assert len(set(samples)) == len(seeds)
    # and the same seeds again give the same samples
    assert backend.generate_batch([req])[0].token_ids == samples


def test_a_one_token_nucleus_is_greedy(backend):
    greedy = backend.generate_batch([GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=10)])[0].token_ids[0]
    tiny = GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=10, temperature=1.0, top_p=1e-6, seeds=(1, 2, 3))
    assert backend.generate_batch([tiny])[0].token_ids == (greedy,) * 3
    wide = GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=10, temperature=1.0, top_p=1.0, seeds=(1, 2, 3))
    assert backend.generate_batch([wide])[0].token_ids != (greedy,) * 3


def test_every_decode_stops_at_the_generation_config_eos(chatml_tokenizer):
    model = build_model(chatml_tokenizer, seed=2)
    free = HFBackend(model, chatml_tokenizer, model_id="tiny").generate(PROMPTS[0], max_new_tokens=8)
    stop = free[3]
    model.generation_config.eos_token_id = [stop]
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny")
    assert backend.eos_token_ids == (stop, chatml_tokenizer.eos_token_id)
    expected = tuple(free[: free.index(stop) + 1])
    assert len(expected) < 8 and expected[-1] == stop
    greedy, nucleus = backend.generate_batch(
        [
            GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=8, seeds=(0, 1)),
            GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=8, temperature=1.0, top_p=1e-6, seeds=(9,)),
        ]
    )
    assert greedy.token_ids == (expected, expected)
    assert nucleus.token_ids == (expected,)
    assert greedy.tokens_computed == len(PROMPTS[0]) + len(expected) - 1
    assert backend.generate(PROMPTS[0], max_new_tokens=8) == list(expected)


def test_generation_counters_do_not_reset_scoring_counters(backend):
    backend.score([ScoreRequest(prompt_ids=PROMPTS[0], target_ids=(3, 4))])
    backend.generate_batch([GenerateRequest(prompt_ids=PROMPTS[2], max_new_tokens=3)])
    backend.score([ScoreRequest(prompt_ids=PROMPTS[1], target_ids=(5,))])
    stats = backend.statistics()
    assert stats.batches == 2 and stats.rows == 2
    assert stats.decodes == 1 and stats.generated_tokens == 3 and stats.generation_tokens_computed == 1 + 2


def test_too_long_and_model_errors_are_batch_failed(backend, chatml_tokenizer):
    with pytest.raises(BatchFailed, match="context of 512"):
        backend.generate_batch([GenerateRequest(prompt_ids=(5,) * 500, max_new_tokens=13)])
    out_of_vocab = GenerateRequest(prompt_ids=(5, len(chatml_tokenizer) + 10), max_new_tokens=2, temperature=1.0)
    with pytest.raises(BatchFailed, match="request 1 of a batch of 2") as info:
        backend.generate_batch([GenerateRequest(prompt_ids=(5,), max_new_tokens=1), out_of_vocab])
    assert isinstance(info.value.__cause__, IndexError)  # the embedding lookup of an id past the vocabulary
    assert backend.generate_batch([]) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seeds": ()}, "num_samples"),
        ({"seeds": (-1,)}, "seeds"),
        ({"seeds": (2**63,)}, "seeds"),
        ({"seeds": (1.5,)}, "seeds"),
        ({"seeds": (True,)}, "seeds"),
        ({"prompt_ids": ()}, "prompt_ids"),
    ],
)
def test_bad_requests_are_config_errors(kwargs, field):
    args = {"prompt_ids": (5, 6), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError) as info:
        GenerateRequest(**args)
    assert info.value.field == field


def test_request_fields_are_normalised():
    req = GenerateRequest(prompt_ids=[5, 6, 7], max_new_tokens=4, temperature=1, top_p=1, seeds=[np.int64(3), 9])
    assert req.prompt_ids == (5, 6, 7) and req.seeds == (3, 9) and type(req.seeds[0]) is int
    assert req.temperature == 1.0 and isinstance(req.temperature, float) and not req.greedy
    assert req.n_samples == 2 and req.n_tokens == 7
    assert GenerateRequest(prompt_ids=(1,), max_new_tokens=1).greedy
    assert hash(req) == hash(GenerateRequest(prompt_ids=(5, 6, 7), max_new_tokens=4, temperature=1.0, seeds=(3, 9)))


def test_validate_generations_rejects_malformed_results():
    greedy = GenerateRequest(prompt_ids=(5,), max_new_tokens=3, seeds=(0, 1))
    sampled = GenerateRequest(prompt_ids=(5,), max_new_tokens=3, temperature=1.0, seeds=(0, 1))
    ok = GenerateResult(token_ids=((1, 2), (1, 2)), tokens_computed=2)
    assert validate_generations([greedy], (ok,)) == [ok]
    assert validate_generations([sampled], [GenerateResult(token_ids=((1,), (2, 3)), tokens_computed=3)])
    bad = [
        ([greedy], [ok, ok], "2 results for 1"),
        ([greedy], "ab", "not a sequence"),
        ([greedy], [object()], "not a GenerateResult"),
        ([greedy], [GenerateResult(token_ids=((1, 2),), tokens_computed=2)], "1 samples for 2 seeds"),
        ([greedy], [GenerateResult(token_ids=((1, 2), (1, 3)), tokens_computed=2)], "greedy samples differ"),
        ([sampled], [GenerateResult(token_ids=((1, 2, 3, 4), (1,)), tokens_computed=2)], "at most 3"),
        ([sampled], [GenerateResult(token_ids=([1], (1,)), tokens_computed=2)], "not a tuple"),
        ([sampled], [GenerateResult(token_ids=((1,), (-1,)), tokens_computed=2)], "non-negative"),
        ([sampled], [GenerateResult(token_ids=((1,), (1,)), tokens_computed=-1)], "tokens_computed"),
    ]
    for reqs, results, message in bad:
        with pytest.raises(BatchFailed, match=message):
            validate_generations(reqs, results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_is_seeded_per_row_and_leaves_cuda_rng_alone(chatml_tokenizer):
    model = build_model(chatml_tokenizer, seed=2).cuda()
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny")
    row = GenerateRequest(prompt_ids=PROMPTS[0], max_new_tokens=16, temperature=1.5, top_p=0.9, seeds=(123, 4))
    cpu_before, cuda_before = torch.get_rng_state(), torch.cuda.get_rng_state()
    alone = backend.generate_batch([row])[0].token_ids
    assert torch.equal(torch.get_rng_state(), cpu_before) and torch.equal(torch.cuda.get_rng_state(), cuda_before)
    torch.cuda.manual_seed(77)
    torch.rand(99, device="cuda")
    mate = GenerateRequest(prompt_ids=PROMPTS[1], max_new_tokens=16, temperature=1.5, seeds=(7,))
    assert backend.generate_batch([mate, row])[1].token_ids == alone
    assert len(set(alone)) == 2


LONGER = [PROMPTS[0], PROMPTS[1], PROMPTS[2], (3, 3, 3), (9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13), (60, 61)]


@pytest.mark.parametrize("margin", [0.0, None, 1e9], ids=["never-redo", "default", "always-redo"])
def test_greedy_rows_decoded_together_equal_each_row_alone(model, chatml_tokenizer, margin):
    """Left-padded batches of greedy rows (ragged prompts: padding matters) give each row's own text."""
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4, greedy_tie_margin=margin)
    reqs = [GenerateRequest(prompt_ids=p, max_new_tokens=10) for p in LONGER]
    results = backend.generate_batch(reqs)
    for r, res in zip(reqs, results, strict=True):
        assert res.token_ids == (hf_generate(model, r.prompt_ids, 10, backend.pad_token_id, do_sample=False),)
    redone = backend.statistics().redone_alone
    if margin == 0.0:
        assert redone == 0  # every row came from a batched decode
    elif margin == 1e9:
        assert redone == len(LONGER)  # every row was near a "tie", so decoded again alone
    else:
        assert backend.greedy_tie_margin == 1e-3 and 0 <= redone <= len(LONGER)


def test_greedy_batches_record_the_top2_margins_of_their_rows(model, chatml_tokenizer):
    # the margin a row is checked against is that of its own steps only: a margin just above the
    # smallest step margin of any row keeps exactly the rows whose every step is above it
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8, greedy_tie_margin=0.0)
    reqs = [GenerateRequest(prompt_ids=p, max_new_tokens=6) for p in LONGER]
    logits_min = []
    for p in LONGER:
        ids = torch.tensor([list(p)])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                pad_token_id=backend.pad_token_id, output_scores=True, return_dict_in_generate=True,
            )
        scores = torch.stack(out.scores, dim=1)[0]  # [T, V]
        top2 = scores.topk(2, dim=-1).values
        logits_min.append(float((top2[:, 0] - top2[:, 1]).min()))
    ordered = sorted(logits_min)
    k = len(LONGER) // 2
    assert ordered[k] - ordered[k - 1] > 1e-3  # far apart compared with padding's float rounding
    cut = (ordered[k - 1] + ordered[k]) / 2  # half the rows have a step below it
    strict = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8, greedy_tie_margin=cut)
    strict.generate_batch(reqs)
    assert strict.statistics().redone_alone == sum(m < cut for m in logits_min)


def test_bad_tie_margin_is_refused(model, chatml_tokenizer):
    with pytest.raises(ConfigError):
        HFBackend(model, chatml_tokenizer, model_id="tiny", greedy_tie_margin=-1.0)


@pytest.mark.parametrize("gap", [0.0, None, 2.0], ids=["never-redo", "default", "always-redo"])
def test_sampled_rows_decoded_together_equal_each_row_alone(model, chatml_tokenizer, gap):
    """Ragged prompts, several seeds each, in left-padded batches: every sample is its row's own."""
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4, sample_tie_gap=gap)
    reqs = [GenerateRequest(prompt_ids=p, max_new_tokens=10, temperature=1.3, top_p=0.95, seeds=(k, 100 + k)) for k, p in enumerate(LONGER)]
    results = backend.generate_batch(reqs)
    eos = backend.eos_token_ids
    for r, res in zip(reqs, results, strict=True):
        assert res.token_ids == tuple(
            reference_sample(model, r.prompt_ids, 10, eos, seed=s, temperature=1.3, top_p=0.95) for s in r.seeds
        )
    redone = backend.statistics().redone_alone
    if gap == 0.0:
        assert redone == 0
    elif gap == 2.0:
        assert redone == 2 * len(LONGER)  # every draw is within 2 of a boundary
    else:
        assert backend.sample_tie_gap == 1e-5 and redone <= 2 * len(LONGER)
