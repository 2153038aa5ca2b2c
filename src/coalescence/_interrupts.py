"""How the command line stops: SIGINT, SIGTERM and a closed output (private to the CLI).

**Signals.** Python runs a signal handler in the main thread between two bytecodes, wherever the
interpreter happens to be. A handler that *raises* (Python's default for SIGINT, and this CLI's
old SIGTERM handler) can land inside the event loop's own machinery: asyncio's ``_run_once`` pops
a ready callback (e.g. the wake-up of a task whose wait was just cancelled) and the exception
leaves before the callback runs. That task never runs again; the loop's shutdown then cancels all
tasks and waits for them forever, while anyio's cancel scope re-delivers its cancellation on every
loop iteration: a busy, endless loop that still holds the archive lock (issue 15, item 5b). So
while the event loop runs, and while the archive is being closed, no signal raises anything:

- the first SIGINT or SIGTERM wakes a watcher task in the loop, which cancels the run with an
  ordinary anyio cancel scope. The model call in flight is waited for (the collator's call is
  shielded; the cancellation reaches its jobs before they are archived, so a resume recomputes
  that one batch), every row the archive took is flushed, the run is closed with status
  ``interrupted``, and the command exits 130 (SIGINT) or 143 (SIGTERM). Outside the run (parsing, model loading, printing) the first
  signal raises :class:`Stopped` at once, as Ctrl-C always did;
- a second signal gives that orderly stop :data:`GRACE_SECONDS` more, then a watchdog thread ends
  the process with ``os._exit`` and the same exit code. The archive is then as after ``kill -9``:
  its renamed parts are intact, buffered rows are lost, the ``flock`` lock dies with the process,
  and a resume recomputes the rest;
- a third signal ends the process at once, the same way;
- after the orderly stop, the CLI's ``main()`` ends the process itself with the first signal's
  code (:meth:`Interrupts.exit_stopped`): further signals change nothing.

Signals reach the watchdog thread as bytes on the interpreter's wake-up file descriptor, so the
escalation works even while the main thread sleeps in ``select`` (a stuck model call) or is
blocked in C code.

**A closed output** (``coalescence ... | head -1``): a write to a pipe whose reader is gone raises
:class:`BrokenPipeError` (Python ignores SIGPIPE). The CLI turns it into exit code 141 (128 +
SIGPIPE, what a shell reports for a process killed by SIGPIPE) with no traceback; during a run, the
archive is closed first, as on SIGTERM. Following the Python documentation's note on SIGPIPE, the
closed stream is pointed at ``/dev/null`` before exiting so the interpreter's final flush cannot
fail again.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio

__all__ = (
    "EXIT_OUTPUT_CLOSED",
    "GRACE_SECONDS",
    "STOPPED",
    "Interrupts",
    "OutputClosed",
    "Stopped",
    "exit_code",
    "is_broken_pipe",
    "quiet_closed_outputs",
    "write_stderr",
)

GRACE_SECONDS = 5.0
"""How long the orderly stop may still take after a second signal before the process exits."""

EXIT_OUTPUT_CLOSED = 141
"""Exit code when standard output (or error) was closed by its reader: 128 + SIGPIPE."""

STOPPED: Any = object()
"""What :meth:`Interrupts.run` returns when a signal cancelled the run."""


class Stopped(KeyboardInterrupt):
    """A signal ended the command (a ``KeyboardInterrupt``, so code that lets Ctrl-C through lets it through).

    Args:
        signum: the first signal received (``signal.SIGINT`` or ``signal.SIGTERM``).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class OutputClosed(Exception):
    """Standard output or error was closed by its reader (exit 141); not an ``OSError`` on purpose,
    so that handlers of write failures of the archive or ``--out`` do not take it for one."""


def exit_code(signum: int) -> int:
    """The exit code of a command ended by ``signum``: 128 + the signal number (130, 143)."""
    return 128 + int(signum)


def is_broken_pipe(exc: BaseException) -> bool:
    """Whether ``exc`` is a :class:`BrokenPipeError`, or an exception group holding one."""
    if isinstance(exc, (BrokenPipeError, OutputClosed)):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(is_broken_pipe(e) for e in exc.exceptions)
    return False


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe or socket whose reader has closed its end (``POLLERR``)."""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def quiet_closed_outputs() -> None:
    """Point standard output, and standard error if its reader is gone too, at ``/dev/null``.

    The Python documentation's recipe for a ``BrokenPipeError``: afterwards nothing the interpreter
    still flushes at exit can raise again.
    """
    for stream, always in ((sys.stdout, True), (sys.stderr, False)):
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # a test's capture object: nothing to redirect
            continue
        if always or _reader_gone(fd):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)


def write_stderr(text: str) -> None:
    """Print one line on standard error; a closed standard error loses it quietly."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _raw_stderr(text: str) -> None:
    """Write to file descriptor 2 directly (safe inside a signal handler or a watchdog thread)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


class Interrupts:
    """The SIGINT/SIGTERM handling of one command (see the module docstring).

    Two parts, so that neither depends on where the main thread happens to be:

    - the Python handler (main thread, between two bytecodes) only raises :class:`Stopped` for
      the first signal when no run is in progress (outside :meth:`deferred`), and does nothing else;
    - a watchdog thread reads every SIGINT/SIGTERM as a byte on the interpreter's signal wake-up
      file descriptor (``signal.set_wakeup_fd``: written by the C-level handler, in whichever thread
      the signal lands, even while the main thread sleeps in the event loop's ``select`` with no
      timeout). It records the first signal and wakes the run's watcher task (:meth:`run`) through a
      socket pair; on the second it starts the grace period, at its end (or at a third signal) it
      ends the process with ``os._exit``.

    Args:
        grace_seconds: how long the orderly stop may take after a second signal.
    """

    def __init__(self, *, grace_seconds: float = GRACE_SECONDS) -> None:
        self.grace_seconds = grace_seconds
        self.signum: int | None = None  # the first SIGINT/SIGTERM received
        self.count = 0  # SIGINT/SIGTERM received (counted by the watchdog)
        self._deferred = 0  # > 0 while the run or the archive's close is in progress: never raise
        self._raised = False
        self._previous: dict[int, Any] = {}
        self._previous_wakeup: int | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._signals_w: int | None = None

    # -- installation ---------------------------------------------------------------------------
    def install(self) -> bool:
        """Install the handlers (main thread only) and start the watchdog; ``False`` elsewhere."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        signals_r, self._signals_w = os.pipe()
        os.set_blocking(self._signals_w, False)
        threading.Thread(target=self._watchdog, args=(signals_r,), name="coalescence watchdog", daemon=True).start()
        self._previous_wakeup = signal.set_wakeup_fd(self._signals_w, warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        """Put the previous handlers back and end the watchdog (unless it is counting down)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._previous_wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._previous_wakeup = None
        if self._signals_w is not None:
            os.close(self._signals_w)  # the watchdog reads end-of-file and returns
            self._signals_w = None
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None

    # -- the handler and the watchdog -------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        # The main thread, between two bytecodes, wherever it is: raise only outside a run.
        if self._deferred == 0 and not self._raised:
            self._raised = True
            raise Stopped(self.signum if self.signum is not None else signum)

    def _watchdog(self, fd: int) -> None:
        deadline: float | None = None
        try:
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([fd], [], [], timeout)
                if not ready:
                    self._exit("the orderly stop did not end in time")
                data = os.read(fd, 64)
                if not data:
                    return  # the command ended: handlers restored
                for signum in data:
                    if signum in (signal.SIGINT, signal.SIGTERM):
                        deadline = self._count(signum, deadline)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _count(self, signum: int, deadline: float | None) -> float | None:
        self.count += 1
        if self.count == 1:
            self.signum = signum
            wake = self._wake_w
            if wake is not None:
                with contextlib.suppress(OSError):
                    wake.send(b"\0")  # the run's watcher cancels the run, inside the event loop
            return deadline
        if self.count == 2:
            _raw_stderr(
                f"coalescence: a second signal ({signal.Signals(signum).name}): still stopping; the process exits in "
                f"{self.grace_seconds:g} s at most (a third signal exits at once)\n"
            )
            return time.monotonic() + self.grace_seconds
        self._exit("a third signal")
        return deadline

    def _exit(self, why: str) -> None:
        code = exit_code(self.signum if self.signum is not None else signal.SIGINT)
        _raw_stderr(
            f"coalescence: {why}: exiting now (code {code}); the archive keeps its complete parts "
            "and its lock is released: run the same command to resume\n"
        )
        os._exit(code)

    # -- the run ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, the first signal cancels the run (:meth:`run`) instead of raising."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    def finish(self) -> None:
        """Keep the handlers until the process exits, never raising again (the command is done)."""
        self._deferred += 1

    def exit_stopped(self, code: int) -> None:
        """End the process with ``code`` after the orderly stop (standard output and error flushed,
        then ``os._exit``): the interpreter's shutdown would put the default signal handlers back,
        and a further signal arriving then would end the process by that signal instead."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    def raise_if_stopped(self) -> None:
        """Raise :class:`Stopped` if a signal arrived (outside :meth:`deferred`)."""
        if self.signum is not None:
            raise Stopped(self.signum)

    async def run(self, run: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``run()``; the first signal cancels it. For ``anyio.run`` inside :meth:`deferred`.

        Returns:
            What ``run()`` returned, or :data:`STOPPED` when a signal cancelled it.

        Raises:
            Exception: what ``run()`` raised, unchanged (not wrapped in an exception group).
        """
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, tg.cancel_scope)
            try:
                outcome["value"] = await run()
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                outcome["error"] = exc
            finally:
                tg.cancel_scope.cancel()  # the run ended (or was cancelled): stop the watcher
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value", STOPPED)

    async def _watch(self, scope: anyio.CancelScope) -> None:
        sock = self._wake_r
        if sock is not None:
            wait = getattr(anyio, "wait_readable", None) or anyio.wait_socket_readable
            while self.signum is None:
                await wait(sock)
                with contextlib.suppress(OSError):
                    sock.recv(64)
        elif self.signum is None:  # no handlers (not the main thread): nothing to watch
            await anyio.sleep_forever()
        scope.cancel()

