"""The commands: each parses nothing and decides nothing, it calls the application layer
(:mod:`coalescence.app`) and prints what comes back."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..app.lifecycle import RunFailed, Session, write_after_run
from ..errors import ArchiveError, ReportError
from .messages import fail

__all__ = ("COMMANDS", "SESSIONS", "session")


SESSIONS: list[Session] = []  # the running command's lifecycle (signals, the archive it writes)


def session() -> Session:
    if not SESSIONS:  # a command function called without main(): no handlers, nothing to watch
        SESSIONS.append(Session())
    return SESSIONS[-1]


def _quiet_transformers(args: argparse.Namespace) -> None:
    """Third-party loading noise off unless ``--verbose``: transformers' warnings and bars, and
    vLLM's start-up (its INFO/WARNING log of the engine's configuration, a logged traceback of a
    chat-template warm-up it cannot do without a tokenizer, deprecation warnings of its imports,
    torch's C++ NUMA note); their errors stay, and so do coalescence's own warnings."""
    if not args.verbose:
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


def _notify(args: argparse.Namespace) -> Any:
    """What the run tells of the model it loads or starts, printed on stderr (``None``: quiet)."""
    if args.no_progress:
        return None
    return lambda line: print(f"coalescence: {line}", file=sys.stderr, flush=True)


def _run_phases(run: Any, args: argparse.Namespace) -> Any:
    """An explain run's or a sweep's phases after its check: the tokenizer and template (every
    coalition rendered, no weights), the weights, snapshots and targets, the archive created or
    resumed, then the run, closed with its status."""
    from ..scheduler.progress import TqdmProgress

    _quiet_transformers(args)
    run.preflight()
    run.load(progress=TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every), notify=_notify(args))
    run.open_archive()
    session().track(run.run_dir, run.engine)
    if run.archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run.run_dir}: {run.resumed_coalitions} coalitions already evaluated", file=sys.stderr)
        if run.archive.results:
            print(f"coalescence: {len(run.archive.results)} conversations finished before are restored, not planned again", file=sys.stderr)
    return session().finish(run.engine, run.evaluate)


def _explain(args: argparse.Namespace) -> int:
    from ..app.explain import ExplainRun
    from ..app.options import settings_from
    from ..app.settings import RunSettings

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
        return fail(report_failed, 4)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from ..app.options import settings_from
    from ..app.sweeps import RUN_OPTIONS, SweepRun, SweepSettings

    run = SweepRun(args.input, settings_from(SweepSettings, args, run=RUN_OPTIONS.settings(args)))
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
    from ..app.options import settings_from
    from ..app.replay import ReplayRun
    from ..app.settings import ReplaySettings
    from ..scheduler.progress import TqdmProgress

    settings = settings_from(ReplaySettings, args)
    replay = ReplayRun(args.run_dir, settings)
    if not replay.needs_model or args.model is None:
        explanations = replay.fit()  # with no model; names the missing coalitions when there are some
    else:
        _quiet_transformers(args)
        replay.load(progress=TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every), notify=_notify(args))
        replay.open_archive()
        session().track(args.run_dir, replay.engine)
        try:
            explanations = session().finish(replay.engine, replay.evaluate)
        except ArchiveError as exc:
            raise RunFailed(exc) from exc
    write_after_run(lambda: replay.write(explanations), replay.out_path)  # before printing: a closed output must not lose the document
    for explanation in explanations:
        print(explanation.format_table())
        print()
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..app.options import settings_from
    from ..app.report import ReportSettings, write_report_files

    write_report_files(args.source, settings_from(ReportSettings, args), written=lambda what, path: print(f"{what}: {path}"))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from ..app.compare import CompareSettings, compare_files
    from ..app.options import settings_from

    settings = settings_from(CompareSettings, args)
    print(compare_files(args.sources, settings).format())
    if settings.html is not None:
        print(f"html: {Path(settings.html)}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from ..app.evaluate import evaluate_source
    from ..app.options import settings_from
    from ..app.settings import EvaluateSettings
    from ..scheduler.progress import TqdmProgress

    settings = settings_from(EvaluateSettings, args)
    _quiet_transformers(args)
    progress = TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every)
    evaluation = evaluate_source(args.source, settings, progress=progress)
    print(evaluation.format())
    if settings.out is not None:
        print(f"json: {settings.out}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from ..app.show import RENDER_OPTIONS, show_coalition

    print(show_coalition(args.source, args.coalition, settings=RENDER_OPTIONS.settings(args), index=args.conversation).format())
    return 0


def _archive(args: argparse.Namespace) -> int:
    from ..archive.reader import archive_info, format_archive_info
    from ..archive.writer import compact

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


COMMANDS = {"explain": _explain, "replay": _replay, "sweep": _sweep, "compare": _compare, "evaluate": _evaluate, "show": _show, "archive": _archive, "report": _report}
"""The subcommands' functions by name: ``function(args) -> exit code``."""
