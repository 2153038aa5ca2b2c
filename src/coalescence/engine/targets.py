"""The answer a coalition is scored on: generated where the conversation has none, and the room
the model's context leaves for it."""

from __future__ import annotations

from ..backends.base import ScoringBackend
from ..conversation import Conversation
from ..errors import ConfigError, InputError
from ..masking.render import ChatRenderer

__all__ = ("check_room", "generated_target")


def check_room(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """Refuse a generation that could run past the model's context of ``limit`` tokens, before it starts.

    Raises:
        InputError: the prompt alone fills the context (field ``messages``).
        ConfigError: the prompt plus ``max_new_tokens`` could exceed it (field ``max_new_tokens``).
    """
    if prompt_tokens >= limit:
        raise InputError(
            f"the prompt renders to {prompt_tokens} tokens, leaving no room in the model's context of "
            f"{limit} for an answer; shorten the conversation or use a longer-context model",
            field="messages",
        )
    if prompt_tokens + max_new_tokens > limit:
        raise ConfigError(
            f"{max_new_tokens} new tokens after a prompt of {prompt_tokens} tokens could exceed the model's "
            f"context of {limit}; give --max-new-tokens {max(limit - prompt_tokens, 1)} or less, or a shorter prompt",
            field="max_new_tokens",
        )


def generated_target(
    backend: ScoringBackend, renderer: ChatRenderer, conversation: Conversation, max_new_tokens: int
) -> Conversation:
    """``conversation`` with the answer the model generates greedily from its full prompt (at most
    ``max_new_tokens`` tokens) as its target: the ids without the stop token the model ended with,
    the text their decoding with special tokens kept (see :meth:`~coalescence.engine.Engine.prepare`).

    Raises:
        ConfigError: ``max_new_tokens`` < 1, or the prompt plus it exceeds the model's context.
        InputError: the prompt alone fills the context, or the generated answer is empty.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"must be >= 1, got {max_new_tokens}", field="max_new_tokens")
    prompt = renderer.encode_prompt(conversation.messages)
    check_room(len(prompt), max_new_tokens, int(backend.max_context))
    new_ids = [int(i) for i in backend.generate(prompt, max_new_tokens=max_new_tokens)]
    stopped = bool(new_ids) and new_ids[-1] in renderer.special_ids
    content = new_ids[:-1] if stopped else new_ids
    text = backend.tokenizer.decode(content, skip_special_tokens=False)
    if not text.strip():
        raise InputError(
            "the model generated an empty answer; give the answer as a last assistant "
            'message or a "target" string',
            field="target",
        )
    return conversation.with_target(text, source="generated", ids=content)
