"""coalescence compare --html: one self-contained page of the comparison, checked against numbers
computed here (each method's values rounded as the printed table rounds them, Spearman's rho by
scipy.stats.spearmanr, the errors against exact by hand) and against the charts' geometry (one
value axis for every chart)."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from helpers.cli import run_cli as cli

pytest.importorskip("matplotlib")

METHODS = ("exact", "loo", "banzhaf")



class Tables(HTMLParser):
    """The text of every table cell, by table class, row by row."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)



@pytest.fixture(scope="module")
def page(compare_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, str]:
    where = tmp_path_factory.mktemp("compare-page")
    out, page = where / "cmp.json", where / "cmp.html"
    code, printed, err = cli(["compare", str(compare_run / "run"), "--method", ",".join(METHODS), "--budget", "32", "--out", str(out), "--html", str(page)])
    assert code == 0, err
    assert printed.endswith(f"html: {page}\n")
    return page.read_text(encoding="utf-8"), json.loads(out.read_text(encoding="utf-8")), printed


def test_values_and_ranks_side_by_side_as_the_table_rounds_them(page: tuple[str, dict, str]) -> None:
    text, doc, _ = page
    (rows,) = [t for name, t in Tables(text).tables.items() if name == "compare"]
    head, body = rows[:2], rows[2:]
    assert head[0][1 : 1 + len(METHODS)] == list(METHODS)
    values = {c["name"]: c["values"] for c in doc["columns"]}
    labels = [p["label"] for p in doc["players"]]
    exact = values["exact"]
    # rows in exact's rank order (largest first, ties by player order)
    order = sorted(range(len(labels)), key=lambda i: (-exact[i], i))
    assert [r[0] for r in body] == [labels[i] for i in order]
    for row, i in zip(body, order):
        for k, method in enumerate(METHODS):
            v = values[method]
            rank = 1 + sum(1 for j in range(len(v)) if v[j] > v[i] or (v[j] == v[i] and j < i))
            assert row[1 + 2 * k] == f"{v[i]:+.4f}" and row[2 + 2 * k] == str(rank)
    # the printed table shows the same rounded numbers
    printed = page[2]
    for method in METHODS:
        for v in values[method]:
            assert f"{v:+.4f}" in printed


def test_agreement_is_scipys_spearman_and_the_error_against_exact(page: tuple[str, dict, str]) -> None:
    text, doc, _ = page
    rows = Tables(text).tables["agreement"][1:]
    values = {c["name"]: np.array(c["values"]) for c in doc["columns"]}
    assert [r[0] for r in rows] == ["exact (the reference)", "loo", "banzhaf"]
    for row in rows[1:]:
        v = values[row[0]]
        rho = spearmanr(values["exact"], v).statistic
        diffs = np.abs(v - values["exact"])
        assert row[1] == f"{rho:+.3f}"
        assert row[3] == f"{diffs.max():.4f}" and row[4] == f"{np.sqrt(np.mean(diffs**2)):.4f}"
    top = set(np.argsort(-values["exact"], kind="stable")[:3])
    assert rows[2][2] == f"{len(top & set(np.argsort(-values['banzhaf'], kind='stable')[:3])) / 3:.2f}"


def test_one_chart_per_explanation_on_one_value_axis(page: tuple[str, dict, str]) -> None:
    text, doc, _ = page
    n = len(doc["players"])
    assert "<script" not in text.lower() and "http" not in text.replace("http://www.w3.org", "")
    lengths = {}
    for method in METHODS:
        figure = re.search(rf'<figure id="cmp-{method}">(.*?)</figure>', text, re.S)
        assert figure is not None, method
        bars = dict(re.findall(rf'<g id="cmp-{method}-chart-bar-(\d+)">\s*<path d="([^"]+)"', figure.group(1)))
        assert sorted(int(i) for i in bars) == list(range(n))
        values = {c["name"]: c["values"] for c in doc["columns"]}[method]
        for i, d in bars.items():
            xs = [float(x) for x in re.findall(r"([-0-9.]+) [-0-9.]+", html.unescape(d))]
            lengths[(method, int(i))] = (min(xs), max(xs), values[int(i)])
    # one axis: the zero line at one x in every chart, and one length per unit of value
    zeros = {round(hi if v < 0 else lo, 2) for lo, hi, v in lengths.values() if abs(v) > 1e-9}
    per_unit = [(hi - lo) / abs(v) for lo, hi, v in lengths.values() if abs(v) > 1e-3]
    assert len(zeros) == 1 and max(per_unit) == pytest.approx(min(per_unit), rel=1e-2)


def test_html_never_overwrites_a_source(compare_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.json"
    copy.write_bytes((compare_run / "exact.json").read_bytes())
    before = copy.read_bytes()
    for argv in (
        ["compare", str(copy), str(compare_run / "run"), "--method", "loo", "--html", str(copy)],
        ["compare", str(compare_run / "run"), "--method", "exact,loo", "--html", str(compare_run / "run" / "page.html")],
        ["compare", str(compare_run / "run"), "--method", "exact,loo", "--out", str(tmp_path / "a"), "--html", str(tmp_path / "a")],
    ):
        code, out, err = cli(argv)
        assert code == 2 and out == "" and err.startswith("coalescence: error: --html: ") and err.count("\n") == 1, err
    assert copy.read_bytes() == before and not (compare_run / "run" / "page.html").exists() and not (tmp_path / "a").exists()
