"""From coalition to token ids: chat template rendering and teacher-forcing targets.

Scoring (teacher forcing). The answer is located by character offsets in the *full* rendering
(the prompt messages plus the answer as the last assistant turn, rendered by the model's own chat
template): the scored tokens are the tokens that overlap the answer's content, through the
template's end-of-turn token (the decision to stop is part of the answer); template text after
that token is not scored. Whatever the template writes between the assistant header and the
answer's content (Qwen3's empty reasoning block ``<think>\\n\\n</think>\\n\\n``, the space after
Llama-2's ``[/INST]``) is prompt: conditioned on, never scored, and recorded
(:attr:`TargetTokens.inserted`). Every coalition is rendered the same way, its masked messages plus
the answer, and its prompt is that text up to the answer's first scored token, so the template
treats each coalition as it treats the original, and every coalition is scored on the same ids.

Generation (a target to generate, regenerate-and-compare utilities) uses the generation prompt
(the messages and the assistant header, ``add_generation_prompt=True``).

A generated answer (the snapshot's :attr:`~coalescence.conversation.Conversation.target_ids`) is
scored as the ids the model produced, never decoded and encoded again (decode-then-encode is not
the identity: a byte-level token cut inside a UTF-8 character decodes to U+FFFD, a leading-space
token is merged or stripped). The rule: every coalition's prompt is its *generation prompt*
(what the model generated the answer after), and the target is the generated ids (the stop token
the model ended with excluded) followed by the template's end-of-turn, the tokens the template
writes after an answer's content up to and including its first special token (whitespace before
it included, as for a text answer). The assistant turn's content in the full rendering is the
ids' decoded text (special tokens kept), which is what is shown and what answer sub-spans count
characters in; nothing is located by it. Nothing the template writes between the assistant header
and an answer's content in a full rendering (Qwen3's empty reasoning block) is then in the
prompt: the model generated after the header.

Dates. Templates that write today's date (Llama 3.1/3.2's ``Today Date``, through the
``strftime_now`` helper or the ``date_string`` variable) render under one pinned instant per
renderer (:attr:`ChatRenderer.now`): transformers passes extra ``apply_chat_template`` keyword
arguments to the template as variables, after converting them to plain data (a callable becomes
the text ``"<function>"``), so ``date_string`` is passed as a variable, and ``strftime_now`` is
shadowed by a Jinja macro put in front of the template (only of a template that names it) that
formats the pinned instant's fields, passed as a variable. :attr:`ChatRenderer.renders_date` says
whether the template's text changes with the date (rendered under two pinned dates, compared).

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

A template that raises on a conversation (Llama-2, Mistral and Gemma templates refuse roles that do
not alternate user/assistant) raises :class:`~coalescence.errors.TemplateRefused` quoting the
template's message; so does a template that does not render the answer verbatim.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from ..snapshot import ConversationSnapshot
from ..conversation import Message
from ..errors import InputError, TemplateRefused
from .policies import AbsencePolicy

__all__ = ("TODAY_ENV", "ChatRenderer", "RenderedText", "TargetTokens", "template_now")

_PROBE = "\u2063coalescence-probe\u2063"
_SYSTEM_PROBE = "\u2063coalescence-system-probe\u2063"
_PRIVATE_USE = range(0xE000, 0xF900)


class RenderedText(str):
    """Rendered chat text that remembers where message content holds special-token text.

    A plain :class:`str` in every other respect; :meth:`ChatRenderer.encode` reads
    :attr:`content_specials` to encode those characters as text rather than as control tokens.

    Attributes:
        content_specials: ``(start, end)`` character spans (sorted, disjoint) of the text that
            comes from message content and spells a special token.
    """

    content_specials: tuple[tuple[int, int], ...] = ()


def _with_spans(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """``text`` carrying ``spans`` (a plain ``str`` when there are none)."""
    if not spans:
        return str(text)
    out = RenderedText(text)
    out.content_specials = tuple(spans)
    return out


def _spans_of(text: str) -> tuple[tuple[int, int], ...]:
    return getattr(text, "content_specials", ())


def _slice(text: str, start: int, end: int) -> str:
    """``text[start:end]``, keeping the content spans inside it (shifted)."""
    spans = [(max(a, start) - start, min(b, end) - start) for a, b in _spans_of(text) if a < end and b > start]
    return _with_spans(text[start:end], spans)


def _sentinel(texts: Sequence[str]) -> str:
    """A private-use character that occurs in none of ``texts``."""
    used = set().union(*(set(t) for t in texts)) if texts else set()
    return next(chr(c) for c in _PRIVATE_USE if chr(c) not in used)

TODAY_ENV = "COALESCENCE_TODAY"
"""The environment variable that fixes "now" for chat templates that write the date: an ISO
date (``2024-07-26``, midnight) or date and time (``2024-07-26T09:30:00``). Unset: the clock."""

# strftime directives the pinned instant is formatted with (platform-independent ones)
_DIRECTIVES = "aAbBcdfGHIjmMpSuUVwWxXyYzZ%"

_STRFTIME_MACRO = (
    "{%- macro strftime_now(format) -%}"
    "{%- set ns = namespace(out='', pct=false) -%}"
    "{%- for ch in format -%}"
    "{%- if ns.pct -%}{%- set ns.out = ns.out + (coalescence_now[ch] if ch in coalescence_now else '%' + ch) -%}"
    "{%- set ns.pct = false -%}"
    "{%- elif ch == '%' -%}{%- set ns.pct = true -%}"
    "{%- else -%}{%- set ns.out = ns.out + ch -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.out -}}"
    "{%- endmacro %}"
)
"""Shadows transformers' ``strftime_now`` global: the same formatting, of the pinned instant."""

_DATE_PROBES = (datetime(2001, 2, 3, 4, 5, 6), datetime(2002, 11, 12, 13, 14, 15))


def template_now() -> datetime:
    """The instant a new renderer pins: :data:`TODAY_ENV` when set, else the local clock (naive,
    as transformers' ``strftime_now``), to the second.

    Raises:
        ConfigError: :data:`TODAY_ENV` is set to something that is not an ISO date or datetime.
    """
    from ..errors import ConfigError

    raw = os.environ.get(TODAY_ENV)
    if raw is None or not raw.strip():
        return datetime.now().replace(microsecond=0)
    try:
        return datetime.fromisoformat(raw.strip()).replace(microsecond=0, tzinfo=None)
    except ValueError:
        raise ConfigError(f"must be an ISO date (2024-07-26) or datetime, got {raw!r}", field=TODAY_ENV) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetTokens:
    """The teacher-forcing target of a snapshot.

    Attributes:
        ids: token ids scored: the tokens overlapping the answer's content, then the end-of-turn
            token.
        text: the text those tokens cover (the answer, plus the end-of-turn token text; with a
            :attr:`lead`, the template text the first token starts with).
        answer: the answer's content (the snapshot's target).
        full_prompt_ids: token ids of the full (unmasked) prompt: everything before the first
            scored token.
        full_text: the rendered full conversation, prompt and answer.
        includes_end_of_turn: True when the template's end-of-turn token is scored.
        offsets: ``[n_target]`` character ``(start, end)`` of each target token, relative to the
            start of the answer text (from the tokenizer's offset mapping of the full
            conversation); the end-of-turn token starts at ``len(answer)`` or later; a first token
            that starts with template text (:attr:`lead`) starts below 0.
        answer_start: character offset of the answer's content in :attr:`full_text`.
        lead: template text inside the first scored token, before the answer's content (``" "``
            when a tokenizer merges the space after ``[/INST]`` into the answer's first word);
            usually empty. Whitespace only.
        tail: the template text after the answer's content in :attr:`full_text`.
        inserted: the template text between the generation prompt (``add_generation_prompt``)
            and the answer's content: empty for most templates, Qwen3's empty reasoning block for
            Qwen3; ``None`` when the full rendering does not start with the generation prompt.
        generated: True when the ids are a generated answer's own ids (module docs): every
            coalition is scored after its generation prompt.
        round_trips: for a generated answer, whether its decoded text encodes back to its ids
            (always True for a text answer).
    """

    ids: tuple[int, ...]
    text: str
    full_prompt_ids: tuple[int, ...]
    full_text: str
    includes_end_of_turn: bool
    offsets: tuple[tuple[int, int], ...] = ()
    answer: str = ""
    answer_start: int = 0
    lead: str = ""
    tail: str = ""
    inserted: str | None = ""
    generated: bool = False
    round_trips: bool = True

    def to_dict(self) -> dict[str, Any]:
        """What the run manifest records of the rendering around the answer (JSON-ready)."""
        out: dict[str, Any] = {"inserted": self.inserted, "lead": self.lead, "tail": self.tail}
        if self.generated:
            out["generated_ids"] = True
        return out

    def notes(self) -> tuple[str, ...]:
        """What a user must know of a generated answer's tokens (empty for a text answer): a
        generation cut inside a UTF-8 character, ids that do not round-trip through their text."""
        if not self.generated:
            return ()
        notes: tuple[str, ...] = ()
        if self.answer.endswith("\ufffd"):
            notes += (
                "the generated answer was cut inside a UTF-8 character (its text ends in U+FFFD); "
                "the generated token ids are scored as they are",
            )
        if not self.round_trips:
            notes += (
                "the generated answer's text does not encode back to its token ids; the generated ids "
                "are scored, its text is shown as decoded",
            )
        return notes


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and encodes them with exactly one BOS.

    Args:
        tokenizer: a transformers fast tokenizer with a ``chat_template`` (offsets are needed).
        now: the instant templates that write the date render (default :func:`template_now`,
            read once here): every rendering of this renderer uses it (module docs).

    Attributes:
        injects_default_system: whether the template adds a system turn of its own to a
            conversation that has none (SmolLM2's, Qwen2.5's and Llama-2-chat's original one do;
            detected by rendering, see :meth:`_probe_default_system`).
        now: the pinned instant (naive datetime, seconds).
        renders_date: whether the template's text depends on the date (a one-message
            conversation rendered under two pinned dates differs).

    Raises:
        InputError: the tokenizer has no chat template (field ``--model``).
        ConfigError: :data:`TODAY_ENV` is not an ISO date (when ``now`` is not given).
    """

    def __init__(self, tokenizer: Any, *, now: datetime | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(
                "the model's tokenizer has no chat template; use an instruction-tuned (chat) model",
                field="model",
            )
        self.tokenizer = tokenizer
        self.now = (now if now is not None else template_now()).replace(microsecond=0)
        source = tokenizer.get_chat_template()
        self._names_strftime = "strftime_now" in source
        self._names_date_string = "date_string" in source
        # trim_blocks drops one newline after the macro's tag: a template's own first newline is kept
        self._source = (_STRFTIME_MACRO + ("\n" if source.startswith("\n") else "") + source) if self._names_strftime else None
        self._date_options = self._options_at(self.now)
        bos_id = tokenizer.bos_token_id
        probe = tokenizer("a").input_ids
        self._bos_id: int | None = bos_id if (bos_id is not None and probe[:1] == [bos_id]) else None
        self._bos_text: str | None = tokenizer.bos_token if self._bos_id is not None else None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special_ids = {int(i) for i in tokenizer.all_special_ids}
        special_ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        self._special_ids = frozenset(special_ids)
        self._control_text = {i: str(tokenizer.convert_ids_to_tokens(i)) for i in special_ids}
        names = {str(t) for t in tokenizer.all_special_tokens}
        names |= {str(tok.content) for tok in added.values() if getattr(tok, "special", False)}
        spelled = sorted((t for t in names if t), key=lambda t: (-len(t), t))  # longest first
        self._special_re: re.Pattern[str] | None = re.compile("|".join(map(re.escape, spelled))) if spelled else None
        self.special_ids: frozenset[int] = self._special_ids
        """The tokenizer's special token ids (a generation's trailing one is its stop token)."""
        self.renders_date = self._probe_date()
        self.injects_default_system = self._probe_default_system()

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

    def _probe_default_system(self) -> bool:
        """Whether the template writes text of its own (a default system prompt) before the first
        user turn of a conversation that has no system message.

        Detected by rendering: the user probe ``P`` alone gives ``head + P + ...``, and with a
        system probe ``S`` first it gives ``before + S + between + P + ...``. A template that
        injects nothing writes, without the system message, the text around the system slot with
        the system turn cut out: ``head == before[:i] + between[j:]`` for some ``i``, ``j``
        (ChatML: the user header; Llama-2: ``<s>[INST] ``; Llama-3.1: its date turn, written
        either way). Anything else in ``head`` (SmolLM2's "You are a helpful AI assistant...",
        Llama-2's ``<<SYS>>\\n{default}\\n<</SYS>>``) is text the template adds only when no
        system message is given. A template that drops a system message is held to the same rule
        with the whole text before ``P`` as ``before``; one that refuses it (Gemma, Mistral)
        injects nothing.
        """
        try:
            alone = self.render_prompt([Message(role="user", content=_PROBE)])
        except TemplateRefused:
            return False
        head = alone.split(_PROBE, 1)[0]
        try:
            both = self.render_prompt([Message(role="system", content=_SYSTEM_PROBE), Message(role="user", content=_PROBE)])
        except TemplateRefused:
            return False
        around = both.split(_PROBE, 1)[0]
        before, _, between = around.partition(_SYSTEM_PROBE)  # a dropped system message: between == ""
        return not any(head.startswith(before[:i]) and between.endswith(head[i:]) for i in range(len(before) + 1))

    def _apply(self, conversation: list[dict[str, Any]], **options: Any) -> str:
        """``apply_chat_template`` as text (a :class:`RenderedText` when content holds
        special-token text); a template that raises becomes :class:`TemplateRefused`.

        Raises:
            TemplateRefused: the template raises on this conversation.
            InputError: content holds special-token text and the template renders the escaped
                conversation other than character for character (field ``messages``).
        """
        found = self.special_text(m.get("content") for m in conversation)
        text = self._apply_raw(conversation, **options)
        if not found:
            return text
        assert self._special_re is not None
        mark = _sentinel([text, *(m.get("content") or "" for m in conversation if isinstance(m.get("content"), str))])
        escaped_convo = [
            m | {"content": self._special_re.sub(lambda x: mark * len(x.group(0)), m["content"])}
            if isinstance(m.get("content"), str) else m
            for m in conversation
        ]
        escaped = self._apply_raw(escaped_convo, **options)
        spans = [(x.start(), x.end()) for x in re.finditer(re.escape(mark) + "+", escaped)]
        rebuilt = list(escaped)
        if len(escaped) == len(text):
            for a, b in spans:
                rebuilt[a:b] = text[a:b]
        if len(escaped) != len(text) or "".join(rebuilt) != text or not all(self._only_specials(text[a:b]) for a, b in spans):
            raise InputError(
                f"the conversation contains the special-token text {', '.join(map(repr, found))}, and the "
                "chat template does not render it in place, so it cannot be encoded as text; remove or "
                "rewrite that text",
                field="messages",
            )
        return _with_spans(text, spans)

    def _only_specials(self, text: str) -> bool:
        """Whether ``text`` is one or more special-token strings back to back."""
        assert self._special_re is not None
        return self._special_re.sub("", text) == "" and bool(text)

    def _options_at(self, now: datetime) -> dict[str, Any]:
        """The ``apply_chat_template`` options that render the date as ``now`` (module docs)."""
        options: dict[str, Any] = {}
        if self._names_date_string:
            options["date_string"] = now.strftime("%d %b %Y")  # Llama 3.1's variable and format
        if self._source is not None:
            options["chat_template"] = self._source
            options["coalescence_now"] = {c: now.strftime("%" + c) for c in _DIRECTIVES}
        return options

    def _probe_date(self) -> bool:
        """Whether a one-message conversation renders differently under two pinned dates."""
        if not (self._names_strftime or self._names_date_string):
            return False
        convo = [{"role": "user", "content": _PROBE}]
        try:
            texts = {
                self.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **self._options_at(t))
                for t in _DATE_PROBES
            }
        except Exception:  # a template that refuses the probe: rendered conversations say the rest
            return False
        return len(texts) > 1

    def _apply_raw(self, conversation: list[dict[str, Any]], **options: Any) -> str:
        """``apply_chat_template`` as text, under the pinned date; a template that raises becomes
        :class:`TemplateRefused`."""
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **self._date_options, **options)
        except Exception as exc:  # jinja2's TemplateError (raise_exception), or a template bug
            reason = _first_line(exc)
            raise TemplateRefused(
                f"the model's chat template refuses the conversation ({reason})", field="chat template", reason=reason
            ) from exc

    def render_prompt(self, messages: Sequence[Message]) -> str:
        """The chat-template text of ``messages`` followed by the assistant header (generation).

        With no messages at all (every player absent, turns dropped), the prompt is what the
        template renders before the answer of a conversation made of the answer alone (so a
        template that injects a default system prompt does so here too).

        Raises:
            TemplateRefused: the template raises on this conversation.
        """
        if not messages:
            full = self.render_full([], _PROBE)
            return _slice(full, 0, full.index(_PROBE))
        return self._apply([m.as_dict() for m in messages], add_generation_prompt=True)

    def render_full(self, messages: Sequence[Message], answer: str) -> str:
        """The chat-template text of ``messages`` plus the assistant ``answer`` turn.

        Raises:
            TemplateRefused: the template raises on this conversation.
        """
        convo = [m.as_dict() for m in messages] + [{"role": "assistant", "content": answer}]
        return self._apply(convo)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, with exactly one BOS where the tokenizer uses one.

        Special-token text from message content (a :class:`RenderedText`) is encoded as text
        (see module docs).

        Raises:
            InputError: content holds special-token text that this tokenizer cannot encode as
                text exactly (field ``messages``).
        """
        if _spans_of(text):
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
        return any(a == 0 for a, _ in _spans_of(text))  # the text's first "BOS" is content

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of ``text`` (no BOS added): one tokenizer call, or, where
        content holds special-token text, the piecewise encoding of the module docs."""
        spans = _spans_of(text)
        if not spans:
            enc = self.tokenizer(str(text), add_special_tokens=False, return_offsets_mapping=True)
            return list(enc.input_ids), [tuple(o) for o in enc.offset_mapping]
        mark = _sentinel([text])
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

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Generation prompt token ids (messages + assistant header)."""
        return self.encode(self.render_prompt(messages))

    def scoring_prompt(self, messages: Sequence[Message], target: TargetTokens) -> str:
        """The text a coalition's ``messages`` are scored after: their full rendering with the
        answer, up to the answer's first scored token (see module docs).

        Raises:
            TemplateRefused: the template raises on this conversation, or renders the answer other
                than verbatim, or with other template text inside its first token.
        """
        if target.generated:  # scored after the prompt the answer was generated from (module docs)
            return self.render_prompt(messages)
        full = self.render_full(messages, target.answer)
        if full.endswith(target.answer + target.tail):
            pos = len(full) - len(target.tail) - len(target.answer)
        else:
            pos = full.rfind(target.answer)
            if pos < 0:
                raise TemplateRefused(
                    "the model's chat template does not render the answer verbatim in a masked "
                    "conversation, so its tokens cannot be located",
                    field="chat template",
                )
        cut = pos - len(target.lead)
        if full[cut:pos] != target.lead:
            raise TemplateRefused(
                f"the chat template writes {full[max(cut, 0):pos]!r} before the answer in a masked "
                f"conversation where the original has {target.lead!r}",
                field="chat template",
            )
        return _slice(full, 0, cut)

    def coalition_prompt(
        self,
        snapshot: ConversationSnapshot,
        policy: AbsencePolicy,
        present: np.ndarray,
        target: TargetTokens | None = None,
    ) -> list[int]:
        """Scoring prompt token ids of one coalition (``present``: ``[n_players]`` bool).

        Args:
            target: the snapshot's target tokens under ``policy`` (computed when ``None``).
        """
        target = target if target is not None else self.target_tokens(snapshot, policy)
        return self.encode(self.scoring_prompt(policy.render(snapshot, present), target))

    def generation_prompt(
        self, snapshot: ConversationSnapshot, policy: AbsencePolicy, present: np.ndarray
    ) -> list[int]:
        """Generation prompt token ids of one coalition (messages + assistant header)."""
        return self.encode_prompt(policy.render(snapshot, present))

    def target_tokens(self, snapshot: ConversationSnapshot, policy: AbsencePolicy | None = None) -> TargetTokens:
        """The token ids to score, located in the tokenized full conversation (see module docs).

        Args:
            snapshot: the conversation and its target.
            policy: the absence policy (its full coalition is the conversation scored; a policy
                that merges adjacent messages merges them here too). ``None``: the snapshot's
                messages as they are.

        Raises:
            TemplateRefused: the template raises on the full conversation, does not render the
                answer verbatim (e.g. it strips the answer's whitespace), or a token joins template
                text other than whitespace to the answer's first characters.
            InputError: tokenizing the prompt alone differs from the prompt part of the full
                conversation, or the answer tokenizes to nothing.
        """
        if policy is not None:
            messages = policy.render(snapshot, np.ones(snapshot.n_players, dtype=bool))
        else:
            messages = list(snapshot.conversation.messages)
        if snapshot.conversation.target_ids is not None:
            return self._generated_target(messages, snapshot.target, snapshot.conversation.target_ids)
        answer = snapshot.target
        full_text = self.render_full(messages, answer)
        try:
            gen_prompt: str | None = self.render_prompt(messages)
        except TemplateRefused:
            gen_prompt = None
        start_at = len(gen_prompt) if gen_prompt is not None and full_text.startswith(gen_prompt) else 0
        answer_start = full_text.find(answer, start_at) if start_at else full_text.rfind(answer)
        if answer_start < 0:
            raise TemplateRefused(
                f"the model's chat template does not render the answer verbatim (it changes "
                f"{answer[:24]!r}...), so its tokens cannot be located; strip the answer's leading and "
                "trailing whitespace",
                field="chat template",
            )
        answer_end = answer_start + len(answer)
        ids, offsets = self._tokenize(full_text)
        first = next((k for k, (s, e) in enumerate(offsets) if e > answer_start and e > s), len(ids))
        if first == len(ids):
            raise InputError("the target answer tokenizes to no tokens", field="target")
        prompt_end = min(offsets[first][0], answer_start)
        lead = full_text[prompt_end:answer_start]
        if lead.strip():
            raise TemplateRefused(
                f"the tokenizer joins the template text {lead!r} and the answer's first characters "
                f"({answer[:12]!r}...) into one token, so prompt and answer tokens cannot be separated",
                field="chat template",
            )
        # last answer token: every token starting before the answer's end
        last = first
        while last < len(ids) and offsets[last][0] < answer_end:
            last += 1
        includes_eot = False
        # the end-of-turn token: the first special token after the answer (whitespace between them,
        # if the template puts any, is part of what is scored)
        k = last
        while k < len(ids) and ids[k] not in self._special_ids and not full_text[
            offsets[k][0] : offsets[k][1]
        ].strip():
            k += 1
        if k < len(ids) and ids[k] in self._special_ids:
            last = k + 1
            includes_eot = True
        target_ids = ids[first:last]
        end_char = offsets[last - 1][1]
        prompt_text = _slice(full_text, 0, prompt_end)
        prompt_ids = self.encode(prompt_text)
        bos = 1 if self._needs_bos(prompt_text) else 0  # a prepended BOS shifts the prompt by one
        if prompt_ids[bos:] != ids[:first]:
            raise InputError(
                "tokenizing the prompt alone differs from the prompt part of the full conversation;"
                " this tokenizer/template pair is not supported",
                field="model",
            )
        inserted = None
        if gen_prompt is not None and full_text.startswith(gen_prompt) and len(gen_prompt) <= answer_start:
            inserted = full_text[len(gen_prompt) : answer_start]
        return TargetTokens(
            ids=tuple(target_ids),
            text=full_text[prompt_end:end_char],
            full_prompt_ids=tuple(prompt_ids),
            full_text=str(full_text),
            includes_end_of_turn=includes_eot,
            offsets=tuple((s - answer_start, e - answer_start) for s, e in offsets[first:last]),
            answer=answer,
            answer_start=answer_start,
            lead=lead,
            tail=full_text[answer_end:],
            inserted=inserted,
        )

    def end_of_turn(self, messages: Sequence[Message]) -> tuple[list[int], str]:
        """The template's end-of-turn after an answer to ``messages``: the ids (and their text) of
        what the template writes after an answer's content up to and including its first special
        token, whitespace before it included; empty when template text that is not whitespace
        comes first or there is no special token (nothing of the template is then scored, as for
        a text answer).

        Raises:
            TemplateRefused: the template raises on the conversation with an answer.
        """
        full = self.render_full(messages, _PROBE)
        tail = full[full.rindex(_PROBE) + len(_PROBE) :]
        enc = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
        for k, (tid, (s, e)) in enumerate(zip(enc.input_ids, enc.offset_mapping, strict=True)):
            if tid in self._special_ids:
                return list(enc.input_ids[: k + 1]), tail[:e]
            if tail[s:e].strip():
                break
        return [], ""

    def _generated_target(self, messages: Sequence[Message], answer: str, content: Sequence[int]) -> TargetTokens:
        """The target of a generated answer: its ids, then the template's end-of-turn (module docs)."""
        tokenizer = self.tokenizer
        content = [int(i) for i in content]
        decoded = tokenizer.decode(content, skip_special_tokens=False)
        if decoded != answer:
            raise InputError(
                "the generated answer's text is not the decoding of its token ids; the record was "
                "altered: restore it, or give the answer as text",
                field="target_ids",
            )
        prompt_text = self.render_prompt(messages)
        eot_ids, eot_text = self.end_of_turn(messages)
        # per token, the characters of the answer it completes: the stable prefix of the decoded
        # text grows with each token; a token ending inside a character overlaps that character
        offsets: list[tuple[int, int]] = []
        stable = 0
        for k in range(len(content)):
            partial = tokenizer.decode(content[: k + 1], skip_special_tokens=False)
            common = 0
            for a, b in zip(partial, answer):
                if a != b:
                    break
                common += 1
            end = max(common, stable)
            pending = len(partial) > common and end < len(answer)
            offsets.append((stable, end + 1 if pending else end))
            stable = end
        n = len(answer)
        at = 0
        for tid in eot_ids:
            piece = tokenizer.decode([tid], skip_special_tokens=False)
            offsets.append((n + at, n + at + len(piece)))
            at += len(piece)
        again = tokenizer(answer, add_special_tokens=False).input_ids
        return TargetTokens(
            ids=tuple(content + eot_ids),
            text=answer + eot_text,
            full_prompt_ids=tuple(self.encode(prompt_text)),
            full_text=prompt_text + answer + eot_text,
            includes_end_of_turn=bool(eot_ids),
            offsets=tuple(offsets),
            answer=answer,
            answer_start=len(prompt_text),
            lead="",
            tail=eot_text,
            inserted="",
            generated=True,
            round_trips=list(again) == content,
        )
