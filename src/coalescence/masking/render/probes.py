"""What a chat template does, found by rendering probe conversations: whether it injects a
default system prompt, and whether its text changes with the date.

The probes are texts no conversation holds (invisible separators around a name); a template
that refuses a probe conversation is taken to do neither (rendered conversations say the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ...conversation import Message
from ...errors import TemplateRefused
from .dates import DATE_PROBES, date_options

__all__ = ("PROBE", "SYSTEM_PROBE", "Probes")

PROBE = "\u2063coalescence-probe\u2063"
"""A user message or answer no conversation holds."""
SYSTEM_PROBE = "\u2063coalescence-system-probe\u2063"
"""A system message no conversation holds."""


class Probes:
    """The template probes of :class:`~coalescence.masking.render.ChatRenderer` (a mixin)."""

    tokenizer: Any
    _names_strftime: bool
    _names_date_string: bool
    _source: str | None

    if TYPE_CHECKING:

        def render_prompt(self, messages: Sequence[Message]) -> str: ...

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
            alone = self.render_prompt([Message(role="user", content=PROBE)])
        except TemplateRefused:
            return False
        head = alone.split(PROBE, 1)[0]
        try:
            both = self.render_prompt([Message(role="system", content=SYSTEM_PROBE), Message(role="user", content=PROBE)])
        except TemplateRefused:
            return False
        around = both.split(PROBE, 1)[0]
        before, _, between = around.partition(SYSTEM_PROBE)  # a dropped system message: between == ""
        return not any(head.startswith(before[:i]) and between.endswith(head[i:]) for i in range(len(before) + 1))

    def _options_at(self, now: datetime) -> dict[str, Any]:
        """The ``apply_chat_template`` options that render the date as ``now`` (:mod:`.dates`)."""
        return date_options(now, date_string=self._names_date_string, source=self._source)

    def _probe_date(self) -> bool:
        """Whether a one-message conversation renders differently under two pinned dates."""
        if not (self._names_strftime or self._names_date_string):
            return False
        convo = [{"role": "user", "content": PROBE}]
        try:
            texts = {
                self.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **self._options_at(t))
                for t in DATE_PROBES
            }
        except Exception:  # a template that refuses the probe: rendered conversations say the rest
            return False
        return len(texts) > 1
