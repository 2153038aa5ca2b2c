"""Rendering and tokenization: byte-exact full coalition, target ids, exactly one BOS."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.models import build_tokenizer

from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy
from coalescence.masking.render import ChatRenderer

USER = "The Eiffel Tower was completed in 1889. Big Ben's clock tower in London was finished in 1859. When was the tower completed?"


def snap(system: bool = True) -> ConversationSnapshot:
    msgs = [Message(role="user", content=USER)]
    if system:
        msgs.insert(0, Message(role="system", content="You are a helpful assistant."))
    return ConversationSnapshot.build(
        Conversation(messages=tuple(msgs), target="It was completed in 1889."), unit="sentence"
    )


@pytest.fixture(scope="module", params=["chatml", "bos", "bos_in_template"])
def tokenizer(request):
    return build_tokenizer(request.param)


def test_full_coalition_renders_the_original_byte_for_byte(tokenizer):
    s = snap()
    r = ChatRenderer(tokenizer)
    original = tokenizer.apply_chat_template(
        [m.as_dict() for m in s.conversation.messages], tokenize=False, add_generation_prompt=True
    )
    full_msgs = DropPolicy().render(s, np.ones(s.n_players, dtype=bool))
    assert r.render_prompt(full_msgs) == original
    assert r.render_full(full_msgs, s.target) == tokenizer.apply_chat_template(
        [m.as_dict() for m in s.conversation.messages] + [{"role": "assistant", "content": s.target}],
        tokenize=False,
    )
    assert r.coalition_prompt(s, DropPolicy(), np.ones(s.n_players, dtype=bool)) == list(
        r.target_tokens(s).full_prompt_ids
    )


def test_target_ids_are_the_slice_after_the_assistant_header(tokenizer):
    s = snap()
    r = ChatRenderer(tokenizer)
    t = r.target_tokens(s)
    full_text = r.render_full(s.conversation.messages, s.target)
    prompt_text = r.render_prompt(s.conversation.messages)
    full_ids = tokenizer(full_text, add_special_tokens=False).input_ids
    n_prompt = len(tokenizer(prompt_text, add_special_tokens=False).input_ids)
    eot = tokenizer.eos_token_id
    assert eot in full_ids[n_prompt:]
    stop = full_ids.index(eot, n_prompt) + 1  # through the end-of-turn token, not beyond
    assert list(t.ids) == full_ids[n_prompt:stop]
    assert t.includes_end_of_turn
    assert t.text == s.target + tokenizer.eos_token
    assert tokenizer.decode(list(t.ids)) == s.target + tokenizer.eos_token
    # not the answer tokenized alone (the first answer token follows the header's newline)
    assert full_ids[n_prompt - 1] != t.ids[0]


def test_exactly_one_bos(tokenizer):
    s = snap()
    r = ChatRenderer(tokenizer)
    bos = tokenizer.bos_token_id
    uses_bos = tokenizer("a").input_ids[0] == bos
    for present in (np.ones(s.n_players, dtype=bool), np.zeros(s.n_players, dtype=bool)):
        ids = r.coalition_prompt(s, DropPolicy(), present)
        if uses_bos:
            assert ids[0] == bos and ids.count(bos) == 1
        else:
            # the ChatML tokenizer's "BOS" (<|im_start|>) is a turn header, never prepended
            assert r.render_prompt(DropPolicy().render(s, present)).startswith("<|im_start|>")
            assert ids == tokenizer(r.render_prompt(DropPolicy().render(s, present)), add_special_tokens=False).input_ids


def test_kept_text_present_masked_text_absent(tokenizer):
    s = snap()
    r = ChatRenderer(tokenizer)
    present = np.array([p.index != 1 for p in s.players])  # drop "The Eiffel Tower ... 1889."
    prompt = r.render_prompt(DropPolicy().render(s, present))
    assert "The Eiffel Tower was completed in 1889." not in prompt
    for p in s.players:
        if present[p.index]:
            assert p.text in prompt
    decoded = tokenizer.decode(r.coalition_prompt(s, PlaceholderPolicy(), present))
    assert "[removed] Big Ben" in decoded and "1889" not in decoded


def test_empty_coalition_and_default_system_prompt():
    tok = build_tokenizer("chatml")
    r = ChatRenderer(tok)
    assert r.injects_default_system  # the ChatML template adds "You are a default assistant."
    s = snap(system=False)
    empty = r.render_prompt(DropPolicy().render(s, np.zeros(s.n_players, dtype=bool)))
    assert empty == "<|im_start|>system\nYou are a default assistant.<|im_end|>\n<|im_start|>assistant\n"
    assert not ChatRenderer(build_tokenizer("bos")).injects_default_system
    assert ChatRenderer(build_tokenizer("bos")).render_prompt([]) == "<|assistant|>\n"
