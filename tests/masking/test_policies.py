"""Absence policies: byte-exact full coalition, kept text present, absent text gone, whitespace rule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalescence.conversation import Conversation, ConversationSnapshot, Message
from coalescence.errors import ConfigError, MaskError
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy, available_policies, get_policy


def snapshot(user_text: str, *, unit: str = "sentence", system: str = "Be brief.") -> ConversationSnapshot:
    c = Conversation(
        messages=(Message(role="system", content=system), Message(role="user", content=user_text)),
        target="Answer.",
    )
    return ConversationSnapshot.build(c, unit=unit)


ABC = "Alpha is first. Beta is second.  Gamma is third."


def user_text(s, present, policy):
    msgs = policy.render(s, np.array(present, dtype=bool))
    users = [m.content for m in msgs if m.role == "user"]
    return users[0] if users else None


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ((1, 1, 1, 1), ABC),
        ((1, 0, 1, 1), "Beta is second.  Gamma is third."),
        ((1, 1, 0, 1), "Alpha is first. Gamma is third."),
        ((1, 1, 1, 0), "Alpha is first. Beta is second."),
        ((1, 0, 1, 0), "Beta is second."),
        ((1, 1, 0, 0), "Alpha is first."),
        ((1, 0, 0, 1), "Gamma is third."),
        ((1, 0, 0, 0), None),  # every player of the message absent: the message is removed
    ],
)
def test_drop_whitespace_rule(present, expected):
    s = snapshot(ABC)
    assert [p.text for p in s.players[1:]] == ["Alpha is first.", "Beta is second.", "Gamma is third."]
    assert user_text(s, present, DropPolicy()) == expected


def test_placeholder_keeps_separators():
    s = snapshot(ABC)
    policy = PlaceholderPolicy(text="[gone]")
    assert user_text(s, (1, 1, 0, 1), policy) == "Alpha is first. [gone]  Gamma is third."
    assert user_text(s, (1, 0, 0, 0), policy) == "[gone] [gone]  [gone]"
    msgs = policy.render(s, np.zeros(4, dtype=bool))
    assert [m.content for m in msgs] == ["[gone]", "[gone] [gone]  [gone]"]


def test_turn_drop_removes_the_message_and_placeholder_replaces_it():
    s = snapshot(ABC, unit="turn")
    assert [m.role for m in DropPolicy().render(s, np.array([False, True]))] == ["user"]
    assert DropPolicy().render(s, np.array([True, False]))[-1].role == "system"
    msgs = PlaceholderPolicy().render(s, np.array([True, False]))
    assert [(m.role, m.content) for m in msgs] == [("system", "Be brief."), ("user", "[removed]")]


def test_non_attributable_messages_never_change():
    c = Conversation(
        messages=(Message(role="system", content="Keep me. Always."), Message(role="user", content=ABC)),
        target="A.",
    )
    s = ConversationSnapshot.build(c, unit="sentence", roles=["user"])
    for present in itertools.product([False, True], repeat=s.n_players):
        msgs = DropPolicy().render(s, np.array(present))
        assert msgs[0] == c.messages[0]


def test_bad_coalition_shape():
    s = snapshot(ABC)
    with pytest.raises(MaskError):
        DropPolicy().render(s, np.ones(3, dtype=bool))
    with pytest.raises(MaskError):
        DropPolicy().render(s, np.ones(4, dtype=int))


def test_registry():
    assert set(available_policies()) >= {"drop", "placeholder"}
    assert get_policy("placeholder", text="X").params() == {"text": "X"}
    with pytest.raises(ConfigError) as info:
        get_policy("blur")
    assert info.value.field == "--absence-policy"


sentence = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=12
).map(lambda w: w.replace(".", "") + ".")
separator = st.sampled_from([" ", "  ", "\n", "\n\n", " \t "])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(sentence, separator), min_size=1, max_size=6),
    st.sampled_from(["", " ", "\n"]),
    st.data(),
)
def test_drop_invariants_on_generated_text(parts, lead, data):
    text = lead + "".join(s + sep for s, sep in parts).rstrip(" \t\n") 
    if not text.strip():
        return
    s = snapshot(text)
    n = s.n_players
    full = DropPolicy().render(s, np.ones(n, dtype=bool))
    assert full == list(s.conversation.messages)  # byte-exact full coalition
    present = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    msgs = DropPolicy().render(s, present)
    rendered = "".join(m.content for m in msgs)
    for p in s.players:
        if present[p.index]:
            assert p.text in rendered
    kept = [p.text for p in s.players if present[p.index]]
    # kept players appear in order, separated by whitespace only (no glued neighbours)
    users = [m.content for m in msgs if m.role == "user"]
    user_kept = [p.text for p in s.players if present[p.index] and p.role == "user"]
    if user_kept:
        body = users[0]
        pos = 0
        for t in user_kept:
            at = body.index(t, pos)
            assert not body[pos:at].strip()  # nothing but whitespace between kept sentences
            pos = at + len(t)
        assert not body[pos:].strip()
    else:
        assert not users
    assert len(kept) == int(present.sum())
