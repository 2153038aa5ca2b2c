"""Progress reporting: a small protocol the engine calls and the CLI implements."""

from __future__ import annotations

import sys
from typing import Any, Protocol

__all__ = ("NullProgress", "Progress", "ProgressTally", "TqdmProgress", "in_notebook")


class Progress(Protocol):
    """Receives progress of a run: coalitions planned and finished.

    The counts are the run's, summed over every evaluation it makes (several conversations in
    flight at once, rounds, phases): ``total`` never decreases, ``done`` never decreases and never
    exceeds ``total``. A call to :meth:`on_planned` after the first raises the total of the same run.
    """

    def on_planned(self, total: int) -> None:
        """``total`` distinct coalitions will be resolved (evaluated or served from the store)."""
        ...

    def on_finished(self, done: int, total: int) -> None:
        """``done`` of ``total`` coalitions are resolved."""
        ...


class ProgressTally:
    """Sums the coalitions of many scheduler runs into one monotone count for a :class:`Progress`.

    An engine keeps one tally and hands it to the scheduler of every evaluation, so a dataset run
    with several conversations in flight (or on Ray workers) reports one total, the sum of every
    conversation's coalitions, and one count that only grows (each evaluation used to restart
    the count at its own ``done`` of its own ``total``).

    Args:
        progress: the callbacks to forward the running totals to.

    Attributes:
        total: coalitions planned so far, summed over the runs (int).
        done: coalitions resolved so far, summed over the runs (int).
    """

    __slots__ = ("done", "progress", "total")

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.total = 0
        self.done = 0

    def plan(self, n: int) -> None:
        """``n`` more coalitions will be resolved."""
        self.total += int(n)
        self.progress.on_planned(self.total)

    def advance(self, n: int = 1) -> None:
        """``n`` more coalitions are resolved (a run of unknown size raises the total with them)."""
        self.done += int(n)
        self.total = max(self.total, self.done)
        self.progress.on_finished(self.done, self.total)


class NullProgress:
    """Ignores progress (the library default)."""

    def on_planned(self, total: int) -> None:
        """Do nothing."""

    def on_finished(self, done: int, total: int) -> None:
        """Do nothing."""


class TqdmProgress:
    """Progress on stderr (used by the CLI and the Python API): a tqdm bar on a terminal (or a
    notebook, through ``tqdm.auto``); elsewhere (a log file, CI) a plain line at most every
    ``interval`` seconds and one at the end, never a carriage return.

    Args:
        desc: the label.
        disable: no progress at all (e.g. ``--no-progress``).
        file: where it is written (default ``sys.stderr`` at the first call).
        interval: seconds between two plain lines (> 0).
        clock: the time source (``time.monotonic``), for tests.
    """

    def __init__(
        self, desc: str = "coalitions", *, disable: bool = False, file: Any = None, interval: float = 30.0, clock: Any = None
    ) -> None:
        import time

        self.desc = desc
        self.disable = disable
        self.file = file
        self.interval = float(interval)
        self.clock = clock or time.monotonic
        self._bar: Any = None
        self._plain: bool | None = None
        self._start = 0.0
        self._last = 0.0
        self._state = (0, 0)
        self._said: tuple[int, int] | None = None

    def _stream(self) -> Any:
        return self.file if self.file is not None else sys.stderr

    def _is_plain(self) -> bool:
        if self._plain is None:
            stream = self._stream()
            try:
                terminal = bool(stream.isatty())
            except (AttributeError, ValueError, OSError):
                terminal = False
            self._plain = not (terminal or in_notebook())
        return self._plain

    def on_planned(self, total: int) -> None:
        """Open the bar with ``total`` steps, or raise an open bar's total to ``total``."""
        if self.disable:
            return
        if self._is_plain():
            if self._start == 0.0:
                self._start = self._last = self.clock()
            self._state = (self._state[0], total)
            return
        tqdm = _tqdm_class()
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()
            return
        self._bar = tqdm(total=total, desc=self.desc, unit="coal", leave=False, file=self.file, disable=False)

    def on_finished(self, done: int, total: int) -> None:
        """Advance the bar to ``done`` (plain: a line when ``interval`` seconds have passed)."""
        if self.disable:
            return
        if self._is_plain():
            self._state = (done, total)
            now = self.clock()
            if now - self._last >= self.interval:
                self._last = now
                self._line(now)
            return
        if self._bar is not None:
            self._bar.update(done - self._bar.n)

    def _line(self, now: float) -> None:
        done, total = self._state
        elapsed = now - self._start
        share = f" ({100 * done / total:.0f}%)" if total else ""
        left = ""
        if 0 < done < total and elapsed > 0:
            left = f", about {_duration(elapsed * (total - done) / done)} left"
        self._said = self._state
        print(f"coalescence: {self.desc} {done}/{total}{share}, {_duration(elapsed)}{left}", file=self._stream(), flush=True)

    def close(self) -> None:
        """Close the bar if open (plain: the last count, if not said yet)."""
        if self._plain and not self.disable and self._start and self._said != self._state:
            self._line(self.clock())
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 4 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (IPython's shell there is a ZMQInteractiveShell;
    importing ipykernel alone is not running in it)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except AttributeError:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _tqdm_class() -> Any:
    """tqdm's notebook widget when a notebook can draw it (ipywidgets installed), else its text bar
    (``tqdm.auto`` alone would warn in a notebook without ipywidgets)."""
    if in_notebook():
        import importlib.util

        if importlib.util.find_spec("ipywidgets") is not None:  # the widget needs it
            from tqdm.notebook import tqdm

            return tqdm
    from tqdm.std import tqdm

    return tqdm
