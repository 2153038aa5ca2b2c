"""Code for a child ``python -c`` process: the real CLI with a slowed model call, so that a signal
or a kill lands mid-run. Only the test's child process is patched, never the library."""

from __future__ import annotations


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
