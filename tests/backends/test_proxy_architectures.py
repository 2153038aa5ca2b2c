"""The compacted proxy game on every architecture that claims it (issue 46), and the refusal of the rest.

The check needs no reference of the proxy's own: a tiny random model whose attention output
projections are zeroed in every layer but the last carries nothing between positions until that
layer, so a token's cached keys and values there depend on its own token and position only. A
correct compacted proxy row (the absent players' keys masked, every visible key re-rotated to the
position it has once the hidden tokens are gone) is then an exact row: one plain forward of the
row's prompt without its hidden tokens, then the target, at positions 0.. n - 1, log-softmax in
float64. (That prompt keeps the separators around an absent player that the renderer's drop
policy also removes, e.g. a "\n\n": the proxy game's own difference from the exact game, which
the positions do not change.) The last layer's queries and
keys are scaled up so its attention depends on the positions (the same rows at the full
conversation's positions differ by more than 1e-3 nats: the check can fail).

Forcing the proxy on an architecture it refuses (partial rotary, NoPE layers, interleaved RoPE)
fails the same check, so those are refused by capability, before any model call, with a reason
that the engine's note quotes (a run there fits its exact rows alone).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.proxy_reference import reference_at_original_positions
from helpers.snapshots import LANDMARKS, conversation_of, render_for

from coalescence.backends.base import ProxyScoreRequest
from coalescence.backends.hf import HFBackend
from coalescence.backends.hf.proxy import PROXY_ARCHITECTURES
from coalescence.engine.proxy import ProxyGame
from coalescence.errors import BackendError
from coalescence.masking.proxy import TAIL_RULES, proxy_layout

ATOL = 1e-4  # nats, fp32
LAYERS = 4  # SmolLM3's default NoPE pattern makes the last of 4 layers a NoPE layer

EXTRA: dict[str, dict] = {
    "mistral": {"sliding_window": None},  # Mistral v0.1's 4,096-token window: refused (below)
    "stablelm": {"partial_rotary_factor": 0.5},
    "phi": {"partial_rotary_factor": 0.5},
    "cohere": {"logit_scale": 1.0},  # default 0.0625 flattens the logits
    "mistral-window": {"sliding_window": 4096},
    "phi3-partial": {"partial_rotary_factor": 0.75},  # Phi-4-mini's
    "llama-dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    **{f"llama-{t}": {"rope_scaling": {"rope_type": t, "factor": 2.0, "original_max_position_embeddings": 256}} for t in ("linear", "yarn")},
    "llama-llama3": {"rope_scaling": {
        "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    }},
}
"""Per-case settings beyond the shared tiny shape (a case ``"<model_type>-<variant>"`` is that architecture)."""

CLAIMED = PROXY_ARCHITECTURES + ("llama-linear", "llama-llama3", "llama-yarn")
"""Every architecture with the proxy game, and the RoPE types of :data:`COMPACT_ROPE_TYPES` beyond ``default``."""

REFUSED = {
    "stablelm": "partial rotary",
    "phi": "partial rotary",
    "smollm3": "NoPE",
    "cohere": "interleaved",
    "gpt_neox": "partial rotary",
    "gemma3_text": "no single rotary",  # one rotary per layer type
    "starcoder2": "not among those",
    "gemma2": "sliding-window",
    "mistral-window": "sliding-window",
    "phi3-partial": "partial rotary",
    "llama-dynamic": "'dynamic'",
}
"""Architectures without the proxy game, and what their refusal names."""


def conversation():
    return conversation_of(
        "Some facts: It is 330 m tall. It was designed by Gustave Eiffel's company. It was completed in 1889.\n\nWhen was it completed?",
        system=LANDMARKS,
    )


@pytest.fixture(scope="module")
def game():
    return render_for("chatml", conversation())


def tiny(kind: str, tokenizer, *, seed: int = 5):
    """A tiny random ``kind`` causal LM (float32) whose attention moves nothing between positions
    before its last layer (every other layer's output projection zeroed), the last layer's
    attention sharpened (queries and keys x4) so it depends on the positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        kind.split("-")[0], vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        rope_theta=100.0, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **EXTRA.get(kind, {}),
    )
    attn = "eager" if kind == "gemma2" else "sdpa"  # Gemma 2's soft-capping has no sdpa
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    layers = list(model.base_model.layers)
    with torch.no_grad():
        for layer in layers[:-1]:
            attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attention
            out = next(getattr(attn, n) for n in ("o_proj", "dense", "out_proj") if hasattr(attn, n))
            out.weight.zero_()
        last = layers[-1].self_attn if hasattr(layers[-1], "self_attn") else layers[-1].attention
        for name in ("q_proj", "k_proj", "qkv_proj", "query_key_value"):
            if hasattr(last, name):
                getattr(last, name).weight.mul_(4.0)
        for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):  # normalised queries / keys: scale after
            norm = getattr(last, name, None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                norm.weight.mul_(4.0)
    return model


def exact_row(model, r: ProxyScoreRequest) -> np.ndarray:
    """``[n_target]`` log-probabilities of the exact game: the prompt without the hidden tokens,
    then the target, one plain forward at positions 0.. n - 1."""
    keep = np.ones(len(r.prompt_ids), dtype=bool)
    for a, b in r.hidden:
        keep[a:b] = False
    prompt = [t for t, k in zip(r.prompt_ids, keep, strict=True) if k]
    seq = prompt + list(r.target_ids[:-1])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), position_ids=torch.arange(len(seq))[None]).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = len(prompt)
    return np.array([logp[p - 1 + j, t].item() for j, t in enumerate(r.target_ids)])


def requests_of(renderer, snapshot, target, rule: str) -> list[ProxyScoreRequest]:
    n = snapshot.n_players
    rng = np.random.default_rng(11)
    rows = [np.zeros(n, dtype=bool), np.arange(n) % 2 == 0, np.arange(n) % 2 == 1] + [rng.random(n) < 0.5 for _ in range(3)]
    layout = proxy_layout(renderer, snapshot, target, tail=rule)
    out = []
    for row in rows:
        r = layout.request(row)
        out.append(r)
    return out


@pytest.mark.parametrize("kind", CLAIMED)
@pytest.mark.parametrize("split", [True, False], ids=["prefix-split", "dense-mask"])
def test_compacted_proxy_rows_are_the_exact_rows_where_attention_moves_nothing(game, kind, split):
    tokenizer, renderer, snapshot, target = game
    model = tiny(kind, tokenizer)
    backend = HFBackend(model, tokenizer, model_id=kind, split_attention=split)
    assert backend.supports_proxy and backend.proxy_refusal_reason is None, backend.proxy_refusal_reason
    contrast = []
    for rule in TAIL_RULES:
        requests = requests_of(renderer, snapshot, target, rule)
        for r, x in zip(requests, backend.score_proxy(requests), strict=True):
            expected = exact_row(model, r)
            np.testing.assert_allclose(x.token_logprobs, expected, atol=ATOL)
            contrast.append(abs(reference_at_original_positions(model, r) - expected.sum()))
    # the positions matter on this model: without the compaction the rows would be off
    assert max(contrast) > 1e-3, contrast


@pytest.mark.parametrize("kind", ["stablelm", "phi", "phi3-partial", "smollm3", "cohere"])
def test_forced_on_an_unmodelled_rope_the_check_fails(game, kind):
    """The check above can fail: forced on layers without RoPE or interleaved RoPE, the compacted
    rows are off the exact rows by more than 1e-3 nats; on a partial rotary embedding the forward
    fails mid-run (the rotation is narrower than the keys: what Phi did before the refusal), and a
    full-width rotation of the same frequencies (what the proxy applies to a full-rotary model) runs
    but is off by more than 1e-3 nats."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    tokenizer, renderer, snapshot, target = game
    model = tiny(kind, tokenizer)
    backend = HFBackend(model, tokenizer, model_id=kind, split_attention=False)
    assert not backend.supports_proxy
    backend._rope, backend.supports_proxy = model.model.rotary_emb, True  # what the old check let through
    requests = requests_of(renderer, snapshot, target, "after-last-player")
    if "partial rotary" in backend.proxy_refusal_reason:
        with pytest.raises(BackendError, match="size of tensor"):
            backend.score_proxy(requests)
        backend._rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=100.0))
    out = backend.score_proxy(requests)
    errors = [abs(x.utility - exact_row(model, r).sum()) for r, x in zip(requests, out, strict=True)]
    assert max(errors) > 1e-3, errors


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_the_rest_are_refused_before_any_model_call_with_the_reason(game, kind):
    tokenizer, renderer, snapshot, target = game
    model = tiny(kind, tokenizer)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    backend = HFBackend(model, tokenizer, model_id=kind)
    assert backend.supports_proxy is False
    assert REFUSED[kind] in backend.proxy_refusal_reason
    note = ProxyGame(tail="after-last-player").refusal(backend, teacher_forced=True, policy_id="drop")
    assert note == f"backend HFBackend cannot score the shared-KV proxy game: {backend.proxy_refusal_reason}"
    request = requests_of(renderer, snapshot, target, "after-last-player")[0]
    with pytest.raises(BackendError, match=REFUSED[kind]):
        backend.score_proxy([request])
    assert calls == []  # refused before any model call


class CountingProxy(HFBackend):
    """The transformers backend, counting the proxy calls it is given."""

    proxy_calls = 0

    def score_proxy(self, requests):
        self.proxy_calls += 1
        return super().score_proxy(requests)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["phi", "llama"])
async def test_a_run_on_a_refused_architecture_fits_exact_rows_with_the_reason(game, kind, anyio_backend):
    """Phi (partial rotary in ``rope_parameters``, which crashed mid-run before): the engine asks
    ``supports_proxy`` before the run, sends no proxy row and notes why; Llama plays the proxy game."""
    from coalescence.attribution.estimators.proxy.shapley import TwoFidelityShapley
    from coalescence.engine import Engine
    from coalescence.masking.policies import DropPolicy

    tokenizer, _, snapshot, _ = game
    backend = CountingProxy(tiny(kind, tokenizer), tokenizer, model_id=kind)
    engine = Engine(backend, batch_size=8, proxy_game=ProxyGame(tail="after-last-player"))
    explanation = await engine.explain(snapshot, TwoFidelityShapley(budget=16, seed=0, proxy_budget=24), DropPolicy())
    engine.close()
    notes = [n for n in explanation.notes if n.startswith("exact rows only")]
    if kind == "llama":
        assert backend.proxy_calls > 0 and explanation.proxy is not None and notes == []
    else:
        assert backend.proxy_calls == 0 and explanation.proxy is None
        assert notes == [f"exact rows only: backend CountingProxy cannot score the shared-KV proxy game: {backend.proxy_refusal_reason}"]
        assert "phi has a partial rotary embedding (partial_rotary_factor 0.5" in notes[0]
