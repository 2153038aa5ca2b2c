"""The teacher-forcing target of a snapshot: the token ids scored and where they are.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ("TargetTokens",)



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
