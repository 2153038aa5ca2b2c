"""The proxy game's layout (issue 37): player token ranges and tail rules, checked by decoding.

The references are the rendered text itself: a player's tokens decode to its text (plus the
whitespace a token carries before it), tokens outside every player hold no player's text, and each
tail rule's cut is where its rule says in the decoded prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.snapshots import LANDMARKS, conversation_of, render_for

from coalescence.backends.base import ProxyScoreRequest
from coalescence.conversation import Conversation
from coalescence.errors import ConfigError, MaskError
from coalescence.masking import proxy as proxy_module
from coalescence.masking.policies import DropPolicy
from coalescence.masking.proxy import TAIL_RULES, proxy_layout
from coalescence.snapshot import ConversationSnapshot

FAMILY_NAMES = ("chatml", "llama3", "llama2", "qwen3")
ANSWER = "It was completed in 1889."


def proxy_conversation() -> Conversation:
    """A one-message RAG prompt (context sentences, then the question, all players) with a system
    prompt first (or, for templates that fold it, first anyway)."""
    return conversation_of(
        "Some facts: It is 330 m tall. It was designed by Gustave Eiffel's company.\n\nWhen was it completed?",
        system=LANDMARKS,
        target=ANSWER,
    )


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def setup(request):
    return render_for(request.param, proxy_conversation())


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("path", ["marked", "searched"])
def test_player_ranges_cover_exactly_the_players_text(setup, monkeypatch, path):
    tokenizer, renderer, snapshot, target = setup
    if path == "searched":  # the fallback: each message's content searched in order
        monkeypatch.setattr(proxy_module, "_marked_pieces", lambda *a: None)
    else:  # the marked rendering must serve every family here: no silent fallback
        monkeypatch.setattr(proxy_module, "_searched_pieces", lambda *a: pytest.fail("searched"))
    layout = proxy_layout(renderer, snapshot, target, tail="last-turn")
    full = renderer.coalition_prompt(snapshot, DropPolicy(), np.ones(snapshot.n_players, dtype=bool), target)
    assert list(layout.prompt_ids) == full  # byte-identical to the exact game's full coalition
    assert layout.target_ids == target.ids
    owned = np.zeros(len(layout.prompt_ids), dtype=bool)
    for player, ranges in zip(snapshot.players, layout.player_ranges, strict=True):
        assert len(ranges) == 1  # one sentence: one contiguous run of tokens
        a, b = ranges[0]
        text = _decode(tokenizer, layout.prompt_ids[a:b])
        # the player's text, and nothing else but the whitespace its first token carries
        assert text.strip() == player.text, (player.label, text)
        owned[a:b] = True
    rest = _decode(tokenizer, [t for t, o in zip(layout.prompt_ids, owned) if not o])
    for player in snapshot.players:
        assert player.text not in rest
    assert "Eiffel" not in rest and "330" not in rest and "completed" not in rest


def test_tail_rules_cut_where_they_say(setup):
    tokenizer, renderer, snapshot, target = setup
    question = snapshot.conversation.messages[-1].content
    layouts = {rule: proxy_layout(renderer, snapshot, target, tail=rule) for rule in TAIL_RULES}
    ids = layouts["answer"].prompt_ids
    last_end = max(b for ranges in layouts["answer"].player_ranges for _, b in ranges)
    # after-last-player: right after the last player's last token (the question is a player)
    assert layouts["after-last-player"].tail_start == last_end
    assert _decode(tokenizer, ids[: last_end]).endswith("When was it completed?")
    # last-turn: the tail starts with the last message's content
    cut = layouts["last-turn"].tail_start
    assert _decode(tokenizer, ids[cut:]).lstrip().startswith("Some facts:")
    assert "Some facts" not in _decode(tokenizer, ids[:cut])
    # answer: the whole last content is shared, the tail holds none of it
    cut = layouts["answer"].tail_start
    assert _decode(tokenizer, ids[:cut]).rstrip().endswith(question[-12:])
    assert "completed" not in _decode(tokenizer, ids[cut:])
    for layout in layouts.values():
        assert 1 <= layout.tail_start <= len(ids)
        assert layout.tail_tokens == len(ids) + len(target.ids) - 1 - layout.tail_start


def test_a_question_before_the_context_is_shared_under_after_last_player(setup):
    tokenizer, renderer, _, _ = setup
    content = "Question: When was it completed?\n\nContext: It is 330 m tall. It was completed in 1889."
    a, b = content.index("It is"), content.index("It was")
    # declared players: the two context sentences only (the question is not a player)
    data = {
        "messages": [{"role": "user", "content": content}],
        "target": ANSWER,
        "players": [{"message": 0, "start": a, "end": b - 1}, {"message": 0, "start": b, "end": len(content)}],
    }
    from coalescence.inputs import conversation_from_input

    snapshot = ConversationSnapshot.build(conversation_from_input(data), unit="sentence")
    assert [p.text for p in snapshot.players] == ["It is 330 m tall.", "It was completed in 1889."]
    target = renderer.target_tokens(snapshot, DropPolicy())
    after = proxy_layout(renderer, snapshot, target, tail="after-last-player")
    answer = proxy_layout(renderer, snapshot, target, tail="answer")
    turn = proxy_layout(renderer, snapshot, target, tail="last-turn")
    assert after.tail_start == answer.tail_start  # the context ends the message
    assert turn.tail_start < after.player_ranges[0][0][0]  # the question and the context in the tail
    assert "Question" in _decode(tokenizer, turn.prompt_ids[turn.tail_start :])


def test_request_hides_the_absent_players_ranges(setup):
    _, renderer, snapshot, target = setup
    layout = proxy_layout(renderer, snapshot, target, tail="last-turn")
    n = snapshot.n_players
    rng = np.random.default_rng(3)
    for _ in range(8):
        present = rng.random(n) < 0.5
        req = layout.request(present, prefix_group="g")
        assert isinstance(req, ProxyScoreRequest) and req.prefix_group == "g"
        assert req.tail_start == layout.tail_start and req.prompt_ids == layout.prompt_ids
        expected = np.zeros(len(layout.prompt_ids), dtype=bool)
        for i in np.flatnonzero(~present):
            for a, b in layout.player_ranges[i]:
                expected[a:b] = True
        got = np.zeros_like(expected)
        for a, b in req.hidden:
            got[a:b] = True
        assert (got == expected).all()
        assert all(b < c for (_, b), (c, _) in zip(req.hidden, req.hidden[1:]))  # merged: never touching
    assert layout.request(np.ones(n, dtype=bool)).hidden == ()
    with pytest.raises(MaskError):
        layout.request(np.ones(n + 1, dtype=bool))
    with pytest.raises(MaskError):
        layout.request(np.ones(n, dtype=np.int64))


def test_unknown_tail_rule_and_bad_requests_are_refused(setup):
    _, renderer, snapshot, target = setup
    with pytest.raises(ConfigError) as info:
        proxy_layout(renderer, snapshot, target, tail="middle")
    assert info.value.field == "proxy_game"
    base = dict(prompt_ids=(1, 2, 3, 4), target_ids=(5,))
    for bad, field in [
        (dict(tail_start=0), "tail_start"),
        (dict(tail_start=5), "tail_start"),
        (dict(tail_start=2, hidden=((0, 1),)), "hidden"),  # position 0 always visible
        (dict(tail_start=2, hidden=((2, 2),)), "hidden"),
        (dict(tail_start=2, hidden=((2, 3), (1, 2))), "hidden"),
        (dict(tail_start=2, hidden=((1, 5),)), "hidden"),
    ]:
        with pytest.raises(ConfigError) as info:
            ProxyScoreRequest(**base, **bad)
        assert info.value.field == field
    ok = ProxyScoreRequest(**base, tail_start=4, hidden=((1, 2), (2, 4)))
    assert ok.hidden == ((1, 2), (2, 4)) and ok.n_tokens == 5


def test_a_generated_answer_is_scored_after_the_generation_prompt(setup):
    tokenizer, renderer, snapshot, _ = setup
    ids = tuple(tokenizer(ANSWER, add_special_tokens=False).input_ids)
    conv = proxy_conversation()
    generated = Conversation(messages=conv.messages, target=tokenizer.decode(list(ids)), target_ids=ids)
    snap = ConversationSnapshot.build(generated, unit="sentence")
    target = renderer.target_tokens(snap, DropPolicy())
    layout = proxy_layout(renderer, snap, target)
    # the exact game scores a generated answer after the generation prompt (messages + header)
    assert list(layout.prompt_ids) == renderer.encode_prompt(list(conv.messages))
    assert layout.target_ids == target.ids and layout.target_ids[: len(ids)] == ids
    last = max(b for ranges in layout.player_ranges for _, b in ranges)
    assert layout.tail_start == last and _decode(tokenizer, layout.prompt_ids[:last]).endswith("When was it completed?")


def test_a_question_after_the_context_is_in_the_tail_under_after_last_player_only(setup):
    tokenizer, renderer, _, _ = setup
    content = "Context: It is 330 m tall. It was completed in 1889.\n\nQuestion: When was it completed?"
    a, b = content.index("It is"), content.index("It was")
    data = {
        "messages": [{"role": "user", "content": content}],
        "target": ANSWER,
        "players": [{"message": 0, "start": a, "end": b - 1}, {"message": 0, "start": b, "end": content.index("\n")}],
    }
    from coalescence.inputs import conversation_from_input

    snapshot = ConversationSnapshot.build(conversation_from_input(data), unit="sentence")
    target = renderer.target_tokens(snapshot, DropPolicy())
    after = proxy_layout(renderer, snapshot, target, tail="after-last-player")
    answer = proxy_layout(renderer, snapshot, target, tail="answer")
    assert after.tail_start < answer.tail_start
    assert "Question: When was it completed?" in _decode(tokenizer, after.prompt_ids[after.tail_start :])
    assert "Question" not in _decode(tokenizer, answer.prompt_ids[answer.tail_start :])
