"""The proxy game as one object (issue 48): :class:`~coalescence.engine.proxy.ProxyGame` knows its
name, tail rule, layout and refusal; the tail rules are a registry a rule can be added to from
outside the package, and the run's settings, the CLI's choices and the engine all read it.

References are written here: the game's name is the stem and the rule's name joined by a colon (the
name archived rows carry); a rule registered from outside cuts where it says in the decoded prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.snapshots import LANDMARKS, conversation_of, render_for

from coalescence.backends.testing import FakeBackend
from coalescence.engine import Engine, ProxyGame, proxy_game_of
from coalescence.engine.proxy import PROXY_COST_MULTIPLE
from coalescence.errors import ConfigError, TemplateRefused
from coalescence.masking.codec import PackedMask
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy
from coalescence.masking.proxy import DEFAULT_TAIL, TAIL_RULES, TailSite, register_tail_rule

ANSWER = "It was completed in 1889."


@pytest.fixture
def setup():
    conversation = conversation_of("It is 330 m tall. It was designed by Eiffel.\n\nWhen was it completed?", system=LANDMARKS, target=ANSWER)
    return render_for("chatml", conversation)


@pytest.fixture
def first_player_rule():
    """A rule registered from outside the package: the tail starts at the first player's first token
    (every player inside the tail). Removed again after the test."""

    def first_player(site: TailSite) -> int:
        return min(a for ranges in site.player_ranges for a, _ in ranges)

    register_tail_rule("first-player", first_player)
    yield first_player
    TAIL_RULES.pop("first-player")


def test_the_game_is_named_by_its_tail_rule_and_its_choices_map_onto_it():
    assert ProxyGame().tail == DEFAULT_TAIL == "after-last-player"
    assert ProxyGame(tail="last-turn").name == "kv-proxy-compact:last-turn"
    assert proxy_game_of("none") is None
    assert proxy_game_of("auto") == ProxyGame(tail="after-last-player", cost_limit=3.0) and PROXY_COST_MULTIPLE == 3.0
    assert proxy_game_of("answer") == ProxyGame(tail="answer", cost_limit=None)  # named: played whatever it costs


def test_unknown_rules_and_bad_limits_are_refused_once_with_the_nearest_name():
    with pytest.raises(ConfigError) as info:
        ProxyGame(tail="last_turn")
    assert info.value.field == "proxy_game" and "did you mean last-turn?" in info.value.message
    with pytest.raises(ConfigError) as info:
        proxy_game_of("atuo")
    assert info.value.field == "proxy_game" and "did you mean auto?" in info.value.message
    for bad in (0, -1.0, True, "3"):
        with pytest.raises(ConfigError) as info:
            ProxyGame(cost_limit=bad)
        assert info.value.field == "proxy_cost_limit"
    with pytest.raises(ConfigError) as info:  # the engine takes the object, and says how to make one
        Engine(FakeBackend(render_for("chatml", conversation_of("a. b.", target=ANSWER))[0]), proxy_game="last-turn")
    assert info.value.field == "proxy_game" and "ProxyGame(tail='last-turn')" in info.value.message
    with pytest.raises(ConfigError):
        register_tail_rule("not-callable", 3)  # type: ignore[arg-type]
    builtin = TAIL_RULES["answer"]
    with pytest.raises(ConfigError) as info:  # a built-in rule is not replaced by accident
        register_tail_rule("answer", lambda site: 1)
    assert "already registered" in info.value.message and TAIL_RULES["answer"] is builtin


def test_a_rule_registered_from_outside_is_a_choice_everywhere_and_cuts_where_it_says(setup, first_player_rule):
    from coalescence.app.groups import proxy_games
    from coalescence.app.settings import RunSettings

    tokenizer, renderer, snapshot, target = setup
    assert "first-player" in proxy_games() and proxy_games()[:2] == ("auto", "none")
    assert RunSettings(method="lasso", budget=16, proxy_game="first-player").proxy == ProxyGame(tail="first-player")
    layout = ProxyGame(tail="first-player").layout(renderer, snapshot, target, DropPolicy())
    assert layout.tail == "first-player"
    first = min(a for ranges in layout.player_ranges for a, _ in ranges)
    assert layout.tail_start == first
    # decoded: the shared part holds no player's text, the tail begins with the first player's
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    shared, tail = decode(layout.prompt_ids[:first]), decode(layout.prompt_ids[first:])
    assert all(p.text not in shared for p in snapshot.players)
    assert tail.lstrip().startswith(snapshot.players[0].text[:10])
    # the same game as the engine plays it: a layout and a key of its own name
    engine = Engine(FakeBackend(tokenizer), proxy_game=ProxyGame(tail="first-player"))
    snap = engine.prepare(snapshot.conversation, unit="sentence")
    assert engine.proxy_layout(snap, DropPolicy()).tail_start == first
    assert engine.proxy_refusal(snap, DropPolicy()) is None
    mask = PackedMask.from_bools(np.ones(snap.n_players, dtype=bool))
    assert engine.key(snap, DropPolicy(), mask, game="kv-proxy-compact:first-player") != engine.key(snap, DropPolicy(), mask)


def test_the_refusal_says_why_for_each_reason(setup):
    tokenizer, renderer, snapshot, target = setup
    game = ProxyGame()
    assert game.refusal(FakeBackend(tokenizer), teacher_forced=True, policy_id="drop") is None
    assert "generates a new answer" in game.refusal(None, teacher_forced=False, policy_id="drop")
    assert game.refusal(None, teacher_forced=True, policy_id="placeholder") == "the proxy game is defined for the drop policy only, not placeholder"

    def refused():
        raise TemplateRefused("no verbatim text", field="chat template")

    assert game.refusal(None, teacher_forced=True, policy_id="drop", lay_out=refused) == (
        "the proxy game cannot lay out this conversation (chat template: no verbatim text)"
    )
    engine = Engine(FakeBackend(tokenizer))  # no game asked for: off, and said so
    snap = engine.prepare(snapshot.conversation, unit="sentence")
    assert engine.proxy_refusal(snap, DropPolicy()) == "the proxy game is off (proxy_game none)"
    played = Engine(FakeBackend(tokenizer), proxy_game=game)
    assert played.proxy_refusal(snap, PlaceholderPolicy()) == "the proxy game is defined for the drop policy only, not placeholder"
