"""A command that read an archive exits with its own code, never aborted at interpreter exit.

The rule: after a read, no native thread may still need the interpreter while it exits. Arrow's
worker threads used to drop the last reference to a part's bytes (Python ``bytes`` wrapped in a
``pa.BufferReader``) after the read had returned; freeing them takes the GIL, and a thread that asks
for it while the interpreter finalises is ended with ``pthread_exit``, whose unwinding through
Arrow's C++ destructor calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, exit 134, after the correct output (a core dump showed ``arrow::py::PyBuffer::~PyBuffer``
in an Arrow worker). Measured before the fix: 5 aborts in 228 ``coalescence replay`` runs (2.2%)
of a real archive; the issue saw 2 of 47 replays and 4 of 71 refusals. Each child below reads a
three-part archive and is refused on a damaged copy (the good parts are decoded before the damaged
one is met). N = 60 keeps the test near a minute on a loaded machine; at the measured 2.2% rate
P(no abort before the fix) = 0.978^60 = 26%, so a single pass proves little: it is a guard that
fails about three times in four before the fix, not a proof (after the fix: 0 of 200 replays aborted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers.archive_rows import seven_rows

from coalescence.archive import RunArchive, list_parts

RUN = {"snapshot_ids": ["a" * 64], "model": {"id": "m"}, "utility": {"kind": "logprob"}, "absence_policy": {"id": "drop"}}
CHILD = """
import sys
from coalescence.archive import read_rows
from coalescence.errors import ArchiveError
assert read_rows(sys.argv[1]).num_rows == 7
try:
    read_rows(sys.argv[2])
except ArchiveError as exc:
    assert "is corrupt" in str(exc), exc
else:
    raise SystemExit("the damaged part was not refused")
print("ok", flush=True)
"""
N = 60


def test_reads_and_refusals_never_abort_at_interpreter_exit(tmp_path: Path) -> None:
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    for path in (good, damaged):
        archive = RunArchive.create(path, RUN, flush_rows=3)
        for i, row in enumerate(seven_rows()):
            archive.append({**row, "evaluation_key": f"{i:064x}", "token_logprobs": [-0.25 * i, -1.5]})
        archive.close()
    last = list_parts(damaged)[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x01
    last.write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def child(_: int) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-c", CHILD, str(good), str(damaged)], capture_output=True, text=True, env=env, timeout=60)
        return done.returncode, done.stdout + done.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(child, range(N)))
    failed = [(code, text) for code, text in results if code != 0 or text.strip() != "ok"]
    assert not failed, f"{len(failed)} of {N} children failed, e.g. exit {failed[0][0]}: {failed[0][1][-300:]}"
