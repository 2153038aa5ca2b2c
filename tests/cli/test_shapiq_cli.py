"""A shapiq approximator as a coalescence method, end to end on the real CLI and a tiny random Llama:
interactions in the document and the table, kill -9 then resume equals an uninterrupted run,
replay with no model equals the run, and bad settings exit 2 naming the option.

The injected piece: a slow backend call in the child process (tests/helpers/children.py, as in the resume tests), so that
the kill lands mid-run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("shapiq", reason="the shapiq extra: pip install -c constraints.txt 'coalescence[shapiq]'")

from coalescence.archive import read_manifest, read_rows  # noqa: E402
from coalescence.cli import main  # noqa: E402
from helpers.children import kill_when, parts_written  # noqa: E402  (the resume tests' slowed backend)

USER = (
    "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. The Colosseum opened in 80.\n"
    "- The Opera House opened in 1973.\n- The bridge opened in 1937."
)
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}
N = 6  # sentence players
BUDGET = 40  # of 2^6 = 64 coalitions


def argv(input_path: Path, model: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "explain", str(input_path), "--model", str(model), "--unit", "sentence", "--method", "shapiq:KernelSHAPIQ",
        "--budget", str(BUDGET), "--seed", "5", "--interactions", "2", "--index", "SII",
        "--batch-size", "1", "--flush-rows", "4", "--archive", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture
def conversation(tmp_path: Path) -> Path:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("shapiq-reference")
    path = tmp / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    out = tmp / "out.json"
    assert main(argv(path, tiny_model_dir, tmp / "run", "--out", str(out))) == 0
    return json.loads(out.read_text()), tmp / "run"


def values(doc: dict) -> list[float]:
    return [p["value"] for p in doc["players"]]


def same_values(doc: dict, reference: dict) -> bool:
    """Equal to ARCHITECTURE's fp32 tolerance: a resumed run re-evaluates the lost coalitions
    with a cold prefix cache, which moves a utility by a few fp32 ulps."""
    return values(doc) == pytest.approx(values(reference), rel=0, abs=1e-4)


def test_the_document_and_the_table_carry_the_interactions(reference, tiny_model_dir, tmp_path, capsys):
    doc, run_dir = reference
    assert doc["method"] == "shapiq:KernelSHAPIQ" and doc["n_coalitions"] <= BUDGET
    assert doc["interaction_index"] == "SII" and doc["interaction_order"] == 2
    pairs = doc["interactions"]
    assert len(pairs) == N * (N - 1) // 2  # every pair of the 6 players
    labels = [p["label"] for p in doc["players"]]
    for term in pairs:
        assert len(term["players"]) == 2 and term["unit"] == doc["value_unit"]
        assert term["players"] == [labels[i] for i in term["player_indices"]]
    magnitudes = [abs(t["value"]) for t in pairs]
    assert magnitudes == sorted(magnitudes, reverse=True)  # largest first
    manifest = read_manifest(run_dir)
    assert manifest["runs"][0]["run_config"]["interactions"] == {"order": 2, "index": "SII"}
    # the table names the top pairs (resume of the finished run: nothing evaluated again)
    capsys.readouterr()
    assert main(argv(tmp_path / "missing.json", tiny_model_dir, run_dir)) == 2  # a missing input: exit 2
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    assert main(argv(path, tiny_model_dir, run_dir)) == 0
    table = capsys.readouterr().out
    assert "top 5 of 15 interactions (SII, orders 2..2" in table
    top = pairs[0]
    assert f"{' x '.join(top['players'])}" in table


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    kill_when(argv(conversation, tiny_model_dir, run_dir), parts_written(run_dir, 3), timeout=120)
    on_disk = read_rows(run_dir).num_rows
    ref_doc, ref_run = reference
    assert 12 <= on_disk < ref_doc["n_coalitions"]
    out = tmp_path / "out.json"
    assert main(argv(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == ref_doc["n_coalitions"] - on_disk  # only what was lost
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == ref_doc["n_coalitions"] == len(set(rows["coalition_key"].to_pylist()))
    assert same_values(doc, ref_doc)
    got, want = ({tuple(t["player_indices"]): t["value"] for t in d["interactions"]} for d in (doc, ref_doc))
    assert got.keys() == want.keys() and [got[k] for k in want] == pytest.approx(list(want.values()), rel=0, abs=1e-4)


def test_replay_with_no_model_equals_the_run(reference, tmp_path, monkeypatch):
    ref_doc, run_dir = reference

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")

    monkeypatch.setattr("coalescence.backends.registry.load_backend", no_model)
    out = tmp_path / "replay.json"
    # the run's interactions come back with its method; --budget and --seed as the run's
    assert main(["replay", str(run_dir), "--method", "shapiq:KernelSHAPIQ", "--budget", str(BUDGET), "--seed", "5", "--out", str(out)]) == 0
    (doc,) = json.loads(out.read_text())["explanations"]
    assert values(doc) == values(ref_doc) and doc["interactions"] == ref_doc["interactions"]
    # another method fitted from the same archive, with no model: exact needs all 64, refused
    assert main(["replay", str(run_dir), "--method", "exact"]) == 2


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--method", "shapiq:NoSuchApproximator"], "--method"),
        (["--method", "kernelshap", "--budget", "20", "--interactions", "2"], "--interactions"),
        (["--method", "exact", "--index", "SII"], "--index"),
        (["--method", "shapiq:KernelSHAPIQ", "--budget", "20", "--interactions", "2", "--index", "STII"], "--index"),
    ],
)
def test_bad_settings_exit_2_naming_the_option(tmp_path, conversation, tiny_model_dir, capsys, extra, option):
    args = ["explain", str(conversation), "--model", str(tiny_model_dir), "--unit", "sentence", "--archive", str(tmp_path / "r"), *extra]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_sweep_fits_shapiq_methods_from_the_one_pool_and_scores_them_against_exact(tmp_path, tiny_model_dir):
    """Two conversations, exact and two shapiq approximators at two budgets and seeds: each shapiq
    cell equals its own explain run, and its error column is its distance to the exact values."""
    import numpy as np
    import pyarrow.parquet as pq

    data = tmp_path / "data.jsonl"
    second = json.loads(json.dumps(CONVERSATION))
    second["messages"][1]["content"] = USER.replace("1889", "1890")
    data.write_text("".join(json.dumps(c) + "\n" for c in (CONVERSATION, second)), encoding="utf-8")
    out = tmp_path / "out"
    args = [
        "sweep", str(data), "--model", str(tiny_model_dir), "--unit", "sentence", "--methods", "exact,shapiq:SVARM,shapiq:KernelSHAP",
        "--budgets", "20,40", "--seeds", "0,1", "--out", str(out), "--batch-size", "4", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    table = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["method"] for r in table} == {"exact", "shapiq:SVARM", "shapiq:KernelSHAP"}
    exact = {r["snapshot_id"]: np.array(r["values"]) for r in table if r["method"] == "exact"}
    cell = next(r for r in table if r["method"] == "shapiq:SVARM" and r["budget"] == 40 and r["seed"] == 1)
    truth = exact[cell["snapshot_id"]]
    assert cell["rel_l2"] == pytest.approx(np.linalg.norm(np.array(cell["values"]) - truth) / np.linalg.norm(truth), rel=1e-9)
    # the same cell as its own explain run on the first conversation
    single = tmp_path / "one.json"
    single.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    doc_path = tmp_path / "svarm.json"
    assert main([
        "explain", str(single), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "shapiq:SVARM",
        "--budget", "40", "--seed", "1", "--archive", str(tmp_path / "svarm"), "--out", str(doc_path), "--no-progress",
    ]) == 0  # fmt: skip
    doc = json.loads(doc_path.read_text())
    row = next(r for r in table if r["method"] == "shapiq:SVARM" and r["budget"] == 40 and r["seed"] == 1 and r["snapshot_id"] == doc["snapshot_id"])
    np.testing.assert_allclose(row["values"], values(doc), atol=1e-4)


def test_the_report_names_the_interactions(reference, tmp_path):
    doc, _ = reference
    src = tmp_path / "doc.json"
    src.write_text(json.dumps(doc), encoding="utf-8")
    page = tmp_path / "report.html"
    assert main(["report", str(src), "-o", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    top = doc["interactions"][0]
    assert "SII, orders 2..2, 15 sets" in html and " \u00d7 ".join(top["players"]) in html


def test_an_external_shapiq_method_resumes_after_kill_9_and_replays_with_no_model(tmp_path, conversation, tiny_model_dir, monkeypatch):
    """shapiq:RegressionMSR (shapiq 1.8, run by the external shapiq in Python 3.12) on the real CLI:
    kill -9 mid-run then resume equals an uninterrupted run, every coalition once; replay with no
    model equals the run."""
    from coalescence.attribution.estimators.shapiq import ENV_PYTHON, external_shapiq

    if external_shapiq() is None:
        pytest.skip(f"no external shapiq: `make install` sets one up (.venv-shapiq), or set {ENV_PYTHON}")

    def run_argv(run_dir: Path, *extra: str) -> list[str]:
        return [
            "explain", str(conversation), "--model", str(tiny_model_dir), "--unit", "sentence",
            "--method", "shapiq:RegressionMSR", "--budget", str(BUDGET), "--seed", "5", "--batch-size", "1",
            "--flush-rows", "4", "--archive", str(run_dir), "--no-progress", *extra,
        ]  # fmt: skip

    ref_out = tmp_path / "reference.json"
    assert main(run_argv(tmp_path / "reference", "--out", str(ref_out))) == 0
    ref = json.loads(ref_out.read_text())
    assert ref["method"] == "shapiq:RegressionMSR" and 20 <= ref["n_coalitions"] <= BUDGET

    run_dir = tmp_path / "run"
    kill_when(run_argv(run_dir), parts_written(run_dir, 3), timeout=120)
    on_disk = read_rows(run_dir).num_rows
    assert 12 <= on_disk < ref["n_coalitions"]
    out = tmp_path / "out.json"
    assert main(run_argv(run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == ref["n_coalitions"] - on_disk
    rows = read_rows(run_dir, dedupe=False)
    assert rows.num_rows == ref["n_coalitions"] == len(set(rows["coalition_key"].to_pylist()))
    assert same_values(doc, ref)

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")

    monkeypatch.setattr("coalescence.backends.registry.load_backend", no_model)
    replayed = tmp_path / "replay.json"
    assert main(["replay", str(run_dir), "--method", "shapiq:RegressionMSR", "--budget", str(BUDGET), "--seed", "5", "--out", str(replayed)]) == 0
    (again,) = json.loads(replayed.read_text())["explanations"]
    # the archive's utilities, refitted: the resumed run's values to the last bits (the XGBoost
    # proxy of RegressionMSR, fitted again in a fresh shapiq process, was seen 1 ulp apart); a lost
    # or misplaced utility moves a value by >= 8e-5 (see same_values), 1e8 times this tolerance
    assert values(again) == pytest.approx(values(doc), rel=1e-12, abs=0)
