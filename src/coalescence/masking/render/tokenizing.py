"""Encoding rendered text: token ids with exactly one BOS, and with special-token text from
message content encoded as text (:mod:`.spans`).

Exactly one BOS: when the tokenizer prepends a BOS token by default and the rendered text does not
already start with it, one is prepended; the template's own BOS text is never doubled.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ...errors import InputError
from .spans import sentinel, spans_of

__all__ = ("Tokenizing",)


class Tokenizing:
    """The encoding half of :class:`~coalescence.masking.render.ChatRenderer` (a mixin: the
    renderer sets these attributes in its ``__init__``).

    Attributes:
        tokenizer: the transformers fast tokenizer.
        special_ids: the tokenizer's special token ids.
    """

    tokenizer: Any
    special_ids: frozenset[int]
    _special_ids: frozenset[int]
    _bos_id: int | None
    _bos_text: str | None
    _control_text: dict[int, str]
    _special_re: re.Pattern[str] | None

    def special_text(self, texts: Iterable[str | None]) -> tuple[str, ...]:
        """The special-token strings (``<|im_end|>``, ``<s>``...) that occur in ``texts``.

        Args:
            texts: message contents and answers (``None`` entries are skipped).

        Returns:
            The distinct strings found, sorted; empty when none (their text is then encoded
            exactly as before, see module docs).
        """
        if self._special_re is None:
            return ()
        found = {m.group(0) for t in texts if isinstance(t, str) for m in self._special_re.finditer(t)}
        return tuple(sorted(found))

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, with exactly one BOS where the tokenizer uses one.

        Special-token text from message content (a :class:`RenderedText`) is encoded as text
        (see module docs).

        Raises:
            InputError: content holds special-token text that this tokenizer cannot encode as
                text exactly (field ``messages``).
        """
        if spans_of(text):
            ids, _ = self._tokenize(text)
        else:
            ids = self.tokenizer(str(text), add_special_tokens=False).input_ids
        if self._needs_bos(text):
            ids = [self._bos_id, *ids]
        return list(ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode` with each token's character ``(start, end)`` in ``text`` (a prepended
        BOS gets ``(0, 0)``): the ids are exactly :meth:`encode`'s.

        Raises:
            InputError: as :meth:`encode`.
        """
        ids, offsets = self._tokenize(text)
        if self._needs_bos(text):
            ids, offsets = [self._bos_id, *ids], [(0, 0), *offsets]
        return list(ids), [(int(a), int(b)) for a, b in offsets]

    def _needs_bos(self, text: str) -> bool:
        if self._bos_id is None or not self._bos_text or not text.startswith(self._bos_text):
            return self._bos_id is not None
        return any(a == 0 for a, _ in spans_of(text))  # the text's first "BOS" is content

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of ``text`` (no BOS added): one tokenizer call, or, where
        content holds special-token text, the piecewise encoding of the module docs."""
        spans = spans_of(text)
        if not spans:
            enc = self.tokenizer(str(text), add_special_tokens=False, return_offsets_mapping=True)
            return list(enc.input_ids), [tuple(o) for o in enc.offset_mapping]
        mark = sentinel([text])
        chars = list(text)
        for a, b in spans:
            chars[a:b] = mark * (b - a)
        escaped = "".join(chars)
        enc = self.tokenizer(escaped, add_special_tokens=False, return_offsets_mapping=True)
        esc_ids = list(enc.input_ids)
        esc_offsets = [tuple(o) for o in enc.offset_mapping]
        # the template's control tokens: special tokens spelled out in the text (not an <unk>)
        controls = [
            k for k, (i, (a, b)) in enumerate(zip(esc_ids, esc_offsets, strict=True))
            if i in self._control_text and self._control_text[i] in escaped[a:b]
        ]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        bounds = [-1, *controls, len(esc_ids)]
        for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if n:  # the control token itself
                ids.append(esc_ids[lo])
                offsets.append(esc_offsets[lo])
            start = esc_offsets[lo][1] if lo >= 0 else 0
            end = esc_offsets[hi][0] if hi < len(esc_ids) else len(text)
            if not any(a < end and b > start for a, b in spans):
                ids += esc_ids[lo + 1 : hi]
                offsets += esc_offsets[lo + 1 : hi]
                continue
            alone = self.tokenizer(escaped[start:end], add_special_tokens=False).input_ids
            if list(alone) != esc_ids[lo + 1 : hi]:
                found = ", ".join(repr(text[a:b]) for a, b in spans[:3])
                raise InputError(
                    f"the conversation contains the special-token text {found}, and this tokenizer "
                    "encodes a piece of text alone differently from inside the whole text, so it "
                    "cannot be encoded as text exactly; remove or rewrite that text",
                    field="messages",
                )
            piece = self.tokenizer(
                text[start:end], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True
            )
            ids += list(piece.input_ids)
            offsets += [(a + start, b + start) for a, b in piece.offset_mapping]
        return ids, offsets
