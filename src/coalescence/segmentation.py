"""Text units: where the paragraphs, sentences and words of a text are, as character spans.

The span functions take a string and return ``(start, end)`` character offsets into it, in text
order, non-overlapping, each span non-empty and trimmed of surrounding whitespace, so that
``text[start:end]`` is the unit's text byte for byte. :func:`segment_players` turns them (and
turns, tool exchanges, declared spans) into the players of a conversation.

- ``paragraph``: text separated by blank lines (a line break, optional horizontal whitespace, and
  another line break).
- ``sentence``: pysbd (rule-based sentence boundary disambiguation; Sadvilkar & Neumann 2020).
- ``word``: NLTK's Penn Treebank word tokenizer (``TreebankWordTokenizer.span_tokenize``; Bird,
  Klein & Loper 2009) on each pysbd sentence, which needs no downloaded data: punctuation and
  clitics are their own words (``"don't."`` is ``do``, ``n't``, ``.``), and a run of characters with no space (CJK, an
  emoji sequence) stays one word.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from typing import Any

from .conversation import ROLES, UNITS, Conversation, Player
from .errors import BackendUnavailable, InputError

__all__ = ("SPAN_UNITS", "paragraph_spans", "segment_players", "sentence_spans", "unit_spans", "word_spans")

_BLANK_LINE = re.compile(r"\n[^\S\n]*\n\s*")


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    """``[start, end)`` with surrounding whitespace removed, or None when nothing is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the paragraphs of ``text`` (separated by blank lines), trimmed."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for match in _BLANK_LINE.finditer(text):
        span = _trimmed(text, cursor, match.start())
        if span:
            spans.append(span)
        cursor = match.end()
    span = _trimmed(text, cursor, len(text))
    if span:
        spans.append(span)
    return spans


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of ``text``, whitespace trimmed, in order.

    Uses pysbd for the boundaries; each span is re-located in ``text`` so offsets are exact even
    where pysbd's own offsets drift.
    """
    import pysbd

    segmenter = pysbd.Segmenter(language="en", clean=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for sentence in segmenter.segment(text):
        core = sentence.strip()
        if not core:
            continue
        start = text.find(core, cursor)
        if start < 0:  # pysbd altered the text; fall back to the rest of the text
            core = text[cursor:].strip()
            start = text.find(core, cursor)
            if not core:
                break
        end = start + len(core)
        spans.append((start, end))
        cursor = end
    return spans


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the words of ``text`` (NLTK Treebank tokenizer, see module docs).

    Raises:
        BackendUnavailable: NLTK is not installed (with the install command).
    """
    try:
        from nltk.tokenize import TreebankWordTokenizer
    except ImportError as exc:  # pragma: no cover - nltk is a dependency
        raise BackendUnavailable(
            "the word unit needs NLTK; install it with: pip install 'nltk>=3.9'", field="--unit"
        ) from exc
    tokenizer = TreebankWordTokenizer()
    spans: list[tuple[int, int]] = []
    for s_start, s_end in sentence_spans(text):  # Treebank expects one sentence at a time
        sentence = text[s_start:s_end]
        try:
            raw = list(tokenizer.span_tokenize(sentence))
        except ValueError:  # a character the tokenizer rewrote and cannot align: whitespace runs
            raw = [(m.start(), m.end()) for m in re.finditer(r"\S+", sentence)]
        for start, end in raw:
            span = _trimmed(text, s_start + start, s_start + end)
            if span:
                spans.append(span)
    return spans


SPAN_UNITS: dict[str, Callable[[str], list[tuple[int, int]]]] = {
    "paragraph": paragraph_spans,
    "sentence": sentence_spans,
    "word": word_spans,
}
"""The units that split text, by name."""


def unit_spans(text: str, unit: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """Spans of ``unit`` inside ``text[start:end]``, as offsets into ``text``.

    Args:
        text: the whole text (a message's content).
        unit: a key of :data:`SPAN_UNITS`.
        start: first character of the region to split.
        end: end of the region (exclusive; default the end of ``text``).

    Returns:
        ``(start, end)`` pairs into ``text``, in order, non-empty, whitespace trimmed.
    """
    stop = len(text) if end is None else end
    return [(start + a, start + b) for a, b in SPAN_UNITS[unit](text[start:stop])]


def _regions(
    conversation: Conversation, role_set: set[str], unit: str
) -> list[tuple[int, int, int, str | None]]:
    """The text regions a unit splits: ``(message, start, end, label prefix or None)``.

    With declared players, the regions are the declared spans (text outside them is never a
    player); otherwise every attributable message is a region.
    """
    msgs = conversation.messages
    if conversation.declared:
        return [
            (d.message, d.start, d.end, d.label)
            for d in conversation.declared
            if msgs[d.message].role in role_set
        ]
    return [(m, 0, len(msg.content), None) for m, msg in enumerate(msgs) if msg.role in role_set]


def _tool_groups(conversation: Conversation, role_set: set[str]) -> list[list[int]]:
    """Message groups of ``--unit tool``: an assistant message with tool calls and the tool messages
    that answer it (by ``tool_call_id``, else the tool messages right after it); every other
    attributable message alone. An exchange takes only attributable messages: with ``tool`` outside
    ``role_set`` its tool messages stay in every coalition, and with ``assistant`` outside it each
    tool message is a player alone."""
    msgs = conversation.messages
    groups: list[list[int]] = []
    taken: set[int] = set()
    for m, msg in enumerate(msgs):
        if m in taken or msg.role not in role_set:
            continue
        group = [m]
        if msg.role == "assistant" and msg.tool_call_ids and "tool" in role_set:
            ids = set(msg.tool_call_ids)
            for j in range(m + 1, len(msgs)):
                other = msgs[j]
                if other.role != "tool":
                    if other.role == "assistant" and other.tool_call_ids:
                        break
                    continue
                if (other.tool_call_ids and set(other.tool_call_ids) & ids) or (
                    not other.tool_call_ids and j == group[-1] + 1
                ):
                    group.append(j)
            taken.update(group)
        groups.append(group)
    return groups


def segment_players(
    conversation: Conversation, *, unit: str = "turn", roles: Iterable[str] | None = None
) -> tuple[Player, ...]:
    """Cut the attributable messages of a conversation into players.

    Units:

    - ``turn``: one player per attributable message, empty messages included (an empty player
      removes nothing, so its value is 0: the dummy axiom).
    - ``paragraph`` / ``sentence`` / ``word``: one player per paragraph (blank-line separated),
      sentence (pysbd) or word (NLTK Treebank) of each attributable message, whitespace around them
      excluded from the spans (see :mod:`coalescence.segmentation`). With declared players, only
      the text inside them is split and the rest is held fixed.
    - ``tool``: like ``turn``, except that an assistant message with tool calls and the tool
      messages answering it form one player.
    - ``document``: the players the input declares (its ``players`` list, or the documents of the
      RAG form), in the input's order.

    Args:
        conversation: the conversation (its prompt messages are segmented; the target never is).
        unit: one of :data:`UNITS`.
        roles: the roles whose messages are attributable; ``None`` means every role. Messages of
            other roles are always kept in every coalition.

    Returns:
        The players, indexed from 0: in message order, then text order (``document``: the
        declared order).

    Raises:
        InputError: unknown unit or role, ``document`` without declared players, or no
            attributable player (field ``--unit``/``--roles``).
    """
    if unit not in UNITS:
        raise InputError(f"unknown unit {unit!r}; use one of {', '.join(UNITS)}", field="--unit")
    role_set = set(ROLES if roles is None else roles)
    bad = sorted(role_set - set(ROLES))
    if bad:
        raise InputError(
            f"unknown role {bad[0]!r}; use a comma-separated subset of {','.join(ROLES)}",
            field="--roles",
        )
    msgs = conversation.messages
    players: list[Player] = []

    def add(label: str, m: int, start: int, end: int, extra: tuple[tuple[int, int, int], ...] = ()) -> None:
        players.append(
            Player(
                index=len(players),
                label=label,
                role=msgs[m].role,
                message_index=m,
                start=start,
                end=end,
                text=msgs[m].content[start:end],
                extra=extra,
            )
        )

    if unit == "document":
        if not conversation.declared:
            raise InputError(
                'the input declares no players; give a "players" list or the RAG form '
                '{"documents", "question", "answer"}, or choose another unit',
                field="--unit",
            )
        for m, start, end, label in _regions(conversation, role_set, unit):
            add(label or "", m, start, end)
    elif unit == "turn":
        for m, msg in enumerate(msgs):
            if msg.role in role_set:
                add(f"{msg.role}[{m}]", m, 0, len(msg.content))
    elif unit == "tool":
        for group in _tool_groups(conversation, role_set):
            m = group[0]
            label = "+".join(f"{msgs[j].role}[{j}]" for j in group)
            add(label, m, 0, len(msgs[m].content), tuple((j, 0, len(msgs[j].content)) for j in group[1:]))
    else:
        letter = {"paragraph": "p", "sentence": "s", "word": "w"}[unit]
        counts: dict[Any, int] = {}
        for m, start, end, prefix in _regions(conversation, role_set, unit):
            base = prefix if prefix is not None else f"{msgs[m].role}[{m}]"
            for a, b in unit_spans(msgs[m].content, unit, start, end):
                k = counts.get(base, 0)
                counts[base] = k + 1
                add(f"{base}.{letter}{k}", m, a, b)
    if not players:
        present = sorted({msg.role for msg in msgs if msg.content.strip()})
        raise InputError(
            f"no attributable players: no message with a role in {sorted(role_set)} has any "
            f"{unit}; the conversation has {present}; widen --roles or choose another --unit",
            field="--roles",
        )
    return tuple(players)
