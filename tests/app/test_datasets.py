"""Datasets: many conversations in flight through one scheduler and collator, Parquet inputs, and a
resumed dataset run that restores finished conversations instead of planning them again.

Real parts: the tiny random Llama saved to disk (``tiny_model_dir``), real archives, the CLI
in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.cli import run_cli_quiet as run
from helpers.datasets import RecordingProgress, conversations

from coalescence.archive import read_rows
from coalescence.engine import Engine


def explain(tmp: Path, source: Path, model: Path, name: str, *options: str) -> list[dict]:
    out = tmp / f"{name}.json"
    code, _, err = run(["explain", str(source), "--model", str(model), "--unit", "sentence", "--method", "loo", "--archive", str(tmp / name), "--out", str(out), *options])
    assert code == 0, err
    return json.loads(out.read_text(encoding="utf-8"))["explanations"]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(7)), encoding="utf-8")
    return path


def test_conversations_in_flight_together_give_the_one_at_a_time_values_in_fewer_model_calls(tmp_path, jsonl, tiny_model_dir):
    alone = explain(tmp_path, jsonl, tiny_model_dir, "alone", "--max-conversations-in-flight", "1", "--batch-size", "8")
    together = explain(tmp_path, jsonl, tiny_model_dir, "together", "--max-conversations-in-flight", "8", "--batch-size", "8")
    assert [d["snapshot_id"] for d in alone] == [d["snapshot_id"] for d in together]  # input order kept
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose([p["value"] for p in a["players"]], [p["value"] for p in b["players"]], atol=1e-4)
        assert a["n_evaluations"] == b["n_evaluations"] == len(a["players"]) + 2  # counted per conversation
    rows = {name: read_rows(tmp_path / name) for name in ("alone", "together")}
    for table in rows.values():
        assert len(set(table["coalition_key"].to_pylist())) == table.num_rows == sum(len(d["players"]) + 2 for d in alone)
    calls = {name: len(set(t["batch_id"].to_pylist())) for name, t in rows.items()}
    # each conversation's leave-one-out plan (n + 2 <= 6 coalitions) alone leaves batches of 8
    # part empty; together they fill them
    assert calls["together"] < calls["alone"], calls


def test_a_parquet_dataset_is_the_jsonl_dataset(tmp_path, jsonl, tiny_model_dir):
    rows = conversations(7)
    table = pa.table(
        {
            "messages": [r.get("messages") for r in rows],
            "documents": [r.get("documents") for r in rows],
            "question": [r.get("question") for r in rows],
            "answer": [r.get("answer") for r in rows],
        }
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    from_parquet = explain(tmp_path, path, tiny_model_dir, "parquet")
    from_jsonl = explain(tmp_path, jsonl, tiny_model_dir, "jsonl")
    assert [d["snapshot_id"] for d in from_parquet] == [d["snapshot_id"] for d in from_jsonl]
    for a, b in zip(from_parquet, from_jsonl, strict=True):
        assert [p["value"] for p in a["players"]] == pytest.approx([p["value"] for p in b["players"]], abs=1e-4)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "robot", "content": "Hi."}]]}), bad)
    code, out, err = run(["explain", str(bad), "--model", str(tiny_model_dir), "--archive", str(tmp_path / "bad-run")])
    assert code == 2 and err.startswith("coalescence: error: row 0: messages[0].role:") and not (tmp_path / "bad-run").exists()


def test_a_resumed_dataset_run_restores_finished_conversations_without_planning_them(tmp_path, jsonl, tiny_model_dir, monkeypatch):
    first = explain(tmp_path, jsonl, tiny_model_dir, "run")
    results = (tmp_path / "run" / "results.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(results) == len(first)
    planned: list[str] = []
    original = Engine.explain

    async def counting(self, snapshot, estimator, policy):
        planned.append(snapshot.snapshot_id)
        return await original(self, snapshot, estimator, policy)

    monkeypatch.setattr(Engine, "explain", counting)
    again = explain(tmp_path, jsonl, tiny_model_dir, "run")
    assert planned == []  # every conversation restored
    code, out, err = run(["explain", str(jsonl), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo", "--archive", str(tmp_path / "run")])
    assert code == 0, err
    assert "nan" not in out and out.count("(no model evaluations in this session)") == len(first)
    for a, b in zip(first, again, strict=True):
        assert [p["value"] for p in a["players"]] == [p["value"] for p in b["players"]]
        assert b["n_evaluations"] == 0 and any("restored from the archive" in n for n in b["notes"])
    # a session killed after three conversations: the others are planned (and served from the archive)
    (tmp_path / "run" / "results.jsonl").write_text("\n".join(results[:3]) + "\n" + results[3][:40], encoding="utf-8")
    partial = explain(tmp_path, jsonl, tiny_model_dir, "run")
    assert sorted(planned) == sorted(d["snapshot_id"] for d in first[3:])
    assert all(d["n_evaluations"] == 0 for d in partial)
    # another method is another result: not restored
    planned.clear()
    code, _, err = run(["explain", str(jsonl), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact", "--archive", str(tmp_path / "run")])
    assert code == 0, err
    assert len(planned) == len(first)


def test_a_list_of_inputs_in_python_is_the_jsonl_dataset(tmp_path, jsonl, tiny_model_dir):
    import coalescence

    got = coalescence.explain(conversations(7), model=str(tiny_model_dir), unit="sentence", method="loo")
    ref = explain(tmp_path, jsonl, tiny_model_dir, "ref")
    assert isinstance(got, list) and [e.snapshot.snapshot_id for e in got] == [d["snapshot_id"] for d in ref]
    for e, d in zip(got, ref, strict=True):
        assert [float(v) for v in e.estimate.values] == pytest.approx([p["value"] for p in d["players"]], abs=1e-4)
    with pytest.raises(coalescence.InputError) as bad:
        coalescence.explain([conversations(1)[0], {"messages": [{"role": "robot", "content": "Hi."}]}], model=str(tiny_model_dir))
    assert bad.value.field == "input 1: messages[0].role"


def test_progress_of_conversations_in_flight_is_one_monotone_count_over_the_dataset(tmp_path, jsonl, tiny_model_dir):
    """Issue 24 item 11: with several conversations in flight, the bar's total was one conversation's
    and its count jumped back at every conversation. The rule: one total, the sum over the dataset
    of each conversation's leave-one-out plan (n players + the empty and full coalitions, computed
    here from the output), counts that never decrease, and a last count equal to that total."""
    from coalescence.app.settings import RunSettings
    from coalescence.app.explain import explain_run

    progress = RecordingProgress()
    settings = RunSettings(
        model=str(tiny_model_dir), unit="sentence", method="loo", archive=str(tmp_path / "run"),
        max_conversations_in_flight=4, batch_size=8,
    )
    result = explain_run(str(jsonl), settings, progress=progress)
    explanations = result.explanations
    expected = sum(len(e.snapshot.players) + 2 for e in explanations)
    assert len(explanations) == 8 and expected > 2 * (3 + 2)  # more than one conversation's worth
    assert progress.planned and progress.planned[-1] == expected
    assert progress.planned == sorted(progress.planned)
    dones = [d for d, _ in progress.finished]
    totals = [t for _, t in progress.finished]
    assert dones == list(range(1, expected + 1))  # one step per coalition, never back
    assert totals == sorted(totals) and all(d <= t for d, t in progress.finished)
    assert progress.finished[-1] == (expected, expected)
