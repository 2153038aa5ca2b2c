"""Labels are text in every chart (never matplotlib mathtext), and a report that fails after the
run's results are written is its own exit code (4), one line, with the results kept."""

from __future__ import annotations

import html
import io
import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from helpers.cli import run_cli

from coalescence.archive import read_manifest
from coalescence.report.chart import bar_chart_svg
from coalescence.report.colors import DivergingScale

# a dollar pair that mathtext cannot parse, a pair it would draw as math, an escaped dollar, a lone one
LABELS = ["cost_$x^$", "lunch $5 vs taxi $60", r"price \$3", "tip $2"]
USER = "Lunch was $5.\nThe taxi was $60.\n- The tip: $2\nWhat did I spend most on?"
ANSWER = "You spent the most on the taxi ($60)."


def svg_texts(svg: str) -> list[str]:
    """The character content of every ``<text>`` element, XML entities decoded."""
    return [html.unescape(re.sub(r"<[^>]+>", "", body)) for body in re.findall(r"<text\b[^>]*>(.*?)</text>", svg, re.S)]


def conversation() -> dict:
    # players named by the user, one per line of the user's message, with the labels above
    lines = USER.split("\n")
    starts = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
    players = [{"message": 0, "start": s, "end": s + len(line), "label": label} for s, line, label in zip(starts, lines, LABELS)]
    return {"messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}], "players": players}


def test_chart_labels_are_drawn_as_written() -> None:
    svg = bar_chart_svg(LABELS, [0.5, -0.25, 0.125, 1.0], [0.1, 0.1, 0.1, 0.1], unit="nats $", scale=DivergingScale(1.0), chart_id="c1")
    texts = svg_texts(svg)
    for label in LABELS:  # each label is one text element holding exactly its characters
        assert label in texts, texts
    assert "value (nats $)" in texts and "error bars: ±1 standard error" in texts
    assert "font-style:italic" not in svg and "DejaVu Sans Oblique" not in svg  # mathtext draws x italic


def test_explanation_plot_labels_are_drawn_as_written(tmp_path: Path, tiny_model_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from coalescence.app.settings import ReplaySettings
    from coalescence.app.replay import replay_run

    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(conversation()), encoding="utf-8")
    run_dir = tmp_path / "run"
    code, _, stderr = run_cli(["explain", str(path), "--model", str(tiny_model_dir), "--method", "exact", "--archive", str(run_dir), "--no-progress"])
    assert code == 0, stderr
    (explanation,) = replay_run(run_dir, ReplaySettings(methods=("exact",)))
    ax = explanation.plot()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        ax.figure.savefig(buf, format="svg")  # drawn after plot() returned, under the default rc
    plt.close(ax.figure)
    texts = svg_texts(buf.getvalue())
    for label in LABELS:  # each bar's label is "LABEL text of the player", drawn as written
        assert any(t.startswith(label + " ") for t in texts), texts
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(label for t in ticks for label in LABELS if t.startswith(label + " ")) == sorted(LABELS)


@pytest.fixture
def labelled_input(tmp_path: Path) -> Path:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(conversation()), encoding="utf-8")
    return path


def test_html_of_a_run_with_dollar_labels(labelled_input: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    page, run_dir = tmp_path / "report.html", tmp_path / "run"
    argv = ["explain", str(labelled_input), "--model", str(tiny_model_dir), "--method", "exact", "--archive", str(run_dir), "--html", str(page), "--no-progress"]
    code, stdout, stderr = run_cli(argv)
    assert code == 0, stderr
    assert stderr == ""
    svg = page.read_text(encoding="utf-8").split("<svg", 1)[1]
    texts = svg_texts(svg)

    def drawn(label: str, texts: list[str]) -> bool:  # the page's chart labels a bar "LABEL text of the player"
        return any(t == label or t.startswith(label + " ") for t in texts)

    for label in LABELS:
        assert drawn(label, texts), texts
    code, _, stderr = run_cli(["report", str(run_dir), "-o", str(tmp_path / "again.html")])
    assert code == 0, stderr
    assert all(drawn(label, svg_texts((tmp_path / "again.html").read_text(encoding="utf-8"))) for label in LABELS)


def _blocked(tmp_path: Path) -> Path:
    """A report path that passes the checks before the run and cannot be written after it: a link
    to ``blocker/report.html`` where ``blocker`` is a file, so its directory cannot be made."""
    (tmp_path / "blocker").write_text("a file where the report's directory should be\n")
    link = tmp_path / "report.html"
    os.symlink(tmp_path / "blocker" / "report.html", link)
    return link


@pytest.mark.parametrize("where", ["file-in-the-way", "dev-full"])
def test_a_report_failure_after_the_results_is_exit_4(where: str, labelled_input: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    if where == "dev-full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    page = _blocked(tmp_path) if where == "file-in-the-way" else Path("/dev/full")
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    argv = [
        "explain", str(labelled_input), "--model", str(tiny_model_dir), "--method", "exact",
        "--archive", str(run_dir), "--out", str(out), "--html", str(page), "--no-progress",
    ]  # fmt: skip
    code, stdout, stderr = run_cli(argv)
    assert code == 4, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("coalescence: error: --html: the HTML report was not written"), stderr
    assert f"coalescence report {run_dir} -o PATH" in lines[0]
    # the results are kept: the archive complete, the --out document written, the table printed
    assert read_manifest(run_dir)["runs"][-1]["status"] == "complete"
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [p["label"] for p in doc["players"]] == LABELS
    assert all(label in stdout for label in LABELS) and "html:" not in stdout
    if where == "file-in-the-way":
        assert not os.path.exists(page)
    # and the report is made again from the archive, with no model
    code, _, stderr = run_cli(["report", str(run_dir), "-o", str(tmp_path / "again.html")])
    assert code == 0, stderr
