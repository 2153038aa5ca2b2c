"""Input forms: declared players, the RAG form, JSONL batches; each on the tiny model and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import pytest

from coalescence.archive import read_manifest, read_pool
from coalescence.attribution.estimators import ExactShapley
from coalescence.cli import main
from coalescence.conversation import ConversationSnapshot, segment_players
from coalescence.engine import Engine
from coalescence.errors import InputError
from coalescence.inputs import DEFAULT_RAG_TEMPLATE, RagTemplate, conversation_from_input, load_inputs, load_template
from coalescence.masking.policies import DropPolicy

USER = "Context: Paris is in France. Rome is in Italy. Question: where is Paris?"
DECLARED = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "In France."},
    ],
    "players": [
        {"message": 1, "start": 9, "end": 28, "label": "paris"},
        {"message": 1, "start": 29, "end": 46, "label": "rome"},
        {"message": 0, "start": 0, "end": 9},
    ],
}
RAG = {
    "documents": [
        {"id": "a", "title": "Paris", "text": "Paris is the capital of France."},
        {"id": "b", "title": "Rome", "text": "Rome is the capital of Italy. It is old."},
        {"id": "c", "title": "", "text": ""},
    ],
    "question": "What is the capital of France?",
    "answer": "Paris.",
}


def test_declared_players_keep_input_order_labels_and_spans():
    c = conversation_from_input(DECLARED)
    players = segment_players(c, unit="document")
    assert [p.label for p in players] == ["paris", "rome", "system[0][0:9]"]
    assert [p.text for p in players] == ["Paris is in France.", "Rome is in Italy.", "Be brief."]
    snap = ConversationSnapshot.build(c, unit="document")
    assert snap.n_players == 3
    # finer units split inside the declared players only; the rest is held fixed
    sentences = segment_players(c, unit="sentence")
    assert [p.label for p in sentences] == ["paris.s0", "rome.s0", "system[0][0:9].s0"]
    words = segment_players(c, unit="word")
    assert [p.text for p in words][:4] == ["Paris", "is", "in", "France"]


def bad(field_path: str, **change):
    data = json.loads(json.dumps(DECLARED))
    for key, value in change.items():
        i, name = key.split("__")
        data["players"][int(i[1:])][name] = value
    return pytest.param(data, field_path, id=field_path)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        bad("players[0].end", p0__end=999),
        bad("players[1].end", p1__end=29),  # empty
        bad("players[0].start", p0__start=-1),
        bad("players[2].message", p2__message=2),  # the answer holds no players
        bad("players[2].message", p2__message=7),
        bad("players[1].start", p1__start=20),  # overlaps players[0]
        bad("players[0].label", p0__label=""),
        bad("players[0].start", p0__start="9"),
        pytest.param(DECLARED | {"players": []}, "players", id="empty-list"),
        pytest.param({k: v for k, v in RAG.items() if k != "question"}, "question", id="rag-question"),
        pytest.param(RAG | {"documents": [{"id": "x"}]}, "documents[0].text", id="rag-text"),
        pytest.param(RAG | {"documents": [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}]}, "documents[1].id", id="rag-dup"),
        pytest.param(RAG | {"messages": []}, "documents", id="rag-and-messages"),
    ],
)
def test_bad_input_names_the_field(data, field):
    with pytest.raises(InputError) as info:
        conversation_from_input(data)
    assert info.value.field == field


def test_rag_form_renders_each_document_as_a_player():
    c = conversation_from_input(RAG)
    assert c.target == "Paris." and [m.role for m in c.messages] == ["system", "user"]
    user = c.messages[1].content
    assert user == (
        "Document [a] Paris\nParis is the capital of France.\n\n"
        "Document [b] Rome\nRome is the capital of Italy. It is old.\n\n"
        "Document [c] \n\n\nQuestion: What is the capital of France?"
    )
    players = segment_players(c, unit="document")
    assert [p.label for p in players] == ["doc[a]", "doc[b]", "doc[c]"]
    assert players[0].text == "Document [a] Paris\nParis is the capital of France."
    assert [p.label for p in segment_players(c, unit="sentence")] == ["doc[a].s0", "doc[a].s1", "doc[b].s0", "doc[b].s1", "doc[b].s2", "doc[c].s0"]
    # dropping a document removes its block and one separator; the question stays
    snap = ConversationSnapshot.build(c, unit="document")
    msgs = DropPolicy().render(snap, np.array([True, False, True]))
    assert msgs[1].content == (
        "Document [a] Paris\nParis is the capital of France.\n\nDocument [c] \n\n\nQuestion: What is the capital of France?"
    )
    msgs = DropPolicy().render(snap, np.zeros(3, dtype=bool))
    assert msgs[1].content == "Question: What is the capital of France?"


def test_custom_template(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"system": "", "user": "Q: {question}\n{documents}", "document": "- {text}", "separator": "\n"}))
    template = load_template(path)
    c = conversation_from_input(RAG, template)
    assert [m.role for m in c.messages] == ["user"]
    assert c.messages[0].content.startswith("Q: What is the capital of France?\n- Paris is")
    assert load_template(None) == DEFAULT_RAG_TEMPLATE
    with pytest.raises(InputError) as info:
        RagTemplate(user="no documents here {question}")
    assert info.value.field == "--template"
    path.write_text(json.dumps({"colour": "x"}))
    with pytest.raises(InputError, match="unknown key"):
        load_template(path)


def test_jsonl_names_the_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(DECLARED) + "\n\n" + json.dumps(RAG | {"question": ""}) + "\n")
    with pytest.raises(InputError) as info:
        load_inputs(path)
    assert info.value.field == "line 3: question"
    path.write_text("\n")
    with pytest.raises(InputError, match="no input"):
        load_inputs(path)
    path.write_text(json.dumps(DECLARED) + "\n" + json.dumps(RAG) + "\n")
    conversations, batch = load_inputs(path)
    assert batch and len(conversations) == 2


@pytest.mark.parametrize("data", [DECLARED, RAG], ids=["declared", "rag"])
def test_input_forms_on_the_tiny_model(tiny_backend, data):
    engine = Engine(tiny_backend, batch_size=4)
    snap = engine.prepare(conversation_from_input(data), unit="document")
    explanation = anyio.run(engine.explain, snap, ExactShapley(), DropPolicy())
    est = explanation.estimate
    assert abs(est.efficiency_gap) < 1e-6
    if data is RAG:  # "doc[c]" has a header: not a dummy, but a real player
        assert explanation.n_evaluations == 2**3


def test_cli_jsonl_one_archive_many_snapshots(tmp_path: Path, tiny_model_dir: Path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(DECLARED) + "\n" + json.dumps(RAG) + "\n")
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    code = main(["explain", str(path), "--model", str(tiny_model_dir), "--archive", str(run_dir), "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads(out.read_text())
    assert [e["unit"] for e in doc["explanations"]] == ["document", "document"]
    assert [len(e["players"]) for e in doc["explanations"]] == [3, 3]
    manifest = read_manifest(run_dir)
    ids = manifest["runs"][-1]["snapshot_ids"]
    assert ids == [e["snapshot_id"] for e in doc["explanations"]]
    assert {s["snapshot_id"] for s in manifest["snapshots"]} == set(ids)
    assert all("template_injects_default_system" in s for s in manifest["snapshots"])
    for sid in ids:
        masks, _ = read_pool(run_dir, sid)
        assert masks.shape == (8, 3)
    assert "== input 2 of 2" in captured.out


def test_cli_rag_with_a_template_and_a_unit(tmp_path: Path, tiny_model_dir: Path, capsys):
    path = tmp_path / "rag.json"
    path.write_text(json.dumps(RAG))
    template = tmp_path / "t.json"
    template.write_text(json.dumps({"document": "<{id}> {text}"}))
    out = tmp_path / "out.json"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--template", str(template), "--unit", "sentence",
            "--method", "loo", "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert "explanations" not in doc and doc["unit"] == "sentence"
    assert [p["label"] for p in doc["players"]][:2] == ["doc[a].s0", "doc[b].s0"]


def test_examples_load():
    (rag,), batch = load_inputs("examples/rag.json")
    assert not batch and [p.label for p in segment_players(rag, unit="document")] == ["doc[1]", "doc[2]", "doc[3]"]
    (tools,), _ = load_inputs("examples/tools.json")
    assert [p.label for p in segment_players(tools, unit="tool")][-1] == "assistant[2]+tool[3]"
    conversations, batch = load_inputs("examples/batch.jsonl")
    assert batch and len(conversations) == 3


def test_cli_system_absent_and_tool_unit(tmp_path: Path, tiny_model_dir: Path, capsys):
    out = tmp_path / "out.json"
    argv = ["explain", "examples/tools.json", "--model", str(tiny_model_dir), "--unit", "tool", "--method", "loo",
            "--system-absent", "empty", "--archive", str(tmp_path / "run"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["absence_params"] == {"system_absent": "empty"}
    assert doc["players"][-1]["label"] == "assistant[2]+tool[3]"
    snapshot = read_manifest(tmp_path / "run")["snapshots"][0]
    assert snapshot["template_injects_default_system"] is True
    assert snapshot["default_system_in_play"] == "never"  # the system message is kept empty
    bad = [*argv[:-5], "--absence-policy", "placeholder", "--archive", str(tmp_path / "r2"), "--no-progress"]
    assert main(bad) == 2 and "--system-absent" in capsys.readouterr().err
