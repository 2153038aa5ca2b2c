"""Exit codes, the same for every command (every error is one line on stderr)::

    0    success
    1    a model failure during the run (the model raised, or gave non-finite output);
         what was evaluated stays in the archive
    2    bad input or settings, including a damaged or foreign archive: refused before
         anything is written (the line names the field or file and the fix); also a chat
         template that refuses a coalition first met during a run of more than 4,096
         coalitions (what was evaluated stays in the archive)
    3    the archive or an output file could not be written after the run started (disk
         full, I/O error): what was flushed stays, the manifest says what happened, and
         the same command resumes once the cause is fixed
    4    the HTML report could not be drawn or written after the run's results were
         (the archive and --out are complete and kept; coalescence report RUN_DIR -o PATH
         makes it again)
    130  interrupted (SIGINT)
    141  standard output closed (e.g. piped into head)
    143  terminated (SIGTERM)

Signals and a closed output: the first SIGINT or
SIGTERM during a run cancels it inside the event loop (a signal handler never raises there): the
model call in flight is waited for (its rows are recomputed on resume), every row the archive took
is flushed, the run is closed with status ``interrupted``, exit 130 or 143; outside a run (loading, printing) it stops the command at once. A second signal
gives that stop 5 more seconds, then the process exits anyway (the same exit code), leaving the
archive as ``kill -9`` would (complete parts intact, buffered rows lost, the lock released with
the process, a resume recomputes the rest); a third signal exits at once. A write to a closed
standard output (or error) ends any command quietly with 141, no traceback; during a run the
archive is closed first, as on SIGTERM.
"""

from __future__ import annotations

import re

from ..errors import ArchiveWriteError, BatchFailed, CoalescenceError, ReportError

__all__ = ("EXIT_CODES", "error_exit_code")

EXIT_CODES = "exit codes:\n" + re.sub(
    r":\w+:`~?([^`]+)`|``([^`]+)``", lambda m: m.group(1) or m.group(2), (__doc__ or "").split("::\n\n", 1)[1].rstrip()
)
"""The exit-code table of the module docstring (every command's ``--help`` epilog)."""


def error_exit_code(exc: CoalescenceError) -> int:
    """The exit code of a library error that ends a command (the table above)."""
    return 1 if isinstance(exc, BatchFailed) else 3 if isinstance(exc, ArchiveWriteError) else 4 if isinstance(exc, ReportError) else 2
