"""Locating the answer: the tokens a coalition is scored on, and the prompt it is scored after.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...conversation import Message
from ...errors import InputError, TemplateRefused
from ...snapshot import ConversationSnapshot
from ..policies import AbsencePolicy
from .probes import PROBE
from .spans import slice_text
from .target import TargetTokens

__all__ = ("Locating",)


class Locating:
    """Where the answer is, for :class:`~coalescence.masking.render.ChatRenderer` (a mixin that
    reads the renderer's rendering and encoding)."""

    tokenizer: Any
    _special_ids: frozenset[int]

    if TYPE_CHECKING:

        def render_prompt(self, messages: Sequence[Message]) -> str: ...

        def render_full(self, messages: Sequence[Message], answer: str) -> str: ...

        def encode(self, text: str) -> list[int]: ...

        def _needs_bos(self, text: str) -> bool: ...

        def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

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
        return slice_text(full, 0, cut)

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
        prompt_text = slice_text(full_text, 0, prompt_end)
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
        full = self.render_full(messages, PROBE)
        tail = full[full.rindex(PROBE) + len(PROBE) :]
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
