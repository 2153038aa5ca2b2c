"""An explain run is given what it fits (its phases), from outside the package, with no subclass:
a hand-written leave-one-out run on the fake backend's quadratic game gives the values the game's
definition gives, records its own ``run_config`` in the archive manifest, and its player limit
refuses a game before any model call. The settings normalise what they are given before they are
constructed (``dataclasses.replace`` too)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import coalescence
from coalescence.app.explain import ExplainRun
from coalescence.app.lifecycle import run_blocking
from coalescence.app.settings import RunSettings
from coalescence.backends.testing import FakeBackend
from coalescence.errors import EstimatorError

SENTENCES = ("The Eiffel Tower was completed in 1889.", "I am planning a weekend in Lisbon.", "Order the grilled sardines.", "When was it completed?")
WORDS = ("Eiffel", "Lisbon", "sardines", "When")
"""One word only each sentence holds: the game sees a player as present when its word is in the prompt."""
WEIGHTS = (3.0, 1.0, 0.25, 1.5)
PAIR = -2.5
"""v(S) = -12 + sum of WEIGHTS over S + PAIR when players 0 and 3 are both present (nats)."""


def v(present: np.ndarray) -> float:
    """The game's value of a coalition, by its definition (nats)."""
    return -12.0 + sum(w for w, here in zip(WEIGHTS, present, strict=True) if here) + (PAIR if present[0] and present[3] else 0.0)


def make_backend(tokenizer) -> FakeBackend:
    def game(prompt_ids: tuple[int, ...], target_ids: tuple[int, ...]) -> list[float]:
        text = tokenizer.decode(prompt_ids)
        return [v(np.array([w in text for w in WORDS])) / len(target_ids)] * len(target_ids)

    return FakeBackend(tokenizer, game=game)


SOURCE = {"messages": [{"role": "user", "content": " ".join(SENTENCES)}, {"role": "assistant", "content": "In 1889."}]}


class LeaveOneOut:
    """Phases of a run that evaluates the full coalition and each one-player removal and reports
    v(N) - v(N without i) per player (nats)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit

    def player_limit(self, run):
        return self.limit

    def validate_game(self, run, n_players, *, refused):
        pass

    def plan(self, run, n_players):
        full = np.ones(n_players, dtype=bool)
        return [full] + [np.where(np.arange(n_players) == i, False, full) for i in range(n_players)]

    def fine_game(self, run, snapshot):
        return None  # no hierarchy

    def outputs(self, run):
        return None, None

    def run_config(self, run):
        return {"command": "leave-one-out by hand", "players": run.snapshots[0].n_players}

    def restored(self, run, snap):
        return None

    def record(self, run, snap, result):
        pass

    async def explain_one(self, run, k, snap):
        masks, utilities = await run.engine.evaluate(snap, run.policy, self.plan(run, snap.n_players))
        value = {tuple(m): float(u) for m, u in zip(masks, utilities, strict=True)}
        full = tuple([True] * snap.n_players)
        return [value[full] - value[tuple(i != j for j in range(snap.n_players))] for i in range(snap.n_players)]


def test_a_run_given_its_phases_fits_what_they_say(tmp_path, chatml_tokenizer):
    settings = RunSettings(model="fake", unit="sentence", method="loo", archive=tmp_path / "run")
    run = ExplainRun(SOURCE, settings, backend=make_backend(chatml_tokenizer), phases=LeaveOneOut())
    run.preflight()
    run.load()
    run.open_archive()
    try:
        (values,) = run_blocking(run.evaluate)
    finally:
        run.close("complete")
    n = len(SENTENCES)
    full = np.ones(n, dtype=bool)
    expected = [v(full) - v(np.arange(n) != i) for i in range(n)]  # by the game's definition
    assert values == pytest.approx(expected, abs=1e-5)  # the fake scores in float32
    assert expected == pytest.approx([3.0 - 2.5, 1.0, 0.25, 1.5 - 2.5])  # the pair term goes with player 0 or 3
    config = coalescence.read_manifest(tmp_path / "run")["runs"][-1]["run_config"]
    assert config["command"] == "leave-one-out by hand" and config["players"] == n


def test_the_phases_player_limit_refuses_before_any_model_call(chatml_tokenizer):
    backend = make_backend(chatml_tokenizer)
    with pytest.raises(EstimatorError) as caught:
        ExplainRun(SOURCE, RunSettings(model="fake", unit="sentence", method="loo"), backend=backend, phases=LeaveOneOut(limit=3))
    assert caught.value.field == "method" and "at most 3" in caught.value.message
    assert backend.calls == []


def test_settings_are_normalised_before_construction_and_by_replace():
    settings = RunSettings(model="m", roles=" user, system ,", hierarchy="document,sentence")
    assert settings.roles == ("user", "system") and settings.hierarchy == ("document", "sentence")
    assert settings.method == "default"
    assert dataclasses.replace(settings, hierarchy=None, method=None, budget=64).method == "auto"  # chosen again, as on construction
