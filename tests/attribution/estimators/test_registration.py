"""Adding an estimator from outside the package: one class and one ``register_estimator`` call make
it a method everywhere (the live ``METHODS``, ``make_estimator``, the CLI's help, the engine).

The estimator defined here is leave-one-in, ``v({i}) - v(empty)`` (the first-order effect of each
player alone). On an additive game it equals every Shapley value; the game is the public fake
backend's presence game made additive as in ``tests/helpers/presence.py``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest

from coalescence.attribution.estimators import Capabilities, Estimate, make_estimator, pool_lookup, register_estimator
from coalescence.attribution.estimators import registry
from coalescence.cli import main
from coalescence.masking.policies import DropPolicy

from helpers.presence import additive_presence_game, eiffel


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaveOneIn:
    """``values[i] = v({i}) - v(empty)`` in the utility's unit, from n + 2 coalitions."""

    name: str = field(default="leave-one-in", init=False)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=False, reports_stderr=False)

    def validate(self, n_players: int) -> None:
        if n_players < 1:
            raise ValueError("no players")

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        self.validate(n_players)
        rows = [np.zeros(n_players, dtype=bool), np.ones(n_players, dtype=bool)]
        rows += [np.arange(n_players) == i for i in range(n_players)]
        return iter(rows)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        n = masks.shape[1]
        lookup = pool_lookup(masks, utilities)
        rows = list(self.plan(n))
        u = np.array([lookup[np.packbits(r, bitorder="little").tobytes()] for r in rows])
        values = u[2:] - u[0]
        return Estimate(
            method=self.name, values=values, stderr=None, v_empty=float(u[0]), v_full=float(u[1]),
            efficiency_gap=float(values.sum() - (u[1] - u[0])), n_evaluations=len(rows),
        )  # fmt: skip


@pytest.fixture
def registered():
    register_estimator("leave-one-in", LeaveOneIn)
    yield
    registry.ESTIMATORS.pop("leave-one-in", None)


def test_a_registered_estimator_is_a_method_everywhere(registered, monkeypatch):
    from coalescence.attribution.estimators import METHODS

    assert METHODS[-1] == "leave-one-in" and registry.METHODS == METHODS
    assert isinstance(make_estimator("leave-one-in"), LeaveOneIn)
    monkeypatch.setenv("COLUMNS", "500")  # argparse wraps help at hyphens on narrow terminals
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["explain", "--help"])
    assert exit_.value.code == 0
    assert "leave-one-in" in " ".join(out.getvalue().split())


def test_without_registration_it_is_no_method():
    from coalescence.attribution.estimators import METHODS

    assert "leave-one-in" not in METHODS


@pytest.mark.anyio
async def test_the_engine_runs_it_to_the_closed_form_of_an_additive_game(registered, chatml_tokenizer, anyio_backend):
    snap = eiffel()
    n = snap.n_players
    engine, expected, _ = additive_presence_game(chatml_tokenizer, snap)
    explanation = await engine.explain(snap, make_estimator("leave-one-in"), DropPolicy())
    np.testing.assert_allclose(explanation.values, expected, atol=1e-4)
    assert explanation.estimate.method == "leave-one-in" and explanation.estimate.n_evaluations == n + 2
