"""shapiq in another Python: a worker process (``_worker.py``) that runs the approximators of a
newer shapiq than this Python can install, answering one JSON line per request."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ....errors import BackendUnavailable, EstimatorError
from ..base import library_seed
from .inprocess import _cannot_run, _outside, _Run

if TYPE_CHECKING:
    from .estimator import ShapiqEstimator

__all__ = ("ENV_PYTHON", "LINK_NAME", "NEWER_APPROXIMATORS", "ExternalShapiq", "external_shapiq")


ENV_PYTHON = "COALESCENCE_SHAPIQ_PYTHON"
"""Environment variable: the path of a Python interpreter whose shapiq runs the approximators the
shapiq installed here lacks (:func:`external_shapiq`)."""

LINK_NAME = "coalescence-shapiq-python"
"""Without :data:`ENV_PYTHON`, an interpreter (or a link to one) of this name beside this Python's
executable is the external shapiq's (``make install`` links ``.venv-shapiq``'s Python there)."""

NEWER_APPROXIMATORS = frozenset({"RegressionMSR", "ProxySHAP", "LeverageSHAP", "PolySHAP", "OddSHAP"})
"""Approximators of shapiq 1.5 and later (Python >= 3.12), not in 1.4.1, the newest shapiq for Python 3.11."""


def external_shapiq() -> ExternalShapiq | None:
    """The external shapiq: a Python interpreter, named by :data:`ENV_PYTHON` or found as
    :data:`LINK_NAME` beside this Python's executable, that runs shapiq in a worker process
    (``_worker.py``). It lets a Python 3.11 install (this project's torch build) use the
    approximators of shapiq 1.5+ (RegressionMSR, ProxySHAP, LeverageSHAP, ...), which need Python
    3.12: the adapter only needs shapiq to draw a plan from a stand-in game and to replay it on the
    pool, both plain numbers, so the model never leaves this process.

    Returns:
        the worker's handle (one per interpreter path per process, started on first use), or
        ``None`` when none is set up.

    Raises:
        BackendUnavailable: :data:`ENV_PYTHON` names no executable file.
    """
    import os
    import sys
    from pathlib import Path

    path = os.environ.get(ENV_PYTHON, "").strip()
    if path:
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            raise BackendUnavailable(f"{ENV_PYTHON}={path} is not an executable Python; point it at a Python >= 3.12 that has shapiq")
    else:
        link = Path(sys.executable).parent / LINK_NAME
        if not link.exists():
            return None
        path = str(link)
    return _external(path)


@functools.cache
def _external(path: str) -> ExternalShapiq:
    return ExternalShapiq(path)


class ExternalShapiq:
    """shapiq in another interpreter: a worker process (``_worker.py``) answering one JSON
    line per request on its standard input and output; started on first use, restarted after a
    fork, ended with this process (its input closes).

    Args:
        python: the interpreter's path.

    Raises (from its methods):
        BackendUnavailable: the worker does not start, dies, or lacks shapiq (with its last
            error line).
    """

    def __init__(self, python: str) -> None:
        import threading

        self.python = python
        self.key = f"external:{python}"
        self._proc: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        self._described: dict[str, Any] | None = None

    def _start(self) -> Any:
        import os
        import subprocess
        import tempfile
        from pathlib import Path

        worker = Path(__file__).with_name("_worker.py")
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        try:
            proc = subprocess.Popen(
                [self.python, "-I", str(worker)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                env=env,
                start_new_session=True,  # the user's Ctrl-C is this process's to handle; EOF ends it
            )
        except OSError as exc:
            raise BackendUnavailable(f"{ENV_PYTHON}: cannot start {self.python}: {exc.strerror}") from None
        if not self._pid:
            import atexit

            atexit.register(self.close)
        self._pid = os.getpid()
        return proc

    def close(self) -> None:
        """End the worker (its input closes, it exits); the next request starts another."""
        import os
        import subprocess

        proc, self._proc = self._proc, None
        if proc is None or self._pid != os.getpid():
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()
        self._stderr.close()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        import json
        import os

        with self._lock:
            if self._proc is None or self._pid != os.getpid() or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                self._proc.wait(timeout=10)
                self._stderr.seek(0)
                last = [ln for ln in self._stderr.read().splitlines() if ln.strip()][-1:] or ["no output"]
                self._stderr.close()
                for stream in (self._proc.stdin, self._proc.stdout):
                    try:
                        stream.close()
                    except OSError:  # a broken pipe's unflushed line
                        pass
                self._proc = None
                raise BackendUnavailable(
                    f"the external shapiq ({self.python}) stopped: {last[0].strip()}; it needs a Python >= 3.12 with shapiq "
                    f"(set {ENV_PYTHON}, or run `make install`)"
                )
            return json.loads(line)

    def _describe(self) -> dict[str, Any]:
        if self._described is None:
            answer = self._ask({"op": "describe"})
            if "error" in answer:
                raise BackendUnavailable(f"the external shapiq ({self.python}) failed: {answer['error']}")
            self._described = answer
        return self._described

    def names(self) -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
        """name -> (valid indices, constructor parameters) of the external shapiq's approximators."""
        return {name: (frozenset(d["valid_indices"]), tuple(d["params"])) for name, d in self._describe()["approximators"].items()}

    def describe(self, name: str) -> tuple[frozenset[str], tuple[str, ...]]:
        return self.names()[name]

    def version(self) -> str:
        d = self._describe()
        return f"shapiq {d['version']} (Python {d['python']}, {self.python})"

    def run(self, est: ShapiqEstimator, n: int, budget: int, lookup: dict[bytes, float] | None) -> _Run:
        pool = None
        if lookup is not None:
            pool = {}
            for key, value in lookup.items():
                if len(key) * 8 >= n and np.isfinite(value):
                    bits = np.unpackbits(np.frombuffer(key, dtype=np.uint8), bitorder="little")[:n]
                    pool["".join("1" if b else "0" for b in bits)] = float(value)
        answer = self._ask(
            {
                "op": "run",
                "name": est.approximator,
                "n": n,
                "seed": library_seed(est.seed),
                "options": est._options(n),
                "budget": budget,
                "order": est.interactions,
                "pool": pool,
            }
        )
        if "error" in answer:
            if answer["kind"] == "config":
                raise _cannot_run(est, n, answer["error"])
            if answer["kind"] == "outside":
                raise EstimatorError(_outside(est.name))
            raise EstimatorError(f"{est.name} failed in the external shapiq: {answer['error']}")
        rows = np.array([[c == "1" for c in b] for b in answer["asked"]], dtype=bool).reshape(-1, n)
        values = np.asarray(answer["values"], dtype=np.float64)
        terms = tuple((tuple(players), float(value)) for players, value in answer["terms"])
        return rows, values, terms
