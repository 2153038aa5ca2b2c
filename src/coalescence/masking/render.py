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

Exactly one BOS: when the tokenizer prepends a BOS token by default and the rendered text does not
already start with it, one is prepended; the template's own BOS text is never doubled.

A template that raises on a conversation (Llama-2, Mistral and Gemma templates refuse roles that do
not alternate user/assistant) raises :class:`~coalescence.errors.TemplateRefused` quoting the
template's message; so does a template that does not render the answer verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..conversation import ConversationSnapshot, Message
from ..errors import InputError, TemplateRefused
from .policies import AbsencePolicy

__all__ = ("ChatRenderer", "TargetTokens")

_PROBE = "\u2063coalescence-probe\u2063"


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

    def to_dict(self) -> dict[str, Any]:
        """What the run manifest records of the rendering around the answer (JSON-ready)."""
        return {"inserted": self.inserted, "lead": self.lead, "tail": self.tail}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and encodes them with exactly one BOS.

    Args:
        tokenizer: a transformers fast tokenizer with a ``chat_template`` (offsets are needed).

    Attributes:
        injects_default_system: whether the template adds a system turn of its own to a
            conversation that has none (SmolLM2's and Qwen2.5's do).

    Raises:
        InputError: the tokenizer has no chat template (field ``--model``).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(
                "the model's tokenizer has no chat template; use an instruction-tuned (chat) model",
                field="model",
            )
        self.tokenizer = tokenizer
        bos_id = tokenizer.bos_token_id
        probe = tokenizer("a").input_ids
        self._bos_id: int | None = bos_id if (bos_id is not None and probe[:1] == [bos_id]) else None
        self._bos_text: str | None = tokenizer.bos_token if self._bos_id is not None else None
        self._special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
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

    def _apply(self, conversation: list[dict[str, str]], **options: Any) -> str:
        """``apply_chat_template`` as text; a template that raises becomes :class:`TemplateRefused`."""
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
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
