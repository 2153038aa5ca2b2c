"""Segmentation: tool exchanges under --roles, the chunked sentence splitter, early player counts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coalescence.conversation import Conversation, ConversationSnapshot, segment_players
from coalescence.inputs import load_inputs
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy

# -- --unit tool with --roles: an exchange takes only attributable messages -------------------

TOOLS_JSON = "examples/tools.json"
TOOL_RESULT = '{"city": "Lisbon", "day": "tomorrow", "rain_probability": 0.8, "summary": "showers"}'


def _every_coalition(snapshot):
    for bits in itertools.product([False, True], repeat=snapshot.n_players):
        yield np.array(bits, dtype=bool)


@pytest.mark.parametrize(
    ("roles", "labels"),
    [
        (["assistant"], ["assistant[2]"]),
        (["user", "assistant"], ["user[1]", "assistant[2]"]),
        (["system", "assistant"], ["system[0]", "assistant[2]"]),
    ],
)
def test_tool_messages_stay_in_every_coalition_when_tool_is_not_a_role(roles, labels):
    (conversation,), _ = load_inputs(TOOLS_JSON)
    assert conversation.messages[3].role == "tool" and conversation.messages[3].content == TOOL_RESULT
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=roles)
    assert [p.label for p in snapshot.players] == labels
    assert all(not p.extra for p in snapshot.players)
    for policy in (DropPolicy(), PlaceholderPolicy()):
        for present in _every_coalition(snapshot):
            rendered = policy.render(snapshot, present)
            tool = [m for m in rendered if m.role == "tool"]
            assert [m.content for m in tool] == [TOOL_RESULT], (policy.id, present)


def test_tool_exchange_with_every_role_still_pairs_the_call_and_its_result():
    (conversation,), _ = load_inputs(TOOLS_JSON)
    players = segment_players(conversation, unit="tool", roles=["assistant", "tool"])
    assert [p.label for p in players] == ["assistant[2]+tool[3]"]
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=["assistant", "tool"])
    rendered = DropPolicy().render(snapshot, np.array([False]))
    assert [m.role for m in rendered] == ["system", "user"]  # the call and its result go together


def test_tool_messages_alone_when_assistant_is_not_a_role():
    (conversation,), _ = load_inputs(TOOLS_JSON)
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=["tool"])
    assert [p.label for p in snapshot.players] == ["tool[3]"]
    rendered = DropPolicy().render(snapshot, np.array([False]))
    assert [m.role for m in rendered] == ["system", "user", "assistant"]
    assert rendered[2].content.startswith("<tool_call>\n")
