"""Progress where nobody watches a terminal: plain lines at most every interval and one at the end,
never a carriage return; on a terminal, tqdm's bar."""

from __future__ import annotations

import io

from coalescence.scheduler.progress import TqdmProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_a_plain_line_per_interval_and_the_last_count():
    out, clock = io.StringIO(), Clock()
    progress = TqdmProgress("coalitions", file=out, interval=30, clock=clock)
    progress.on_planned(200)
    for done in range(1, 101):  # 100 coalitions over 100 s: lines at 30, 60, 90 s
        clock.now += 1
        progress.on_finished(done, 200)
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "coalescence: coalitions 30/200 (15%), 30 s, about 2 min 50 s left",  # 170 left at 1 a second
        "coalescence: coalitions 60/200 (30%), 1 min 0 s, about 2 min 20 s left",
        "coalescence: coalitions 90/200 (45%), 1 min 30 s, about 1 min 50 s left",
        "coalescence: coalitions 100/200 (50%), 1 min 40 s, about 1 min 40 s left",
    ]


def test_a_short_run_says_its_count_once_and_disabled_says_nothing():
    out, clock = io.StringIO(), Clock()
    progress = TqdmProgress(file=out, clock=clock)
    progress.on_planned(8)
    for done in range(1, 9):
        progress.on_finished(done, 8)
    clock.now += 3
    progress.close()
    assert out.getvalue() == "coalescence: coalitions 8/8 (100%), 3 s\n"
    quiet = io.StringIO()
    off = TqdmProgress(file=quiet, disable=True)
    off.on_planned(8)
    off.on_finished(8, 8)
    off.close()
    assert quiet.getvalue() == ""


def test_a_terminal_gets_the_bar(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the CLI silences third-party bars this way, never ours
    out = Terminal()
    progress = TqdmProgress(file=out)
    progress.on_planned(4)
    progress.on_finished(4, 4)
    progress.close()
    assert "\r" in out.getvalue() and "coalitions:" in out.getvalue() and "/4 " in out.getvalue()
