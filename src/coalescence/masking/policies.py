"""Absence policies: how an absent player disappears from the conversation.

A policy turns a snapshot and a coalition (which players are present) into the chat messages of
the masked prompt. Policies are registered by id (:func:`register_policy`, :func:`get_policy`) so
more can be added; a policy's id and :meth:`~AbsencePolicy.params` enter the coalition key.

Rules shared by every policy:

- text that belongs to no player (and messages of non-attributable roles) is never changed;
- with every player present the messages are exactly the original ones (byte for byte).

``drop`` (:class:`DropPolicy`) removes an absent player's text. A *turn* player removes its whole
message. The whitespace rule, the same for every unit (paragraph, sentence, word, declared spans,
tool exchanges): a removed player and the whitespace touching it collapse to one separator, the
first non-empty whitespace among the text's end before it, the gaps, and the text's start after
it, except that text that touched the removed player on its right stays attached (punctuation);
to nothing at the start or end of the message (the message's own leading and trailing whitespace
stay). So removing a player never glues two neighbours together and never leaves a dangling
separator: ``"A. B.  C."`` without B is ``"A. C."``, without C is ``"A. B."``; the words ``Do
n't go`` of ``"Don't go"`` without ``n't`` give ``"Do go"``, the words of ``"is big."`` without
``big`` give ``"is."``; blank-line paragraphs keep their blank line. Text between players that is not whitespace (a template's headers) is never removed.
A message whose players are all absent and whose remaining text is whitespace is removed, like a
dropped turn, except a system message under ``system_absent="empty"``, which stays with empty
content. (Chat templates that inject a default system prompt when no system message is present
will inject it when the system message is removed: the renderer reports that behaviour, see
:attr:`ChatRenderer.injects_default_system`.) An empty player (an empty message under ``turn``)
removes nothing, so its value is 0 (the dummy axiom).

``placeholder`` (:class:`PlaceholderPolicy`) replaces an absent player's text with a fixed string
(default ``"[removed]"``) and keeps every message and separator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ..conversation import ConversationSnapshot, Message, Player, players_by_message
from ..errors import ConfigError, MaskError
from ..userinput import check_text

__all__ = (
    "AbsencePolicy",
    "DropPolicy",
    "PlaceholderPolicy",
    "SYSTEM_ABSENT",
    "available_policies",
    "get_policy",
    "register_policy",
)


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


def _join_kept(content: str, players: list[Player], kept: list[str | None]) -> str:
    """Rebuild a message from its pieces (text, or None where removed) and the text between them.

    The whitespace rule (module docs): text with no removed piece in it is unchanged. A run of
    removed pieces together with the whitespace touching it (the whitespace that ends the text
    before, whitespace-only gaps, the whitespace that starts the text after) becomes, when there is
    text on both sides, nothing if the text after touched the removed piece (punctuation: ``"is
    big."`` without ``big`` is ``"is."``), else the first non-empty of those whitespace strings;
    nothing at the start
    of the message (leading whitespace of the message itself is kept), and the message's own
    trailing whitespace at its end. Text between players that is not whitespace is never removed.
    """
    segs: list[str | None] = [content[: players[0].start]]
    for j, (player, text) in enumerate(zip(players, kept, strict=True)):
        if j > 0:
            segs.append(content[players[j - 1].end : player.start])
        segs.append(text)
    segs.append(content[players[-1].end :])
    if all(seg is not None for seg in segs):
        return "".join(s for s in segs if s is not None)
    out = ""
    i = 0
    while i < len(segs):
        seg = segs[i]
        if seg is not None:
            out += seg
            i += 1
            continue
        whitespace = [out[len(out.rstrip()) :]]
        j = i
        while j < len(segs) and (segs[j] is None or not segs[j].strip()):  # type: ignore[union-attr]
            if segs[j] is not None:
                whitespace.append(segs[j])  # type: ignore[arg-type]
            j += 1
        if j == len(segs):  # removed text up to the end of the message
            out = out.rstrip() + content[len(content.rstrip()) :] if out.strip() else out
            break
        right = segs[j]
        assert right is not None
        if not out.strip():  # removed text at the start of the message
            out += right.lstrip()
        else:
            leading = right[: len(right) - len(right.lstrip())]
            whitespace.append(leading)
            attached = not ((segs[j - 1] or "") + leading)  # the right text touched the removed one
            separator = "" if attached else next((w for w in whitespace if w), "")
            out = out.rstrip() + separator + right.lstrip()
        i = j + 1
    return out


SYSTEM_ABSENT: tuple[str, ...] = ("removed", "empty")
"""What ``drop`` does with a system message whose players are all absent: remove the message (a
template may then inject its default system prompt), or keep it with empty content."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpanPolicy:
    """Shared rendering: each absent player's text becomes :meth:`_absent_text` (None = removed)."""

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
        return messages


@dataclass(frozen=True, slots=True, kw_only=True)
class DropPolicy(_SpanPolicy):
    """Remove an absent player's text; a message left without text is removed (module docs).

    Args:
        system_absent: ``"removed"`` (default): a system message whose players are all absent is
            removed like any other; ``"empty"``: it stays, with empty content (so a template that
            injects a default system prompt when none is given does not). The two render
            differently, so a non-default value enters the coalition key through :meth:`params`.

    Raises:
        ConfigError: ``system_absent`` is not one of :data:`SYSTEM_ABSENT`.
    """

    system_absent: str = "removed"
    id: str = "drop"

    def __post_init__(self) -> None:
        if self.system_absent not in SYSTEM_ABSENT:
            raise ConfigError(
                f"unknown rule {self.system_absent!r}; use one of {', '.join(SYSTEM_ABSENT)}",
                field="--system-absent",
            )

    def params(self) -> dict[str, Any]:
        """``{}`` for the default rule, else ``{"system_absent": "empty"}``."""
        return {} if self.system_absent == "removed" else {"system_absent": self.system_absent}

    def _absent_text(self, player: Player) -> str | None:
        return None

    def _emptied(self, message: Message) -> Message | None:
        if message.role == "system" and self.system_absent == "empty":
            return replace(message, content="")
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceholderPolicy(_SpanPolicy):
    """Replace an absent player's text with ``text`` (default ``"[removed]"``).

    Raises:
        ConfigError: ``text`` is not a string, or not Unicode text (a lone surrogate).
    """

    text: str = "[removed]"
    id: str = "placeholder"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConfigError(f"placeholder must be a string, got {self.text!r}", field="--placeholder")
        check_text(self.text, "--placeholder", ConfigError)

    def params(self) -> dict[str, Any]:
        """``{"text": placeholder}``."""
        return {"text": self.text}

    def _absent_text(self, player: Player) -> str | None:
        return self.text


_REGISTRY: dict[str, Callable[..., AbsencePolicy]] = {
    "drop": DropPolicy,
    "placeholder": PlaceholderPolicy,
}


def register_policy(policy_id: str, factory: Callable[..., AbsencePolicy]) -> None:
    """Register an absence policy factory under ``policy_id`` (replacing any previous one)."""
    _REGISTRY[policy_id] = factory


def available_policies() -> tuple[str, ...]:
    """The registered policy ids, sorted."""
    return tuple(sorted(_REGISTRY))


def get_policy(policy_id: str, **params: Any) -> AbsencePolicy:
    """Build the registered policy ``policy_id`` with ``params``.

    Raises:
        ConfigError: unknown id (field ``--absence-policy``) or bad parameters.
    """
    try:
        factory = _REGISTRY[policy_id]
    except KeyError:
        raise ConfigError(
            f"unknown absence policy {policy_id!r}; use one of {', '.join(available_policies())}",
            field="--absence-policy",
        ) from None
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for {policy_id!r}: {exc}", field="--absence-policy") from exc
