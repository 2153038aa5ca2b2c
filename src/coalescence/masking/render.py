"""From coalition to token ids: chat template rendering and teacher-forcing targets.

The masked prompt messages (from an absence policy) are rendered with the model's own chat
template (``tokenizer.apply_chat_template``) and a generation prompt (the assistant header).

The target token ids are taken from the tokenized *full* conversation (prompt + answer), not from
the answer tokenized alone: they are the tokens after the assistant header, from the first answer
token through the template's end-of-turn token (the decision to stop is part of the answer);
template text after that token is not scored. Every coalition is scored on these same ids.

Exactly one BOS: when the tokenizer prepends a BOS token by default and the rendered text does not
already start with it, one is prepended; the template's own BOS text is never doubled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..conversation import ConversationSnapshot, Message
from ..errors import InputError
from .policies import AbsencePolicy

__all__ = ("ChatRenderer", "TargetTokens")

_PROBE = "\u2063coalescence-probe\u2063"


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetTokens:
    """The teacher-forcing target of a snapshot.

    Attributes:
        ids: token ids of the answer, first answer token through the end-of-turn token.
        text: the text those tokens cover (the answer, plus the end-of-turn token text).
        full_prompt_ids: token ids of the full (unmasked) prompt up to the assistant header.
        full_text: the rendered full conversation, prompt and answer.
        includes_end_of_turn: True when the template's end-of-turn token is scored.
        offsets: ``[n_target]`` character ``(start, end)`` of each target token, relative to the
            start of the answer text (from the tokenizer's offset mapping of the full
            conversation); the end-of-turn token starts at ``len(answer)`` or later.
    """

    ids: tuple[int, ...]
    text: str
    full_prompt_ids: tuple[int, ...]
    full_text: str
    includes_end_of_turn: bool
    offsets: tuple[tuple[int, int], ...] = ()


class ChatRenderer:
    """Renders messages with a tokenizer's chat template and encodes them with exactly one BOS.

    Args:
        tokenizer: a transformers fast tokenizer with a ``chat_template`` (offsets are needed).

    Raises:
        InputError: the tokenizer has no chat template (field ``--model``).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(
                "the model's tokenizer has no chat template; use an instruction-tuned (chat) model",
                field="--model",
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
        text = self.render_prompt([Message(role="user", content=_PROBE)])
        head = text.split(_PROBE, 1)[0]
        return "system" in head.lower()

    def render_prompt(self, messages: Sequence[Message]) -> str:
        """The chat-template text of ``messages`` followed by the assistant header.

        With no messages at all (every player absent, turns dropped), the prompt is what the
        template renders before the answer of a conversation made of the answer alone (so a
        template that injects a default system prompt does so here too).
        """
        if not messages:
            full = self.render_full([], _PROBE)
            return full[: full.index(_PROBE)]
        return self.tokenizer.apply_chat_template(
            [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
        )

    def render_full(self, messages: Sequence[Message], answer: str) -> str:
        """The chat-template text of ``messages`` plus the assistant ``answer`` turn."""
        convo = [m.as_dict() for m in messages] + [{"role": "assistant", "content": answer}]
        return self.tokenizer.apply_chat_template(convo, tokenize=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, with exactly one BOS where the tokenizer uses one."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if self._needs_bos(text):
            ids = [self._bos_id, *ids]
        return list(ids)

    def _needs_bos(self, text: str) -> bool:
        return self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text))

    def encode_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Prompt token ids (messages + assistant header) for scoring or generation."""
        return self.encode(self.render_prompt(messages))

    def coalition_prompt(
        self, snapshot: ConversationSnapshot, policy: AbsencePolicy, present: np.ndarray
    ) -> list[int]:
        """Prompt token ids of one coalition (``present``: ``[n_players]`` bool)."""
        return self.encode_prompt(policy.render(snapshot, present))

    def target_tokens(self, snapshot: ConversationSnapshot) -> TargetTokens:
        """The token ids to score, from the tokenized full conversation (see module docs).

        Raises:
            InputError: the template does not render the prompt as a prefix of the full
                conversation, the answer text is not found after the assistant header, or the
                prompt/answer boundary falls inside a token.
        """
        messages = snapshot.conversation.messages
        prompt_text = self.render_prompt(messages)
        full_text = self.render_full(messages, snapshot.target)
        if not full_text.startswith(prompt_text):
            raise InputError(
                "the chat template does not render the prompt as a prefix of the full conversation;"
                " this model's template cannot be used for teacher forcing",
                field="--model",
            )
        answer_start = full_text.find(snapshot.target, len(prompt_text))
        if answer_start < 0:
            raise InputError(
                "the chat template changes the answer text (it is not found after the assistant "
                "header); strip leading/trailing whitespace from the target",
                field="target",
            )
        answer_end = answer_start + len(snapshot.target)
        enc = self.tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc.input_ids)
        offsets: list[tuple[int, int]] = [tuple(o) for o in enc.offset_mapping]
        boundary = len(prompt_text)
        first = next((k for k, (s, _) in enumerate(offsets) if s >= boundary), len(ids))
        if first < len(ids) and first > 0 and offsets[first - 1][1] > boundary:
            raise InputError(
                "the tokenizer merges the assistant header with the answer's first characters "
                f"({snapshot.target[:12]!r}...), so prompt and answer tokens cannot be separated; "
                "remove leading whitespace from the answer",
                field="target",
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
        if not target_ids:
            raise InputError("the target answer tokenizes to no tokens", field="target")
        end_char = offsets[last - 1][1]
        prompt_ids = self.encode(prompt_text)
        bos = 1 if self._needs_bos(prompt_text) else 0  # a prepended BOS shifts the prompt by one
        if prompt_ids[bos:] != ids[:first]:
            raise InputError(
                "tokenizing the prompt alone differs from the prompt part of the full conversation;"
                " this tokenizer/template pair is not supported",
                field="--model",
            )
        return TargetTokens(
            ids=tuple(target_ids),
            text=full_text[offsets[first][0] : end_char],
            full_prompt_ids=tuple(prompt_ids),
            full_text=full_text,
            includes_end_of_turn=includes_eot,
            offsets=tuple((s - answer_start, e - answer_start) for s, e in offsets[first:last]),
        )
