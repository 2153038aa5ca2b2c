"""Absence policies: how an absent player disappears from the conversation.

A policy turns a snapshot and a coalition (which players are present) into the chat messages of
the masked prompt. Policies are registered by id (:func:`register_policy`, :func:`get_policy`) so
more can be added; a policy's id and :meth:`~AbsencePolicy.params` enter the coalition key.

Rules shared by every policy:

- text that belongs to no player (and messages of non-attributable roles) is never changed;
- with every player present the messages are exactly the original ones (byte for byte).

``drop`` (:class:`DropPolicy`) removes an absent player's text. A *turn* player removes its whole
message. The whitespace rule, the same for every unit (paragraph, sentence, word, declared spans,
tool exchanges): a removed run of players collapses, with the whitespace touching it, to the
strongest whitespace around it: a blank line beats a line break, a line break beats spaces; among
equal line breaks the last one wins (so the next line keeps its indentation), among spaces the
first. So removing players never
joins two lines or paragraphs that were separate and changes no character outside the removed
players and that one separator: ``"A. B.\n\nQ?"`` without B is ``"A.\n\nQ?"``, ``"A. B. C."``
without B is ``"A. C."``, ``"- a\n- b\n- c"`` without ``- b`` is ``"- a\n- c"``. Two exceptions
remove the separator: at the start or end of a message the run collapses to nothing (the
message's own leading and trailing whitespace stay), and text that touched the removed run on its
right stays attached when no line break is involved (punctuation: the words of ``"is big."``
without ``big`` give ``"is."``; of ``"Don't go"`` without ``n't``, ``"Do go"``). Text between
players that is not whitespace (a template's headers, text outside declared players) is never
removed. A message whose players are all absent and whose remaining text is whitespace is removed,
like a dropped turn, except under ``empty_turns="empty"`` (every role) or
``system_absent="empty"`` (system messages), where it stays with empty content. (Chat templates
that inject a default system prompt when no system message is present will inject it when the
system message is removed: the renderer reports that behaviour, see
:attr:`ChatRenderer.injects_default_system`.) An empty player (an empty message under ``turn``)
removes nothing, so its value is 0 (the dummy axiom). ``merge_adjacent=True`` (both policies)
then joins adjacent messages of the same role into one, joined by a blank line, for templates that
require alternating roles.

``placeholder`` (:class:`PlaceholderPolicy`) replaces an absent player's text with a fixed string
(default ``"[removed]"``) and keeps every message and separator.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..snapshot import ConversationSnapshot
from ..conversation import Message, Player, players_by_message
from ..errors import ConfigError, MaskError
from ..registry import Registry
from ..userinput import check_text

__all__ = (
    "AbsencePolicy",
    "POLICIES",
    "DropPolicy",
    "EMPTY_TURNS",
    "PlaceholderPolicy",
    "SYSTEM_ABSENT",
    "line_breaks",
    "merge_adjacent_messages",
    "available_policies",
    "get_policy",
    "register_policy",
)


@runtime_checkable
class AbsencePolicy(Protocol):
    """How absent players are removed from the prompt.

    Attributes:
        id: registry id, part of the coalition key.
    """

    id: str

    def params(self) -> dict[str, Any]:
        """Parameters that change the rendered text (they enter the coalition key)."""
        ...

    def render(self, snapshot: ConversationSnapshot, present: np.ndarray) -> list[Message]:
        """The prompt messages of the coalition.

        Args:
            snapshot: the conversation and its players.
            present: ``[n_players]`` bool, True where the player is in the coalition.

        Returns:
            The masked prompt messages (the target answer is not among them).

        Raises:
            MaskError: ``present`` has the wrong shape or dtype.
        """
        ...


def _check_present(snapshot: ConversationSnapshot, present: np.ndarray) -> np.ndarray:
    arr = np.asarray(present)
    if arr.dtype != np.bool_ or arr.shape != (snapshot.n_players,):
        raise MaskError(
            f"coalition must be a bool array of shape ({snapshot.n_players},), got "
            f"{arr.dtype} {arr.shape}",
            field="mask",
        )
    return arr


_LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")
"""A line break: what :meth:`str.splitlines` splits on, ``\\r\\n`` counted once."""


def line_breaks(whitespace: str) -> int:
    """The number of line breaks in ``whitespace`` (``\\r\\n`` is one; see :meth:`str.splitlines`)."""
    return len(_LINE_BREAK.findall(whitespace))


def _separator(candidates: list[str], attached: bool) -> str:
    """The whitespace a removed run collapses to: the strongest of ``candidates``.

    ``candidates`` are the whitespace strings around and inside the run, in text order (the end of
    the text before it, whitespace-only gaps, the start of the text after it). Strength is the
    number of line breaks (a blank line beats a line break, a line break beats spaces); among
    equal line breaks the last one wins, so the line after the run keeps its own indentation, and
    among spaces alone the first. With no line
    break anywhere and text that touched the removed run on its right (punctuation), nothing.
    """
    best = ""
    strength = -1
    for ws in candidates:
        if not ws:
            continue
        k = line_breaks(ws)
        if k > strength or (k == strength and k > 0):  # equal line breaks: the last; equal spaces: the first
            best, strength = ws, k
    if strength <= 0 and attached:
        return ""
    return best


def _strength(whitespace: str) -> int:
    """How strongly ``whitespace`` separates: its line breaks, or -1 for none at all."""
    return line_breaks(whitespace) if whitespace else -1


def _join_kept(content: str, players: list[Player], kept: list[str | None]) -> str:
    """Rebuild a message from its pieces (text, or None where removed) and the text between them.

    The whitespace rule (module docs). The message is a sequence of *gaps* (text between players)
    and *pieces* (players' text, kept or removed). Text with no removed piece in it is unchanged,
    and a kept piece is never changed, whitespace included. A run of removed pieces, with the
    whitespace-only gaps among them and the whitespace that ends the gap before and starts the gap
    after, becomes:

    - at the start of the message, nothing (the message's own leading whitespace stays); at its
      end, the message's own trailing whitespace;
    - between text on both sides, a separator: the strongest of those whitespace strings
      (:func:`_separator`: most line breaks; among equal line breaks the last, among spaces the
      first), or nothing when none has a line break and the text after touched the removed piece
      (punctuation: ``"is big."`` without ``big`` is ``"is."``), or nothing when whitespace of the
      kept text on either side (a declared player's own edge) already separates as strongly.

    So no line break outside the removed pieces is lost unless an equal or stronger one stands in
    for it, and text between players that is not whitespace is never removed.
    """
    # (text, kind): kind "gap" (between players: its edge whitespace may collapse), "kept" (a
    # present player's text: never changed) or "removed"
    segs: list[tuple[str, str]] = [(content[: players[0].start], "gap")]
    for j, (player, text) in enumerate(zip(players, kept, strict=True)):
        if j > 0:
            segs.append((content[players[j - 1].end : player.start], "gap"))
        segs.append((text, "kept") if text is not None else (content[player.start : player.end], "removed"))
    segs.append((content[players[-1].end :], "gap"))
    if all(kind != "removed" for _, kind in segs):
        return "".join(text for text, _ in segs)
    out: list[tuple[str, str]] = []  # the output so far, as (text, kind)

    def text_of(parts: list[tuple[str, str]]) -> str:
        return "".join(t for t, _ in parts)

    i = 0
    while i < len(segs):
        text, kind = segs[i]
        if kind != "removed":
            out.append((text, kind))
            i += 1
            continue
        # a removed piece's own edge whitespace (a declared span may hold it) is whitespace around
        # the run too; its text is gone
        # the run: removed pieces and the whitespace-only gaps among them
        whitespace: list[str] = []
        left_gap = out[-1] if out and out[-1][1] == "gap" else None
        if left_gap is not None:
            whitespace.append(left_gap[0][len(left_gap[0].rstrip()) :])
        j = i
        while j < len(segs) and (segs[j][1] == "removed" or (segs[j][1] == "gap" and not segs[j][0].strip())):
            piece, piece_kind = segs[j]
            if piece_kind == "gap":
                whitespace.append(piece)
            else:
                whitespace.append(piece[: len(piece) - len(piece.lstrip())])
                whitespace.append(piece[len(piece.rstrip()) :])
            j += 1
        # whether the text after touched the last removed piece's text (no whitespace between them)
        k = j - 1
        while segs[k][1] == "gap":
            k -= 1
        touched = not segs[k][0][-1:].isspace() and not "".join(t for t, _ in segs[k + 1 : j])
        if j == len(segs):  # removed text up to the end of the message
            if text_of(out).strip():
                if left_gap is not None:
                    out[-1] = (left_gap[0].rstrip(), "gap")
                out.append((content[len(content.rstrip()) :], "gap"))
            break
        right, right_kind = segs[j]
        right_ws = right[: len(right) - len(right.lstrip())] if right_kind == "gap" else ""
        if right_kind == "gap":
            whitespace.append(right_ws)
            touched = touched and not right_ws
        if not text_of(out).strip():  # removed text at the start of the message
            out.append((right[len(right_ws) :], right_kind))
        else:
            if left_gap is not None:
                out[-1] = (left_gap[0].rstrip(), "gap")
            kept_left = text_of(out)  # its trailing whitespace, if any, is a kept piece's own
            kept_edge = kept_left[len(kept_left.rstrip()) :] + (
                right[: len(right) - len(right.lstrip())] if right_kind == "kept" else ""
            )
            separator = _separator(whitespace, touched)
            if _strength(kept_edge) >= _strength(separator):
                separator = ""  # a kept player's own whitespace already separates as strongly
            out.append((separator, "gap"))
            out.append((right[len(right_ws) :], right_kind))
        i = j + 1
    return text_of(out)


SYSTEM_ABSENT: tuple[str, ...] = ("removed", "empty")
"""What ``drop`` does with a system message whose players are all absent: remove the message (a
template may then inject its default system prompt), or keep it with empty content."""

EMPTY_TURNS: tuple[str, ...] = ("removed", "empty")
"""What ``drop`` does with any message whose players are all absent: remove it (default), or keep
it with empty content, so the conversation keeps its sequence of roles in every coalition."""

MERGED_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
"""The roles whose adjacent messages ``merge_adjacent`` joins (tool results stay separate)."""

MERGE_SEPARATOR = "\n\n"
"""What joins the contents of merged adjacent messages (a blank line)."""


def merge_adjacent_messages(messages: list[Message]) -> list[Message]:
    """Join adjacent messages of the same role (system, user or assistant) into one message.

    The contents are joined by :data:`MERGE_SEPARATOR` (empty contents are skipped); tool messages
    are never merged. Chat templates that require alternating roles (Llama-2, Mistral, Gemma)
    refuse two user turns side by side, which dropping the assistant turn between them produces.

    Returns:
        The messages with every run of same-role messages merged (the input is not changed).
    """
    out: list[Message] = []
    for message in messages:
        prev = out[-1] if out else None
        if prev is not None and prev.role == message.role and message.role in MERGED_ROLES:
            parts = [c for c in (prev.content, message.content) if c]
            out[-1] = replace(
                prev,
                content=MERGE_SEPARATOR.join(parts),
                tool_call_ids=prev.tool_call_ids + message.tool_call_ids,
            )
        else:
            out.append(message)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpanPolicy:
    """Shared rendering: each absent player's text becomes :meth:`_absent_text` (None = removed).

    Args:
        merge_adjacent: after removal, join adjacent messages of the same role into one
            (:func:`merge_adjacent_messages`), in every coalition, the full one included; it changes
            the rendered text, so ``True`` enters the coalition key through :meth:`params`.
    """

    merge_adjacent: bool = False

    def _base_params(self) -> dict[str, Any]:
        if not isinstance(self.merge_adjacent, bool):
            raise ConfigError(f"must be true or false, got {self.merge_adjacent!r}", field="merge_adjacent")
        return {"merge_adjacent": True} if self.merge_adjacent else {}

    def _absent_text(self, player: Player) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _emptied(self, message: Message) -> Message | None:
        """What replaces a message whose players were all removed and nothing else is left."""
        return None

    def render(self, snapshot: ConversationSnapshot, present: np.ndarray) -> list[Message]:
        present = _check_present(snapshot, present)
        groups = players_by_message(snapshot.players)
        messages: list[Message] = []
        for m, message in enumerate(snapshot.conversation.messages):
            pieces = groups.get(m)
            if not pieces or all(present[p.index] for p in pieces):
                messages.append(message)
                continue
            # an empty piece removes nothing (its player is a dummy: value 0)
            kept = [
                message.content[p.start : p.end] if present[p.index] or p.start == p.end else self._absent_text(p)
                for p in pieces
            ]
            content = _join_kept(message.content, pieces, kept)
            if all(k is None for k in kept) and not content.strip():
                emptied = self._emptied(message)  # every player of the message removed
                if emptied is not None:
                    messages.append(emptied)
                continue
            messages.append(replace(message, content=content))
        return merge_adjacent_messages(messages) if self.merge_adjacent else messages


@dataclass(frozen=True, slots=True, kw_only=True)
class DropPolicy(_SpanPolicy):
    """Remove an absent player's text; a message left without text is removed (module docs).

    Args:
        system_absent: ``"removed"`` (default): a system message whose players are all absent is
            removed like any other; ``"empty"``: it stays, with empty content (so a template that
            injects a default system prompt when none is given does not).
        empty_turns: ``"removed"`` (default): any message whose players are all absent is
            removed; ``"empty"``: it stays with empty content, so every coalition keeps the
            original sequence of roles (what templates that require alternating roles need for
            units finer than a turn).
        merge_adjacent: see :class:`_SpanPolicy`.

        Non-default values render differently, so they enter the coalition key through
        :meth:`params`.

    Raises:
        ConfigError: ``system_absent`` or ``empty_turns`` is not one of :data:`SYSTEM_ABSENT`.
    """

    system_absent: str = "removed"
    empty_turns: str = "removed"
    id: str = "drop"

    def __post_init__(self) -> None:
        if self.system_absent not in SYSTEM_ABSENT:
            raise ConfigError(
                f"unknown rule {self.system_absent!r}; use one of {', '.join(SYSTEM_ABSENT)}",
                field="system_absent",
            )
        if self.empty_turns not in EMPTY_TURNS:
            raise ConfigError(
                f"unknown rule {self.empty_turns!r}; use one of {', '.join(EMPTY_TURNS)}",
                field="empty_turns",
            )
        self._base_params()

    def params(self) -> dict[str, Any]:
        """The non-default rules: ``{}`` by default, else e.g. ``{"system_absent": "empty"}``,
        ``{"empty_turns": "empty"}``, ``{"merge_adjacent": True}``."""
        out = {} if self.system_absent == "removed" else {"system_absent": self.system_absent}
        if self.empty_turns != "removed":
            out["empty_turns"] = self.empty_turns
        return out | self._base_params()

    def _absent_text(self, player: Player) -> str | None:
        return None

    def _emptied(self, message: Message) -> Message | None:
        if self.empty_turns == "empty" or (message.role == "system" and self.system_absent == "empty"):
            return replace(message, content="")
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceholderPolicy(_SpanPolicy):
    """Replace an absent player's text with ``text`` (default ``"[removed]"``).

    Args:
        text: the placeholder.
        merge_adjacent: see :class:`_SpanPolicy`.

    Raises:
        ConfigError: ``text`` is not a string, or not Unicode text (a lone surrogate).
    """

    text: str = "[removed]"
    id: str = "placeholder"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConfigError(f"placeholder must be a string, got {self.text!r}", field="placeholder")
        check_text(self.text, "placeholder", ConfigError)
        self._base_params()

    def params(self) -> dict[str, Any]:
        """``{"text": placeholder}`` (and ``"merge_adjacent": True`` when set)."""
        return {"text": self.text} | self._base_params()

    def _absent_text(self, player: Player) -> str | None:
        return self.text


def _check_factory(policy_id: str, factory: object) -> None:
    if not callable(factory):
        raise ConfigError(f"the absence policy {policy_id!r} must be a callable factory, got {type(factory).__name__}", field="absence_policy")


POLICIES: Registry[Callable[..., AbsencePolicy]] = Registry("absence policy", field="absence_policy", check=_check_factory)
"""Absence policy factories by id (``--absence-policy``'s choices, in registration order): a
factory's keyword parameters are the policy's own settings, checked by the registry
(:meth:`~coalescence.registry.Registry.create`) before it is called."""


def register_policy(policy_id: str, factory: Callable[..., AbsencePolicy], *, replace: bool = False) -> None:
    """Register an absence policy factory under ``policy_id``. The factory's keyword parameters (a
    dataclass's fields, or its signature's names) are the policy's settings: :func:`get_policy`
    refuses any other, naming it.

    Raises:
        ConfigError: ``policy_id`` is empty, ``factory`` is not callable, or the id is already
            registered to another factory and ``replace`` is false (field ``absence_policy``).
    """
    POLICIES.register(policy_id, factory, replace=replace)


register_policy("drop", DropPolicy)
register_policy("placeholder", PlaceholderPolicy)


def available_policies() -> tuple[str, ...]:
    """The registered policy ids, in registration order."""
    return POLICIES.names()


def get_policy(policy_id: str, **params: Any) -> AbsencePolicy:
    """Build the registered policy ``policy_id`` with its settings ``params``.

    Raises:
        ConfigError: unknown id, a setting the policy does not take (both with a "did you mean"),
            or a bad value (field ``absence_policy``, or the setting's own).
    """
    return POLICIES.create(policy_id, **params)
