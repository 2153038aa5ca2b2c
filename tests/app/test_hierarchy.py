"""Units on the tiny model, the game axioms they must keep, and hierarchical attribution."""

from __future__ import annotations

import json

import anyio
import numpy as np
import pytest

from coalescence.attribution.estimators import ExactShapley, LeaveOneOut
from coalescence.app.hierarchy import explain_hierarchical, parse_hierarchy
from coalescence.snapshot import fine_snapshot
from coalescence.cli import main
from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.engine import Engine
from coalescence.errors import ConfigError
from coalescence.inputs import conversation_from_input
from coalescence.masking.policies import DropPolicy

RAG = {
    "documents": [
        {"id": "a", "title": "Paris", "text": "Paris is the capital of France. It is big."},
        {"id": "b", "title": "Rome", "text": "Rome is in Italy."},
        {"id": "c", "title": "Tower", "text": "The tower was completed in 1889. It is tall. It is old."},
    ],
    "question": "When was the tower completed?",
    "answer": "In 1889.",
}


def run(engine, snap, estimator, policy=DropPolicy()):
    return anyio.run(engine.explain, snap, estimator, policy)


@pytest.mark.parametrize(
    ("unit", "data"),
    [
        ("paragraph", {"messages": [{"role": "user", "content": "Paris is big.\n\nRome is old.\n\nWhen?"}], "target": "Now."}),
        ("word", {"messages": [{"role": "user", "content": "When was it completed?"}], "target": "In 1889."}),
        ("tool", {"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "function": {"name": "w", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "1", "content": "Sunny."},
        ], "target": "It is sunny."}),
    ],
)
def test_units_on_the_tiny_model(tiny_backend, unit, data):
    engine = Engine(tiny_backend, batch_size=4)
    snap = engine.prepare(Conversation.from_dict(data), unit=unit)
    explanation = run(engine, snap, ExactShapley())
    assert explanation.n_evaluations == 2**snap.n_players
    assert abs(explanation.estimate.efficiency_gap) < 1e-6


def test_dummy_axiom_for_an_empty_player(tiny_backend):
    c = Conversation(
        messages=(Message(role="system", content=""), Message(role="user", content="When was the tower completed? Tell me.")),
        target="In 1889.",
    )
    snap = ConversationSnapshot.build(c, unit="turn")
    assert snap.players[0].text == ""
    explanation = run(Engine(tiny_backend, batch_size=1), snap, ExactShapley())
    assert abs(explanation.values[0]) < 1e-4
    assert explanation.values[0] == pytest.approx(0.0, abs=1e-4)


def test_one_player_gets_v_full_minus_v_empty(tiny_backend):
    c = Conversation(messages=(Message(role="user", content="When was the tower completed?"),), target="In 1889.")
    snap = ConversationSnapshot.build(c, unit="turn")
    explanation = run(Engine(tiny_backend), snap, ExactShapley())
    est = explanation.estimate
    assert explanation.n_evaluations == 2
    assert est.values[0] == pytest.approx(est.v_full - est.v_empty, abs=1e-9)


# -- hierarchical attribution -------------------------------------------------------------------

def test_parse_hierarchy():
    assert parse_hierarchy("document,sentence") == ("document", "sentence")
    for bad in ("document", "sentence,sentence", "turn,document", "turn,letter"):
        with pytest.raises(ConfigError) as info:
            parse_hierarchy(bad)
        assert info.value.field == "hierarchy"


def test_fine_snapshot_is_the_direct_fine_segmentation():
    c = conversation_from_input(RAG)
    coarse = ConversationSnapshot.build(c, unit="document")
    fine, parents = fine_snapshot(coarse, "sentence")
    direct = ConversationSnapshot.build(c, unit="sentence")
    assert fine.snapshot_id == direct.snapshot_id
    assert parents == tuple(sorted(parents)) and set(parents) == {0, 1, 2}
    for f, parent in zip(fine.players, parents, strict=True):
        assert f.text in coarse.players[parent].text
    assert [p.label for p in fine.players][:3] == ["doc[a].s0", "doc[a].s1", "doc[a].s2"]


# two turns, a system one of one sentence and a user one of two
TOWER = Conversation(
    messages=(
        Message(role="system", content="Be brief. Answer."),
        Message(role="user", content="The tower was completed in 1889. When was it completed?"),
    ),
    target="In 1889.",
)


def hierarchical(engine, coarse, fine, parents, top_k, estimator=ExactShapley):
    return anyio.run(
        lambda: explain_hierarchical(engine, coarse, fine, parents, estimator_for=lambda n: estimator(), policy=DropPolicy(), top_k=top_k)
    )


def test_k_equal_to_all_coarse_players_is_the_direct_fine_run(tiny_backend):
    c = TOWER
    coarse = ConversationSnapshot.build(c, unit="turn")
    fine, parents = fine_snapshot(coarse, "sentence")
    result = hierarchical(Engine(tiny_backend), coarse, fine, parents, top_k=2)
    assert result.coarse.n_evaluations == 2**2 and result.fine.n_evaluations == 2**4
    direct = run(Engine(tiny_backend), ConversationSnapshot.build(c, unit="sentence"), ExactShapley())
    np.testing.assert_allclose(result.fine.values, direct.values, atol=1e-4)
    assert [p.label for p in result.fine.snapshot.players] == [p.label for p in direct.snapshot.players]


def test_top_k_refines_with_the_rest_held_present(tiny_backend):
    coarse = ConversationSnapshot.build(conversation_from_input(RAG), unit="document")
    fine, parents = fine_snapshot(coarse, "sentence")
    engine = Engine(tiny_backend)
    result = hierarchical(engine, coarse, fine, parents, top_k=1, estimator=LeaveOneOut)
    (top,) = result.refined
    assert abs(result.coarse.values[top]) == max(abs(v) for v in result.coarse.values)
    k = parents.count(top)
    assert result.coarse.n_evaluations == 3 + 2 and result.fine.n_evaluations == k + 2  # the plans
    assert result.n_evaluations == engine.statistics().executed
    assert [p.label.split(".")[0] for p in result.fine.snapshot.players] == [coarse.players[top].label] * k
    # the fine game's grand coalition is the full conversation; its empty one keeps the other documents
    assert result.fine.estimate.v_full == pytest.approx(result.coarse.estimate.v_full, abs=1e-4)
    doc = result.to_dict()
    assert doc["hierarchy"]["n_evaluations"] == {"coarse": 5, "fine": k + 2, "total": k + 7}
    assert doc["fine"]["coalitions_snapshot_id"] == fine.snapshot_id


def test_cli_hierarchy(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "rag.json"
    path.write_text(json.dumps(RAG))
    out = tmp_path / "out.json"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--top-k", "1",
            "--method", "loo", "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["hierarchy"]["units"] == ["document", "sentence"] and len(doc["hierarchy"]["refined"]) == 1
    assert doc["coarse"]["unit"] == "document" and doc["fine"]["players"]
    assert "model evaluations: coarse 5 + fine" in capsys.readouterr().out
    code = main([*argv[:-5], "--archive", str(tmp_path / "run2"), "--unit", "sentence", "--no-progress"])
    assert code == 2 and "--unit" in capsys.readouterr().err


# three documents of 9 sentences: at the sentence unit each is 10 fine players (its header line,
# "Document [i] title", is a sentence of its own)
NINES = {
    "documents": [{"id": str(i), "title": f"Item {i}", "text": " ".join(f"Fact {j} holds." for j in range(9))} for i in range(3)],
    "question": "Which fact about item 1 is true?",
    "answer": "Fact 3.",
}


@pytest.mark.parametrize(
    ("top_k", "says"),
    [(None, "every one of the 3 document players, at least 30 sentence players"), ("2", "the top 2 of 3 document players, at least 20 sentence players")],
)
def test_a_fine_level_exact_cannot_play_is_refused_before_the_model(top_k, says, tmp_path, tiny_model_dir, capsys):
    # exact Shapley takes at most 16 players; the two smallest documents alone hold 20 fine ones:
    # refused in the preflight, before the weights load and the coarse level runs (no archive)
    path = tmp_path / "nines.json"
    path.write_text(json.dumps(NINES))
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--method", "exact",
            "--archive", str(tmp_path / "run"), "--no-progress", *(["--top-k", top_k] if top_k else [])]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("coalescence: error: --top-k: the fine level refines "), err
    assert says in err and "allows at most 16" in err
    assert not (tmp_path / "run").exists()


def test_a_coarse_unit_the_input_lacks_is_named_by_the_hierarchy(tmp_path, tiny_model_dir, capsys):
    # no declared documents in a chat conversation: the user gave --hierarchy, not --unit
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi. Where is it?"}, {"role": "assistant", "content": "Here."}]}))
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--archive", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("coalescence: error: --hierarchy: the input declares no players"), err
    assert "choose another coarse unit" in err and not (tmp_path / "run").exists()


def test_resuming_a_hierarchy_with_another_utility_points_to_a_replay_that_runs(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "rag.json"
    path.write_text(json.dumps(RAG))
    run_dir = tmp_path / "run"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--top-k", "1",
            "--method", "loo", "--archive", str(run_dir), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*argv, "--utility", "mean_logprob"]) == 2
    err = capsys.readouterr().err
    hint = err[err.index("`coalescence replay") + 1 : err.index("` (or")].replace("--utility ...", "--utility mean_logprob")
    assert "--snapshot " in hint  # a hierarchy's archive replays level by level
    # the command the hint gives runs, with no model
    assert main([*hint.split()[1:], "--no-progress"]) == 0, capsys.readouterr().err


def test_cli_hierarchy_fine_level_names_the_runs_utility(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "rag.json"
    path.write_text(json.dumps(RAG))
    out = tmp_path / "out.json"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--top-k", "1",
            "--method", "loo", "--utility", "mean_logprob", "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    for level in ("coarse", "fine"):
        assert doc[level]["utility"] == "mean_logprob" and doc[level]["value_unit"] == "nats per token"
    assert doc["fine"]["utility_detail"] == doc["coarse"]["utility_detail"]
    assert capsys.readouterr().out.count("value (nats per token)") == 2


LONG_RAG = {
    "documents": [
        {"id": "a", "title": "Paris", "text": "Paris is the capital of France. It is big."},
        {"id": "b", "title": "Rome", "text": "Rome is in Italy."},
        {
            "id": "c",
            "title": "Tower",
            "text": "The tower was completed in 1889. It is tall. It is old. It is made of iron. "
            "It was built for a fair. Many visit it.",
        },
    ],
    "question": "When was the tower completed?",
    "answer": "In 1889.",
}


def test_the_fine_level_has_its_own_notes_and_plays_the_proxy_game(tmp_path, tiny_model_dir, capsys):
    """A coarse level of 3 documents (8 coalitions, all within the budget: exact values, no proxy
    game) and a fine level of their sentences (12 with the titles: 4,096 coalitions, 24 sampled): the fine
    level says what it did, not what the coarse one did, plays the proxy game named for the run,
    and its replay from the archive gives the same values."""
    path = tmp_path / "rag.json"
    path.write_text(json.dumps(LONG_RAG))
    out = tmp_path / "out.json"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--hierarchy", "document,sentence", "--top-k", "3",
            "--method", "proxy-shapley", "--budget", "24", "--proxy-game", "after-last-player",
            "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    coarse, fine = doc["coarse"], doc["fine"]
    assert len(coarse["players"]) == 3 and coarse["proxy"] is None
    assert any("the budget covers all 8 coalitions" in n for n in coarse["notes"])
    n = len(fine["players"])
    assert n > 9  # the documents' sentences and titles
    assert not any("covers all" in note or "every one of the" in note for note in fine["notes"])  # the coarse level's
    assert any(note.startswith(f"fine level: {n} of {n} fine players refined; no other is held present") for note in fine["notes"])
    assert fine["proxy"]["game"] == "kv-proxy-compact:after-last-player" and fine["n_evaluations"] <= 24
    from coalescence.app.fit import fit_archive  # the report's refit of a run directory, both levels

    again = fit_archive(tmp_path / "run", budget=24)["explanations"][0]
    assert again["fine"]["proxy"]["game"] == fine["proxy"]["game"]
    np.testing.assert_allclose([p["value"] for p in again["fine"]["players"]], [p["value"] for p in fine["players"]], atol=1e-9)


DEFAULT_SYSTEM = "injects its own default system prompt in coalitions where every system player is absent"


def test_the_fine_level_notes_a_default_system_prompt_only_where_its_system_turn_can_be_absent(tiny_backend):
    # the chatml family's template (SmolLM2's) writes its own system prompt where the system message
    # is removed; a fine game that holds the system turn present never removes it: no such note there
    from coalescence.masking.render import ChatRenderer

    assert ChatRenderer(tiny_backend.tokenizer).injects_default_system
    c = TOWER
    coarse = ConversationSnapshot.build(c, unit="turn")
    fine, parents = fine_snapshot(coarse, "sentence")
    engine = Engine(tiny_backend)
    system_kept = np.array([p == 0 for p in parents])  # the system turn's sentences present, the user's absent
    assert not any(DEFAULT_SYSTEM in n for n in engine.conversation_notes(fine, DropPolicy(), empty=system_kept))
    assert any(DEFAULT_SYSTEM in n for n in engine.conversation_notes(fine, DropPolicy(), empty=~system_kept))
    assert any(DEFAULT_SYSTEM in n for n in engine.conversation_notes(fine, DropPolicy()))  # every player absent
    # the hierarchy's fine level: the note where the system turn (coarse player 0) is refined, else none
    result = hierarchical(engine, coarse, fine, parents, top_k=1, estimator=LeaveOneOut)
    assert any(DEFAULT_SYSTEM in n for n in result.fine.notes) == (0 in result.refined)
    assert any(DEFAULT_SYSTEM in n for n in result.coarse.notes)
