"""The transformers backend on a tiny random Llama: what is particular to it (the contract every
backend passes, values against a float64 reference included, is tests/backends/test_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.models import build_model

from coalescence.backends.base import ScoreRequest
from coalescence.backends.hf import HFBackend
from coalescence.errors import ConfigError


def reference_logprobs(model, prompt, target):
    """log p(target_j | prefix) from one unpadded forward pass over the whole sequence."""
    ids = torch.tensor([list(prompt) + list(target)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return np.array([logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(target)])


@pytest.fixture(scope="module")
def model(chatml_tokenizer):
    return build_model(chatml_tokenizer, seed=1)


def requests(vocab: int, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for prompt_len, target_len in [(5, 3), (17, 3), (1, 4), (30, 2), (9, 6), (2, 1), (12, 5)]:
        out.append(
            ScoreRequest(
                prompt_ids=tuple(int(x) for x in rng.integers(5, vocab, prompt_len)),
                target_ids=tuple(int(x) for x in rng.integers(5, vocab, target_len)),
            )
        )
    return out


def test_pad_positions_never_scored(model, chatml_tokenizer):
    reqs = requests(len(chatml_tokenizer), seed=3)
    a = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8)
    b = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=8)
    b.pad_token_id = 7  # a different (real) token in the pad positions changes nothing
    for x, y in zip(a.score(reqs), b.score(reqs), strict=True):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-5)


def test_without_logits_to_keep_gives_the_same_values(model, chatml_tokenizer):
    reqs = requests(len(chatml_tokenizer), seed=5)
    fast = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4)
    full = HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=4)
    full._keep_logits = False
    for x, y in zip(fast.score(reqs), full.score(reqs), strict=True):
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-5)


def test_bad_settings(model, chatml_tokenizer):
    # a row longer than the context: tests/backends/test_contract.py (every backend)
    with pytest.raises(ConfigError):
        HFBackend(model, chatml_tokenizer, model_id="tiny", max_batch_size=0)
    with pytest.raises(ConfigError):
        ScoreRequest(prompt_ids=(), target_ids=(1,))
    with pytest.raises(ConfigError) as info:
        HFBackend.dtype_from_name("float8")
    assert info.value.field == "dtype"


def test_generate_is_greedy(model, chatml_tokenizer):
    backend = HFBackend(model, chatml_tokenizer, model_id="tiny")
    prompt = [5, 9, 11, 40]
    new = backend.generate(prompt, max_new_tokens=4)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(new)):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert new == ids[len(prompt) :]
