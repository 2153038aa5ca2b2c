"""The report's other views: the pairwise interaction heatmap, the chart as an image file
(``report --image``, ``Explanation.save_chart``) and the headings of a page of several methods.

The references are the ``--out`` document's own numbers and rules written out here: the heatmap's
cell tooltips are read back and compared with the document's interaction terms, the image's bars
are measured (their length against the values they stand for), and the PNG's size is read from
its header.
"""

from __future__ import annotations

import contextlib
import html
import io
import itertools
import json
import re
import struct
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from coalescence.cli import main
from helpers.report_runs import TRICKY, Run, explain

pytest.importorskip("matplotlib")

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You answer from the context."},
        {"role": "user", "content": "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. Pisa took two centuries. When was the tower completed?"},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}
SVG = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    """An exact run with its order-2 interactions (k-SII, from all 2^n coalitions)."""
    run = explain(tmp_path_factory.mktemp("pairs"), tiny_model_dir, CONVERSATION, "--unit", "sentence", "--method", "exact", "--interactions", "2")
    assert run.code == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    """A permutation run (standard errors) without interactions, of text a chart must draw as written."""
    run = explain(tmp_path_factory.mktemp("plain"), tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "permutation", "--budget", "64")
    assert run.code == 0, run.stderr
    assert all(p["stderr"] is not None for p in run.doc["players"])
    return run


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``coalescence.cli.main(argv)``'s exit code, stdout and stderr; argparse's refusals (exit 2,
    raised as SystemExit) included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def cell_tips(page: str) -> list[tuple[str, str, float, str]]:
    """``(A, B, value, unit)`` of every heatmap cell's tooltip ``<title>A × B: +x unit</title>``."""
    out = []
    for text in re.findall(r"<title>([^<]*)</title>", page):
        match = re.fullmatch(r"(.+?) \u00d7 (.+?): ([-+][0-9.e+-]+) (\S+)", html.unescape(text))
        if match:
            out.append((match.group(1), match.group(2), float(match.group(3)), match.group(4)))
    return out


# -- the pairwise interaction heatmap -------------------------------------------------------------


def test_heatmap_cells_are_the_documents_pair_terms(pairs: Run) -> None:
    doc = pairs.doc
    page = pairs.html.read_text(encoding="utf-8")
    terms = {frozenset(t["players"]): t["value"] for t in doc["interactions"] if len(t["players"]) == 2}
    n = len(doc["players"])
    assert len(terms) == n * (n - 1) // 2 > 0
    tips = cell_tips(page)
    assert len(tips) == 2 * len(terms)  # both halves of the matrix, no diagonal
    seen: dict[tuple[str, str], float] = {}
    for a, b, value, unit in tips:
        assert a != b and unit == doc["value_unit"]
        assert value == pytest.approx(terms[frozenset((a, b))], abs=5.1e-5)  # four decimals
        seen[(a, b)] = value
    assert all(seen[(b, a)] == value for (a, b), value in seen.items())  # symmetric
    # the title names the index and the unit; the largest terms stay listed in the run's facts
    index = doc["interaction_index"]
    assert f"{index} pair interactions, in {doc['value_unit']}" in html.unescape(page)
    assert f"Pairwise interactions ({index})" in page
    assert re.search(rf"<dt>interactions</dt><dd>{re.escape(index)}, orders 2..2, {len(terms)} sets", page)


def test_heatmap_lays_the_players_out_in_player_order(pairs: Run) -> None:
    page = pairs.html.read_text(encoding="utf-8")
    cells = [(int(a), int(b)) for a, b in re.findall(r'id="ex0-pairs-cell-(\d+)-(\d+)"', page)]
    n = len(pairs.doc["players"])
    assert sorted(cells) == cells  # drawn row by row, in player order
    assert set(cells) == {(a, b) for a in range(n) for b in range(n) if a != b}


def test_no_heatmap_without_interactions(plain: Run) -> None:
    page = plain.html.read_text(encoding="utf-8")
    assert plain.doc.get("interactions") is None
    assert cell_tips(page) == [] and "pairs-cell" not in page and "Pairwise interactions" not in page


def synthetic(n: int, pairs: list[tuple[int, int, float]]) -> dict[str, Any]:
    """A document of ``n`` one-word players and the given pair terms (written here, not by a run)."""
    words = [f"word{i}" for i in range(n)]
    content = " ".join(words)
    players, at = [], 0
    for i, w in enumerate(words):
        players.append({"index": i, "label": f"user[0].w{i}", "role": "user", "message_index": 0, "start": at, "end": at + len(w), "value": (-1) ** i * (1 + i) / n, "stderr": None})
        at += len(w) + 1
    terms = [{"players": [f"user[0].w{a}", f"user[0].w{b}"], "player_indices": [a, b], "value": v, "unit": "nats"} for a, b, v in pairs]
    return {
        "schema_version": 1, "method": "shapiq:KernelSHAPIQ", "target": "yes", "value_unit": "nats", "snapshot_id": "0" * 64,
        "messages": [{"role": "user", "content": content}], "players": players,
        "interaction_index": "FSII", "interaction_order": 2, "interactions": sorted(terms, key=lambda t: -abs(t["value"])),
    }  # fmt: skip


def test_many_players_show_only_those_of_the_largest_terms(tmp_path: Path) -> None:
    n = 60
    # 25 strong pairs over 50 distinct players, then weak pairs among the rest
    strong = [(2 * k, 2 * k + 1, 10.0 - 0.1 * k) for k in range(25)]
    weak = [(a, b, 0.01) for a, b in itertools.combinations(range(50, 60), 2)]
    source = tmp_path / "doc.json"
    source.write_text(json.dumps(synthetic(n, strong + weak)), encoding="utf-8")
    out = tmp_path / "page.html"
    code, _, err = run_cli(["report", str(source), "-o", str(out)])
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    shown = {int(a) for a, _ in re.findall(r'id="ex0-pairs-cell-(\d+)-(\d+)"', page)}
    # the largest pairs by |value|, whole, while at most 40 players: the first 20 strong pairs
    assert shown == {i for a, b, _ in strong[:20] for i in (a, b)}
    assert "Only the 40 players of the 20 largest pair terms by |value| are shown (of 60 players)" in page
    for a, b, value, _ in cell_tips(page):
        ia, ib = int(a.rsplit("w", 1)[1]), int(b.rsplit("w", 1)[1])
        assert value == pytest.approx(dict(((x, y), v) for x, y, v in strong)[(min(ia, ib), max(ia, ib))], abs=5.1e-5)


# -- the chart as an image -------------------------------------------------------------------------


def bar_label(doc: dict[str, Any], p: dict[str, Any]) -> str:
    """The chart's rule: the label, then the text's first 28 characters (whitespace runs as one space)."""
    text = " ".join(doc["messages"][p["message_index"]]["content"][p["start"] : p["end"]].split())
    return f"{p['label']} {text if len(text) <= 28 else text[:27] + chr(0x2026)}"


def svg_bars(root: ET.Element) -> dict[int, tuple[float, float, str]]:
    """Each bar's ``(left x, right x, fill colour)`` by player index (groups ``bar-<i>``)."""
    bars = {}
    for g in root.iter(f"{SVG}g"):
        match = re.fullmatch(r"(?:.*-)?bar-(\d+)", g.get("id", ""))
        if match:
            (path,) = g.iter(f"{SVG}path")
            xs = [float(x) for x in re.findall(r"([-0-9.]+) [-0-9.]+", path.get("d", ""))]
            fill = re.search(r"fill:\s*(#[0-9a-f]{6})", path.get("style", ""))
            bars[int(match.group(1))] = (min(xs), max(xs), fill.group(1) if fill else "")
    return bars


def test_image_svg_has_one_bar_per_player_drawn_to_scale(plain: Run, tmp_path: Path) -> None:
    image = tmp_path / "chart.svg"
    code, out, err = run_cli(["report", str(plain.out), "--image", str(image)])
    assert code == 0, err
    assert out == f"image: {image}\n"
    root = ET.fromstring(image.read_bytes())  # a standalone SVG document: parses as XML
    assert root.tag == f"{SVG}svg"
    doc = plain.doc
    bars = svg_bars(root)
    assert sorted(bars) == list(range(len(doc["players"])))
    # every bar runs from the zero line to its value: one length per unit for all of them
    values = [p["value"] for p in doc["players"]]
    zero = {round(right if v < 0 else left, 3) for (left, right, _), v in zip((bars[i] for i in range(len(values))), values) if abs(v) > 1e-9}
    assert len(zero) == 1
    per_unit = [(right - left) / abs(v) for (left, right, _), v in ((bars[i], values[i]) for i in range(len(values))) if abs(v) > 1e-3]
    assert max(per_unit) == pytest.approx(min(per_unit), rel=1e-3)
    # the labels as the page's, largest value first; error bars for a method with standard errors
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    ranked = sorted(doc["players"], key=lambda p: (-p["value"], p["index"]))
    labels = [t for t in texts if t in {bar_label(doc, p) for p in doc["players"]}]
    assert labels == [bar_label(doc, p) for p in ranked]
    assert "value (nats)" in texts and "error bars: ±1 standard error" in texts


def test_image_and_page_draw_the_same_bars(plain: Run, tmp_path: Path) -> None:
    image, page = tmp_path / "chart.svg", tmp_path / "page.html"
    code, out, err = run_cli(["report", str(plain.out), "-o", str(page), "--image", str(image)])
    assert code == 0, err
    assert out == f"report: {page}\nimage: {image}\n"
    in_image = svg_bars(ET.fromstring(image.read_bytes()))
    text = page.read_text(encoding="utf-8")
    highlight = dict(re.findall(r'data-index="(\d+)"[^>]*style="background-color: (#[0-9a-f]{6})', text))
    assert {i: colour for i, (_, _, colour) in in_image.items()} == {int(i): c for i, c in highlight.items()}
    inline = re.findall(r'id="ex0-chart-bar-(\d+)"', text)
    assert sorted(int(i) for i in inline) == sorted(in_image)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (the first, right after the 8-byte signature)."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_image_png_is_a_readable_png(pairs: Run, tmp_path: Path) -> None:
    image = tmp_path / "chart.PNG"
    code, _, err = run_cli(["report", str(pairs.out), "--image", str(image)])
    assert code == 0, err
    data = image.read_bytes()
    width, height = png_size(data)
    assert width == 960 and 150 <= height < 2000  # 6.4 inches at 150 dpi
    Image = pytest.importorskip("PIL.Image")
    with Image.open(image) as picture:
        assert picture.format == "PNG" and picture.size == (width, height)
        picture.verify()


@pytest.mark.parametrize("name", ["chart.jpg", "chart", "chart.png.txt"])
def test_image_suffix_other_than_png_or_svg_is_refused(plain: Run, tmp_path: Path, name: str) -> None:
    code, out, err = run_cli(["report", str(plain.out), "--image", str(tmp_path / name)])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("coalescence: error: --image: ") and ".png, .svg" in err
    assert list(tmp_path.iterdir()) == []


def test_report_needs_an_output_and_never_writes_into_its_archive(plain: Run, tmp_path: Path) -> None:
    code, out, err = run_cli(["report", str(plain.out)])
    assert code == 2 and out == "" and err.startswith("coalescence: error: --output: ") and err.count("\n") == 1
    inside = plain.run_dir / "chart.png"
    code, _, err = run_cli(["report", str(plain.run_dir), "--image", str(inside)])
    assert code == 2 and "--image: " in err and "inside the run archive" in err and not inside.exists()
    code, _, err = run_cli(["report", str(plain.out), "-o", str(tmp_path / "x.svg"), "--image", str(tmp_path / "x.svg")])
    assert code == 2 and "--image: " in err and not (tmp_path / "x.svg").exists()


def test_save_chart_writes_what_report_image_writes(plain: Run, tmp_path: Path) -> None:
    from coalescence.app.replay import replay_run
    from coalescence.app.settings import ReplaySettings
    from coalescence.errors import ConfigError

    (explanation,) = replay_run(plain.run_dir, ReplaySettings(methods=("permutation",), budget=64))
    assert [p["value"] for p in explanation.to_dict()["players"]] == pytest.approx([p["value"] for p in plain.doc["players"]], abs=1e-12)
    api, cli = tmp_path / "api.png", tmp_path / "cli.png"
    assert explanation.save_chart(api) == api
    code, _, err = run_cli(["report", str(plain.out), "--image", str(cli)])
    assert code == 0, err
    assert api.read_bytes()[:8] == PNG_MAGIC and png_size(api.read_bytes()) == png_size(cli.read_bytes())
    with pytest.raises(ConfigError, match=r"accepted suffixes: \.png, \.svg"):
        explanation.save_chart(tmp_path / "chart.pdf")
    assert not (tmp_path / "chart.pdf").exists()
    # plot() draws the same bars: its labels, in the same order, as the image's
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = explanation.plot()
    doc = plain.doc
    ranked = sorted(doc["players"], key=lambda p: (-p["value"], p["index"]))
    assert [t.get_text() for t in ax.get_yticklabels()] == [bar_label(doc, p) for p in ranked]
    assert [bar.get_gid() for bar in ax.patches] == [f"bar-{p['index']}" for p in ranked]
    plt.close(ax.figure)


def test_an_explanation_presents_itself_through_the_installed_formatter(plain: Run) -> None:
    """The result holds data; its display methods hand it to the formatter installed with
    ``set_formatter`` (the report's, installed by ``import coalescence``), with their arguments."""
    from coalescence.app.replay import replay_run
    from coalescence.app.settings import ReplaySettings
    from coalescence.attribution import explanation as module
    from coalescence.errors import BackendUnavailable
    from coalescence.report.formatter import ExplanationFormatter

    (explanation,) = replay_run(plain.run_dir, ReplaySettings(methods=("permutation",), budget=64))
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def format_table(self, e: Any, *, snippet: int) -> str:
            calls.append(("table", e, snippet))
            return "a table"

        def plot(self, e: Any, ax: Any, *, top: int | None, scale: str) -> Any:
            calls.append(("plot", e, ax, top, scale))
            return "axes"

        def save_chart(self, e: Any, path: Any, *, scale: str) -> Any:
            calls.append(("chart", e, path, scale))
            return path

        def report(self, e: Any, path: Any, *, scale: str) -> Any:
            calls.append(("report", e, path, scale))
            return "view"

        def notebook_html(self, e: Any) -> str | None:
            calls.append(("html", e))
            return "<div/>"

    assert isinstance(module.formatter(), ExplanationFormatter)
    previous = module.set_formatter(Recorder())
    try:
        results = [
            explanation.format_table(snippet=7),
            explanation.plot("ax", top=3, scale="linear"),
            explanation.save_chart("c.svg", scale="linear"),
            explanation.report("r.html", scale="linear"),
            explanation._repr_html_(),
        ]
        assert results == ["a table", "axes", "c.svg", "view", "<div/>"]
        assert calls == [
            ("table", explanation, 7),
            ("plot", explanation, "ax", 3, "linear"),
            ("chart", explanation, "c.svg", "linear"),
            ("report", explanation, "r.html", "linear"),
            ("html", explanation),
        ]
        module.set_formatter(None)
        assert explanation._repr_html_() is None  # the plain repr, as without the report's packages
        with pytest.raises(BackendUnavailable, match="set_formatter"):
            explanation.format_table()
    finally:
        module.set_formatter(previous)
    assert "rank" in explanation.format_table().splitlines()[0]  # the report's table again


def test_image_of_several_explanations_has_one_panel_each(pairs: Run, tmp_path: Path) -> None:
    image = tmp_path / "chart.svg"
    code, _, err = run_cli(["report", str(pairs.run_dir), "--method", "exact,loo", "--image", str(image)])
    assert code == 0, err
    root = ET.fromstring(image.read_bytes())
    n = len(pairs.doc["players"])
    ids = [g.get("id") for g in root.iter(f"{SVG}g") if re.fullmatch(r"bar-\d+", g.get("id", ""))]
    assert len(ids) == 2 * n and sorted(set(ids)) == sorted(f"bar-{i}" for i in range(n))
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("exact \u00b7 run ") for t in texts) and any(t.startswith("loo \u00b7 run ") for t in texts)


# -- a page of several methods names them --------------------------------------------------------


def test_several_methods_are_named_by_method_and_run(pairs: Run, tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    code, _, err = run_cli(["report", str(pairs.run_dir), "--method", "exact,loo", "-o", str(out)])
    assert code == 0, err
    page = out.read_text(encoding="utf-8")
    run_id = json.loads((pairs.run_dir / "manifest.json").read_text(encoding="utf-8"))["runs"][-1]["run_id"]
    index = re.findall(r'<a href="(#ex\d+)">([^<]*)</a>', page)
    assert index == [("#ex0", f"exact \u00b7 run {run_id}"), ("#ex1", f"loo \u00b7 run {run_id}")]
    snapshot = pairs.doc["snapshot_id"]
    assert "Snapshot" not in page and f"{snapshot[:12]} \u00b7" not in page


def test_the_proxy_line_says_when_the_proxy_rows_were_not_used() -> None:
    """The printout's proxy line: a control variate where the estimator used the proxy rows, "not
    used" where it computed them and fitted the exact rows alone (diagnostics proxy_used = 0)."""
    from coalescence.report.formatter import proxy_line

    proxy = {"game": "kv-proxy-compact:after-last-player", "coalitions": 4, "evaluations": 4, "shared": 4, "pearson": 0.9, "spearman": 0.8}
    assert proxy_line(proxy).endswith("; a control variate only: the values are the exact game's")
    assert proxy_line(proxy, used=False).endswith("; not used: the values are of the exact rows alone")
    assert "r = 0.900, Spearman 0.800 over 4 coalitions" in proxy_line(proxy, used=False)


def test_the_page_states_the_proxy_game_as_the_printout_does(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A two-fidelity run (lasso at 8 exact coalitions with the proxy game): the page's facts carry
    the printout's proxy line, its counts and agreement taken from the document."""
    from coalescence.report.formatter import proxy_line

    run = explain(tmp_path / "two", tiny_model_dir, CONVERSATION, "--unit", "sentence", "--method", "lasso", "--budget", "8")
    assert run.code == 0, run.stderr
    proxy = run.doc["proxy"]
    assert proxy["game"] == "kv-proxy-compact:after-last-player" and proxy["coalitions"] >= 8
    line = proxy_line(proxy)
    assert line in run.stdout
    page = html.unescape(run.html.read_text(encoding="utf-8"))
    assert "proxy game" in page and line in page
    # the diagnostics' counts as whole numbers on both, the LDS nothing was held out for as n/a
    d = run.doc["diagnostics"]
    count = d["proxy_evaluations"]
    assert count == int(count) >= 8
    assert d["lds"] is None or d["lds"] != d["lds"]  # NaN, or null in JSON
    for text in (page, run.stdout):
        assert f"proxy_evaluations = {int(count)}," in text.replace("   ", ", ") and f"{int(count)}.0" not in text
        assert "lds = n/a" in text and "n_train = 8" in text
