"""The ``coalescence`` command line.

- ``coalescence explain INPUT``: attribute a model's answer to the parts of a chat conversation,
  print a ranked table, write the run archive (``--archive``; an existing run is resumed) and the
  JSON document (``--out``).
- ``coalescence replay RUN_DIR --method a,b``: fit estimators from an archive, with no model when
  the archive covers their plans (``--model`` evaluates only what is missing).
- ``coalescence sweep DATASET --methods a,b --budgets 64,128 --seeds 0,1 --out DIR``: every
  (method, budget, seed) fitted from one coalition pool per conversation; ``DIR/results.parquet``
  and a printed summary, with the error against exact when exact is among the methods.
- ``coalescence archive info RUN_DIR`` / ``coalescence archive compact RUN_DIR``.
- ``coalescence report SOURCE -o report.html``: the explanations of an ``--out`` document or a run
  archive as one self-contained HTML page (``explain --html PATH`` writes it after the run);
  ``--image chart.png`` (or ``.svg``) writes its ranked bar chart as an image.
- ``coalescence compare A B ...``: explanations of one conversation side by side, with their
  agreement (``--out`` JSON, ``--html`` one self-contained page).
- ``coalescence evaluate RUN_OR_DOC``: an explanation's faithfulness on fresh exact coalitions of
  its game (LDS with a bootstrap interval; top-k removal drops against random k), the coalitions
  archived in the run archive for later evaluations and replays.

Exit codes, the same for every command (every error is one line on stderr): see
:mod:`coalescence.cli.exit_codes` (and the end of every ``--help``). The package: :mod:`.parser`
(the arguments, generated from the settings), :mod:`.commands` (what each command calls and
prints), :mod:`.messages` (errors as one line naming the option), :mod:`.reference` (writes
docs/cli.md, every command's ``--help``: ``python -m coalescence.cli.reference``), and here
``main`` (signals, the exit code).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from .._interrupts import EXIT_OUTPUT_CLOSED, Interrupts, Stopped, exit_code, is_broken_pipe, quiet_closed_outputs, write_stderr
from ..app.lifecycle import RunFailed, Session
from ..errors import CoalescenceError
from .commands import COMMANDS
from .exit_codes import EXIT_CODES, error_exit_code
from .messages import FLAGS, error_line, fail, flags_of
from .parser import build_parser

__all__ = ("EXIT_CODES", "build_parser", "main")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring).

    Args:
        argv: the arguments; ``None`` (the console script, ``python -m coalescence``) reads
            ``sys.argv`` and keeps the signal handlers until the process exits, so that a late
            signal during the interpreter's shutdown cannot raise either, and after a signal
            stopped the command it ends the process with that code itself (outputs flushed,
            ``os._exit``), so a further signal cannot change the exit status; a caller passing
            ``argv`` gets its own handlers back on return.
    """
    interrupts = Interrupts()
    interrupts.install()
    try:
        with Session(interrupts).running():
            code = _main(argv)
    finally:
        if argv is None:
            interrupts.finish()
        else:
            interrupts.restore()
    if argv is None and interrupts.signum is not None:
        # the orderly stop is over and its line printed: end here, so that a further signal
        # cannot reach the default handlers the interpreter's shutdown puts back (a death by
        # that signal instead of this exit status)
        interrupts.exit_stopped(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    try:  # the command, then its archive closed if it was left open (the error closing it printed)
        return Session.current().conclude(lambda: _command(argv), report=lambda error: write_stderr(error_line(error)))
    except KeyboardInterrupt as exc:  # a first signal while a failure was being reported
        return exit_code(exc.signum if isinstance(exc, Stopped) else signal.SIGINT)
    except Exception as exc:
        if not is_broken_pipe(exc):
            raise
        # the reader of our output is gone (`| head`): end quietly, as SIGPIPE would have
        quiet_closed_outputs()
        return EXIT_OUTPUT_CLOSED


def _command(argv: Sequence[str] | None) -> int:
    # third-party loading bars (e.g. GGUF de-quantization) read TQDM_* defaults when tqdm is first
    # imported; our own bar passes its setting explicitly, so this silences only theirs
    os.environ.setdefault("TQDM_DISABLE", "1")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        sys.stdout.flush()  # --help into a closed pipe: the broken pipe shows here, not at exit
        raise
    FLAGS.clear()
    FLAGS.update(flags_of(parser, args))
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Session.current().track(None, None)
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's final flush
        return code
    except RunFailed as exc:  # a write after the run started (exit_codes)
        return fail(exc.error, 3)
    except CoalescenceError as exc:
        return fail(exc, error_exit_code(exc))
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        where = Session.current().run_dir
        saved = f"; evaluated coalitions are in {where} (run the same command to resume)" if where else ""
        write_stderr(f"coalescence: {'terminated' if signum == signal.SIGTERM else 'interrupted'}{saved}")
        return exit_code(signum)
