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
  archive as one self-contained HTML page (``explain --html PATH`` writes it after the run).

Exit codes, the same for every command (every error is one line on stderr)::

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

Signals and a closed output (mechanics in :mod:`coalescence._interrupts`): the first SIGINT or
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

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._version import __version__
from ._interrupts import (
    EXIT_OUTPUT_CLOSED,
    Interrupts,
    Stopped,
    exit_code,
    is_broken_pipe,
    quiet_closed_outputs,
    write_stderr,
)
from .app.lifecycle import RunFailed, Session, write_after_run
from .errors import ArchiveError, ArchiveWriteError, BatchFailed, CoalescenceError, ConfigError, ReportError

__all__ = ("build_parser", "main")

logger = logging.getLogger("coalescence")

_SESSION: list[Session] = []  # the running command's lifecycle (signals, the archive it writes)


EXIT_CODES = "exit codes:\n" + re.sub(
    r":\w+:`~?([^`]+)`|``([^`]+)``", lambda m: m.group(1) or m.group(2), __doc__.split("::\n\n", 1)[1].rstrip()
)
"""The exit-code table of the module docstring (the ``--help`` epilog)."""


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, keeping the lines of the exit-code table in the epilog."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(("exit codes:", "example:")):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse with the command's error contract: one line naming the option, exit code 2; every
    command's ``--help`` ends with the exit-code table."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        match = re.match(r"argument ([^:]+): (.*)", message, re.S)
        field, text = (match.group(1).split("/")[-1], match.group(2)) if match else ("arguments", message)
        self.exit(2, f"coalescence: error: {field}: {' '.join(text.split())} (see {self.prog} --help)\n")


_EXPLAIN_ONLY = ("method", "budget", "seed", "interactions", "index", "target_stderr", "hierarchy", "top_k", "out", "html")
_RAY = ("workers", "ray_address", "gpus_per_worker", "threads_per_worker")
_NOT_RENDERING = (
    *_EXPLAIN_ONLY, *_RAY, "backend", "vllm_url", "device", "dtype", "batch_size", "utility", "target_span", "target_substring",
    "temperature", "top_p", "num_samples", "max_new_tokens", "archive", "new_run", "flush_rows", "flush_seconds", "skip_corrupt",
    "max_conversations_in_flight",
)  # fmt: skip


def _subcommand(sub: Any, name: str, *, example: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with one example command, then the exit codes."""
    return sub.add_parser(name, epilog=f"example:\n  {example}\n\n{EXIT_CODES}", **kwargs)


def _add_display_options(p: argparse.ArgumentParser) -> None:
    from .app.options import positive_float

    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--progress-every",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="when stderr is not a terminal (a log file, CI): a plain progress line at most this often, "
        "never carriage returns (default: %(default)s)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``coalescence`` command: each run command's options are generated
    from its settings (:mod:`coalescence.app.settings`), grouped in ``--help`` as the settings are."""
    from .app.options import add_options, positive_int, seed
    from .app.settings import ReplaySettings, RunSettings
    from .app.sweeps import SweepSettings
    from .attribution.estimators import METHODS

    parser = _Parser(
        prog="coalescence",
        description="Coalition attribution for language models: how much each part of a chat "
        "conversation drives the model's answer (Shapley-style values, by default in nats of log-probability).",
    )
    parser.add_argument("--version", action="version", version=f"coalescence {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = _subcommand(
        sub,
        "explain",
        example="coalescence explain examples/eiffel.json --unit sentence --out eiffel.json",
        help="attribute an answer to the parts of a conversation",
        description="Attribute the target answer of a chat conversation to its players. INPUT is a "
        'JSON file {"messages": [{"role", "content"}, ...], "target"?}: the last assistant message '
        'is the answer explained, or the "target" string; if the conversation ends on another role '
        "the model generates the answer once, greedily. An existing --archive is resumed: only the "
        "coalitions it lacks are evaluated.",
    )
    ex.add_argument(
        "input",
        metavar="INPUT",
        help="input JSON file (OpenAI chat messages, optionally with declared \"players\", or the RAG "
        'form {"documents", "question", "answer"}), a .jsonl file with one input per line, or a .parquet '
        "dataset with one input per row (a messages column and the optional fields as columns)",
    )
    add_options(ex, RunSettings)
    _add_display_options(ex)

    rp = _subcommand(
        sub,
        "replay",
        example="coalescence replay runs/eiffel --method kernelshap,banzhaf --budget 64",
        help="fit estimators from a run archive, without a model when it covers them",
        description="Fit one or more estimators from the coalitions a run archive holds. With no "
        "--model, every coalition an estimator plans must be in the archive; with --model, the "
        "missing ones are evaluated (and archived) and the rest are served from the archive.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR", help="run archive directory")
    add_options(rp, ReplaySettings)
    _add_display_options(rp)

    sw = _subcommand(
        sub,
        "sweep",
        example="coalescence sweep data.jsonl --methods exact,kernelshap --budgets 64,128 --seeds 0,1 --out sweep/",
        help="benchmark estimators, budgets and seeds on a dataset from one coalition pool",
        description="Evaluate, per conversation of DATASET, the union of the coalitions every "
        "(method, budget, seed) plans, once (one pool feeds every estimator), fit each on its own "
        "plan's coalitions, and write OUT/results.parquet (one row per conversation and cell: values, "
        "evaluations, model and fit time, and the error against exact when exact is among the methods) "
        "and print a summary per method and budget. The same command again resumes: finished "
        "conversations are restored from the archive, with no model call.",
    )
    sw.add_argument(
        "input",
        metavar="DATASET",
        help="a .jsonl file with one input per line, a .parquet dataset, or one input .json file (the explain inputs)",
    )
    add_options(sw, SweepSettings)
    add_options(
        sw,
        RunSettings,
        exclude=_EXPLAIN_ONLY + _RAY,
        help={
            "archive": "run archive directory (default: DIR/archive); resumed if it holds this run",
            "max_conversations_in_flight": "conversations evaluated at once through one scheduler, their coalitions "
            "filling the same batches (bounds memory) (default: %(default)s)",
        },
        defaults={"archive": None},
    )
    _add_display_options(sw)

    rep = _subcommand(
        sub,
        "report",
        example="coalescence report runs/eiffel -o eiffel.html",
        help="write explanations as one self-contained HTML page",
        description="Write the explanations of SOURCE as one self-contained HTML page (no script, no "
        "network request; opens from disk offline): the conversation with each player highlighted by "
        "its value, the answer's tokens, a ranked bar chart and the run's facts. SOURCE is a JSON "
        "document written by explain --out or replay --out (single, JSONL batch, hierarchy, replay), "
        "or a run archive directory, fitted with --method from the coalitions it holds, with no model.",
    )
    rep.add_argument("source", metavar="SOURCE", help="an --out JSON document or a run archive directory")
    rep.add_argument("-o", "--output", metavar="HTML", required=True, help="the HTML file written")
    rep.add_argument(
        "--method", default=None, help=f"run archive: comma-separated methods fitted ({','.join(METHODS)}) (default: the run's method)"
    )
    rep.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="run archive: sampling budget (default: the run's for a one-input run, else 32 x players)",
    )
    rep.add_argument("--seed", type=seed, default=None, help="run archive: seed of the sampling plans (default: the run's)")
    rep.add_argument("--run", default=None, help="run archive: run id (default: the last run)")
    rep.add_argument(
        "--scale",
        choices=("robust", "linear"),
        default="robust",
        help="colour scale: robust (when one value dwarfs the rest, the values below the 90th percentile of "
        "|value| take 80%% of the shades, so they stay apart; the largest is still the darkest) or linear "
        "(default: %(default)s)",
    )

    cm = _subcommand(
        sub,
        "compare",
        example="coalescence compare runs/eiffel --method exact,kernelshap,lasso --budget 64",
        help="compare explanations of one conversation side by side",
        description="Print the values of several explanations of one conversation side by side, players in the "
        "first one's rank order, with each one's agreement with the first (Spearman rank correlation, top-k "
        "overlap) and, where an exact explanation is among them, each one's error against it. SOURCE is an --out "
        "document or a run archive (fitted with no model, as `coalescence report`); one archive with --method a,b,c "
        "compares the methods.",
    )
    cm.add_argument("sources", metavar="SOURCE", nargs="+", help="--out JSON documents or run archive directories")
    cm.add_argument("--method", default=None, help="run archives: comma-separated methods fitted (default: the run's method)")
    cm.add_argument("--budget", type=positive_int, default=None, help="run archives: sampling budget (default: the run's, else 32 x players)")
    cm.add_argument("--seed", type=seed, default=None, help="run archives: seed of the sampling plans (default: the run's)")
    cm.add_argument("--top-k", type=positive_int, default=3, help="k of the top-k overlap (default: %(default)s)")
    cm.add_argument("--conversation", type=int, default=0, metavar="K", help="which conversation of a batch, from 0 (default: 0)")
    cm.add_argument("--out", metavar="JSON", default=None, help="also write the comparison as JSON here")

    sh = _subcommand(
        sub,
        "show",
        example="coalescence show examples/eiffel.json --unit sentence --coalition without:user[1].s2",
        help="print a coalition's prompt exactly as the model reads it",
        description="Print the prompt of one coalition of a conversation as the model reads it (chat template "
        "applied, special tokens spelled out), its token count, and the answer tokens it is scored on. SOURCE is an "
        "input (rendered with --model, --unit and the absence options) or a run archive (its snapshot, policy, "
        "model and date). Only the tokenizer is loaded.",
    )
    sh.add_argument("source", metavar="SOURCE", help="an input file (.json, .jsonl, .parquet) or a run archive directory")
    sh.add_argument(
        "--coalition",
        default="full",
        metavar="SPEC",
        help="full, empty, without:LABEL (every player but LABEL), only:LABEL, or one 0/1 per player in order "
        "(default: %(default)s)",
    )
    sh.add_argument("--conversation", type=int, default=0, metavar="K", help="which conversation of a dataset or snapshot of an archive, from 0 (default: 0)")
    add_options(sh, RunSettings, exclude=_NOT_RENDERING)

    ar = _subcommand(sub, "archive", example="coalescence archive info runs/eiffel", help="inspect or compact a run archive")
    ar_sub = ar.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    info = ar_sub.add_parser("info", help="summary of a run archive")
    info.add_argument("run_dir", metavar="RUN_DIR")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.add_argument("--skip-corrupt", action="store_true", help="skip unreadable parts")
    cp = ar_sub.add_parser("compact", help="merge the parts of a run archive into one, atomically")
    cp.add_argument("run_dir", metavar="RUN_DIR")
    cp.add_argument("--skip-corrupt", action="store_true", help="drop unreadable parts while compacting")
    return parser


def _report(args: argparse.Namespace) -> int:
    from .app.outputs import html_path
    from .app.report import report_source
    from .report import render_report, write_report

    out = html_path(args.output, "output")
    assert out is not None
    methods = [m.strip() for m in args.method.split(",") if m.strip()] if args.method is not None else None
    if methods is not None and not methods:
        raise ConfigError("give at least one method, e.g. --method exact", field="method")
    report = report_source(args.source, methods=methods, budget=args.budget, seed=args.seed, run_id=args.run)
    try:
        page = render_report(report, scale=args.scale)
    except CoalescenceError:
        raise
    except Exception as exc:  # a drawing library's failure: exit 4, one line, not a model failure
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ReportError(f"the report could not be drawn ({type(exc).__name__}: {first})", field="output") from exc
    write_report(out, page, field="output")
    print(f"report: {out}")
    return 0


_FLAGS: dict[str, str] = {}
"""The library's field names (settings, e.g. ``budget``) mapped to the running command's options
(``--budget``); filled by :func:`_command` from the parser of the command it runs."""

_LINE = re.compile(r"^(line \d+: )?(.*)$", re.S)


def _flags_of(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> dict[str, str]:
    """Field name -> option of the subcommand ``argv`` runs (its long option), so a library error about ``budget`` names ``--budget`` and one about ``archive`` names
    ``--archive`` under ``explain`` and ``RUN_DIR`` under ``replay``."""
    out: dict[str, str] = {}
    positional_archive = ""
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = next((a for a in (argv or sys.argv[1:]) if a in action.choices), None)
                if name is not None:
                    stack.append(action.choices[name])
                continue
            if action.option_strings:
                out.setdefault(action.dest, max(action.option_strings, key=len))
            elif action.dest == "run_dir":
                positional_archive = str(action.metavar)
    if "archive" not in out and positional_archive:
        out["archive"] = positional_archive  # replay, archive info/compact: the archive is RUN_DIR
    return out


def _named(field: str | None) -> str | None:
    """The option (or field) an error names, e.g. ``budget`` -> ``--budget``, ``line 3: unit`` ->
    ``line 3: --unit``; input fields such as ``messages[1].content`` stay as they are."""
    if field is None:
        return None
    match = _LINE.match(field)
    assert match is not None
    prefix, name = match.group(1) or "", match.group(2)
    return prefix + _FLAGS.get(name, name)


def _error_line(exc: CoalescenceError) -> str:
    """``coalescence: error: OPTION: message`` on one line, whatever the message holds."""
    field = _named(exc.field)
    text = f"{field}: {exc.message}" if field else exc.message
    return f"coalescence: error: {' '.join(text.split())}"


def _fail(exc: CoalescenceError, code: int) -> int:
    print(_error_line(exc), file=sys.stderr)
    return code


def _quiet_transformers(args: argparse.Namespace) -> None:
    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def _notify(args: argparse.Namespace) -> Any:
    """What the run tells of the model it loads or starts, printed on stderr (``None``: quiet)."""
    if args.no_progress:
        return None
    return lambda line: print(f"coalescence: {line}", file=sys.stderr, flush=True)


def _session() -> Session:
    if not _SESSION:  # a command function called without main(): no handlers, nothing to watch
        _SESSION.append(Session())
    return _SESSION[-1]


def _run_phases(run: Any, args: argparse.Namespace) -> Any:
    """An explain run's or a sweep's phases after its check: the tokenizer and template (every
    coalition rendered, no weights), the weights, snapshots and targets, the archive created or
    resumed, then the run, closed with its status."""
    from .scheduler.progress import TqdmProgress

    _quiet_transformers(args)
    run.preflight()
    run.load(progress=TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every), notify=_notify(args))
    run.open_archive()
    _session().track(run.run_dir, run.engine)
    if run.archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run.run_dir}: {run.resumed_coalitions} coalitions already evaluated", file=sys.stderr)
        if run.archive.results:
            print(f"coalescence: {len(run.archive.results)} conversations finished before are restored, not planned again", file=sys.stderr)
    return _session().finish(run.engine, run.evaluate)


def _explain(args: argparse.Namespace) -> int:
    from .app.explain import ExplainRun
    from .app.options import settings_from
    from .app.settings import RunSettings

    run = ExplainRun(args.input, settings_from(RunSettings, args))  # inputs and settings checked
    explanations = _run_phases(run, args)
    payload = write_after_run(lambda: run.write_out(explanations), run.out_path)
    # the results are written (archive, --out): a report that fails now is exit 4, after the table
    report_failed = None
    try:
        run.write_html(payload)
    except ReportError as exc:
        report_failed = exc
    for k, explanation in enumerate(explanations):
        if run.is_batch:
            print(f"== input {k + 1} of {len(explanations)} (snapshot {run.snapshots[k].snapshot_id[:12]}) ==")
        print(explanation.format_table())
        if run.is_batch:
            print()
    out_path, html = run.out_path, run.html_path if report_failed is None else None
    print(f"archive: {run.run_dir}" + (f"   json: {out_path}" if out_path else "") + (f"   html: {html}" if html else ""))
    if report_failed is not None:
        sys.stdout.flush()
        return _fail(report_failed, 4)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from .app.options import settings_from
    from .app.settings import RunSettings
    from .app.sweeps import SweepRun, SweepSettings

    # no --archive: None, the sweep's default (OUT/archive)
    game = settings_from(RunSettings, args, exclude=_EXPLAIN_ONLY + _RAY)
    run = SweepRun(args.input, settings_from(SweepSettings, args, run=game))
    results = _run_phases(run, args)
    result = write_after_run(lambda: run.write(results), run.out_path)
    print(result.summary)
    print(
        f"conversations {len(results)} ({result.restored_conversations} restored from the archive)   "
        f"model evaluations this session {result.model_evaluations}"
    )
    print(f"results: {result.path}   archive: {result.run_dir}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .app.options import settings_from
    from .app.replay import ReplayRun
    from .app.settings import ReplaySettings
    from .scheduler.progress import TqdmProgress

    settings = settings_from(ReplaySettings, args)
    replay = ReplayRun(args.run_dir, settings)
    if not replay.needs_model or args.model is None:
        explanations = replay.fit()  # with no model; names the missing coalitions when there are some
    else:
        _quiet_transformers(args)
        replay.load(progress=TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every), notify=_notify(args))
        replay.open_archive()
        _session().track(args.run_dir, replay.engine)
        try:
            explanations = _session().finish(replay.engine, replay.evaluate)
        except ArchiveError as exc:
            raise RunFailed(exc) from exc
    write_after_run(lambda: replay.write(explanations), replay.out_path)  # before printing: a closed output must not lose the document
    for explanation in explanations:
        print(explanation.format_table())
        print()
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .app.compare import compare
    from .app.outputs import output_path
    from .archive.writer import write_json_atomic

    out = output_path(args.out, "out")
    methods = [m.strip() for m in args.method.split(",") if m.strip()] if args.method is not None else None
    comparison = compare(args.sources, methods=methods, budget=args.budget, seed=args.seed, top_k=args.top_k, snapshot=args.conversation)
    if out is not None:
        write_after_run(lambda: write_json_atomic(out, comparison.to_dict(), field="out"), out)
    print(comparison.format())
    return 0


def _show(args: argparse.Namespace) -> int:
    from .app.options import settings_from
    from .app.settings import RunSettings
    from .app.show import show_coalition

    settings = settings_from(RunSettings, args, exclude=_NOT_RENDERING)
    print(show_coalition(args.source, args.coalition, settings=settings, index=args.conversation).format())
    return 0


def _archive(args: argparse.Namespace) -> int:
    from .archive.reader import archive_info, format_archive_info
    from .archive.writer import compact

    if args.archive_command == "info":
        info = archive_info(args.run_dir, skip_corrupt=args.skip_corrupt)
        if args.json:
            print(json.dumps(info, indent=2))
            return 0
        print(format_archive_info(info))
        return 0
    before, rows = compact(args.run_dir, skip_corrupt=args.skip_corrupt)
    print(f"compacted {args.run_dir}: {before} parts -> {1 if rows else 0}, {rows} coalitions")
    return 0


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
    _SESSION.append(Session(interrupts))
    try:
        code = _main(argv, interrupts)
    finally:
        _SESSION.pop()
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


def _main(argv: Sequence[str] | None, interrupts: Interrupts) -> int:
    try:
        try:
            code = _command(argv)
        except BaseException as exc:
            interrupts.finish()  # from here on, signals do not raise
            _close_left_open(interrupted=interrupts.signum is not None or is_broken_pipe(exc))
            raise
        interrupts.finish()
        _close_left_open(interrupted=interrupts.signum is not None)
        return code
    except KeyboardInterrupt as exc:  # a first signal while a failure was being reported
        return exit_code(exc.signum if isinstance(exc, Stopped) else signal.SIGINT)
    except Exception as exc:
        if not is_broken_pipe(exc):
            raise
        # the reader of our output is gone (`| head`): end quietly, as SIGPIPE would have
        quiet_closed_outputs()
        return EXIT_OUTPUT_CLOSED


def _close_left_open(*, interrupted: bool) -> None:
    """Close an archive the command left open (:meth:`~coalescence.app.lifecycle.Session.close_left_open`)."""
    error = _session().close_left_open(interrupted=interrupted)
    if error is not None:
        write_stderr(_error_line(error))


def _command(argv: Sequence[str] | None) -> int:
    # third-party loading bars (e.g. GGUF de-quantization) read TQDM_* defaults when tqdm is first
    # imported; our own bar passes its setting explicitly, so this silences only theirs
    os.environ.setdefault("TQDM_DISABLE", "1")
    parser = build_parser()
    _FLAGS.clear()
    _FLAGS.update(_flags_of(parser, argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        sys.stdout.flush()  # --help into a closed pipe: the broken pipe shows here, not at exit
        raise
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    commands = {"explain": _explain, "replay": _replay, "sweep": _sweep, "compare": _compare, "show": _show, "archive": _archive, "report": _report}
    _session().track(None, None)
    try:
        code = commands[args.command](args)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's final flush
        return code
    except RunFailed as exc:  # the exit-code table is in the module docstring
        return _fail(exc.error, 3)
    except BatchFailed as exc:
        return _fail(exc, 1)
    except ArchiveWriteError as exc:
        return _fail(exc, 3)
    except ReportError as exc:
        return _fail(exc, 4)
    except CoalescenceError as exc:
        return _fail(exc, 2)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        where = _session().run_dir
        saved = f"; evaluated coalitions are in {where} (run the same command to resume)" if where else ""
        write_stderr(f"coalescence: {'terminated' if signum == signal.SIGTERM else 'interrupted'}{saved}")
        return exit_code(signum)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
