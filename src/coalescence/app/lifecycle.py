"""A run's lifecycle around its phases: the status it closes with, the archive never left open,
signals and a closed output turned into an orderly stop.

A :class:`Session` is one command's (:meth:`Session.current`): it holds the signal handling
(:class:`~coalescence._interrupts.Interrupts`) and the engine being written. :meth:`Session.start`
loads a run's model and opens its archive; :meth:`Session.finish` evaluates the run with signals
deferred and closes the archive with the run's status (``complete``, ``failed``, ``interrupted``);
:meth:`Session.conclude` runs a whole command and closes an archive it left open (a signal between
opening it and the run). What the caller must report is raised as one error
(:class:`RunFailed`: a write after the run started, exit 3 at the command line) or as
:class:`~coalescence._interrupts.Stopped` (a signal) and :class:`~coalescence._interrupts.OutputClosed`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from .._interrupts import STOPPED, Interrupts, OutputClosed, is_broken_pipe
from ..errors import ArchiveError, CoalescenceError

__all__ = ("RunFailed", "Session", "quiet_third_party", "run_blocking", "write_after_run")


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


def quiet_third_party() -> None:
    """Third-party loading noise off, for a command line (the library itself never calls this: it
    sets no levels): transformers' warnings and bars, and vLLM's start-up (its INFO/WARNING log of
    the engine's configuration, a logged traceback of a chat-template warm-up it cannot do without
    a tokenizer, deprecation warnings of its imports, torch's C++ NUMA note); their errors stay,
    and so do coalescence's own warnings."""
    import logging
    import os
    import warnings

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # what it logs while importing, before its own configuration
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm\.")


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

    _running: ClassVar[list[Session]] = []  # the commands running, the innermost last

    def __init__(self, interrupts: Interrupts | None = None) -> None:
        self.interrupts = interrupts if interrupts is not None else Interrupts()
        self.run_dir: str | None = None
        self.engine: Any = None

    @classmethod
    def current(cls) -> Session:
        """The running command's session (the innermost :meth:`running`); with none running (a
        command function called without the CLI's ``main``), one that watches nothing."""
        if not cls._running:
            cls._running.append(cls())
        return cls._running[-1]

    @contextlib.contextmanager
    def running(self) -> Iterator[Session]:
        """This session as :meth:`current` while the block runs."""
        self._running.append(self)
        try:
            yield self
        finally:
            self._running.pop()

    def track(self, run_dir: Path | str | None, engine: Any) -> None:
        """Record the archive being written and its engine (closed by :meth:`close_left_open`)."""
        self.run_dir, self.engine = (str(run_dir) if run_dir is not None else None), engine

    def start(self, run: Any, *, progress: Any = None, notify: Callable[[str], None] | None = None) -> None:
        """Load the model of ``run`` (an explain run, a sweep, a replay) and open its archive (created
        or resumed), tracked here from then on (:meth:`track`) until :meth:`finish` closes it."""
        run.load(progress=progress, notify=notify)
        run.open_archive()
        self.track(run.run_dir, run.engine)

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

    def conclude(self, command: Callable[[], Any], *, report: Callable[[CoalescenceError], Any]) -> Any:
        """Run ``command`` (a whole command); after it, returned or raised, signals no longer raise
        (:meth:`~coalescence._interrupts.Interrupts.finish`) and an archive it left open is closed
        (:meth:`close_left_open`: ``interrupted`` after a signal or a closed output, else ``failed``),
        an error closing it given to ``report``.

        Returns:
            What ``command`` returned (its exception raised here).
        """

        def close(interrupted: bool) -> None:
            self.interrupts.finish()
            error = self.close_left_open(interrupted=interrupted or self.interrupts.signum is not None)
            if error is not None:
                report(error)

        try:
            result = command()
        except BaseException as exc:
            close(is_broken_pipe(exc))
            raise
        close(False)
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
