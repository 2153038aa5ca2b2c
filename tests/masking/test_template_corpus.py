"""The template corpus (issue 12, part 4): every family x unit renders right or is refused early.

For every fixture of :mod:`helpers.chat_templates` and every unit:

- the full coalition re-renders the original conversation byte for byte (the reference is the
  template applied to the input as given, native ``tool_calls`` included);
- the scored tokens are the answer's content plus the end-of-turn token (the reference is the
  decoding written down per family from its template), whatever the template inserts before it;
- the leave-one-out and empty coalitions render, or the game is refused before any model call
  (the families that enforce alternating roles: unless the unit is ``exchange`` or empty turns
  are kept);
- values batched equal values one by one, and v(full) equals a plain forward pass of the
  template's own rendering.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from helpers.chat_templates import FAMILIES, Family, build_family_tokenizer, conversation, family_named
from helpers.models import build_model

from coalescence.attribution.estimators import make_estimator
from coalescence.backends.hf import HFBackend
from coalescence.snapshot import ConversationSnapshot
from coalescence.engine import Engine
from coalescence.errors import TemplateRefused
from coalescence.inputs import conversation_from_input
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer
from coalescence.preflight import check_game

UNITS = ("turn", "paragraph", "sentence", "word", "tool", "exchange")
ANSWER = "It was completed in 1889."


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request):
    fam: Family = request.param
    return fam, build_family_tokenizer(fam)


def _data(fam: Family) -> dict:
    return conversation(fam, tools=fam.native_tools)


def _snapshot(fam: Family, unit: str, roles=None) -> ConversationSnapshot:
    return ConversationSnapshot.build(conversation_from_input(_data(fam)), unit=unit, roles=roles)


def _expected_renders(fam: Family, unit: str, policy: DropPolicy) -> bool:
    """Written from the templates: only alternation-enforcing templates refuse coalitions, and
    only when removal changes the sequence of roles (any unit but exchange, unless emptied
    messages stay)."""
    return not fam.alternates or unit == "exchange" or policy.empty_turns == "empty"


@pytest.mark.parametrize("unit", UNITS)
def test_full_coalition_rerenders_the_original_byte_for_byte(family, unit):
    fam, tok = family
    reference = tok.apply_chat_template(_data(fam)["messages"], tokenize=False)
    assert reference.count(ANSWER) >= 1
    s = _snapshot(fam, unit)
    r = ChatRenderer(tok)
    full = DropPolicy().render(s, np.ones(s.n_players, dtype=bool))
    assert full == list(s.conversation.messages)
    assert r.render_full(full, s.target) == reference
    assert r.target_tokens(s, DropPolicy()).full_text == reference


def test_scored_tokens_are_the_answer_and_the_end_of_turn(family):
    fam, tok = family
    s = _snapshot(fam, "turn")
    t = ChatRenderer(tok).target_tokens(s, DropPolicy())
    assert tok.decode(list(t.ids)) == fam.scored.format(answer=ANSWER, eot=fam.end_of_turn)
    assert t.ids[-1] == tok.convert_tokens_to_ids(fam.end_of_turn) and t.includes_end_of_turn
    assert t.inserted == fam.inserted  # template text between the generation prompt and the answer
    assert t.full_text[t.answer_start : t.answer_start + len(ANSWER)] == ANSWER
    # the scored prompt ends where the answer's first token starts: template text is prompt
    prompt = tok.decode(list(t.full_prompt_ids))
    assert prompt.endswith(fam.inserted.rstrip(" ") if fam.inserted.strip() else prompt[-1:])
    assert all(e > 0 for _, e in t.offsets) and t.offsets[0][0] == -len(t.lead)


def test_qwen3_reasoning_block_is_prompt_not_answer():
    fam = family_named("qwen3")
    tok = build_family_tokenizer(fam)
    s = _snapshot(fam, "sentence")
    t = ChatRenderer(tok).target_tokens(s, DropPolicy())
    # the report: 29 tokens scored for a 12-token answer, 17 of them the template's block
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    assert not set(think) & set(t.ids[:-1])
    assert len(t.ids) == len(tok(ANSWER, add_special_tokens=False).input_ids) + 1
    assert tok.decode(list(t.full_prompt_ids)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert min(a for a, _ in t.offsets) == 0


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("empty_turns", ["removed", "empty"])
def test_leave_one_out_and_empty_render_or_are_refused_early(family, unit, empty_turns):
    fam, tok = family
    policy = DropPolicy(empty_turns=empty_turns)
    s = _snapshot(fam, unit)
    r = ChatRenderer(tok)
    plan = make_estimator("loo").plan(s.n_players)
    if _expected_renders(fam, unit, policy):
        report = check_game(r, s, policy, plan, max_context=4096)
        assert report.exhaustive and report.coalitions == s.n_players + 2 - (s.n_players == 1)
        for row in [np.zeros(s.n_players, dtype=bool), *(~np.eye(s.n_players, dtype=bool))]:
            r.scoring_prompt(policy.render(s, row), report.target)
    else:
        with pytest.raises(TemplateRefused) as info:
            check_game(r, s, policy, plan, max_context=4096)
        message = str(info.value)
        assert "\n" not in message
        assert "Conversation roles must alternate" in message and "--unit exchange" in message
        assert "whose roles are [" in message and "coalition" in message


def test_gemma_refuses_a_system_message_with_the_templates_words():
    fam = family_named("gemma")
    tok = build_family_tokenizer(fam)
    data = conversation(family_named("chatml"))  # has a system message
    s = ConversationSnapshot.build(conversation_from_input(data), unit="exchange")
    with pytest.raises(TemplateRefused) as info:
        check_game(ChatRenderer(tok), s, DropPolicy(), None, max_context=4096)
    assert "System role not supported" in str(info.value) and "original conversation" in str(info.value)


def test_merge_adjacent_renders_dropped_assistant_turns_under_strict_alternation():
    fam = family_named("llama2")
    tok = build_family_tokenizer(fam)
    r = ChatRenderer(tok)
    s = _snapshot(fam, "turn", roles=["assistant"])
    plan = list(make_estimator("exact").plan(s.n_players))
    with pytest.raises(TemplateRefused):
        check_game(r, s, DropPolicy(), plan, max_context=4096)
    merged = DropPolicy(merge_adjacent=True)
    report = check_game(r, s, merged, plan, max_context=4096)
    assert report.exhaustive
    # without the assistant turn the two user turns become one, joined by a blank line
    msgs = merged.render(s, np.zeros(s.n_players, dtype=bool))
    users = [m.content for m in s.conversation.messages if m.role == "user"]
    assert [m.role for m in msgs] == ["system", "user"] and msgs[1].content == "\n\n".join(users)
    assert merged.params() == {"merge_adjacent": True}


def _plain_logprob(model, tok, fam, text: str) -> float:
    """Reference v(full): one forward pass over the template's own rendering; the scored tokens
    are the ones whose decoding is the family's scored text, at the end before template tail."""
    import torch

    ids = tok(text, add_special_tokens=False).input_ids
    if fam.prepends_bos and not text.startswith(fam.bos):
        ids = [tok.bos_token_id, *ids]
    want = fam.scored.format(answer=ANSWER, eot=fam.end_of_turn)
    span = next(
        (i, j)
        for j in range(len(ids), 0, -1)
        for i in range(j - 1, 0, -1)
        if tok.decode(ids[i:j]) == want
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    i, j = span
    return float(sum(logp[k - 1, ids[k]] for k in range(i, j)))


def test_batched_equals_one_by_one_and_a_plain_forward(family):
    fam, tok = family
    unit = "exchange" if fam.alternates else "turn"
    s = _snapshot(fam, unit)
    model = build_model(tok)
    plan = list(make_estimator("loo").plan(s.n_players))
    values = {}
    for batch in (1, 4):
        backend = HFBackend(model, tok, model_id=f"tiny-{fam.name}", max_batch_size=batch)
        engine = Engine(backend, batch_size=batch)
        masks, utilities = anyio.run(engine.evaluate, s, DropPolicy(), plan)
        values[batch] = dict(zip(map(bytes, np.packbits(masks, axis=1)), utilities, strict=True))
    assert values[1].keys() == values[4].keys()
    for key, v in values[1].items():
        assert abs(v - values[4][key]) < 1e-4
    full = next(v for k, v in values[1].items() if k == bytes(np.packbits(np.ones((1, s.n_players), dtype=bool), axis=1)[0]))
    reference = _plain_logprob(model, tok, fam, tok.apply_chat_template(_data(fam)["messages"], tokenize=False))
    assert abs(full - reference) < 1e-4


def test_remedies_named_are_the_ones_not_in_use():
    fam = family_named("llama2")
    tok = build_family_tokenizer(fam)
    s = _snapshot(fam, "turn")
    plan = list(make_estimator("loo").plan(s.n_players))
    with pytest.raises(TemplateRefused) as info:
        check_game(ChatRenderer(tok), s, DropPolicy(merge_adjacent=True), plan, max_context=4096)
    message = str(info.value)
    assert "--unit exchange" in message and "--empty-turns empty" in message and "--merge-adjacent" not in message


def test_a_refusal_met_during_a_run_names_the_coalition(chatml_tokenizer):
    """A template that refuses for its own reasons (not alternation): a coalition the preflight's
    subset did not hold fails during the run with one line naming it, not the alternation remedies."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=chatml_tokenizer.backend_tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' and 'Alpha' not in m['content'] %}"
        "{{ raise_exception('the user turn must mention Alpha') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    from coalescence.conversation import Conversation, Message

    c = Conversation(messages=(Message(role="user", content="Alpha is first. Beta is second."),), target="Ok.")
    s = ConversationSnapshot.build(c, unit="sentence")
    engine = Engine(HFBackend(build_model(tok), tok, model_id="tiny-alpha"), batch_size=2)
    with pytest.raises(TemplateRefused) as info:
        anyio.run(engine.evaluate, s, DropPolicy(), [np.array([True, True]), np.array([False, True])])
    message = str(info.value)
    assert "the coalition without user[0].s0" in message and "must mention Alpha" in message
    assert "during the run" in message and "cannot render such a coalition" in message and "--unit exchange" not in message
