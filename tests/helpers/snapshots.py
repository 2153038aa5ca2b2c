"""Conversations and snapshots the engine, pipeline and proxy tests share: a system message, user
messages, the answer ``It was completed in 1889.``, split into players by sentence."""

from __future__ import annotations

from typing import Any

from helpers.chat_templates import build_family_tokenizer, family_named

from coalescence.conversation import Conversation, Message
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer
from coalescence.snapshot import ConversationSnapshot

ANSWER = "It was completed in 1889."
SYSTEM = "You are a helpful assistant."
LANDMARKS = "You answer questions about landmarks. Keep answers short."
"""The proxy tests' system prompt."""


def conversation_of(*users: str, system: str = SYSTEM, target: str = ANSWER) -> Conversation:
    """A system message, one user message per text in ``users``, and ``target`` as the answer."""
    messages = (Message(role="system", content=system), *(Message(role="user", content=u) for u in users))
    return Conversation(messages=messages, target=target)


def snapshot_of(*users: str, system: str = SYSTEM, target: str = ANSWER, unit: str = "sentence") -> ConversationSnapshot:
    """:func:`conversation_of` split into players by ``unit``."""
    return ConversationSnapshot.build(conversation_of(*users, system=system, target=target), unit=unit)


def eiffel_snapshot() -> ConversationSnapshot:
    """Four players: the system sentence, two facts, the question."""
    return snapshot_of("The Eiffel Tower was completed in 1889. Big Ben was finished in 1859.", "When was the tower completed?")


def render_for(family: str, conversation: Conversation, *, unit: str = "sentence") -> tuple[Any, ChatRenderer, ConversationSnapshot, Any]:
    """A fresh tokenizer of the chat-template family ``family``, its renderer, the snapshot of
    ``conversation`` by ``unit`` and its target tokens under the drop policy."""
    tokenizer = build_family_tokenizer(family_named(family))
    renderer = ChatRenderer(tokenizer)
    snapshot = ConversationSnapshot.build(conversation, unit=unit)
    return tokenizer, renderer, snapshot, renderer.target_tokens(snapshot, DropPolicy())
