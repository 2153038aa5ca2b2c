"""Immutable snapshots: a conversation, its target and its players frozen under one identity.

A :class:`ConversationSnapshot` freezes a conversation, its target and its players (cut by
:func:`coalescence.segmentation.segment_players`, or given) under a ``snapshot_id`` (SHA-256 of a
canonical encoding), which every coalition key starts from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .conversation import Conversation, DeclaredPlayer, Message, Player
from .errors import InputError
from .segmentation import segment_players

__all__ = ("SNAPSHOT_SCHEMA", "ConversationSnapshot", "fine_snapshot")

SNAPSHOT_SCHEMA = 1
"""The version of the canonical encoding hashed into ``snapshot_id``."""


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationSnapshot:
    """An immutable conversation + target + players, identified by ``snapshot_id``.

    Args:
        conversation: the conversation; its target must be set.
        unit: the player unit the players were cut with.
        players: the players (see :func:`segment_players`).

    Attributes:
        snapshot_id: 64 hex chars, SHA-256 of the canonical JSON encoding (sorted keys, no
            whitespace, UTF-8) of the messages, the target, the unit and the player spans, and of
            the target's token ids when the answer was generated (:attr:`Conversation.target_ids`).

    Raises:
        InputError: the target is missing, no players, or a player span that does not match its
            message.
    """

    conversation: Conversation
    unit: str
    players: tuple[Player, ...]
    snapshot_id: str = field(init=False)

    def __post_init__(self) -> None:
        if self.conversation.target is None:
            raise InputError("the snapshot needs a target answer", field="target")
        if not self.players:
            raise InputError("no attributable players", field="roles")
        msgs = self.conversation.messages
        taken: dict[int, list[tuple[int, int, str]]] = {}
        for i, p in enumerate(self.players):
            if p.index != i:
                raise InputError(f"player {i} is out of order", field="players")
            for m, start, end in p.spans:
                if not 0 <= m < len(msgs) or not 0 <= start <= end <= len(msgs[m].content):
                    raise InputError(f"player {p.label} names no message or a span outside it", field="players")
                taken.setdefault(m, []).append((start, end, p.label))
            if msgs[p.message_index].content[p.start : p.end] != p.text:
                raise InputError(f"player {p.label} does not match its message text", field="players")
        for spans in taken.values():
            spans.sort()
            for (_, end_a, _), (start_b, _, label) in zip(spans, spans[1:]):
                if start_b < end_a:
                    raise InputError(f"player {label} overlaps another one", field="players")
        payload = {
            "schema": SNAPSHOT_SCHEMA,
            "messages": [[m.role, m.content] for m in self.conversation.messages],
            "target": self.conversation.target,
            "unit": self.unit,
            "players": [
                [p.message_index, p.start, p.end] + ([list(e) for e in p.extra] if p.extra else [])
                for p in self.players
            ],
        }
        if self.conversation.target_ids is not None:  # absent otherwise: ids of text answers unchanged
            payload["target_ids"] = list(self.conversation.target_ids)
        object.__setattr__(self, "snapshot_id", hashlib.sha256(_canonical(payload)).hexdigest())

    @classmethod
    def build(
        cls, conversation: Conversation, *, unit: str = "turn", roles: Iterable[str] | None = None
    ) -> ConversationSnapshot:
        """Segment ``conversation`` into players and freeze it (see :func:`segment_players`)."""
        return cls(
            conversation=conversation,
            unit=unit,
            players=segment_players(conversation, unit=unit, roles=roles),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConversationSnapshot:
        """Rebuild a snapshot from :meth:`to_dict` output (e.g. an archive manifest).

        Raises:
            InputError: malformed data, or a rebuilt ``snapshot_id`` that differs from the recorded
                one (the data was edited).
        """
        try:
            messages = tuple(Message(role=m["role"], content=m["content"]) for m in data["messages"])
            ids = data.get("target_ids")
            conversation = Conversation(
                messages=messages,
                target=data["target"],
                target_source=data.get("target_source", "field"),
                target_ids=tuple(ids) if isinstance(ids, list) else ids,
            )
            players = tuple(
                Player(
                    index=p["index"],
                    label=p["label"],
                    role=p["role"],
                    message_index=p["message_index"],
                    start=p["start"],
                    end=p["end"],
                    text=messages[p["message_index"]].content[p["start"] : p["end"]],
                    extra=tuple(tuple(e) for e in p.get("extra", ())),
                )
                for p in data["players"]
            )
            snapshot = cls(conversation=conversation, unit=data["unit"], players=players)
        except (KeyError, TypeError, IndexError) as exc:
            raise InputError(f"malformed snapshot record: {exc!r}", field="snapshots") from exc
        recorded = data.get("snapshot_id")
        if recorded is not None and recorded != snapshot.snapshot_id:
            raise InputError(
                f"snapshot {recorded[:12]} does not match its recorded content (rebuilt id "
                f"{snapshot.snapshot_id[:12]}); the record was altered",
                field="snapshots",
            )
        return snapshot

    @property
    def n_players(self) -> int:
        """Number of players n."""
        return len(self.players)

    @property
    def target(self) -> str:
        """The target answer (never ``None`` in a snapshot)."""
        assert self.conversation.target is not None
        return self.conversation.target

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (snapshot_id, messages, target, target_ids for a generated
        answer, unit, players)."""
        ids = self.conversation.target_ids
        return ({"target_ids": list(ids)} if ids is not None else {}) | {
            "snapshot_id": self.snapshot_id,
            "messages": [m.as_dict() for m in self.conversation.messages],
            "target": self.target,
            "target_source": self.conversation.target_source,
            "unit": self.unit,
            "players": [
                {
                    "index": p.index,
                    "label": p.label,
                    "role": p.role,
                    "message_index": p.message_index,
                    "start": p.start,
                    "end": p.end,
                }
                | ({"extra": [list(e) for e in p.extra]} if p.extra else {})
                for p in self.players
            ],
        }


def fine_snapshot(coarse: ConversationSnapshot, fine_unit: str) -> tuple[ConversationSnapshot, tuple[int, ...]]:
    """The fine players inside the coarse players, as one snapshot, and each fine player's parent:
    the fine game of a hierarchical attribution (:mod:`coalescence.app.hierarchy`).

    Args:
        coarse: the coarse snapshot (its target set).
        fine_unit: ``paragraph``, ``sentence`` or ``word``.

    Returns:
        The fine snapshot (unit ``fine_unit``; labels ``<coarse label>.s<k>`` ...) and
        ``parents``: the coarse player index of each fine player.

    Raises:
        InputError: the coarse players hold no fine player (field ``--hierarchy``).
    """
    declared = tuple(
        DeclaredPlayer(message=m, start=a, end=b, label=p.label)
        for p in coarse.players
        for m, a, b in p.spans
        if b > a
    )
    conversation = Conversation(
        messages=coarse.conversation.messages,
        target=coarse.conversation.target,
        target_source=coarse.conversation.target_source,
        target_ids=coarse.conversation.target_ids,
        declared=declared,
    )
    players = segment_players(conversation, unit=fine_unit)
    parents = []
    for f in players:
        parent = next(
            p.index for p in coarse.players if any(m == f.message_index and a <= f.start and f.end <= b for m, a, b in p.spans)
        )
        parents.append(parent)
    return ConversationSnapshot(conversation=conversation, unit=fine_unit, players=players), tuple(parents)
