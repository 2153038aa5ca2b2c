"""Text units: where the paragraphs, sentences and words of a text are, as character spans.

Every function here takes a string and returns ``(start, end)`` character offsets into it, in text
order, non-overlapping, each span non-empty and trimmed of surrounding whitespace, so that
``text[start:end]`` is the unit's text byte for byte. Nothing here knows about messages or
players; :func:`coalescence.conversation.segment_players` turns spans into players.

- ``paragraph``: text separated by blank lines (a line break, optional horizontal whitespace, and
  another line break).
- ``sentence``: pysbd (rule-based sentence boundary disambiguation; Sadvilkar & Neumann 2020).
- ``word``: NLTK's Penn Treebank word tokenizer (``TreebankWordTokenizer.span_tokenize``; Bird,
  Klein & Loper 2009), which needs no downloaded data: punctuation and clitics are their own
  words (``"don't."`` is ``do``, ``n't``, ``.``), and a run of characters with no space (CJK, an
  emoji sequence) stays one word.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .errors import BackendUnavailable

__all__ = ("SPAN_UNITS", "paragraph_spans", "sentence_spans", "unit_spans", "word_spans")

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
    spans: list[tuple[int, int]] = []
    try:
        raw = list(TreebankWordTokenizer().span_tokenize(text))
    except ValueError:  # the tokenizer rewrote a character it cannot align: fall back to runs
        raw = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    for start, end in raw:
        span = _trimmed(text, start, end)
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
