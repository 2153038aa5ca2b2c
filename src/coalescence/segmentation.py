"""Text units: where the paragraphs, sentences and words of a text are, as character spans.

The span functions take a string and return ``(start, end)`` character offsets into it, in text
order, non-overlapping, each span non-empty and trimmed of surrounding whitespace, so that
``text[start:end]`` is the unit's text byte for byte. :func:`segment_players` turns them (and
turns, tool exchanges, declared spans) into the players of a conversation.

- ``paragraph``: text separated by blank lines (a line break, optional horizontal whitespace, and
  another line break).
- ``sentence``: pysbd (rule-based sentence boundary disambiguation; Sadvilkar & Neumann 2020), on
  chunks of at most :data:`SENTENCE_CHUNK` characters, so that time is linear in the text's length
  (see :func:`sentence_spans`).
- ``word``: NLTK's Penn Treebank word tokenizer (``TreebankWordTokenizer.span_tokenize``; Bird,
  Klein & Loper 2009) on each pysbd sentence, which needs no downloaded data: punctuation and
  clitics are their own words (``"don't."`` is ``do``, ``n't``, ``.``), and a run of characters with no space (CJK, an
  emoji sequence) stays one word.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from typing import Any

from .conversation import ROLES, UNITS, Conversation, Player
from .errors import BackendUnavailable, InputError
from .userinput import did_you_mean

__all__ = (
    "SENTENCE_CHUNK",
    "SPAN_UNITS",
    "count_players",
    "paragraph_spans",
    "segment_players",
    "sentence_spans",
    "unit_spans",
    "word_spans",
)

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


SENTENCE_CHUNK = 4096
"""The most characters one pysbd call sees (:func:`sentence_spans` splits longer texts first)."""

_EDGE = 256  # pysbd sentence ends at least this far (or a quarter window) from a window's cut end are final


def _pysbd_spans(segmenter: Any, text: str, start: int, stop: int) -> list[tuple[int, int]]:
    """pysbd's sentences of ``text[start:stop]`` as trimmed spans into ``text``, each re-located
    in the text so offsets are exact even where pysbd's own offsets drift."""
    chunk = text[start:stop]
    spans: list[tuple[int, int]] = []
    cursor = 0
    for sentence in segmenter.segment(chunk):
        core = sentence.strip()
        if not core:
            continue
        at = chunk.find(core, cursor)
        if at < 0:  # pysbd altered the text; fall back to the rest of the chunk
            core = chunk[cursor:].strip()
            at = chunk.find(core, cursor)
            if not core:
                break
        spans.append((start + at, start + at + len(core)))
        cursor = at + len(core)
    return spans


_LIST_ITEM = re.compile(r"[^\S\n]*(?:\d{1,3}[.)]|[A-Za-z][.)]|\(?[ivxlcdm]+\)|[-*\u2022\u2043])(?=\s)", re.I)


def _line_cut(text: str, start: int, stop: int) -> int | None:
    """Where to end a chunk of ``text[start:...]`` at most ``stop``: just after a line break in the
    second half of the window, or None if there is none there. pysbd ends a sentence at every
    line break, so a cut there moves no boundary; but pysbd finds list items ("1.", "b)") by
    reading the whole text, so a cut between two list items comes last, and a cut after a blank
    line before one after a single line break."""
    low = start + (stop - start) // 2
    best: tuple[int, int] | None = None  # (rank, cut)
    at = text.rfind("\n", low, stop)
    while at >= 0:
        cut = at + 1
        before = at  # the start of the last non-blank line before the cut
        while before > start and text[before - 1].isspace():
            before -= 1
        blank = "\n" in text[before:at]
        before = text.rfind("\n", start, before) + 1 if before > start else start
        inside_list = bool(_LIST_ITEM.match(text, cut) and _LIST_ITEM.match(text, max(before, start)))
        rank = (0 if blank else 1) + (2 if inside_list else 0)
        if best is None or rank < best[0]:
            best = (rank, cut)
            if rank == 0:
                break
        at = text.rfind("\n", low, at)
    return None if best is None else best[1]


def _iter_sentence_spans(text: str, chunk: int = SENTENCE_CHUNK) -> Iterator[tuple[int, int]]:
    """The spans of :func:`sentence_spans`, lazily, chunk by chunk (see its docs)."""
    import pysbd

    segmenter = pysbd.Segmenter(language="en", clean=False)
    start, n = 0, len(text)
    while start < n:
        stop = start + chunk
        if stop >= n:
            yield from _pysbd_spans(segmenter, text, start, n)
            return
        cut = _line_cut(text, start, stop)
        if cut is not None:
            yield from _pysbd_spans(segmenter, text, start, cut)
            start = cut
            continue
        # a line longer than the window: keep pysbd's sentence ends far from the window's cut end
        spans = _pysbd_spans(segmenter, text, start, stop)
        final = [span for span in spans[:-1] if span[1] <= stop - min(_EDGE, chunk // 4)]
        if final:
            # resume after the last of them that a list item does not follow (pysbd reads a list's
            # numbering across the text), if one is in the window's second half
            keep = len(final)
            for k in range(len(final), 0, -1):
                if final[k - 1][1] < start + chunk // 2:
                    break
                if not _LIST_ITEM.match(text, final[k - 1][1]):
                    keep = k
                    break
            yield from final[:keep]
            start = final[keep - 1][1]
            continue
        # one sentence fills the window: cut it at its last space (or the window end)
        space = max(text.rfind(" ", start + chunk // 2, stop), text.rfind("\t", start + chunk // 2, stop))
        cut = space + 1 if space >= 0 else stop
        yield from _pysbd_spans(segmenter, text, start, cut)
        start = cut


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of ``text``, whitespace trimmed, in order.

    Uses pysbd for the boundaries; each span is re-located in ``text`` so offsets are exact even
    where pysbd's own offsets drift. pysbd's time grows with the square of a text's length (and
    of a line's), so a text longer than :data:`SENTENCE_CHUNK` characters is split first, and the
    time is linear in the length: into chunks that end at a line break (a blank line preferred),
    where pysbd always ends a sentence; a longer line is segmented in windows of that size, each
    keeping the sentence ends pysbd finds at least 256 characters before the window's end; a
    sentence that fills a whole window without a line break is cut at its last space in the
    window. On text of up to :data:`SENTENCE_CHUNK` characters (a chunk) the spans are pysbd's
    own; on longer text they differ only where pysbd reads context across a chunk: a list split
    between two chunks (numbered, lettered or dashed; pysbd even takes the 'e.' of 'e.g.' for the
    item of a lettered list it saw earlier), or quotation marks and parentheses that pysbd pairs
    across a long line.

    Returns:
        ``(start, end)`` character offsets into ``text``, in order, non-empty, trimmed.
    """
    return list(_iter_sentence_spans(text))


def _iter_word_spans(text: str) -> Iterator[tuple[int, int]]:
    """The spans of :func:`word_spans`, lazily, sentence by sentence."""
    try:
        from nltk.tokenize import TreebankWordTokenizer
    except ImportError as exc:  # pragma: no cover - nltk is a dependency
        raise BackendUnavailable(
            "the word unit needs NLTK; install it with: pip install 'nltk>=3.9'", field="unit"
        ) from exc
    tokenizer = TreebankWordTokenizer()
    for s_start, s_end in _iter_sentence_spans(text):  # Treebank expects one sentence at a time
        sentence = text[s_start:s_end]
        try:
            raw = list(tokenizer.span_tokenize(sentence))
        except ValueError:  # a character the tokenizer rewrote and cannot align: whitespace runs
            raw = [(m.start(), m.end()) for m in re.finditer(r"\S+", sentence)]
        for start, end in raw:
            span = _trimmed(text, s_start + start, s_start + end)
            if span:
                yield span


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the words of ``text`` (NLTK Treebank tokenizer, see module docs), in
    time linear in the length of ``text`` (the sentences come from :func:`sentence_spans`).

    Raises:
        BackendUnavailable: NLTK is not installed (with the install command).
    """
    return list(_iter_word_spans(text))


SPAN_UNITS: dict[str, Callable[[str], list[tuple[int, int]]]] = {
    "paragraph": paragraph_spans,
    "sentence": sentence_spans,
    "word": word_spans,
}
"""The units that split text, by name."""

_ITER_UNITS: dict[str, Callable[[str], Iterable[tuple[int, int]]]] = {
    "paragraph": paragraph_spans,
    "sentence": _iter_sentence_spans,
    "word": _iter_word_spans,
}


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


def _exchange_groups(conversation: Conversation, role_set: set[str]) -> list[list[int]]:
    """Message groups of ``--unit exchange``: a user message and the messages after it up to the
    next user or system message (the assistant's reply, its tool calls and their results) form one
    group; a system message, and a message before the first user message, is a group of its own.
    The last user message and what follows it (the exchange the answer completes) form no group:
    they stay in every coalition. A group is attributable when its first message's role is."""
    msgs = conversation.messages
    users = [m for m, msg in enumerate(msgs) if msg.role == "user"]
    last_user = users[-1] if users else len(msgs)
    groups: list[list[int]] = []
    in_exchange = False  # whether the last group is a user's exchange that later messages join
    for m in range(last_user):
        role = msgs[m].role
        if role in ("user", "system"):
            groups.append([m])
            in_exchange = role == "user"
        elif in_exchange:
            groups[-1].append(m)
        else:  # before the first user message, or right after a system message
            groups.append([m])
    return [g for g in groups if msgs[g[0]].role in role_set]


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
    - ``exchange``: a user message and the reply to it (every message up to the next user or
      system message: the assistant's turns, its tool calls and their results) form one player; a
      system message is a player of its own. The last user message and what follows it, the
      exchange the answer completes, stay in every coalition. Removing whole exchanges keeps
      user and assistant turns alternating, so every coalition renders with templates that
      require alternation (Llama-2, Mistral, Gemma).
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
        raise InputError(f"unknown unit {unit!r}{did_you_mean(unit, UNITS)}; use one of {', '.join(UNITS)}", field="unit")
    role_set = set(ROLES if roles is None else roles)
    bad = sorted(role_set - set(ROLES))
    if bad:
        raise InputError(
            f"unknown role {bad[0]!r}; use a comma-separated subset of {','.join(ROLES)}",
            field="roles",
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
                field="unit",
            )
        for m, start, end, label in _regions(conversation, role_set, unit):
            add(label or "", m, start, end)
    elif unit == "turn":
        for m, msg in enumerate(msgs):
            if msg.role in role_set:
                add(f"{msg.role}[{m}]", m, 0, len(msg.content))
    elif unit in ("tool", "exchange"):
        groups = _tool_groups(conversation, role_set) if unit == "tool" else _exchange_groups(conversation, role_set)
        for group in groups:
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
            field="roles",
        )
    return tuple(players)


def count_players(
    conversation: Conversation, *, unit: str = "turn", roles: Iterable[str] | None = None, at_most: int | None = None
) -> int:
    """The number of players :func:`segment_players` gives, or ``at_most + 1`` as soon as there
    are more than ``at_most``: a text unit stops splitting there, so a limit (exact Shapley's 16
    players) refuses a long text after a few sentences instead of segmenting all of it.

    Args:
        conversation: the conversation.
        unit: one of :data:`UNITS`.
        roles: the attributable roles (``None``: every role).
        at_most: stop counting past this many players (``None``: count them all).

    Returns:
        ``min(n_players, at_most + 1)`` (``n_players`` without ``at_most``).

    Raises:
        InputError: as :func:`segment_players` (unknown unit or role, no attributable player).
    """
    role_set = set(ROLES if roles is None else roles)
    if unit not in _ITER_UNITS or role_set - set(ROLES):  # cheap units; a bad unit or role raises there
        return len(segment_players(conversation, unit=unit, roles=roles))
    limit = at_most if at_most is not None else -1
    count = 0
    for m, start, end, _ in _regions(conversation, role_set, unit):
        for _span in _ITER_UNITS[unit](conversation.messages[m].content[start:end]):
            count += 1
            if count == limit + 1:
                return count
    if count == 0:
        segment_players(conversation, unit=unit, roles=roles)  # raises "no attributable players"
    return count
