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

__all__ = ("COMMANDS",)


def _progress(args: argparse.Namespace) -> Any:
    """The run's progress bar on stderr, third-party loading noise off first unless ``--verbose``."""
    from ..app.lifecycle import quiet_third_party
    from ..scheduler.progress import TqdmProgress

    if not args.verbose:
        quiet_third_party()
    return TqdmProgress("coalitions", disable=args.no_progress, interval=args.progress_every)


def _notify(args: argparse.Namespace) -> Any:
    """What the run tells of the model it loads or starts, printed on stderr (``None``: quiet)."""
    if args.no_progress:
        return None
    return lambda line: print(f"coalescence: {line}", file=sys.stderr, flush=True)


def _run_phases(run: Any, args: argparse.Namespace) -> Any:
    """An explain run's or a sweep's phases after its check: the tokenizer and template (every
    coalition rendered, no weights), the weights, snapshots and targets, the archive created or
    resumed, then the run, closed with its status."""
    progress = _progress(args)
    run.preflight()
    Session.current().start(run, progress=progress, notify=_notify(args))
    if run.archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run.run_dir}: {run.resumed_coalitions} coalitions already evaluated", file=sys.stderr)
        if run.archive.results:
            print(f"coalescence: {len(run.archive.results)} conversations finished before are restored, not planned again", file=sys.stderr)
    return Session.current().finish(run.engine, run.evaluate)


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
    from ..app.explain import ExplainRun
    from ..app.sweeps import RUN_OPTIONS, SweepPhases, SweepSettings

    settings = settings_from(SweepSettings, args, run=RUN_OPTIONS.settings(args))
    phases = SweepPhases(settings)
    run = ExplainRun(args.input, settings.run, phases=phases)
    results = _run_phases(run, args)
    print(write_after_run(lambda: phases.write(run, results), run.out_path).format())
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ..app.options import settings_from
    from ..app.replay import ReplayRun
    from ..app.settings import ReplaySettings

    replay = ReplayRun(args.run_dir, settings_from(ReplaySettings, args))
    if not replay.needs_model or args.model is None:
        explanations = replay.fit()  # with no model; names the missing coalitions when there are some
    else:
        Session.current().start(replay, progress=_progress(args), notify=_notify(args))
        try:
            explanations = Session.current().finish(replay.engine, replay.evaluate)
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

    settings = settings_from(EvaluateSettings, args)
    print(evaluate_source(args.source, settings, progress=_progress(args), notify=_notify(args)).format())
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
        print(json.dumps(info, indent=2) if args.json else format_archive_info(info))
        return 0
    before, rows = compact(args.run_dir, skip_corrupt=args.skip_corrupt)
    print(f"compacted {args.run_dir}: {before} parts -> {1 if rows else 0}, {rows} coalitions")
    return 0


COMMANDS = {"explain": _explain, "replay": _replay, "sweep": _sweep, "compare": _compare, "evaluate": _evaluate, "show": _show, "archive": _archive, "report": _report}
"""The subcommands' functions by name: ``function(args) -> exit code``."""
