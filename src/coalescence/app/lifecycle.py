"""A run's lifecycle around its phases: the status it closes with, the archive never left open,
signals and a closed output turned into an orderly stop.

A :class:`Session` is one command's: it holds the signal handling
(:class:`~coalescence._interrupts.Interrupts`) and the engine being written. :meth:`Session.finish`
evaluates a run with signals deferred and closes the archive with the run's status (``complete``,
``failed``, ``interrupted``); :meth:`Session.close_left_open` closes an archive a command left open
(a signal between opening it and the run). What the caller must report is raised as one error
(:class:`RunFailed`: a write after the run started, exit 3 at the command line) or as
:class:`~coalescence._interrupts.Stopped` (a signal) and :class:`~coalescence._interrupts.OutputClosed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._interrupts import STOPPED, Interrupts, OutputClosed, is_broken_pipe
from ..errors import ArchiveError, CoalescenceError

__all__ = ("RunFailed", "Session", "run_blocking", "write_after_run")


def run_blocking(run: Callable[[], Any]) -> Any:
    """``anyio.run(run)``: the run's own event loop, in this thread, or in a worker thread when
    this thread already runs one (a Jupyter cell, code under asyncio or trio), where a second loop
    cannot start; the caller waits for it either way.

    Returns:
        What ``run`` returned (its exception raised here).
    """
    import anyio

    if not _in_event_loop():
        return anyio.run(run)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="coalescence-run") as pool:
        return pool.submit(anyio.run, run).result()


def _in_event_loop() -> bool:
    """Whether this thread runs an asyncio or trio event loop."""
    import asyncio
    import sys

    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return True
        except RuntimeError:
            pass
    return False


class RunFailed(Exception):
    """An archive or output write that failed after the run started (what was flushed stays; the
    same command resumes), wrapping the library error (:attr:`error`)."""

    def __init__(self, error: CoalescenceError) -> None:
        super().__init__(str(error))
        self.error = error


def write_after_run(write: Callable[[], Any], path: Path | str | None, field: str = "out") -> Any:
    """Call ``write`` (the run's documents); a failure is a :class:`RunFailed` naming ``path``.

    Raises:
        RunFailed: ``write`` raised an :class:`~coalescence.errors.ArchiveError` or an ``OSError``.
    """
    try:
        return write()
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {path}: {exc}", field=field)
        raise RunFailed(error) from exc


class Session:
    """One command's lifecycle: its signal handling and the archive it writes.

    Args:
        interrupts: the command's signal handling (a fresh, uninstalled one by default: nothing
            watched, as when a command runs without the CLI's ``main``).

    Attributes:
        run_dir: the archive being written (named when a run is interrupted), or ``None``.
        engine: the engine whose archive is open, or ``None``.
    """

    def __init__(self, interrupts: Interrupts | None = None) -> None:
        self.interrupts = interrupts if interrupts is not None else Interrupts()
        self.run_dir: str | None = None
        self.engine: Any = None

    def track(self, run_dir: Path | str | None, engine: Any) -> None:
        """Record the archive being written and its engine (closed by :meth:`close_left_open`)."""
        self.run_dir, self.engine = (str(run_dir) if run_dir is not None else None), engine

    def finish(self, engine: Any, run: Callable[[], Any]) -> Any:
        """Run ``run`` (an async callable) to its end, closing the engine's archive with its status.

        Signals do not raise while the run or the archive's close is in progress: the first one
        cancels the run inside the event loop, the archive is flushed and closed as ``interrupted``,
        and :class:`~coalescence._interrupts.Stopped` is raised afterwards. A closed standard output
        or error during the run closes the archive the same way and raises
        :class:`~coalescence._interrupts.OutputClosed`.

        Returns:
            What ``run`` returned.

        Raises:
            CoalescenceError: the run's error (the archive closed as ``failed``).
            RunFailed: the archive could not be closed (its last part or manifest not written).
        """
        import anyio

        status = "interrupted"
        with self.interrupts.deferred():
            try:
                result = anyio.run(self.interrupts.run, run)
                if result is not STOPPED:
                    status = "complete"
            except CoalescenceError:
                status = "failed"
                raise
            except Exception as exc:
                if is_broken_pipe(exc):  # e.g. the progress bar on a closed standard error
                    raise OutputClosed() from exc
                raise
            finally:
                progress = engine.progress
                if hasattr(progress, "close"):
                    with contextlib.suppress(OSError):  # a closed stderr must not keep the archive open
                        progress.close()
                try:
                    engine.close(status=status)
                except ArchiveError as exc:
                    raise RunFailed(exc) from exc
        self.interrupts.raise_if_stopped()
        return result

    def close_left_open(self, *, interrupted: bool) -> CoalescenceError | None:
        """Close an archive that a command left open (a signal or a closed output between opening it
        and the run), as :meth:`finish` would have: buffered rows flushed, status recorded, lock released.

        Returns:
            The error closing it raised (for the caller to report), or ``None``.
        """
        engine, self.engine = self.engine, None
        archive = getattr(engine, "archive", None)
        if archive is None or archive.closed:
            return None
        try:
            engine.close(status="interrupted" if interrupted else "failed")
        except CoalescenceError as exc:
            return exc
        return None
