"""Input parsing, segmentation into players, and snapshot identity."""

from __future__ import annotations

import json

import pytest

from coalescence.conversation import Conversation
from coalescence.snapshot import ConversationSnapshot
from coalescence.inputs import load_conversation
from coalescence.segmentation import segment_players
from coalescence.errors import InputError

TEXT = "The tower is in Paris.  It was completed in 1889. Dr. Smith said so! Mt. Fuji is in Japan."


def convo(**extra):
    data = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": TEXT},
            {"role": "assistant", "content": "In 1889."},
        ]
    }
    data.update(extra)
    return data


def test_last_assistant_is_the_target():
    c = Conversation.from_dict(convo())
    assert c.target == "In 1889." and c.target_source == "last_assistant"
    assert [m.role for m in c.messages] == ["system", "user"]


def test_target_field_overrides_last_assistant():
    c = Conversation.from_dict(convo(target="1889"))
    assert c.target == "1889" and c.target_source == "field"
    assert [m.role for m in c.messages] == ["system", "user"]


def test_ending_on_user_leaves_target_to_generate():
    data = convo()
    data["messages"].pop()
    c = Conversation.from_dict(data)
    assert c.target is None and c.target_source == "none"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([1, 2], "input"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": "q"}], "target": ""}, "target"),
        ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "messages"),
    ],
)
def test_bad_input_names_the_field(data, field):
    with pytest.raises(InputError) as info:
        Conversation.from_dict(data)
    assert info.value.field == field


def test_malformed_json_gives_position(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"messages": [')
    with pytest.raises(InputError, match="line 1 column") as info:
        load_conversation(p)
    assert info.value.field == "input"


def test_sentence_players_have_exact_spans_and_labels():
    c = Conversation.from_dict(convo())
    players = segment_players(c, unit="sentence")
    assert [p.label for p in players] == [
        "system[0].s0",
        "user[1].s0",
        "user[1].s1",
        "user[1].s2",
        "user[1].s3",
    ]
    assert [p.index for p in players] == list(range(5))
    for p in players:
        assert c.messages[p.message_index].content[p.start : p.end] == p.text
        assert p.text == p.text.strip()
    assert players[2].text == "It was completed in 1889."
    assert players[3].text == "Dr. Smith said so!"  # abbreviation not split


def test_turn_players_and_roles():
    c = Conversation.from_dict(convo())
    players = segment_players(c, unit="turn", roles=["user"])
    assert len(players) == 1
    assert players[0].label == "user[1]" and players[0].text == TEXT
    with pytest.raises(InputError) as info:
        segment_players(c, unit="turn", roles=["tool"])
    assert info.value.field == "roles"
    with pytest.raises(InputError) as info:
        segment_players(c, unit="turn", roles=["robot"])
    assert info.value.field == "roles"
    with pytest.raises(InputError) as info:
        segment_players(c, unit="letter")
    assert info.value.field == "unit"


def test_snapshot_id_is_canonical_and_sensitive():
    a = ConversationSnapshot.build(Conversation.from_dict(convo()), unit="sentence")
    b = ConversationSnapshot.build(Conversation.from_dict(json.loads(json.dumps(convo()))), unit="sentence")
    assert a.snapshot_id == b.snapshot_id and len(a.snapshot_id) == 64
    assert ConversationSnapshot.build(Conversation.from_dict(convo()), unit="turn").snapshot_id != a.snapshot_id
    assert ConversationSnapshot.build(Conversation.from_dict(convo(target="x")), unit="sentence").snapshot_id != a.snapshot_id
    other = convo()
    other["messages"][0]["content"] = "Be brief!"
    assert ConversationSnapshot.build(Conversation.from_dict(other), unit="sentence").snapshot_id != a.snapshot_id


def test_examples_load():
    eiffel = ConversationSnapshot.build(load_conversation("examples/eiffel.json"), unit="sentence")
    assert eiffel.target == "It was completed in 1889."
    assert eiffel.n_players == 10
    assert sum("1889" in p.text for p in eiffel.players) == 1
    trip = ConversationSnapshot.build(load_conversation("examples/trip.json"), unit="turn")
    assert [p.role for p in trip.players] == ["system", "user", "assistant", "user"]


# -- units ------------------------------------------------------------------------------------

PARAS = "First paragraph. Two sentences.\n\n  Second one.\n \nThird\nstill third."


def one_user(text: str, **extra) -> Conversation:
    return Conversation.from_dict({"messages": [{"role": "user", "content": text}], "target": "x", **extra})


def test_paragraph_players():
    players = segment_players(one_user(PARAS), unit="paragraph")
    assert [p.text for p in players] == ["First paragraph. Two sentences.", "Second one.", "Third\nstill third."]
    assert [p.label for p in players] == ["user[0].p0", "user[0].p1", "user[0].p2"]


def test_word_players_have_exact_offsets_on_awkward_text():
    text = "Don't stop — naïve cafe\u0301 👩‍👩‍👧 שלום עולם 東京は日本の首都です。 \"quoted\" end."
    players = segment_players(one_user(text), unit="word")
    for p in players:
        assert text[p.start : p.end] == p.text and p.text.strip() == p.text and p.text
    texts = [p.text for p in players]
    assert "Do" in texts and "n't" in texts and "cafe\u0301" in texts and "👩‍👩‍👧" in texts
    assert "東京は日本の首都です。" in texts and "שלום" in texts
    assert players[0].label == "user[0].w0"


TOOL_INPUT = {
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Rain."},
    ]
}


def test_tool_unit_pairs_a_call_with_its_result():
    c = Conversation.from_dict(TOOL_INPUT)
    assert c.messages[1].content == '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    players = segment_players(c, unit="tool")
    assert [p.label for p in players] == ["user[0]", "assistant[1]+tool[2]", "user[3]"]
    assert players[1].extra == ((2, 0, len("Sunny, 21 C.")),)
    snap = ConversationSnapshot.build(c, unit="tool")
    assert snap.to_dict()["players"][1]["extra"] == [[2, 0, 12]]
    assert ConversationSnapshot.from_dict(snap.to_dict()).snapshot_id == snap.snapshot_id
    assert snap.snapshot_id != ConversationSnapshot.build(c, unit="turn").snapshot_id
    from coalescence.masking.policies import DropPolicy
    import numpy as np

    msgs = DropPolicy().render(snap, np.array([True, False, True]))
    assert [m.role for m in msgs] == ["user", "user"]
    with pytest.raises(InputError) as info:
        Conversation.from_dict({"messages": [{"role": "user", "content": "q", "tool_calls": [{}]}], "target": "x"})
    assert info.value.field == "messages[0].tool_calls"


def test_empty_message_is_a_turn_player_but_no_sentence():
    c = Conversation.from_dict({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi. Bye."}], "target": "x"})
    assert [p.label for p in segment_players(c, unit="turn")] == ["system[0]", "user[1]"]
    assert [p.label for p in segment_players(c, unit="sentence")] == ["user[1].s0", "user[1].s1"]


def test_zero_players_is_a_clear_error():
    c = Conversation.from_dict({"messages": [{"role": "user", "content": "   "}], "target": "x"})
    with pytest.raises(InputError, match="no attributable players") as info:
        segment_players(c, unit="sentence")
    assert info.value.field == "roles"
    with pytest.raises(InputError) as info:
        segment_players(c, unit="document")
    assert info.value.field == "unit"
    with pytest.raises(InputError):
        ConversationSnapshot(conversation=c, unit="turn", players=())


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_any_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)


@settings(max_examples=40, deadline=None)
@given(_any_text, st.sampled_from(["paragraph", "sentence", "word"]))
def test_units_give_exact_disjoint_spans_on_any_text(text, unit):
    c = Conversation.from_dict({"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": text}], "target": "x"})
    players = segment_players(c, unit=unit)
    snap = ConversationSnapshot(conversation=c, unit=unit, players=players)  # validates slices and overlaps
    for p in snap.players:
        assert p.text and p.text == p.text.strip() and text[p.start : p.end] == p.text or p.message_index == 0
