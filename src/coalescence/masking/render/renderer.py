"""The chat renderer: a coalition's messages through the model's chat template, as text and as
token ids (:class:`ChatRenderer`), with its parts in the modules of this package.

A template that raises on a conversation (Llama-2, Mistral and Gemma templates refuse roles that do
not alternate user/assistant) raises :class:`~coalescence.errors.TemplateRefused` quoting the
template's message; so does a template that does not render the answer verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import numpy as np

from ...conversation import Message
from ...errors import InputError, TemplateRefused
from ...snapshot import ConversationSnapshot
from ..policies import AbsencePolicy
from .dates import STRFTIME_MACRO, template_now
from .locate import Locating
from .probes import PROBE, Probes
from .spans import sentinel, slice_text, with_spans
from .target import TargetTokens
from .tokenizing import Tokenizing

__all__ = ("ChatRenderer",)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class ChatRenderer(Locating, Tokenizing, Probes):
    """Renders messages with a tokenizer's chat template and encodes them with exactly one BOS.

    Args:
        tokenizer: a transformers fast tokenizer with a ``chat_template`` (offsets are needed).
        now: the instant templates that write the date render (default :func:`template_now`,
            read once here): every rendering of this renderer uses it (:mod:`.dates`).

    Attributes:
        injects_default_system: whether the template adds a system turn of its own to a
            conversation that has none (SmolLM2's, Qwen2.5's and Llama-2-chat's original one do;
            detected by rendering, see :meth:`_probe_default_system`).
        now: the pinned instant (naive datetime, seconds).
        renders_date: whether the template's text depends on the date (a one-message
            conversation rendered under two pinned dates differs).

    Raises:
        InputError: the tokenizer has no chat template (field ``--model``).
        ConfigError: :data:`~.dates.TODAY_ENV` is not an ISO date (when ``now`` is not given).
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
        self._source = (STRFTIME_MACRO + ("\n" if source.startswith("\n") else "") + source) if self._names_strftime else None
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
        mark = sentinel([text, *(m.get("content") or "" for m in conversation if isinstance(m.get("content"), str))])
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
        return with_spans(text, spans)

    def _only_specials(self, text: str) -> bool:
        """Whether ``text`` is one or more special-token strings back to back."""
        assert self._special_re is not None
        return self._special_re.sub("", text) == "" and bool(text)

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
            full = self.render_full([], PROBE)
            return slice_text(full, 0, full.index(PROBE))
        return self._apply([m.as_dict() for m in messages], add_generation_prompt=True)

    def render_full(self, messages: Sequence[Message], answer: str) -> str:
        """The chat-template text of ``messages`` plus the assistant ``answer`` turn.

        Raises:
            TemplateRefused: the template raises on this conversation.
        """
        convo = [m.as_dict() for m in messages] + [{"role": "assistant", "content": answer}]
        return self._apply(convo)

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Generation prompt token ids (messages + assistant header)."""
        return self.encode(self.render_prompt(messages))

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
