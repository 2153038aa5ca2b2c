"""One tiny random Llama per chat-template family (built once per session), shared by the backend
contract suite and the vLLM tests."""

from __future__ import annotations

import functools

import torch

from helpers.chat_templates import build_family_tokenizer, family_named

CONTEXT = 512


@functools.cache
def tokenizer_for(name: str):
    return build_family_tokenizer(family_named(name))


@functools.cache
def model_for(name: str):
    """A tiny random Llama for a family's tokenizer (head size 32: what vLLM's CPU attention needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer_for(name)
    torch.manual_seed(3)
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
