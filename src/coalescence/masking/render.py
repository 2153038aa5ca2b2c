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

A template that raises on a conversation (Llama-2, Mistral and Gemma templates refuse roles that do
not alternate user/assistant) raises :class:`~coalescence.errors.TemplateRefused` quoting the
template's message; so does a template that does not render the answer verbatim.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from ..conversation import ConversationSnapshot, Message
from ..errors import InputError, TemplateRefused
from .policies import AbsencePolicy

__all__ = ("TODAY_ENV", "ChatRenderer", "TargetTokens", "template_now")

_PROBE = "\u2063coalescence-probe\u2063"

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
            conversation that has none (SmolLM2's and Qwen2.5's do).
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
        self.renders_date = self._probe_date()
        bos_id = tokenizer.bos_token_id
        probe = tokenizer("a").input_ids
        self._bos_id: int | None = bos_id if (bos_id is not None and probe[:1] == [bos_id]) else None
        self._bos_text: str | None = tokenizer.bos_token if self._bos_id is not None else None
        self._special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self.special_ids: frozenset[int] = self._special_ids
        """The tokenizer's special token ids (a generation's trailing one is its stop token)."""
        self.injects_default_system = self._probe_default_system()

    def _probe_default_system(self) -> bool:
        """Whether the template adds a system turn to a conversation that has none.

        Detected by rendering a one-message user conversation and looking for text before the
        user's content that is not the user header alone (a heuristic on the word "system").
        """
        try:
            text = self.render_prompt([Message(role="user", content=_PROBE)])
        except TemplateRefused:
            return False
        head = text.split(_PROBE, 1)[0]
        return "system" in head.lower()

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

    def _apply(self, conversation: list[dict[str, str]], **options: Any) -> str:
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
            return full[: full.index(_PROBE)]
        return self._apply([m.as_dict() for m in messages], add_generation_prompt=True)

    def render_full(self, messages: Sequence[Message], answer: str) -> str:
        """The chat-template text of ``messages`` plus the assistant ``answer`` turn.

        Raises:
            TemplateRefused: the template raises on this conversation.
        """
        convo = [m.as_dict() for m in messages] + [{"role": "assistant", "content": answer}]
        return self._apply(convo)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, with exactly one BOS where the tokenizer uses one."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if self._needs_bos(text):
            ids = [self._bos_id, *ids]
        return list(ids)

    def _needs_bos(self, text: str) -> bool:
        return self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text))

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
        return full[:cut]

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
        enc = self.tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc.input_ids)
        offsets: list[tuple[int, int]] = [tuple(o) for o in enc.offset_mapping]
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
        prompt_text = full_text[:prompt_end]
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
            full_text=full_text,
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
