"""Rendered text that remembers where message content spells a special token.

Special-token text in content is text. A message (or the answer) whose content holds the text of
one of the tokenizer's special tokens (``<|im_end|>``, ``<s>``...) would, tokenized whole with the
rendering, become that control token: a forged turn, or an end-of-turn inside the answer. The
conversation is then rendered a second time with those substrings replaced by private-use
characters of the same length; every special token of that rendering is the template's. The text
is encoded at those control tokens (their ids as they are) and each piece between them is
tokenized with ``split_special_tokens=True`` (so content is ordinary text), offsets shifted. A piece
is only trusted when, tokenized alone, it gives the tokens it gets inside the whole text (checked
on the escaped rendering: a Metaspace ``prepend_scheme="first"`` tokenizer fails this), else the
input is refused (:class:`~coalescence.errors.InputError`, field ``messages``). Text without such
substrings is encoded exactly as before (one tokenizer call on the whole text).

This module holds the text side: :class:`RenderedText` (a ``str`` with the character spans of
such content) and the helpers that keep those spans through slicing; the encoding is
:mod:`.tokenizing`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ("PRIVATE_USE", "RenderedText", "sentinel", "slice_text", "spans_of", "with_spans")

PRIVATE_USE = range(0xE000, 0xF900)
"""The private-use characters a sentinel is chosen from."""


class RenderedText(str):
    """Rendered chat text that remembers where message content holds special-token text.

    A plain :class:`str` in every other respect; :meth:`ChatRenderer.encode` reads
    :attr:`content_specials` to encode those characters as text rather than as control tokens.

    Attributes:
        content_specials: ``(start, end)`` character spans (sorted, disjoint) of the text that
            comes from message content and spells a special token.
    """

    content_specials: tuple[tuple[int, int], ...] = ()


def with_spans(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """``text`` carrying ``spans`` (a plain ``str`` when there are none)."""
    if not spans:
        return str(text)
    out = RenderedText(text)
    out.content_specials = tuple(spans)
    return out


def spans_of(text: str) -> tuple[tuple[int, int], ...]:
    """The content spans ``text`` carries (empty for a plain ``str``)."""
    return getattr(text, "content_specials", ())


def slice_text(text: str, start: int, end: int) -> str:
    """``text[start:end]``, keeping the content spans inside it (shifted)."""
    spans = [(max(a, start) - start, min(b, end) - start) for a, b in spans_of(text) if a < end and b > start]
    return with_spans(text[start:end], spans)


def sentinel(texts: Sequence[str]) -> str:
    """A private-use character that occurs in none of ``texts``."""
    used = set().union(*(set(t) for t in texts)) if texts else set()
    return next(chr(c) for c in PRIVATE_USE if chr(c) not in used)
