"""Absence policies: byte-exact full coalition, kept text present, absent text gone, whitespace rule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
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
    assert info.value.field == "absence_policy"


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


# -- every unit: whitespace rule, awkward text, system turn rule --------------------------------

from coalescence.masking.codec import PackedMask, coalition_key  # noqa: E402

AWKWARD = [
    "Cafe\u0301 au lait. Zoe\u0308 said so.",  # combining marks
    "👩‍👩‍👧 family. 🇫🇷 flag! 👍🏽 ok.",  # ZWJ sequences, flags, skin tones
    "שלום עולם. مرحبا بالعالم. Mixed עברית and English.",  # right-to-left
    "東京は日本の首都です。大阪は大きい。漢字かな交じり文",  # CJK without spaces
    "Ｆｕｌｌｗｉｄｔｈ. \u00a0non-breaking\u00a0space. Tab\tinside.",
    "a\u0300\u0301\u0302\u0303 stacked. ∑∫√ math. ẞ ß ǅ.",  # characters a byte-level BPE splits
    "Line one.\r\nLine two.\u2028Line three.\u2029End.",
    "  leading and trailing  \n",
]


@pytest.mark.parametrize("unit", ["turn", "paragraph", "sentence", "word"])
@pytest.mark.parametrize("text", AWKWARD, ids=range(len(AWKWARD)))
def test_full_coalition_is_byte_exact_on_awkward_text(text, unit, chatml_tokenizer):
    from coalescence.masking.render import ChatRenderer

    s = snapshot(text, unit=unit)
    renderer = ChatRenderer(chatml_tokenizer)
    for policy in (DropPolicy(), DropPolicy(system_absent="empty"), PlaceholderPolicy()):
        full = policy.render(s, np.ones(s.n_players, dtype=bool))
        assert full == list(s.conversation.messages)
        rendered = renderer.render_prompt(full)
        assert rendered == renderer.render_prompt(s.conversation.messages)
        assert text in rendered
        ids = renderer.encode(rendered)
        assert chatml_tokenizer.decode(ids) == rendered  # byte-level BPE round trip
    for p in s.players:  # each player alone: its text byte-exact, nothing glued
        present = np.zeros(s.n_players, dtype=bool)
        present[p.index] = True
        present[0] = True
        body = "".join(m.content for m in DropPolicy().render(s, present))
        assert p.text in body


@pytest.mark.parametrize(
    ("text", "unit", "absent", "expected"),
    [
        ("Don't go home.", "word", ["n't"], "Do go home."),
        ("Don't go home.", "word", ["Do", "n't"], "go home."),
        ("Paris, it rains.", "word", [","], "Paris it rains."),
        ("Paris is big. It rains.", "word", ["big"], "Paris is. It rains."),
        ("Paris is big. It rains.", "word", ["is", "big"], "Paris. It rains."),
        ("Paris is big. It rains.", "word", ["It"], "Paris is big. rains."),
        ("One.\n\nTwo.\n\nThree.", "paragraph", ["Two."], "One.\n\nThree."),
        ("One.\n\nTwo.\n\nThree.", "paragraph", ["Three."], "One.\n\nTwo."),
        ("One.\n\nTwo.\n\nThree.\n", "paragraph", ["Three."], "One.\n\nTwo.\n"),
        ("One.\n\n  Two.", "paragraph", ["One."], "Two."),
        ("Alpha one. Beta two.\nGamma three.", "sentence", ["Beta two."], "Alpha one.\nGamma three."),  # the line break stays
        ("Alpha one. Beta two.\nGamma three.", "sentence", ["Alpha one."], "Beta two.\nGamma three."),
    ],
)
def test_whitespace_rule_per_unit(text, unit, absent, expected):
    s = snapshot(text, unit=unit)
    present = np.array([p.role == "system" or p.text not in absent for p in s.players])
    assert user_text(s, present, DropPolicy()) == expected


words = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(words, st.sampled_from([" ", "  ", "\n", "\n\n", " \t"])), min_size=1, max_size=8), st.data())
def test_word_drop_never_glues_or_dangles(parts, data):
    text = "".join(w + sep for w, sep in parts).strip()
    if not text:
        return
    s = snapshot(text, unit="word")
    assert DropPolicy().render(s, np.ones(s.n_players, dtype=bool)) == list(s.conversation.messages)
    present = np.array(data.draw(st.lists(st.booleans(), min_size=s.n_players, max_size=s.n_players)))
    users = [m.content for m in DropPolicy().render(s, present) if m.role == "user"]
    kept = [p for p in s.players if present[p.index] and p.role == "user"]
    if not kept:
        assert not users
        return
    body = users[0]
    assert body == body.strip()  # no dangling separator at either end
    pos = 0
    for prev, p in zip([None, *kept], kept):
        at = body.index(p.text, pos)
        between = body[pos:at]
        assert not between.strip()
        if prev is not None and text[p.start - 1].isspace():
            assert between  # a word that had whitespace before it is never glued to its neighbour
        pos = at + len(p.text)


def test_system_absent_rule_is_explicit_and_keyed():
    s = snapshot("Hello there.", unit="turn")
    none_sys = np.array([False, True])
    assert [m.role for m in DropPolicy().render(s, none_sys)] == ["user"]
    msgs = DropPolicy(system_absent="empty").render(s, none_sys)
    assert [(m.role, m.content) for m in msgs] == [("system", ""), ("user", "Hello there.")]
    assert DropPolicy().params() == {} and DropPolicy(system_absent="empty").params() == {"system_absent": "empty"}
    assert get_policy("drop", system_absent="empty") == DropPolicy(system_absent="empty")
    with pytest.raises(ConfigError) as info:
        DropPolicy(system_absent="blank")
    assert info.value.field == "system_absent"
    mask = PackedMask.from_bools(none_sys)
    keys = {
        coalition_key(snapshot_id=s.snapshot_id, mask=mask, policy_id=p.id, policy_params=p.params(), model_id="m",
                      model_revision="r", dtype="float32", utility={"kind": "logprob"})
        for p in (DropPolicy(), DropPolicy(system_absent="empty"))
    }
    assert len(keys) == 2


def test_an_empty_player_removes_nothing():
    c = Conversation(messages=(Message(role="system", content=""), Message(role="user", content="Hi.")), target="A.")
    s = ConversationSnapshot.build(c, unit="turn")
    assert [p.text for p in s.players] == ["", "Hi."]
    for policy in (DropPolicy(), PlaceholderPolicy()):
        assert policy.render(s, np.array([False, True])) == list(c.messages)
