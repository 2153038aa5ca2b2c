"""Conversations and players: the ground floor, importing nothing of coalescence's but the errors
and the input checks.

A :class:`Conversation` is the input: chat messages in the OpenAI format plus the *target*, the
answer being explained, and optionally the players the input declares (character spans, or the
documents of the RAG form, see :mod:`coalescence.inputs`). A :class:`Player` is a character span
of one message (a tool exchange spans several); :func:`coalescence.segmentation.segment_players`
cuts the attributable messages into players (turns, paragraphs, sentences, words, tool exchanges,
or the declared spans), and :class:`coalescence.snapshot.ConversationSnapshot` freezes a
conversation, its target and its players under a ``snapshot_id``. Files are read by
:mod:`coalescence.inputs` (:func:`~coalescence.inputs.load_conversation`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .errors import InputError
from .userinput import check_text, short_repr

__all__ = (
    "ROLES",
    "UNITS",
    "TOOL_CALL_FORMAT",
    "Conversation",
    "DeclaredPlayer",
    "Message",
    "Player",
    "format_tool_call",
    "players_by_message",
)

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""Message roles accepted in the input (OpenAI chat format)."""

UNITS: tuple[str, ...] = ("turn", "paragraph", "sentence", "word", "tool", "exchange", "document")
"""Player units (see :func:`segment_players`)."""



@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One chat message.

    Args:
        role: one of :data:`ROLES`.
        content: the message text (str, may be empty for non-target messages). An assistant
            message's tool calls are part of it (see :func:`format_tool_call`).
        tool_call_ids: the ids of the tool calls an assistant message makes, or the id a tool
            message answers (``tool_call_id``); used by ``--unit tool`` to pair them.

    Raises:
        InputError: unknown role, non-string content, or content that is not Unicode text (a
            lone surrogate).
    """

    role: str
    content: str
    tool_call_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InputError(
                f"unknown role {self.role!r}; use one of {', '.join(ROLES)}", field="role"
            )
        if not isinstance(self.content, str):
            raise InputError(
                f"content must be a string, got {type(self.content).__name__}", field="content"
            )
        check_text(self.content, "content")

    def as_dict(self) -> dict[str, str]:
        """The message as an OpenAI/transformers chat message ``{"role", "content"}``."""
        return {"role": self.role, "content": self.content}


TOOL_CALL_FORMAT = "<tool_call>\n{call}\n</tool_call>"
"""How a tool call is written into its assistant message's text (one per call, Hermes style):
``call`` is ``{"name": ..., "arguments": ...}`` as compact JSON."""


def format_tool_call(name: str, arguments: Any) -> str:
    """The text of one tool call in an assistant message (:data:`TOOL_CALL_FORMAT`)."""
    if isinstance(arguments, str):
        from .userinput import parse_json

        try:
            arguments = parse_json(arguments, what="arguments", field="arguments")
        except InputError:  # not JSON (or beyond its limits): the string is written as given
            pass
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(", ", ": "))
    return TOOL_CALL_FORMAT.format(call=call)


def _with_tool_calls(content: str, calls: Any, where: str, role: Any) -> tuple[str, tuple[str, ...]]:
    """``content`` with the OpenAI ``tool_calls`` written into it, and the call ids."""
    if role != "assistant":
        raise InputError("only assistant messages make tool calls", field=f"{where}.tool_calls")
    if not isinstance(calls, list) or not calls:
        raise InputError('must be a non-empty list of {"id", "function": {"name", "arguments"}}', field=f"{where}.tool_calls")
    texts, ids = [], []
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InputError('must be {"id", "type": "function", "function": {"name", "arguments"}}', field=at)
        check_text(fn["name"], f"{at}.function.name")
        text = format_tool_call(fn["name"], fn.get("arguments", {}))
        texts.append(check_text(text, f"{at}.function.arguments"))
        ids.append(_call_id(call.get("id", f"call_{k}"), f"{at}.id"))
    body = "\n".join(texts)
    return (f"{content}\n{body}" if content else body), tuple(ids)


def _call_id(value: Any, where: str) -> str:
    """A tool call id (a string; an integer is accepted and written as its digits)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"must be a string, got {type(value).__name__}", field=where)
    return check_text(str(value), where)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclaredPlayer:
    """A player the input declares: a character span of one prompt message.

    Args:
        message: index of the message in :attr:`Conversation.messages` (the input's index).
        start: first character (inclusive).
        end: end (exclusive); non-empty spans only.
        label: the player's name in tables and documents.
    """

    message: int
    start: int
    end: int
    label: str


def _declared_players(raw: Any, messages: Sequence[Message]) -> tuple[DeclaredPlayer, ...]:
    """Parse the input's ``"players"`` list (ranges are checked by :class:`Conversation`)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise InputError('must be a non-empty list of {"message", "start", "end", "label"?}', field="players")
    out = []
    for i, item in enumerate(raw):
        where = f"players[{i}]"
        if not isinstance(item, Mapping):
            raise InputError('must be an object {"message", "start", "end", "label"?}', field=where)
        values = {}
        for key in ("message", "start", "end"):
            v = item.get(key)
            if not isinstance(v, int) or isinstance(v, bool):
                raise InputError(f"must be an integer (character offset or message index), got {short_repr(v)}", field=f"{where}.{key}")
            values[key] = v
        m = values["message"]
        if not 0 <= m < len(messages):
            raise InputError(
                f"message {m} is not a prompt message (0..{len(messages) - 1}; the answer explained "
                "cannot hold players)",
                field=f"{where}.message",
            )
        label = item.get("label")
        if label is None:
            label = f"{messages[m].role}[{m}][{values['start']}:{values['end']}]"
        if not isinstance(label, str) or not label:
            raise InputError(f"must be a non-empty string, got {short_repr(label)}", field=f"{where}.label")
        check_text(label, f"{where}.label")
        if any(d.label == label for d in out):
            raise InputError(f"label {label!r} is given twice; players are told apart by their labels", field=f"{where}.label")
        out.append(DeclaredPlayer(message=m, start=values["start"], end=values["end"], label=label))
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    """A chat conversation and the answer being explained.

    Args:
        messages: the prompt messages, in order (the target answer is not among them).
        target: the assistant answer whose utility is attributed, or ``None`` when it is still to be
            generated by the model (the input ended on a non-assistant turn).
        target_source: where the target came from: ``"last_assistant"``, ``"field"`` (the input's
            ``"target"``), ``"generated"``, or ``"none"`` while it is missing.
        target_ids: the token ids the model generated as the answer (its stop token excluded),
            when it was generated; ``target`` is then their decoded text, shown, never encoded
            again: the ids are what is scored (see :mod:`coalescence.masking.render`). ``None``
            for an answer given as text.

    Raises:
        InputError: no messages, an empty target, or ``target_ids`` that are empty, not
            non-negative integers, or given without a target.
    """

    messages: tuple[Message, ...]
    target: str | None
    target_source: str = "last_assistant"
    declared: tuple[DeclaredPlayer, ...] = ()
    target_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for i, d in enumerate(self.declared):
            where = f"players[{i}]"
            if not 0 <= d.message < len(self.messages):
                raise InputError(
                    f"message {d.message} is not a prompt message (0..{len(self.messages) - 1}; the "
                    "answer explained cannot hold players)",
                    field=f"{where}.message",
                )
            n = len(self.messages[d.message].content)
            if not 0 <= d.start < n:
                raise InputError(f"start {d.start} is outside the message (0..{n - 1})", field=f"{where}.start")
            if not d.start < d.end <= n:
                raise InputError(
                    f"end {d.end} must be after start {d.start} and at most {n} (the message length); "
                    "a player must not be empty",
                    field=f"{where}.end",
                )
        order = sorted(range(len(self.declared)), key=lambda i: (self.declared[i].message, self.declared[i].start))
        for a, b in zip(order, order[1:]):
            da, db = self.declared[a], self.declared[b]
            if da.message == db.message and db.start < da.end:
                raise InputError(
                    f"[{db.start}, {db.end}) overlaps players[{a}] [{da.start}, {da.end}) in message {db.message}",
                    field=f"players[{b}].start",
                )
        if not self.messages:
            raise InputError(
                "the conversation has no prompt messages; add at least one message before the answer",
                field="messages",
            )
        if self.target is not None:
            check_text(self.target, "target")
        if self.target_ids is not None:
            ids = self.target_ids
            if (
                self.target is None
                or not isinstance(ids, tuple)
                or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            ):
                raise InputError(
                    f"must be a non-empty list of token ids (integers >= 0) with a target, got {short_repr(ids)}",
                    field="target_ids",
                )
        if self.target is not None and not self.target.strip():
            raise InputError(
                "the target answer is empty; give a non-empty last assistant message or a "
                '"target" string, or end on a user turn to have the model generate one',
                field="target",
            )

    @classmethod
    def from_dict(cls, data: Any) -> Conversation:
        """Build a conversation from parsed input JSON.

        The input is ``{"messages": [{"role", "content"}, ...], "target": "..."?}``. The last
        assistant message is the target; an explicit ``"target"`` string overrides it (and replaces
        a trailing assistant message). If the conversation ends on another role and has no
        ``"target"``, the target is ``None`` (to be generated).

        Raises:
            InputError: naming the field at fault (``messages``, ``messages[i].role``, ...).
        """
        if not isinstance(data, Mapping):
            raise InputError(
                f"the input must be a JSON object with a 'messages' list, got {type(data).__name__}",
                field="input",
            )
        raw = data.get("messages")
        if raw is None:
            raise InputError('missing; give a list of {"role", "content"} objects', field="messages")
        if not isinstance(raw, list) or not raw:
            raise InputError(
                'must be a non-empty list of {"role", "content"} objects', field="messages"
            )
        messages: list[Message] = []
        for i, item in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(item, Mapping):
                raise InputError('must be an object {"role", "content"}', field=where)
            role = item.get("role")
            if role not in ROLES:
                raise InputError(
                    f"unknown role {short_repr(role)}; use one of {', '.join(ROLES)}", field=f"{where}.role"
                )
            content = item.get("content")
            calls = item.get("tool_calls")
            if content is None and calls:
                content = ""
            if "content" not in item and not calls:
                raise InputError('missing; give the message text as a string ("content": "...")', field=f"{where}.content")
            if not isinstance(content, str):
                raise InputError(
                    f"must be a string, got {type(content).__name__}", field=f"{where}.content"
                )
            check_text(content, f"{where}.content")
            call_ids: tuple[str, ...] = ()
            if calls is not None:
                content, call_ids = _with_tool_calls(content, calls, where, role)
            elif role == "tool" and item.get("tool_call_id") is not None:
                call_ids = (_call_id(item["tool_call_id"], f"{where}.tool_call_id"),)
            messages.append(Message(role=role, content=content, tool_call_ids=call_ids))
        target = data.get("target")
        if target is not None:
            if not isinstance(target, str):
                raise InputError(f"must be a string, got {type(target).__name__}", field="target")
            check_text(target, "target")
            if messages[-1].role == "assistant":
                messages.pop()
            source = "field"
        elif messages[-1].role == "assistant":
            target = messages.pop().content
            if not target.strip():
                raise InputError(
                    "the last assistant message (the answer to explain) is empty; give its text "
                    'or a "target" string',
                    field=f"messages[{len(raw) - 1}].content",
                )
            source = "last_assistant"
        else:
            source = "none"
        declared = _declared_players(data.get("players"), messages)
        return cls(messages=tuple(messages), target=target, target_source=source, declared=declared)

    def with_target(self, target: str, *, source: str, ids: Sequence[int] | None = None) -> Conversation:
        """A copy with the target set (e.g. after generating it: ``ids``, the generated token ids,
        and ``target`` their decoded text)."""
        return replace(self, target=target, target_source=source, target_ids=None if ids is None else tuple(int(i) for i in ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class Player:
    """One attributable part of the conversation: a character span of one message (a tool exchange
    adds the spans of its tool results in :attr:`extra`).

    Args:
        index: position in the player order (0-based); bit ``index`` of a coalition mask.
        label: human-readable name: ``role[m]`` for a turn, ``role[m].p<k>`` / ``.s<k>`` / ``.w<k>``
            for the k-th (0-based) paragraph / sentence / word of message m, ``assistant[m]+tool[j]``
            for a tool exchange, the declared label for a declared player (and ``label.s<k>`` ...
            for the units inside it).
        role: role of the message the player belongs to.
        message_index: index of that message in :attr:`Conversation.messages`.
        start: first character of the span in the message content (inclusive).
        end: end of the span (exclusive); ``content[start:end] == text``.
        text: the player's text.
        extra: further ``(message_index, start, end)`` spans of the same player, in later messages
            (the tool results of a tool exchange); empty for every other unit.
    """

    index: int
    label: str
    role: str
    message_index: int
    start: int
    end: int
    text: str
    extra: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise InputError(f"bad span [{self.start}, {self.end})", field="players")

    @property
    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """Every ``(message_index, start, end)`` span of the player, the first one first."""
        return ((self.message_index, self.start, self.end), *self.extra)


def players_by_message(players: Sequence[Player]) -> dict[int, list[Player]]:
    """Group the pieces of players by message index, each group in text order.

    A player with :attr:`Player.extra` spans appears in the group of each message it covers, as a
    piece: a copy of the player (same ``index`` and ``label``) with that message's span and text
    (``text`` is left empty for extra pieces; renderers use the message content and the span).
    """
    groups: dict[int, list[Player]] = {}
    for p in players:
        groups.setdefault(p.message_index, []).append(p)
        for m, start, end in p.extra:
            groups.setdefault(m, []).append(replace(p, message_index=m, start=start, end=end, text="", extra=()))
    for group in groups.values():
        group.sort(key=lambda q: (q.start, q.end))
    return groups

