"""The ``coalescence`` command line called in this process, its output captured."""

from __future__ import annotations

import contextlib
import io

from coalescence.cli import main


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``coalescence ARGV`` in this process: (exit code, stdout, stderr). Usable outside a test's
    ``capsys``; an argparse refusal (``SystemExit`` from the parser) returns its code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def run_cli_quiet(argv: list[str]) -> tuple[int, str, str]:
    """:func:`run_cli` with ``--no-progress`` appended (no progress bar on the captured stderr)."""
    return run_cli([*argv, "--no-progress"])
