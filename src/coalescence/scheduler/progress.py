"""Progress reporting: a small protocol the engine calls and the CLI implements."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ("NullProgress", "Progress", "TqdmProgress")


class Progress(Protocol):
    """Receives progress of a run: coalitions planned and finished."""

    def on_planned(self, total: int) -> None:
        """``total`` distinct coalitions will be resolved (evaluated or served from the store)."""
        ...

    def on_finished(self, done: int, total: int) -> None:
        """``done`` of ``total`` coalitions are resolved."""
        ...


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
        """Open the bar with ``total`` steps."""
        from tqdm.auto import tqdm

        self.close()
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
