"""Benchmark sweeps: every (method, budget, seed) fitted from one coalition pool per conversation.

Real parts: the tiny random Llama saved to disk (``tiny_model_dir``), real archives, the CLI
in-process (and in a subprocess killed with SIGKILL for the resume). The references are
independent of the sweep: one-method ``coalescence explain`` runs, plans counted from the
estimators themselves, errors computed here with numpy and scipy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.stats import spearmanr

from helpers.children import kill_when, slow_child
from helpers.cli import run_cli_quiet as run
from helpers.datasets import conversations

from coalescence.archive import read_rows
from coalescence.attribution.estimators import make_estimator
from coalescence.masking.codec import PackedMask


PLAYERS = [3, 4, 5, 3]
METHODS = "exact,kernelshap,lasso,loo"
BUDGETS = (8, 16)
SEEDS = (0, 1)


def sweep_argv(data: Path, model: Path, out: Path, methods: str = METHODS, budgets=BUDGETS, seeds=SEEDS, *extra: str) -> list[str]:
    return [
        "sweep", str(data), "--model", str(model), "--unit", "sentence", "--methods", methods,
        "--budgets", ",".join(map(str, budgets)), "--seeds", ",".join(map(str, seeds)), "--out", str(out),
        "--batch-size", "4", *extra,
    ]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_model_dir):
    """One sweep over four conversations: its directory, printed output and table."""
    tmp = tmp_path_factory.mktemp("sweep")
    data = write_jsonl(tmp / "data.jsonl", conversations(4, documents=False))
    code, out, err = run(sweep_argv(data, tiny_model_dir, tmp / "out"))
    assert code == 0, err
    table = pq.read_table(tmp / "out" / "results.parquet").to_pylist()
    return tmp, data, out, table


def explain_values(tmp: Path, source: Path, model: Path, name: str, *options: str) -> list[list[float]]:
    """A separate one-method explain run: each conversation's values."""
    out = tmp / f"{name}.json"
    code, _, err = run(["explain", str(source), "--model", str(model), "--unit", "sentence", "--archive", str(tmp / name), "--out", str(out), *options])
    assert code == 0, err
    document = json.loads(out.read_text(encoding="utf-8"))
    documents = document["explanations"] if "explanations" in document else [document]
    return [[p["value"] for p in d["players"]] for d in documents]


def test_each_cell_is_the_one_method_explain_run_and_a_refused_budget_is_a_recorded_skip(swept, tiny_model_dir, tmp_path):
    tmp, data, out, table = swept
    cells = {(r["method"], r["budget"], r["seed"]) for r in table}
    expected = {("exact", None, None), ("loo", None, None)} | {(m, b, s) for m in ("kernelshap", "lasso") for b in BUDGETS for s in SEEDS}
    assert cells == expected
    assert len(table) == len(expected) * 4
    assert [r["n_players"] for r in table if r["method"] == "exact"] == PLAYERS
    # lasso needs min(16, 2^n) coalitions: budget 8 is refused above 3 players, recorded, not fitted
    for r in table:
        refused = r["method"] == "lasso" and r["budget"] == 8 and r["n_players"] > 3
        assert (r["status"] == "skipped") == refused, r
        if refused:
            assert "below the minimum of 16" in r["reason"] and r["values"] is None and r["n_evaluations"] is None
    one_conversation = write_jsonl(tmp_path / "first.jsonl", conversations(1, documents=False))
    for method, budget, seed in sorted(expected, key=str):
        # a sweep fits every cell from the exact game's rows: the explain run it equals plays no proxy game
        options = ["--method", method, "--proxy-game", "none"] + ([] if budget is None else ["--budget", str(budget), "--seed", str(seed)])
        lasso_refused = method == "lasso" and budget == 8
        source = one_conversation if lasso_refused else data
        reference = explain_values(tmp_path, source, tiny_model_dir, f"{method}-{budget}-{seed}", *options)
        rows = [r for r in table if (r["method"], r["budget"], r["seed"]) == (method, budget, seed)][: len(reference)]
        for row, values in zip(rows, reference, strict=True):
            np.testing.assert_allclose(row["values"], values, atol=1e-4, err_msg=f"{method} {budget} {seed}")
    assert "relL2 med" in out and "skipped lasso budget 8" in out


def test_the_pool_is_the_union_of_the_plans_evaluated_once(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "data.jsonl", conversations(3, documents=False))
    methods, budgets, seeds = ("kernelshap", "lasso", "permutation"), (8, 16), (0, 1, 2)
    code, out, err = run(sweep_argv(data, tiny_model_dir, tmp_path / "out", ",".join(methods), budgets, seeds))
    assert code == 0, err
    rows = read_rows(tmp_path / "out" / "archive", dedupe=False)
    table = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    by_snapshot = {r["snapshot_id"]: r["n_players"] for r in table}
    for snapshot_id, n in by_snapshot.items():
        union: set[bytes] = set()
        for method in methods:
            for budget in budgets:
                for seed in seeds:
                    estimator = make_estimator(method, budget=budget, seed=seed)
                    try:
                        estimator.validate(n)
                    except Exception:
                        continue
                    union |= {PackedMask.from_bools(np.asarray(m, dtype=bool)).words for m in estimator.plan(n)}
        archived = [m for m, s in zip(rows["mask"].to_pylist(), rows["snapshot_id"].to_pylist(), strict=True) if s == snapshot_id]
        assert len(archived) == len(set(archived)) == len(union)  # each distinct coalition once
        assert set(archived) == union
    fitted = sum(r["n_evaluations"] for r in table if r["status"] == "ok")
    assert rows.num_rows < fitted  # the cells share coalitions: fewer model evaluations than fits used
    assert f"model evaluations this session {rows.num_rows}" in out
    # model time: each cell's coalitions' shares of their batches (elapsed_ms / batch_size)
    share = {
        (s, m): e / 1000 / b
        for s, m, e, b in zip(rows["snapshot_id"].to_pylist(), rows["mask"].to_pylist(), rows["elapsed_ms"].to_pylist(), rows["batch_size"].to_pylist(), strict=True)
    }
    for r in table:
        if r["status"] == "ok":
            plan = make_estimator(r["method"], budget=r["budget"], seed=r["seed"]).plan(r["n_players"])
            masks = {PackedMask.from_bools(np.asarray(m, dtype=bool)).words for m in plan}
            assert r["n_evaluations"] == len(masks)
            assert r["model_seconds"] == pytest.approx(sum(share[(r["snapshot_id"], m)] for m in masks))
            assert r["rel_l2"] is None and r["top1"] is None  # no exact in this sweep


def test_the_error_columns_against_exact(swept):
    _, _, _, table = swept
    exact = {r["snapshot_id"]: np.array(r["values"]) for r in table if r["method"] == "exact"}
    checked = 0
    for r in table:
        if r["status"] != "ok" or r["method"] == "exact":
            if r["method"] == "exact":
                assert r["rel_l2"] is None and r["spearman"] is None
            continue
        phi, ref = np.array(r["values"]), exact[r["snapshot_id"]]
        assert r["rel_l2"] == pytest.approx(np.linalg.norm(phi - ref) / np.linalg.norm(ref))
        assert r["spearman"] == pytest.approx(spearmanr(phi, ref).statistic)
        assert r["top1"] == float(np.argmax(phi) == np.argmax(ref))  # random weights: no ties
        k = min(3, len(ref))
        assert r["top3"] == pytest.approx(len(set(np.argsort(-phi)[:k]) & set(np.argsort(-ref)[:k])) / k)
        checked += 1
    assert checked > 20


def test_a_killed_sweep_resumes_to_the_same_results_and_a_finished_one_calls_no_model(swept, tmp_path, tiny_model_dir):
    _, data, _, reference = swept
    out = tmp_path / "out"
    argv = sweep_argv(data, tiny_model_dir, out, METHODS, BUDGETS, SEEDS, "--flush-rows", "4", "--max-conversations-in-flight", "1")
    results = out / "archive" / "results.jsonl"

    def one_result() -> bool:
        return results.exists() and results.read_text(encoding="utf-8").count("\n") >= 1

    kill_when([*argv, "--no-progress"], one_result, timeout=120, child=slow_child(0.03))
    assert not (out / "results.parquet").exists()
    before = read_rows(out / "archive").num_rows

    code, printed, err = run(argv)
    assert code == 0, err
    restored = int(re.search(r"\((\d+) restored from the archive\)", printed).group(1))
    assert 1 <= restored < 4  # the conversations finished before the kill, not planned again
    resumed = pq.read_table(out / "results.parquet")
    assert read_rows(out / "archive").num_rows >= before
    for a, b in zip(resumed.to_pylist(), reference, strict=True):
        assert (a["snapshot_id"], a["method"], a["budget"], a["seed"], a["status"]) == (b["snapshot_id"], b["method"], b["budget"], b["seed"], b["status"])
        if a["status"] == "ok":
            np.testing.assert_allclose(a["values"], b["values"], atol=1e-4)

    rows = read_rows(out / "archive").num_rows
    code, printed, err = run(argv)
    assert code == 0, err
    assert "model evaluations this session 0" in printed and "(4 restored from the archive)" in printed
    assert read_rows(out / "archive").num_rows == rows
    assert pq.read_table(out / "results.parquet").equals(resumed)  # identical, times included


@pytest.mark.parametrize(
    ("option", "value", "flag"),
    [
        ("--methods", "exact,shapley", "--methods"),
        ("--methods", "", "--methods"),
        ("--methods", " , ", "--methods"),
        ("--budgets", "64,lots", "--budgets"),
        ("--budgets", "1.5", "--budgets"),
        ("--seeds", "one", "--seeds"),
    ],
)
def test_bad_input_exits_2_in_one_line_naming_the_flag_and_writes_nothing(tmp_path, tiny_model_dir, option, value, flag):
    data = write_jsonl(tmp_path / "data.jsonl", conversations(1, documents=False))
    argv = sweep_argv(data, tiny_model_dir, tmp_path / "out", "exact,kernelshap", (8,), (0,))
    argv[argv.index(option) + 1] = value
    code, out, err = run(argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"coalescence: error: {flag}:"), err
    assert not (tmp_path / "out").exists()


def test_a_sampling_method_without_budgets_is_refused(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "data.jsonl", conversations(1, documents=False))
    code, _, err = run(["sweep", str(data), "--model", str(tiny_model_dir), "--methods", "exact,lasso", "--out", str(tmp_path / "out")])
    assert code == 2 and err.startswith("coalescence: error: --budgets: methods lasso sample within a budget")
    assert not (tmp_path / "out").exists()


def test_the_python_entry_is_the_command(swept, tiny_model_dir, tmp_path):
    import coalescence

    _, data, _, table = swept
    # the backend options are sweep()'s keywords as explain()'s (batch_size 1: the values of another batching)
    result = coalescence.sweep(
        data, methods=METHODS, budgets=BUDGETS, seeds=SEEDS, out=tmp_path / "py", model=str(tiny_model_dir), unit="sentence",
        batch_size=1, device="cpu",
    )
    assert result.path == tmp_path / "py" / "results.parquet" and result.run_dir == tmp_path / "py" / "archive"
    assert len(result.rows) == len(table)
    for a, b in zip(result.rows, table, strict=True):
        if a["status"] == "ok":
            np.testing.assert_allclose(a["values"], b["values"], atol=1e-4)
    assert "relL2 med" in result.summary
