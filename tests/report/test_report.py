"""The HTML report, read as HTML text (the browser tests in test_report_browser.py render it).

Every page here is made from real explanations of the tiny random Llama (``explain --html`` and
``coalescence report`` run in-process). The references are independent of the report's code: the
input's messages, the WCAG 2 contrast formula written out below, ColorBrewer's RdBu centre colour,
and the ``--out`` document's own numbers.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from coalescence.report import DivergingScale, contrast_ratio, explanation_fragment, load_source, render_report
from coalescence.app.report import report_source
from helpers.report_runs import HUNDRED, SECOND, TRICKY, Run, explain, prompt_messages, run_cli

pytest.importorskip("matplotlib")

RDBU_CENTRE = "#f7f7f7"
"""The centre of ColorBrewer's RdBu scale (colorbrewer2.org): the colour of a value of 0."""


# -- an independent reading of the page ---------------------------------------------------------


class Page(HTMLParser):
    """Collects what the tests compare: the text of each message, the player and token highlights,
    every element id and every attribute that could name a resource."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.messages: dict[tuple[str, int], str] = {}  # (section, message index) -> text
        self.marks: list[dict[str, Any]] = []
        self.tokens: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.urls: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.links: list[str] = []
        self._section = ""
        self._capture: tuple[str, int] | None = None
        self._depth = 0
        self._open: list[dict[str, Any]] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.append(a["id"])
        for name in ("src", "href", "xlink:href", "action", "poster", "srcset", "data"):
            if name in a:
                self.urls.append((tag, name, a[name]))
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        if tag == "section" and a.get("class") == "explanation":
            self._section = a["id"]
        if self._capture is not None:
            self._depth += 1
        elif tag == "div" and "content" in a.get("class", "").split() and "data-message" in a:
            self._capture = (self._section, int(a["data-message"]))
            self.messages[self._capture] = ""
            self._depth = 0
        if tag == "mark" or (tag == "span" and "tok" in a.get("class", "").split()):
            item = dict(a, text="", section=self._section, tag=tag)
            (self.marks if tag == "mark" else self.tokens).append(item)
            self._open.append(item)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("mark", "span") and self._open and self._open[-1]["tag"] == tag:
            self._open.pop()
        if self._capture is not None:
            if self._depth == 0:
                self._capture = None
            else:
                self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._capture is not None:
            self.messages[self._capture] += data
        for item in self._open:
            item["text"] += data


def short(text: str, n: int = 40) -> str:
    """The tooltip's snippet, by the rule: whitespace runs as one space, at most n characters, an
    ellipsis replacing the end of a longer text."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def style_colors(style: str) -> tuple[str, str]:
    """``(background, text)`` colours of an inline style."""
    bg = re.search(r"background-color:\s*(#[0-9a-f]{6})", style)
    fg = re.search(r"(?<!-)color:\s*(#[0-9a-f]{6})", style)
    assert bg and fg, style
    return bg.group(1), fg.group(1)


def wcag_contrast(a: str, b: str) -> float:
    """WCAG 2.1 contrast ratio, written out from the standard: sRGB channels linearised with
    ``c/12.92`` at or below 0.03928 and ``((c+0.055)/1.055)^2.4`` above; L = 0.2126 R + 0.7152 G +
    0.0722 B; ratio = (L_lighter + 0.05) / (L_darker + 0.05)."""

    def lum(color: str) -> float:
        r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def fmt(x: float) -> str:
    """A value as the page writes it (four decimals, signed)."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:+.3e}"


def assert_refused(argv: list[str], field: str, output: Path) -> str:
    code, stdout, stderr = run_cli(argv)
    assert code == 2, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"coalescence: error: {field}: "), lines[0]
    assert "Traceback" not in stderr
    assert not output.exists()
    return lines[0]


# -- the runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(tmp_path_factory.mktemp("single"), tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "exact")
    assert run.code == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def permutation(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    # budget 64: 24 buys 1-2 permutation pairs for these players, too few to know an error
    run = explain(
        tmp_path_factory.mktemp("perm"), tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "permutation", "--budget", "64"
    )
    assert run.code == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(tmp_path_factory.mktemp("batch"), tiny_model_dir, [TRICKY, SECOND], "--unit", "sentence", "--method", "loo")
    assert run.code == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def hierarchy(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    run = explain(
        tmp_path_factory.mktemp("hier"), tiny_model_dir, TRICKY, "--hierarchy", "turn,sentence", "--top-k", "1", "--method", "exact"
    )
    assert run.code == 0, run.stderr
    return run


# -- self-contained, exact, one highlight per player ----------------------------------------------


def test_page_is_self_contained(single: Run) -> None:
    html = single.html.read_text(encoding="utf-8")
    page = Page(html)
    assert "http" not in html.lower()  # no URL of any kind (the input holds none either)
    assert "<script" not in html.lower()  # the input's "<script>" text is escaped, and the page has none
    for tag in ("<link", "<img", "<iframe", "<object", "<embed", "@import"):
        assert tag not in html.lower()
    # the only references are to fragments of the page itself (links, SVG markers) or data: URIs
    assert page.urls
    assert all(v.startswith("#") or v.startswith("data:") for _, _, v in page.urls), page.urls
    assert set(re.findall(r"url\(([^)]*)\)", html)) <= {u for u in re.findall(r"url\((#[^)]*)\)", html)}
    assert len(page.ids) == len(set(page.ids))


def test_every_message_appears_byte_exact(single: Run) -> None:
    page = Page(single.html.read_text(encoding="utf-8"))
    shown = [text for (_, k), text in sorted(page.messages.items(), key=lambda kv: kv[0][1])]
    assert shown == [m["content"] for m in prompt_messages(TRICKY)]  # tabs, CRLF, NBSP, combining marks, RTL


def test_one_highlight_per_player_with_its_text_and_value(single: Run) -> None:
    page = Page(single.html.read_text(encoding="utf-8"))
    players = single.doc["players"]
    assert [int(m["data-index"]) for m in page.marks] == list(range(len(players)))
    ranked = sorted(range(len(players)), key=lambda i: (-players[i]["value"], i))
    for mark, p in zip(page.marks, players, strict=True):
        assert mark["text"] == p["text"]
        assert float(mark["data-value"]) == pytest.approx(p["value"], abs=1e-12)
        rank = ranked.index(p["index"]) + 1  # exact Shapley: no standard errors, so one rank each
        assert mark["title"] == f"{p['label']} \u201c{short(p['text'])}\u201d: {fmt(p['value'])} nats \u00b7 rank {rank} of {len(players)}"
        assert mark["tabindex"] == "0"


def test_standard_errors_are_shown_where_the_method_has_them(permutation: Run) -> None:
    html = permutation.html.read_text(encoding="utf-8")
    page = Page(html)
    for mark, p in zip(page.marks, permutation.doc["players"], strict=True):
        assert p["stderr"] is not None
        assert f"\u00b1 {p['stderr']:.3e}" in mark["title"] or f"\u00b1 {p['stderr']:.4f}" in mark["title"]
    assert "error bars: ±1 standard error" in html  # the chart's axis label: error bars drawn


# -- colours ------------------------------------------------------------------------------------


def test_zero_gets_the_neutral_colour(tmp_path: Path, tiny_model_dir: Path) -> None:
    # --unit turn: an empty turn removes nothing, so its exact Shapley value is 0 (docs/input.md)
    conversation = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": ""},
            {"role": "user", "content": "When was the tower completed?"},
            {"role": "assistant", "content": "It was completed in 1889."},
        ]
    }
    run = explain(tmp_path, tiny_model_dir, conversation, "--unit", "turn", "--method", "exact")
    assert run.code == 0, run.stderr
    assert run.doc["players"][1]["value"] == 0.0
    marks = Page(run.html.read_text(encoding="utf-8")).marks
    assert style_colors(marks[1]["style"])[0] == RDBU_CENTRE
    assert {style_colors(m["style"])[0] for i, m in enumerate(marks) if i != 1}.isdisjoint({RDBU_CENTRE})


def test_scale_is_centred_and_diverging() -> None:
    scale = DivergingScale(2.0)
    assert scale.color(0.0) == RDBU_CENTRE
    assert scale.stops(9)[4] == (0.0, RDBU_CENTRE)  # the legend's middle stop is zero
    for v in (0.05, 0.5, 1.0, 2.0, 5.0):  # positive values blue (b > r), negative red (r > b)
        rp, _, bp = (int(scale.color(v)[i : i + 2], 16) for i in (1, 3, 5))
        rn, _, bn = (int(scale.color(-v)[i : i + 2], 16) for i in (1, 3, 5))
        assert bp > rp and rn > bn
    # a symmetric scale: -v and +v sit at mirrored places, the largest |value| at the ends
    assert scale.position(-1.3) == pytest.approx(1 - scale.position(1.3))
    assert DivergingScale.for_values([-0.5, 3.0, None]).halfrange == 3.0


def test_the_robust_scale_keeps_small_values_apart_and_the_largest_darkest() -> None:
    # one value dwarfs the rest (the demo's question): the knee is the 90th percentile of |value|
    # by nearest rank (the 9th of 10 sorted absolute values), and [0, knee] takes 80% of the shades
    values = [14.47, 3.77, 1.95, 0.7, -0.18, 0.16, 0.5, -0.3, 1.2, 0.9]
    robust, linear = DivergingScale.for_values(values), DivergingScale.for_values(values, "linear")
    assert (robust.halfrange, robust.knee) == (14.47, 3.77) and linear.knee is None
    assert robust.position(3.77) == pytest.approx(0.5 + 0.5 * 0.8)
    assert robust.position(1.95) == pytest.approx(0.5 + 0.5 * 0.8 * 1.95 / 3.77)
    assert robust.position(14.47) == 1.0 and robust.position(-14.47) == 0.0
    assert robust.position(9.12) == pytest.approx(0.5 + 0.5 * (0.8 + 0.2 * (9.12 - 3.77) / (14.47 - 3.77)))
    assert linear.position(3.77) == pytest.approx(0.5 + 0.5 * 3.77 / 14.47)
    # monotone in the value, so ranks read from colours stay ranks
    grid = [k / 10 for k in range(-150, 151)]
    assert all(robust.position(a) <= robust.position(b) for a, b in zip(grid, grid[1:]))
    assert [robust.value_at(robust.position(v)) for v in (-9.0, -1.0, 0.0, 2.5, 14.47)] == pytest.approx([-9.0, -1.0, 0.0, 2.5, 14.47])
    # no dominant value (largest at most twice the knee): linear
    assert DivergingScale.for_values([1.0, 0.9, 0.8, -0.7]).knee is None


def test_rank_ranges_tie_players_whose_intervals_overlap() -> None:
    from coalescence.report.views import rank_ranges

    # 95% intervals (value +- 1.96 se): A [9.02, 10.98], B [7.04, 10.96], C [2.04, 3.96], D [-0.98, 0.98]
    values, stderr = [10.0, 9.0, 3.0, 0.0], [0.5, 1.0, 0.49, 0.5]
    assert rank_ranges(values, stderr) == [(1, 2), (1, 2), (3, 3), (4, 4)]
    assert rank_ranges(values, None) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert rank_ranges(values, [0.5, None, 0.49, 0.5])[1] == (2, 2)  # an unknown error: the point rank


def test_text_contrast_meets_wcag_aa(single: Run, batch: Run) -> None:
    # the library's formula against the standard's published values: black on white 21:1, #777 on white 4.48:1
    assert contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast_ratio("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)
    scale = DivergingScale(1.0)
    for k in range(-100, 101):  # the whole scale, its darkest ends included
        v = k / 100
        assert wcag_contrast(scale.color(v), scale.text_color(v)) >= 4.5, v
    for run in (single, batch):
        page = Page(run.html.read_text(encoding="utf-8"))
        for item in page.marks + page.tokens:
            assert wcag_contrast(*style_colors(item["style"])) >= 4.5, item


# -- answer tokens ------------------------------------------------------------------------------


def test_answer_tokens_add_up_to_the_utility(single: Run) -> None:
    doc = single.doc
    tokens = doc["answer_tokens"]
    assert len(tokens) == doc["target_token_count"]
    # logprob is the sum of the answer tokens' log-probabilities (docs/numbers.md): so are v(full), v(empty)
    assert sum(t["logprob_full"] for t in tokens) == pytest.approx(doc["v_full"], abs=1e-4)
    assert sum(t["logprob_empty"] for t in tokens) == pytest.approx(doc["v_empty"], abs=1e-4)
    for t in tokens:
        if 0 <= t["start"] and t["end"] <= len(ANSWER := doc["target"]):
            assert t["text"] == ANSWER[t["start"] : t["end"]]
    assert "".join(t["text"] for t in tokens) == doc["target"] + "<|im_end|>"  # the end-of-turn token is scored
    page = Page(single.html.read_text(encoding="utf-8"))
    assert [t["text"] for t in page.tokens] == [t["text"] for t in tokens]
    deltas = [float(t["data-delta"]) for t in page.tokens]
    assert deltas == pytest.approx([t["logprob_full"] - t["logprob_empty"] for t in tokens])


def test_subspan_run_marks_the_span(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = explain(tmp_path, tiny_model_dir, TRICKY, "--unit", "sentence", "--method", "loo", "--target-substring", "1889")
    assert run.code == 0, run.stderr
    lo, hi = run.doc["utility_detail"]["target_tokens"]
    page = Page(run.html.read_text(encoding="utf-8"))
    inside = [t for t in page.tokens if "in-span" in t["class"].split()]
    assert "1889" in "".join(t["text"] for t in inside)
    assert len(inside) == hi - lo
    # the values explain the span: v(full) is the span tokens' log p
    full = [t["logprob_full"] for t in run.doc["answer_tokens"]][lo:hi]
    assert sum(full) == pytest.approx(run.doc["v_full"], abs=1e-4)
    assert "Scored span" in run.html.read_text(encoding="utf-8")


def test_a_regenerate_utility_says_it_has_no_token_scores(single: Run) -> None:
    doc = dict(single.doc, utility="exact_match", value_unit="fraction", answer_tokens=None)
    html = render_report(doc)
    assert "has no per-token scores" in html
    assert not Page(html).tokens


# -- forms: 100 players, hierarchy, batch, archive -----------------------------------------------


def test_a_100_player_page_is_under_1_mb(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = explain(tmp_path, tiny_model_dir, HUNDRED, "--unit", "word", "--roles", "user", "--method", "loo")
    assert run.code == 0, run.stderr
    assert len(run.doc["players"]) == 100
    size = run.html.stat().st_size
    assert size < 1_000_000, size
    page = Page(run.html.read_text(encoding="utf-8"))
    assert len(page.marks) == 100
    assert page.messages[("ex0", 1)] == HUNDRED["messages"][1]["content"]


def test_hierarchy_page_shows_both_levels(hierarchy: Run) -> None:
    doc = hierarchy.doc
    page = Page(hierarchy.html.read_text(encoding="utf-8"))
    by_section: dict[str, int] = {}
    for m in page.marks:
        by_section[m["section"]] = by_section.get(m["section"], 0) + 1
    assert by_section == {"ex0-coarse": len(doc["coarse"]["players"]), "ex0-fine": len(doc["fine"]["players"])}
    fine_labels = [m["title"].split(" \u201c")[0] for m in page.marks if m["section"] == "ex0-fine"]
    assert fine_labels == [p["label"] for p in doc["fine"]["players"]]
    html = hierarchy.html.read_text(encoding="utf-8")
    assert ", ".join(doc["hierarchy"]["refined"]) in html
    for level in ("coarse", "fine"):
        shown = [page.messages[(f"ex0-{level}", k)] for k in range(2)]
        assert shown == [m["content"] for m in prompt_messages(TRICKY)]


def test_batch_page_summarises_the_values_across_conversations(batch: Run) -> None:
    html_text = batch.html.read_text(encoding="utf-8")
    page = Page(html_text)
    section = html_text.split('id="summary"', 1)[1].split("</section>", 1)[0]
    rows = [
        [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", section)
    ]
    pooled: dict[str, list[float]] = {}
    everyone = []
    for k, doc in enumerate(batch.doc["explanations"]):
        for p in doc["players"]:
            pooled.setdefault(p["role"], []).append(p["value"])
            everyone.append((abs(p["value"]), k, p["index"], p["label"]))
    for role, values in pooled.items():  # players, mean and mean |value| of each role, by hand
        row = next(r for r in rows if r and r[0] == role)
        assert int(row[1]) == len(values)
        assert float(row[2]) == pytest.approx(sum(values) / len(values), abs=5e-5)
        assert float(row[4]) == pytest.approx(sum(abs(v) for v in values) / len(values), abs=5e-5)
    top = [r for r in rows if len(r) == 4]
    everyone.sort(key=lambda t: (-t[0], t[1], t[2]))
    assert [r[1] for r in top] == [label for _, _, _, label in everyone[: len(top)]]
    links = re.findall(r'<a href="#([^"]+)">', section)
    assert links and set(links) <= set(page.ids)  # each top player links to its highlight


def test_batch_page_indexes_every_explanation(batch: Run) -> None:
    page = Page(batch.html.read_text(encoding="utf-8"))
    index = [link for link in page.links if link in ("#ex0", "#ex1")]
    assert index == ["#ex0", "#ex1"]
    assert {"ex0", "ex1"} <= set(page.ids)
    assert len(page.ids) == len(set(page.ids))  # two charts, no shared SVG id
    for k, conversation in enumerate(batch.inputs):
        messages = prompt_messages(conversation)
        assert [page.messages[(f"ex{k}", i)] for i in range(len(messages))] == [m["content"] for m in messages]
        n = len(batch.doc["explanations"][k]["players"])
        assert sum(1 for m in page.marks if m["section"] == f"ex{k}") == n


def test_report_from_the_archive_needs_no_model(single: Run, tmp_path: Path) -> None:
    out = tmp_path / "from-archive.html"
    code, stdout, stderr = run_cli(["report", str(single.run_dir), "-o", str(out)])
    assert code == 0, stderr
    assert stdout == f"report: {out}\n"
    page = Page(out.read_text(encoding="utf-8"))
    values = [float(m["data-value"]) for m in page.marks]
    assert values == pytest.approx([p["value"] for p in single.doc["players"]], abs=1e-9)  # exact: same values
    assert [t["text"] for t in page.tokens] == [t["text"] for t in single.doc["answer_tokens"]]
    assert "no model call" in out.read_text(encoding="utf-8")


def test_report_from_a_hierarchy_archive_fits_both_levels(hierarchy: Run, tmp_path: Path) -> None:
    report = report_source(hierarchy.run_dir)
    (entry,) = report.entries
    assert entry.hierarchy is not None and entry.fine is not None
    for level in ("coarse", "fine"):  # exact values: the archive gives back what the run computed
        fitted = entry.document if level == "coarse" else entry.fine
        assert [p["label"] for p in fitted["players"]] == [p["label"] for p in hierarchy.doc[level]["players"]]
        assert [p["value"] for p in fitted["players"]] == pytest.approx([p["value"] for p in hierarchy.doc[level]["players"]], abs=1e-9)
        assert fitted["answer_tokens"] == hierarchy.doc[level]["answer_tokens"]
    assert entry.hierarchy["refined"] == hierarchy.doc["hierarchy"]["refined"]


def test_report_of_the_replay_and_batch_documents(batch: Run, tmp_path: Path) -> None:
    replay = tmp_path / "replay.json"
    code, _, stderr = run_cli(["replay", str(batch.run_dir), "--method", "loo", "--out", str(replay)])
    assert code == 0, stderr
    report = load_source(replay)
    assert report.kind == "replay" and len(report.entries) == 2  # one per snapshot
    page = Page(render_report(report))
    assert [link for link in page.links if re.fullmatch(r"#ex\d", link)] == ["#ex0", "#ex1"]
    for k, conversation in enumerate(batch.inputs):
        messages = prompt_messages(conversation)
        assert [page.messages[(f"ex{k}", i)] for i in range(len(messages))] == [m["content"] for m in messages]


def test_several_methods_of_one_conversation_are_no_dataset(batch: Run, tmp_path: Path) -> None:
    """The summary pools one explanation per conversation: a replay of one method on two
    conversations shows it; the same document with a second method's explanation of each
    conversation, or two methods of one conversation, shows none (each player would be counted
    once per method)."""
    out = tmp_path / "loo.json"
    code, _, stderr = run_cli(["replay", str(batch.run_dir), "--method", "loo", "--out", str(out)])
    assert code == 0, stderr
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert len({d["snapshot_id"] for d in doc["explanations"]}) == 2
    other = [dict(d, method="banzhaf") for d in doc["explanations"]]  # another method's values of the same players
    cases = {
        "one method, two conversations": (doc["explanations"], True),
        "two methods, two conversations": (doc["explanations"] + other, False),
        "two methods, one conversation": ([doc["explanations"][0], other[0]], False),
    }
    for name, (explanations, summarised) in cases.items():
        path = tmp_path / "case.json"
        path.write_text(json.dumps(dict(doc, explanations=explanations)), encoding="utf-8")
        assert ('id="summary"' in render_report(load_source(path))) is summarised, name


def test_archive_lacking_coalitions_names_the_replay_command(batch: Run, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    line = assert_refused(["report", str(batch.run_dir), "-o", str(out), "--method", "kernelshap", "--budget", "40"], "--method", out)
    assert "coalescence replay" in line and "--model" in line


def test_explain_html_prints_the_path(single: Run) -> None:
    assert single.stdout.splitlines()[-1].endswith(f"html: {single.html}")
    assert single.html.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_document_without_messages_takes_them_from_its_archive(single: Run, tmp_path: Path) -> None:
    old = {k: v for k, v in single.doc.items() if k not in ("messages", "answer_tokens")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old), encoding="utf-8")
    page = Page(render_report(load_source(path)))
    assert [page.messages[("ex0", k)] for k in range(2)] == [m["content"] for m in prompt_messages(TRICKY)]
    orphan = tmp_path / "orphan.json"
    orphan.write_text(json.dumps({k: v for k, v in old.items() if k != "archive"}), encoding="utf-8")
    line = assert_refused(["report", str(orphan), "-o", str(tmp_path / "o.html")], "SOURCE", tmp_path / "o.html")
    assert "coalescence report RUN_DIR" in line


def test_fragment_embeds_in_a_notebook(single: Run) -> None:
    fragment = explanation_fragment(single.doc)
    assert fragment.startswith('<div class="coalescence-report">')
    assert "<html" not in fragment and "<script" not in fragment.lower()
    assert len(Page(fragment).marks) == len(single.doc["players"])


# -- refused sources -----------------------------------------------------------------------------

BAD_SOURCES = [
    pytest.param(None, "SOURCE", "does not exist", id="missing"),
    pytest.param('{"players": [', "SOURCE", "not valid JSON", id="not-json"),
    pytest.param("[1, 2]", "SOURCE", "expected a JSON object", id="not-an-object"),
    pytest.param({"foo": 1}, "SOURCE", "none of the keys", id="foreign-object"),
    pytest.param({"explanations": []}, "SOURCE", "non-empty list", id="empty-batch"),
    pytest.param(
        {"target": "x", "messages": [{"role": "user", "content": "abc"}], "players": [{"label": "a", "value": 1.0, "message_index": 0, "start": 0, "end": 9}]},
        "SOURCE",
        "players[0].end",
        id="span-outside-message",
    ),
    pytest.param(
        {"target": "x", "messages": [{"role": "user", "content": "abc"}], "players": [{"label": "a", "value": "big", "message_index": 0, "start": 0, "end": 1}]},
        "SOURCE",
        "players[0].value",
        id="value-not-a-number",
    ),
]


@pytest.mark.parametrize(("content", "field", "says"), BAD_SOURCES)
def test_bad_source_is_refused_with_one_line(content: Any, field: str, says: str, tmp_path: Path) -> None:
    source = tmp_path / "source.json"
    if content is not None:
        source.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    out = tmp_path / "report.html"
    line = assert_refused(["report", str(source), "-o", str(out)], field, out)
    assert says in line


def test_a_directory_that_is_no_archive_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    line = assert_refused(["report", str(tmp_path), "-o", str(out)], "SOURCE", out)
    assert "not a run directory" in line


def test_archive_options_with_a_document_are_refused(single: Run, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert_refused(["report", str(single.out), "-o", str(out), "--method", "exact"], "--method", out)


def test_html_path_is_checked_before_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps(TRICKY), encoding="utf-8")
    run_dir = tmp_path / "run"
    argv = ["explain", str(source), "--model", str(tiny_model_dir), "--archive", str(run_dir), "--html", str(tmp_path)]
    assert_refused(argv, "--html", run_dir)
