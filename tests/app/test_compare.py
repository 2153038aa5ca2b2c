"""coalescence compare: values side by side, with the agreement computed by the rules stated here
(Spearman's rho from rank differences, the top-k overlap by counting, errors against exact by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.cli import run_cli as cli
from helpers.compare_runs import MESSAGES




def spearman_by_formula(a, b) -> float:
    """1 - 6 sum d^2 / (n (n^2 - 1)), d the rank differences (no ties among these floats)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    n = len(a)
    return 1 - 6 * float(np.sum((ra - rb) ** 2)) / (n * (n * n - 1))



def test_one_archive_refitted_with_several_methods(compare_run, tmp_path):
    out = tmp_path / "cmp.json"
    code, printed, err = cli(["compare", str(compare_run / "run"), "--method", "exact,loo,banzhaf", "--budget", "32", "--top-k", "2", "--out", str(out)])
    assert code == 0, err
    doc = json.loads(out.read_text(encoding="utf-8"))
    exact_doc = json.loads((compare_run / "exact.json").read_text(encoding="utf-8"))
    exact = [p["value"] for p in exact_doc["players"]]
    assert [c["name"] for c in doc["columns"]] == ["exact", "loo", "banzhaf"]
    np.testing.assert_allclose(doc["columns"][0]["values"], exact, atol=1e-9)  # the archive refits what the run computed
    n = len(exact)
    top = set(np.argsort(-np.array(exact), kind="stable")[:2])
    for column in doc["columns"][1:]:
        values = column["values"]
        assert column["spearman"] == pytest.approx(spearman_by_formula(exact, values), abs=1e-12)
        assert column["top_overlap"] == len(top & set(np.argsort(-np.array(values), kind="stable")[:2])) / 2
        diffs = np.abs(np.array(values) - np.array(exact))
        assert column["max_error"] == pytest.approx(diffs.max()) and column["rmse"] == pytest.approx(np.sqrt(np.mean(diffs**2)))
    assert doc["columns"][0]["spearman"] == pytest.approx(1.0) and len(doc["players"]) == n
    assert "loo: Spearman" in printed and "error against exact" in printed
    # an --out document and the archive compare as two sources
    code, printed, err = cli(["compare", str(compare_run / "exact.json"), str(compare_run / "run"), "--method", "loo"])
    assert code == 0, err
    assert "exact@exact.json" in printed and "loo@run" in printed
    # in Python, as on the command line: one archive alone and the methods as one comma-separated string
    from coalescence.app.compare import compare

    same = compare(str(compare_run / "run"), methods="exact,loo,banzhaf", budget=32, top_k=2).to_dict()
    assert [c["name"] for c in same["columns"]] == ["exact", "loo", "banzhaf"]
    assert [c["values"] for c in same["columns"]] == [c["values"] for c in doc["columns"]]


def test_one_explanation_or_two_conversations_are_refused(compare_run, tiny_model_dir, tmp_path):
    code, out, err = cli(["compare", str(compare_run / "exact.json")])
    assert code == 2 and out == "" and err.count("\n") == 1 and "at least two explanations" in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"messages": MESSAGES[:2] + [{"role": "assistant", "content": "In 1859."}]}), encoding="utf-8")
    code, _, err = cli(["explain", str(other), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo",
                        "--archive", str(tmp_path / "run2"), "--out", str(tmp_path / "other-out.json"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    code, out, err = cli(["compare", str(compare_run / "exact.json"), str(tmp_path / "other-out.json")])
    assert code == 2 and out == "" and "compare explanations of one conversation" in err


def test_an_archive_of_several_conversations_fits_the_one_asked_for(tmp_path, tiny_model_dir):
    batch = tmp_path / "two.jsonl"
    second = [MESSAGES[0], {"role": "user", "content": "Tea is hot.\nIce is cold.\nIs tea hot?"}, {"role": "assistant", "content": "Yes."}]
    batch.write_text(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps({"messages": second}) + "\n", encoding="utf-8")
    run_dir = tmp_path / "run"
    code, _, err = cli(["explain", str(batch), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo", "--archive", str(run_dir), "--no-progress"])
    assert code == 0, err
    # exact's coalitions are in the archive for neither conversation: only loo and the chosen one are fitted
    code, out, err = cli(["compare", str(run_dir), "--method", "loo,loo", "--conversation", "1"])
    assert code == 0, err
    assert "Tea is hot." in out and "Eiffel" not in out
    code, out, err = cli(["compare", str(run_dir), "--method", "loo,loo", "--conversation", "2"])
    assert code == 2 and "--conversation: the run holds 2 conversation(s)" in err


def test_no_output_overwrites_what_it_reads(compare_run, tmp_path):
    copy = tmp_path / "copy.json"
    copy.write_text((compare_run / "exact.json").read_text(encoding="utf-8"), encoding="utf-8")
    before = copy.read_bytes()
    for argv, option in (
        (["compare", str(copy), str(compare_run / "run"), "--out", str(copy)], "--out"),
        (["report", str(copy), "-o", str(copy)], "--output"),
        (["replay", str(compare_run / "run"), "--method", "loo", "--out", str(compare_run / "run" / "manifest.json")], "--out"),
    ):
        code, out, err = cli(argv)
        assert code == 2 and out == "" and err.startswith(f"coalescence: error: {option}: ") and err.count("\n") == 1, err
    assert copy.read_bytes() == before
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    for extra, option in ((["--out", str(chat)], "--out"), (["--out", str(tmp_path / "a.json"), "--html", str(tmp_path / "a.json")], "--html")):
        code, _, err = cli(["explain", str(chat), "--model", "smollm2-135m", "--no-progress", *extra])  # refused before any model loads
        assert code == 2 and err.startswith(f"coalescence: error: {option}: "), err
    assert json.loads(chat.read_text(encoding="utf-8")) == {"messages": MESSAGES}
    code, _, err = cli(["archive", "info", str(compare_run / "run")])
    assert code == 0, err  # the manifest is intact


def test_a_constant_column_has_no_correlation_and_says_why(compare_run, tmp_path):
    # every player of the second explanation has one value: its ranks are all tied, so Spearman's
    # rank correlation is undefined (0/0); the JSON stays strict (null, with the reason), the table
    # says why, and scipy's ConstantInputWarning is not let through (warnings are errors here)
    doc = json.loads((compare_run / "exact.json").read_text(encoding="utf-8"))
    for p in doc["players"]:
        p["value"] = 0.25
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(doc), encoding="utf-8")
    out, html = tmp_path / "cmp.json", tmp_path / "cmp.html"
    code, printed, err = cli(["compare", str(compare_run / "exact.json"), str(flat), "--out", str(out), "--html", str(html)])
    assert code == 0, err
    text = out.read_text(encoding="utf-8")
    parsed = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))  # strict: no NaN
    column = parsed["columns"][1]
    assert column["spearman"] is None and "same value for every player" in column["spearman_undefined"]
    assert parsed["columns"][0]["spearman"] == pytest.approx(1.0) and parsed["columns"][0]["spearman_undefined"] is None
    assert "nan" not in printed.lower() and "no Spearman correlation" in printed and "same value for every player" in printed
    page = html.read_text(encoding="utf-8")
    assert "nan" not in page.lower() and "same value for every player" in page


def test_explanations_in_different_units_are_refused(compare_run, tmp_path):
    # the exact run's coalitions reduced to p (probability) from the archive, no model: the same
    # conversation and players, another unit; one table headed in one unit would mislead
    prob = tmp_path / "prob.json"
    code, _, err = cli(["replay", str(compare_run / "run"), "--method", "exact", "--utility", "prob", "--out", str(prob)])
    assert code == 0, err
    assert [e["value_unit"] for e in json.loads(prob.read_text(encoding="utf-8"))["explanations"]] == ["probability"]
    out, html = tmp_path / "cmp.json", tmp_path / "cmp.html"
    code, printed, err = cli(["compare", str(compare_run / "exact.json"), str(prob), "--out", str(out), "--html", str(html)])
    assert code == 2 and printed == "" and err.count("\n") == 1, err
    assert "probability" in err and "nats" in err and err.startswith("coalescence: error: SOURCE")
    assert not out.exists() and not html.exists()


def test_no_output_goes_into_a_run_archive_that_is_not_read(compare_run, tmp_path):
    # an archive elsewhere (a copy of the exact run's), not among the sources: a page or a JSON
    # written into it would sit among its parts, where no archive tool expects a file
    import shutil

    other = tmp_path / "other-run"
    shutil.copytree(compare_run / "run", other)
    before = sorted(p.name for p in other.rglob("*"))
    doc = str(compare_run / "exact.json")
    for argv, option in (
        (["compare", doc, doc, "--html", str(other / "cmp.html")], "--html"),
        (["compare", doc, doc, "--out", str(other / "parts" / "cmp.json")], "--out"),
        (["report", doc, "-o", str(other / "report.html")], "--output"),
        (["report", doc, "--image", str(other / "chart.png")], "--image"),
    ):
        code, out, err = cli(argv)
        assert code == 2 and out == "" and err.startswith(f"coalescence: error: {option}: ") and err.count("\n") == 1, err
        assert "run archive" in err
    assert sorted(p.name for p in other.rglob("*")) == before


@pytest.mark.parametrize(
    ("given", "named"),
    [({"seed": 0}, "seed"), ({"budget": 8, "run": "r"}, "budget"), ({"method": "exact", "seed": 1}, "method"), ({"method": "", "run": "r"}, "run")],
)
def test_archive_options_with_documents_only_are_refused_naming_the_first(tmp_path, given, named):
    """``coalescence compare``'s settings: fit options where every source is a document are refused
    before any source is read, naming the first given (seed 0 and budget are given, an empty
    method is not)."""
    from coalescence.app.compare import CompareSettings, compare_files
    from coalescence.errors import ConfigError

    sources = [tmp_path / "a.json", tmp_path / "b.json"]
    with pytest.raises(ConfigError, match="every SOURCE here is an --out document") as refused:
        compare_files(sources, CompareSettings(**given))
    assert refused.value.field == named
