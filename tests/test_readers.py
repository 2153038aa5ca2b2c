"""Input formats through one reader interface: a format registered from outside src/ by its file
suffix (here CSV, written with the standard csv module), and in-memory tables (a pandas DataFrame,
a Hugging Face datasets.Dataset) read as the JSONL file of the same rows is, to the same values."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import coalescence
from coalescence.conversation import Conversation
from coalescence.errors import ConfigError, InputError
from coalescence.inputs import READERS, conversation_from_input, load_inputs, read_source, register_reader

ROWS = [
    {"question": "When was the Eiffel Tower completed?", "context": "The Eiffel Tower was completed in 1889.\nBig Ben was finished in 1859.", "answer": "In 1889."},
    {"question": "What is the capital of France?", "context": "Paris is the capital of France.\n\n- Lyon is large.\n- Nice is sunny.", "answer": "Paris."},
]


def as_input(row: dict[str, str]) -> dict:
    """The rule the CSV format states: the context and the question are the user turn, the answer the assistant's."""
    return {
        "messages": [
            {"role": "user", "content": f"{row['context']}\n\n{row['question']}"},
            {"role": "assistant", "content": row["answer"]},
        ]
    }


def csv_reader(path: Path, template) -> tuple[list[Conversation], bool]:
    with path.open(newline="", encoding="utf-8") as f:
        return [conversation_from_input(as_input(row), template) for row in csv.DictReader(f)], True


@pytest.fixture
def csv_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setitem(READERS, ".csv", READERS.get(".csv"))  # restored after the test
    register_reader(".csv", csv_reader)
    path = tmp_path / "qa.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "context", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    return path


@pytest.fixture
def jsonl_file(tmp_path) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(as_input(r)) + "\n" for r in ROWS), encoding="utf-8")
    return path


def test_a_registered_suffix_is_read_by_its_reader(csv_file, jsonl_file) -> None:
    from_csv, is_dataset = load_inputs(csv_file)
    from_jsonl, _ = load_inputs(jsonl_file)
    assert is_dataset and from_csv == from_jsonl
    assert from_csv[1].messages[0].content == "Paris is the capital of France.\n\n- Lyon is large.\n- Nice is sunny.\n\nWhat is the capital of France?"
    upper = csv_file.rename(csv_file.with_suffix(".CSV"))  # suffixes compare lower-case
    assert load_inputs(upper)[0] == from_csv
    with pytest.raises(ConfigError):
        register_reader("csv", csv_reader)  # not a suffix


def test_a_registered_format_runs_end_to_end(csv_file, jsonl_file, tiny_model_dir) -> None:
    common = {"model": str(tiny_model_dir), "unit": "sentence", "method": "loo"}
    by_csv = coalescence.explain(csv_file, **common)
    by_jsonl = coalescence.explain(jsonl_file, **common)
    assert len(by_csv) == len(by_jsonl) == 2
    for a, b in zip(by_csv, by_jsonl, strict=True):
        assert a.snapshot.snapshot_id == b.snapshot.snapshot_id
        np.testing.assert_allclose(a.values, b.values, atol=1e-6)


def test_a_dataframe_and_a_dataset_are_datasets_of_their_rows(jsonl_file, tiny_model_dir) -> None:
    pd = pytest.importorskip("pandas", reason="pip install -c constraints.txt -e '.[notebook]'")
    datasets = pytest.importorskip("datasets", reason="pip install -c constraints.txt -e '.[test]'")
    records = [as_input(r) | {"id": k} for k, r in enumerate(ROWS)]
    expected, _ = load_inputs(jsonl_file)
    frame = pd.DataFrame(records)
    table = datasets.Dataset.from_list(records)
    for source in (frame, table):
        conversations, is_dataset = read_source(source)
        assert is_dataset and conversations == expected
    common = {"model": str(tiny_model_dir), "unit": "sentence", "method": "loo"}
    by_jsonl = coalescence.explain(jsonl_file, **common)
    for source in (frame, table):
        for a, b in zip(coalescence.explain(source, **common), by_jsonl, strict=True):
            assert a.snapshot.snapshot_id == b.snapshot.snapshot_id
            np.testing.assert_allclose(a.values, b.values, atol=1e-6)
    with pytest.raises(InputError, match="no 'messages'"):
        read_source(pd.DataFrame({"text": ["a"]}))
    with pytest.raises(InputError) as info:
        read_source(pd.DataFrame({"messages": [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]]}))
    assert info.value.field.startswith("row 1: ")


def test_a_dataset_dict_is_refused_naming_its_splits() -> None:
    # load_dataset(...) without split= gives a DatasetDict: a mapping of split names to Datasets,
    # not an input dict; the refusal names the splits and how to pick one, not a field never written
    datasets = pytest.importorskip("datasets", reason="pip install -c constraints.txt -e '.[test]'")
    records = [as_input(r) for r in ROWS]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:1])})
    for call in (lambda: read_source(splits), lambda: coalescence.explain(splits, model="smollm2-135m")):
        with pytest.raises(InputError) as info:
            call()
        assert info.value.field == "input" and "messages" not in info.value.message
        assert "train, test" in info.value.message and "['train']" in info.value.message


def test_a_nan_inside_a_document_is_absent_as_a_nan_cell_is() -> None:
    # pandas writes NaN for a missing value, in a cell or inside a record of an object column;
    # both are absent (as a Parquet null is), neither is refused as a float
    pd = pytest.importorskip("pandas", reason="pip install -c constraints.txt -e '.[notebook]'")
    nan = float("nan")
    docs = [{"id": "p", "title": "Paris", "text": "Paris is in France."}, {"id": "r", "text": "Rome is in Italy."}]
    expected = conversation_from_input({"documents": docs, "question": "Where is Paris?"})
    with_nan = [docs[0], {"id": "r", "title": nan, "text": "Rome is in Italy."}]
    frame = pd.DataFrame({"documents": [with_nan], "question": ["Where is Paris?"], "answer": [nan]})
    [conversation], _ = read_source(frame)
    assert conversation == expected
    assert conversation.target is None  # the NaN answer cell: absent, the model would generate it
