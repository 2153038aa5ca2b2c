"""Tiny real tokenizers and a tiny randomly initialised Llama, built in-process (nothing downloaded).

Tokenizers are trained on a small corpus with the ``tokenizers`` library and wrapped in
transformers' ``PreTrainedTokenizerFast`` with a chat template; the model is a ``LlamaForCausalLM``
from a small config with a fixed seed. ``tests/conftest.py`` builds its session fixtures from these.
"""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a default assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's template shape: ChatML, default system prompt injected, no BOS."""

ZEPHYR_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""A zephyr-style template whose tokenizer prepends BOS itself (the template has none)."""

BOS_IN_TEMPLATE = "{{ bos_token }}" + ZEPHYR_TEMPLATE
"""The same, with the BOS text written by the template (must not be doubled)."""

CORPUS = [
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "Big Ben's clock tower in London was finished in 1859.",
    "The Colosseum in Rome was opened in the year 80.",
    "It was completed in 1889. When was the tower completed? You are a helpful assistant.",
    "I am planning a weekend in Lisbon and I love seafood. Order the grilled sardines.",
    "Context: Question: answer the user with the context provided. system user assistant tool",
] * 4


def build_tokenizer(kind: str = "chatml"):
    """A real fast tokenizer (byte-level BPE trained on CORPUS) with a chat template.

    Args:
        kind: ``"chatml"`` (no BOS, ChatML template), ``"bos"`` (prepends ``<s>`` by default,
            zephyr template) or ``"bos_in_template"`` (prepends ``<s>`` and the template writes it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if kind == "chatml":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
        )
        fast.chat_template = CHATML_TEMPLATE
    else:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        fast.chat_template = ZEPHYR_TEMPLATE if kind == "bos" else BOS_IN_TEMPLATE
    return fast


def build_model(tokenizer, *, seed: int = 0, layers: int = 2):
    """A tiny randomly initialised LlamaForCausalLM (float32, eager on CPU) for ``tokenizer``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()
