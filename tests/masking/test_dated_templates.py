"""Templates that write today's date render one pinned date (issue 24, item 3).

The rule: a renderer renders every conversation under the instant it pinned (given, or read
once from ``COALESCENCE_TODAY`` / the clock when it is made); a template renders a date when a
conversation's text changes between two pinned dates. References: the date text written by hand,
and transformers' own rendering (its ``strftime_now`` reads the clock) for today.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from helpers.chat_templates import DATED_FAMILIES, FAMILIES, build_family_tokenizer

from coalescence.conversation import Message
from coalescence.masking.render import ChatRenderer

DAY1, DAY2 = datetime(2024, 7, 26), datetime(2024, 7, 27)
MESSAGES = [Message(role="system", content="Keep answers short.\n- One line."), Message(role="user", content="When was it completed?")]


@pytest.fixture(scope="module", params=[f.name for f in DATED_FAMILIES])
def dated(request):
    return build_family_tokenizer(next(f for f in DATED_FAMILIES if f.name == request.param))


def test_a_dated_template_renders_the_pinned_date(dated):
    for now, text in ((DAY1, "Today Date: 26 Jul 2024\n"), (DAY2, "Today Date: 27 Jul 2024\n")):
        renderer = ChatRenderer(dated, now=now)
        assert renderer.renders_date
        assert text in renderer.render_prompt(MESSAGES)
        assert text in renderer.render_full(MESSAGES, "It was completed in 1889.")


def test_pinned_to_today_it_renders_what_transformers_renders(dated):
    """The macro in front of the template changes nothing but where the date comes from."""
    convo = [m.as_dict() for m in MESSAGES]
    before = dated.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    ours = ChatRenderer(dated, now=datetime.now()).render_prompt(MESSAGES)
    after = dated.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert ours in (before, after)  # (a midnight between the two calls)


def test_the_environment_fixes_today(dated, monkeypatch):
    monkeypatch.setenv("COALESCENCE_TODAY", "2024-07-26")
    renderer = ChatRenderer(dated)
    assert renderer.now == DAY1
    monkeypatch.setenv("COALESCENCE_TODAY", "2024-07-27")  # pinned when the renderer was made
    assert "Today Date: 26 Jul 2024" in renderer.render_prompt(MESSAGES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_templates_without_a_date_are_not_reported(family):
    """Llama 3's fixed ``26 Jul 2024`` is text, not a date of the run; the others write none."""
    tok = build_family_tokenizer(family)
    renderer = ChatRenderer(tok, now=DAY2)
    assert not renderer.renders_date
    convo = [{"role": "user", "content": "When was it completed?"}]
    assert renderer.render_prompt([Message(role="user", content="When was it completed?")]) == tok.apply_chat_template(
        convo, tokenize=False, add_generation_prompt=True
    )
