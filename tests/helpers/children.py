"""Code for a child ``python -c`` process: the real CLI with a slowed model call, so that a signal
or a kill lands mid-run. Only the test's child process is patched, never the library."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def slow_child(seconds: float = 0.04, *, then: str = "") -> str:
    """The child's source: ``HFBackend.score`` sleeps ``seconds`` (and runs the statement ``then``)
    before each call, then ``coalescence.cli.main(sys.argv[1:])`` runs and its code is the exit code."""
    after = f"; {then}" if then else ""
    return f"""
import sys, time
from coalescence.backends.hf import HFBackend
_score = HFBackend.score
def slow(self, requests):
    time.sleep({seconds}){after}
    return _score(self, requests)
HFBackend.score = slow
from coalescence.cli import main
sys.exit(main(sys.argv[1:]))
"""


SLOW_CHILD = slow_child()
"""The resume tests' child: 40 ms per model call."""


def kill_when(argv: list[str], ready: Callable[[], bool], *, timeout: float, child: str = SLOW_CHILD, env: dict[str, str] | None = None) -> int:
    """Run ``python -c child ARGV`` (stdout dropped), SIGKILL it as soon as ``ready()`` holds (polled
    every 5 ms) and return its exit status. Fails, with the child's stderr, if the child exits
    first, or if ``timeout`` seconds pass."""
    process = subprocess.Popen(
        [sys.executable, "-c", child, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    return process.returncode


def parts_written(run_dir: Path, at_least: int) -> Callable[[], bool]:
    """``ready`` for :func:`kill_when`: the run archive at ``run_dir`` holds ``at_least`` parts."""
    from coalescence.archive import list_parts

    return lambda: len(list_parts(run_dir)) >= at_least
