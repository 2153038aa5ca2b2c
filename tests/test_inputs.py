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
from coalescence.snapshot import ConversationSnapshot
from coalescence.segmentation import segment_players
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
    assert info.value.field == "template"
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


# -- JSON Lines, JSON limits and text that is not Unicode (issue 15 items 1, 2, 10) -----------

LINE_BREAKS_IN_TEXT = "one\u2028two\u0085three\u2029four\x1cfive\x0bsix\x0cseven"


def test_jsonl_separates_records_by_newline_only(tmp_path):
    record = {"messages": [{"role": "user", "content": LINE_BREAKS_IN_TEXT}, {"role": "assistant", "content": "ok"}]}
    raw = json.dumps(record, ensure_ascii=False)  # the separators stay raw characters, legal in JSON strings
    assert "\u2028" in raw and "\u0085" in raw
    path = tmp_path / "in.jsonl"
    path.write_bytes((raw + "\r\n\r\n" + raw + "\n").encode("utf-8"))  # CRLF lines and a blank line
    conversations, batch = load_inputs(path)
    assert batch and len(conversations) == 2
    assert [c.messages[0].content for c in conversations] == [LINE_BREAKS_IN_TEXT] * 2
    single = tmp_path / "in.json"
    single.write_text(raw, encoding="utf-8")
    (same,), _ = load_inputs(single)
    assert same == conversations[0]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_json_syntax_error_names_the_position_once(tmp_path, suffix):
    path = tmp_path / f"in{suffix}"
    path.write_text('{"messages": "unterminated')
    with pytest.raises(InputError) as info:
        load_inputs(path)
    where = "at line 1 column 14" if suffix == ".json" else "line 1 is not valid JSON: Unterminated string starting at column 14"
    assert "Unterminated string starting at " in info.value.message and where.split(": ")[-1] in info.value.message
    assert " at at " not in info.value.message


DEEP = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
DEEP_ARGS = (
    '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", '
    '"type": "function", "function": {"name": "f", "arguments": ' + '{"a": ' * 120 + "1" + "}" * 120 + '}}]}], "target": "x"}'
)
HUGE_INT = '{"messages": [{"role": "user", "content": "q"}], "target": "x", "players": [{"message": 0, "start": ' + "9" * 5000 + ', "end": 1}]}'
DUPLICATE = '{"messages": [{"role": "user", "content": "first", "content": "second"}], "target": "x"}'


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(DEEP, "more than 100 levels deep", id="deep"),
        pytest.param(DEEP_ARGS, "more than 100 levels deep", id="deep-tool-arguments"),
        pytest.param(HUGE_INT, "integer literal of 5000 digits", id="5000-digits"),
        pytest.param(DUPLICATE, "the key 'content' appears twice", id="duplicate-key"),
    ],
)
@pytest.mark.parametrize("where", ["json", "jsonl", "template"])
def test_json_beyond_the_parser_limits_is_one_input_error(tmp_path, text, words, where):
    if where == "template":
        path = tmp_path / "t.json"
        path.write_text(text.replace('"messages"', '"user"', 1))
        with pytest.raises(InputError) as info:
            load_template(path)
        field = "template"
    else:
        path = tmp_path / f"in.{where}"
        path.write_text(text if where == "json" else json.dumps(DECLARED) + "\n" + text + "\n")
        with pytest.raises(InputError) as info:
            load_inputs(path)
        field = "input"
        assert where == "json" or "in.jsonl line 2" in info.value.message
    assert info.value.field == field and words in info.value.message and "\n" not in str(info.value)


def test_tool_arguments_string_beyond_the_limits_is_written_as_given():
    deep = '{"a": ' * 150 + "1" + "}" * 150
    data = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "content": "r"},
        ],
        "target": "x",
    }
    c = conversation_from_input(data)
    assert c.messages[1].content == '<tool_call>\n{"name": "f", "arguments": "' + deep.replace('"', '\\"') + '"}\n</tool_call>'


LONE = "\ud83d"


def _with(path: str, value: str, base: dict) -> dict:
    data = json.loads(json.dumps(base))
    node = data
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return data


TOOL_CALL = {
    "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
        {"role": "assistant", "content": "Sunny."},
    ]
}


@pytest.mark.parametrize(
    ("base", "path", "value", "field"),
    [
        (DECLARED, "messages.1.content", f"Context: {LONE} Paris", "messages[1].content"),
        (DECLARED, "messages.2.content", f"In France.{LONE}", "messages[2].content"),
        (DECLARED | {"target": "x"}, "target", LONE, "target"),
        (DECLARED, "players.0.label", f"paris{LONE}", "players[0].label"),
        (RAG, "documents.1.text", f"Rome {LONE}", "documents[1].text"),
        (RAG, "documents.1.title", LONE, "documents[1].title"),
        (RAG, "documents.1.id", LONE, "documents[1].id"),
        (RAG, "question", f"What {LONE}?", "question"),
        (RAG, "answer", f"Paris{LONE}", "answer"),
        (TOOL_CALL, "messages.1.tool_calls.0.function.name", LONE, "messages[1].tool_calls[0].function.name"),
        (TOOL_CALL, "messages.1.tool_calls.0.function.arguments", '{"city": "\\ud83d"}', "messages[1].tool_calls[0].function.arguments"),
        (TOOL_CALL, "messages.1.tool_calls.0.id", LONE, "messages[1].tool_calls[0].id"),
        (TOOL_CALL, "messages.2.tool_call_id", LONE, "messages[2].tool_call_id"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field_before_the_model_loads(tmp_path, capsys, base, path, value, field):
    data = _with(path, value, base)
    text = json.dumps(data)  # ensure_ascii: the lone surrogate is written as the escape "\ud83d"
    assert "\\ud83d" in text
    with pytest.raises(InputError) as info:
        conversation_from_input(json.loads(text))
    assert info.value.field == field and "lone surrogate \\ud83d" in info.value.message
    # the CLI: exit 2 with that field, before the model is even located (--model names nothing)
    source = tmp_path / "in.json"
    source.write_text(text)
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    argv = ["explain", str(source), "--model", str(tmp_path / "no-model"), "--archive", str(run_dir), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coalescence: error: {field}: holds a lone surrogate") and err.count("\n") == 1, err
    assert not run_dir.exists() and not out.exists()


@pytest.mark.parametrize("key", ["system", "user", "document", "separator"])
def test_a_lone_surrogate_in_the_template_is_refused(tmp_path, key):
    path = tmp_path / "t.json"
    value = {"user": "{documents} {question}", "document": "{text}"}.get(key, "") + LONE
    path.write_text(json.dumps({key: value}))
    with pytest.raises(InputError) as info:
        load_template(path)
    assert info.value.field == "template" and info.value.message.startswith(f"'{key}' holds a lone surrogate")


def test_a_lone_surrogate_placeholder_is_refused(tmp_path, capsys):
    argv = ["explain", "examples/eiffel.json", "--model", str(tmp_path / "no-model"), "--absence-policy", "placeholder",
            "--placeholder", f"[{LONE}]", "--archive", str(tmp_path / "run")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("coalescence: error: --placeholder: holds a lone surrogate")


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ("{text} {title.upper}", "plainly"),  # an attribute: str.format would call getattr
        ("{text} {title.nope}", "plainly"),  # AttributeError before
        ("{text} {title[x]}", "plainly"),  # TypeError before
        ("{text} {title:>2000000000}", "plainly"),  # a 2 GB string before
        ("{text} {id!r}", "plainly"),
        ("{text} {0}", "plainly"),
        ("{text} {}", "plainly"),
        ("{text} {id", "not a format string"),
        ("{text} }", "not a format string"),
        ("{text}{text}", "exactly once"),
        ("{{text}}", "exactly once"),
    ],
)
def test_document_template_takes_plain_fields_only(document, words):
    with pytest.raises(InputError) as info:
        RagTemplate(document=document)
    assert info.value.field == "template" and words in info.value.message


def test_document_template_with_escaped_braces_renders():
    c = conversation_from_input(RAG, RagTemplate(document="{{{id}}} {{text}}: {text}"))
    assert c.messages[1].content.startswith("{a} {text}: Paris is the capital of France.")


@pytest.mark.parametrize(
    ("data", "field", "meant"),
    [
        (DECLARED | {"targte": "In France."}, "targte", "target"),
        (DECLARED | {"player": DECLARED["players"]}, "player", "players"),
        (RAG | {"answr": "Paris."}, "answr", "answer"),
        (RAG | {"documents": [{"id": "p", "tittle": "Paris", "text": "Paris is in France."}]}, "documents[0].tittle", "title"),
    ],
)
def test_a_misspelt_optional_field_is_refused_naming_the_closest(tmp_path, capsys, data, field, meant):
    # an optional field ignored for a typo silently changes the run (the answer explained, the
    # players); a field close to a known one is refused, naming it, before the model is located
    with pytest.raises(InputError) as info:
        conversation_from_input(data)
    assert info.value.field == field and f"did you mean {meant!r}?" in info.value.message
    source = tmp_path / "in.json"
    source.write_text(json.dumps(data))
    assert main(["explain", str(source), "--model", str(tmp_path / "no-model"), "--archive", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coalescence: error: {field}: ") and err.count("\n") == 1 and not (tmp_path / "run").exists(), err


def test_fields_of_other_names_are_metadata_and_pass() -> None:
    # dataset rows carry ids and labels: names far from every known field, or a known one with a
    # suffix (question_id), are not typos
    plain = conversation_from_input(DECLARED)
    assert conversation_from_input(DECLARED | {"id": 7, "source": "wiki", "target_id": 3, "label": "x"}) == plain
    rag = conversation_from_input(RAG)
    assert conversation_from_input(RAG | {"question_id": "q1", "id": "r1", "split": "dev"}) == rag
