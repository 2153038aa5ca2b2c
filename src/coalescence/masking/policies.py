"""Absence policies: how an absent player disappears from the conversation.

A policy turns a snapshot and a coalition (which players are present) into the chat messages of
the masked prompt. Policies are registered by id (:func:`register_policy`, :func:`get_policy`) so
more can be added; a policy's id and :meth:`~AbsencePolicy.params` enter the coalition key.

Rules shared by every policy:

- text that belongs to no player (and messages of non-attributable roles) is never changed;
- with every player present the messages are exactly the original ones (byte for byte).

``drop`` (:class:`DropPolicy`) removes an absent player's text. A *turn* player removes its whole
message. For sentence players the whitespace rule is: the whitespace run that followed a kept
player is kept only if another kept piece of text follows it in the same message, so removing a
sentence never glues two neighbours together and never leaves a dangling separator (``"A. B. C."``
without B is ``"A. C."``, without C is ``"A. B."``). A message whose players are all absent and
whose remaining text is whitespace is removed, like a dropped turn. (Chat templates that inject a
default system prompt when no system message is present will then inject it: the renderer
reports that behaviour, see :attr:`ChatRenderer.injects_default_system`.)

``placeholder`` (:class:`PlaceholderPolicy`) replaces an absent player's text with a fixed string
(default ``"[removed]"``) and keeps every message and separator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..conversation import ConversationSnapshot, Message, Player, players_by_message
from ..errors import ConfigError, MaskError

__all__ = (
    "AbsencePolicy",
    "DropPolicy",
    "PlaceholderPolicy",
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
    """Rebuild a message from its players (text or None for removed) and the gaps between them.

    Gaps at the start and end of the message are kept as they are. A whitespace-only gap between
    players is emitted only between two kept pieces (the first such gap after a kept piece is the
    separator); gaps with other text are never removed.
    """
    out: list[str] = [content[: players[0].start]]
    emitted_content = False
    pending: str | None = None
    for j, (player, text) in enumerate(zip(players, kept, strict=True)):
        if j > 0:
            gap = content[players[j - 1].end : player.start]
            if gap.strip():  # real text between players: never removed
                if pending is not None:
                    out.append(pending)
                    pending = None
                out.append(gap)
                emitted_content = True
            elif emitted_content and pending is None:
                pending = gap
        if text is None:
            continue
        if pending is not None:
            out.append(pending)
            pending = None
        out.append(text)
        emitted_content = True
    out.append(content[players[-1].end :])
    return "".join(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpanPolicy:
    """Shared rendering: each absent player's text becomes :meth:`_absent_text` (None = removed)."""

    def _absent_text(self, player: Player) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def render(self, snapshot: ConversationSnapshot, present: np.ndarray) -> list[Message]:
        present = _check_present(snapshot, present)
        groups = players_by_message(snapshot.players)
        messages: list[Message] = []
        for m, message in enumerate(snapshot.conversation.messages):
            players = groups.get(m)
            if not players or all(present[p.index] for p in players):
                messages.append(message)
                continue
            kept = [p.text if present[p.index] else self._absent_text(p) for p in players]
            content = _join_kept(message.content, players, kept)
            if all(k is None for k in kept) and not content.strip():
                continue  # every player of the message removed: the message goes too
            messages.append(Message(role=message.role, content=content))
        return messages


@dataclass(frozen=True, slots=True, kw_only=True)
class DropPolicy(_SpanPolicy):
    """Remove an absent player's text; a message left without text is removed (module docs)."""

    id: str = "drop"

    def params(self) -> dict[str, Any]:
        """No parameters."""
        return {}

    def _absent_text(self, player: Player) -> str | None:
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceholderPolicy(_SpanPolicy):
    """Replace an absent player's text with ``text`` (default ``"[removed]"``).

    Raises:
        ConfigError: ``text`` is not a string.
    """

    text: str = "[removed]"
    id: str = "placeholder"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConfigError(f"placeholder must be a string, got {self.text!r}", field="--placeholder")

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
