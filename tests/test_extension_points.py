"""Adding a utility or a backend from outside the package: one object and one public registration
call make it a choice everywhere (the CLI's choices and help, settings, the engine, the manifest).
(An estimator: tests/attribution/estimators/test_registration.py; an input format: tests/test_readers.py.)

Both run on the public fake backend's presence game made additive (tests/helpers/presence.py):
every target token loses w_t nats for each weighted id t absent from the prompt, so every target
token has the same log-probability in a coalition and player i's exact Shapley value is the
closed form ``n_target * (the weights of the ids it alone brings)`` for the sum (``logprob``), and
that over ``n_target`` for a per-token reduction such as the minimum defined here.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from coalescence.attribution.estimators import make_estimator
from coalescence.backends import registry as backends
from coalescence.cli import main
from coalescence.engine import Engine
from coalescence.masking.policies import DropPolicy
from coalescence.utility import UTILITIES, Utility, UtilitySpec, register_utility

from helpers.presence import additive_presence_game, eiffel

LEAST = Utility(kind="min_logprob", unit="nats", teacher_forced=True, reduction="min", label="least token log p", reduce=lambda lp: float(lp.min()))


@pytest.fixture
def least_registered(monkeypatch):
    monkeypatch.setitem(UTILITIES, "min_logprob", LEAST)  # undone after the test
    register_utility(LEAST)


def help_text(command: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "500")  # argparse wraps help at hyphens on narrow terminals
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(out.getvalue().split())


@pytest.mark.anyio
async def test_a_registered_utility_runs_to_its_closed_form(least_registered, chatml_tokenizer, anyio_backend, monkeypatch):
    import coalescence.utility as utility

    assert "min_logprob" in utility.UTILITY_KINDS and "min_logprob" in utility.TEACHER_FORCED_KINDS
    assert UtilitySpec(kind="min_logprob").to_dict() == {"kind": "min_logprob", "reduce": "min", "unit": "nats"}
    assert "min_logprob" in help_text("explain", monkeypatch) and "min_logprob" in help_text("replay", monkeypatch)
    snap = eiffel()
    game, expected, n_target = additive_presence_game(chatml_tokenizer, snap)
    assert n_target > 1  # else the minimum and the sum agree
    engine = Engine(game.backend, batch_size=4, utility=UtilitySpec(kind="min_logprob"))
    explanation = await engine.explain(snap, make_estimator("exact"), DropPolicy())
    np.testing.assert_allclose(explanation.values, np.array(expected) / n_target, atol=1e-5)
    assert explanation.utility == "min_logprob" and explanation.utility_unit == "nats"
    from coalescence.report import render_report

    page = render_report(explanation.to_dict())  # a teacher-forced kind: the answer shown token by token
    assert page.count('class="tok') == len(explanation.to_dict()["answer_tokens"]) > 1


def test_without_registration_it_is_no_utility():
    import coalescence.utility as utility

    assert "min_logprob" not in utility.UTILITY_KINDS
    with pytest.raises(Exception, match="unknown utility 'min_logprob'"):
        UtilitySpec(kind="min_logprob")


def test_a_registered_backend_is_a_backend_choice_of_the_cli(chatml_tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    snap = eiffel()
    game, expected, _ = additive_presence_game(chatml_tokenizer, snap)
    seen = {}

    def load_presence(source, settings, preloaded):  # the backend settings whole, and what was read of the model
        seen.update(device=settings.device, dtype=settings.dtype, max_batch_size=settings.batch_size, tokenizer=preloaded.tokenizer is not None)
        return game.backend

    monkeypatch.setitem(backends.BACKENDS, "presence", backends.BackendKind(load_presence))  # undone after the test
    backends.register_backend("presence", load_presence)
    assert "presence" in help_text("explain", monkeypatch)
    conversation = snap.conversation
    source = tmp_path / "eiffel.json"
    source.write_text(
        json.dumps({"messages": [{"role": m.role, "content": m.content} for m in conversation.messages], "target": conversation.target}),
        encoding="utf-8",
    )
    out = tmp_path / "out.json"
    argv = ["explain", str(source), "--backend", "presence", "--model", str(tiny_model_dir), "--unit", "sentence"]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main([*argv, "--method", "exact", "--batch-size", "3", "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    np.testing.assert_allclose([p["value"] for p in doc["players"]], expected, atol=1e-4)
    assert seen == {"device": "cpu", "dtype": "float32", "max_batch_size": 3, "tokenizer": True}
