"""Progress reporting: a small protocol the engine calls and the CLI implements."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ("NullProgress", "Progress", "ProgressTally", "TqdmProgress")


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
    """A tqdm progress bar on stderr (used by the CLI).

    Args:
        desc: the bar's label.
        disable: no bar at all (e.g. ``--no-progress``).
    """

    def __init__(self, desc: str = "coalitions", *, disable: bool = False) -> None:
        self.desc = desc
        self.disable = disable
        self._bar: Any = None

    def on_planned(self, total: int) -> None:
        """Open the bar with ``total`` steps, or raise an open bar's total to ``total``."""
        from tqdm.auto import tqdm

        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()
            return
        self._bar = tqdm(total=total, desc=self.desc, unit="coal", disable=self.disable, leave=False)

    def on_finished(self, done: int, total: int) -> None:
        """Advance the bar to ``done``."""
        if self._bar is not None:
            self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Close the bar if open."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
