"""The ``coalescence`` command line.

- ``coalescence explain INPUT``: attribute a model's answer to the parts of a chat conversation,
  print a ranked table, write the run archive (``--archive``; an existing run is resumed) and the
  JSON document (``--out``).
- ``coalescence replay RUN_DIR --method a,b``: fit estimators from an archive, with no model when
  the archive covers their plans (``--model`` evaluates only what is missing).
- ``coalescence archive info RUN_DIR`` / ``coalescence archive compact RUN_DIR``.
- ``coalescence report SOURCE -o report.html``: the explanations of an ``--out`` document or a run
  archive as one self-contained HTML page (``explain --html PATH`` writes it after the run).

Exit codes, the same for every command (every error is one line on stderr)::

    0    success
    1    a model failure during the run (the model raised, or gave non-finite output);
         what was evaluated stays in the archive
    2    bad input or settings, including a damaged or foreign archive: refused before
         anything is written (the line names the field or file and the fix)
    3    the archive or an output file could not be written after the run started (disk
         full, I/O error): what was flushed stays, the manifest says what happened, and
         the same command resumes once the cause is fixed
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
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from ._interrupts import (
    EXIT_OUTPUT_CLOSED,
    STOPPED,
    Interrupts,
    OutputClosed,
    Stopped,
    exit_code,
    is_broken_pipe,
    quiet_closed_outputs,
    write_stderr,
)
from .errors import ArchiveError, ArchiveWriteError, BatchFailed, CoalescenceError, ConfigError, EstimatorError

__all__ = ("build_parser", "main")

logger = logging.getLogger("coalescence")

_UNBUDGETED = ("exact", "loo")
_STATE: dict[str, Any] = {}  # the command's Interrupts, and the run directory and engine being written


EXIT_CODES = "exit codes:\n" + __doc__.split("::\n\n", 1)[1].rstrip()
"""The exit-code table of the module docstring (the ``--help`` epilog)."""


class _RunFailed(Exception):
    """An archive or output write failure after the run started (exit 3), wrapping the library error."""

    def __init__(self, error: CoalescenceError) -> None:
        super().__init__(str(error))
        self.error = error


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, keeping the lines of the exit-code table in the epilog."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit codes:"):
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _add_model_options(p: argparse.ArgumentParser, *, default: str | None) -> None:
    p.add_argument(
        "--model",
        default=default,
        help="model alias (smollm2-135m), local model directory, .gguf file or hub id"
        + (" (default: %(default)s)" if default else " (replay: evaluate coalitions the archive lacks)"),
    )
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype (default: %(default)s)"
    )
    p.add_argument("--batch-size", type=_positive_int, default=4, help="rows per model call (default: %(default)s)")


def _add_archive_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flush-rows", type=_positive_int, default=4096, help="rows per archive part (default: %(default)s)")
    p.add_argument(
        "--flush-seconds",
        type=_positive_float,
        default=30.0,
        help="longest time evaluated rows wait before a part is written (default: %(default)s)",
    )
    p.add_argument("--skip-corrupt", action="store_true", help="skip unreadable archive parts (they are re-evaluated)")


_UTILITY_HELP = (
    "what v(S) measures. Teacher forcing of the fixed answer: logprob (log p of the answer, nats), "
    "mean_logprob (per token, nats), logit_prob (log-odds of p, as in ContextCite), prob (p). "
    "Regenerate-and-compare (the model answers each coalition anew; similarity to the original "
    "answer): exact_match, token_f1, rouge_l, embedding_cosine (needs the embedding extra)"
)


def _add_span_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target-span",
        metavar="START:END",
        default=None,
        help="teacher-forced utilities: score only the answer tokens overlapping characters "
        "START:END of the answer (0-based, END exclusive; a span that cuts a token includes the whole "
        "token; the end-of-turn token is scored with the whole answer only) (default: the whole answer)",
    )
    p.add_argument(
        "--target-substring",
        metavar="TEXT",
        default=None,
        help="teacher-forced utilities: score only the answer tokens of the first occurrence of TEXT",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``coalescence`` command."""
    from .attribution.estimators import METHODS
    from .conversation import ROLES, UNITS
    from .masking.policies import available_policies
    from .utility import UTILITY_KINDS

    parser = _Parser(
        prog="coalescence",
        description="Coalition attribution for language models: how much each part of a chat "
        "conversation drives the model's answer (Shapley-style values, by default in nats of log-probability).",
    )
    parser.add_argument("--version", action="version", version=f"coalescence {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    methods_help = (
        "exact: exact Shapley values, all 2^n coalitions (n <= 16); permutation: antithetic "
        "permutation sampling with standard errors; kernelshap: KernelSHAP (paired sampling, "
        "efficiency imposed, standard errors); banzhaf: Banzhaf values (maximum sample reuse); "
        "lasso: ContextCite-style sparse linear surrogate; loo: leave-one-out"
    )
    ex = sub.add_parser(
        "explain",
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
        'form {"documents", "question", "answer"}), or a .jsonl file with one input per line',
    )
    _add_model_options(ex, default="smollm2-135m")
    ex.add_argument(
        "--unit",
        choices=UNITS,
        default=None,
        help="player unit: turn, paragraph, sentence, word, tool (a tool call and its results), "
        "exchange (a user turn and the reply to it; the last user turn stays), document (the input's "
        "declared players or RAG documents) (default: document when the input declares players, else turn)",
    )
    ex.add_argument(
        "--template",
        metavar="JSON",
        default=None,
        help='RAG prompt template, a JSON file {"system", "user", "document", "separator"} '
        "(default: the one in the README)",
    )
    ex.add_argument(
        "--system-absent",
        choices=("removed", "empty"),
        default="removed",
        help="drop policy: a system message whose players are all absent is removed, or kept "
        "with empty content (default: %(default)s)",
    )
    ex.add_argument(
        "--empty-turns",
        choices=("removed", "empty"),
        default="removed",
        help="drop policy: a message (any role) whose players are all absent is removed, or kept with "
        "empty content so every coalition keeps the conversation's sequence of roles, as templates "
        "that require alternating roles need for units finer than a turn (default: %(default)s)",
    )
    ex.add_argument(
        "--merge-adjacent",
        action="store_true",
        help="render adjacent messages of the same role (system, user, assistant) as one message, "
        "joined by a blank line, in every coalition: dropping a turn then never puts two user turns "
        "side by side (templates that require alternating roles)",
    )
    ex.add_argument(
        "--hierarchy",
        metavar="COARSE,FINE",
        default=None,
        help="hierarchical attribution: attribute at COARSE, then refine the --top-k coarse players "
        "at FINE with the rest held present (e.g. document,sentence)",
    )
    ex.add_argument("--top-k", type=_positive_int, default=None, help="--hierarchy: coarse players refined (default: 3)")
    ex.add_argument(
        "--roles",
        default=None,
        help=f"comma-separated roles whose messages are players (default: all of {','.join(ROLES)}); "
        "messages of other roles stay in every coalition",
    )
    ex.add_argument("--method", choices=METHODS, default="exact", help=methods_help + " (default: %(default)s)")
    ex.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="sampling methods (permutation, kernelshap, banzhaf, lasso): the most distinct model "
        "evaluations (default: 32 x players)",
    )
    ex.add_argument("--seed", type=int, default=0, help="seed of the sampling plan (default: %(default)s)")
    ex.add_argument(
        "--target-stderr",
        type=_positive_float,
        default=None,
        metavar="NATS",
        help="permutation, kernelshap, banzhaf: sample in doubling rounds until every player's "
        "standard error is below NATS or --budget is spent (the output says which)",
    )
    ex.add_argument(
        "--absence-policy",
        choices=available_policies(),
        default="drop",
        help="how an absent player disappears: drop its text (a turn removes its message) or "
        "replace it with --placeholder (default: %(default)s)",
    )
    ex.add_argument("--placeholder", default="[removed]", help="placeholder text (default: %(default)s)")
    ex.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        help="length limit when the answer is generated, and of each regenerated answer; with the prompt it must "
        "fit the model's context (default: %(default)s)",
    )
    ex.add_argument("--utility", choices=UTILITY_KINDS, default="logprob", help=_UTILITY_HELP + " (default: %(default)s)")
    _add_span_options(ex)
    ex.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="regenerate utilities: 0 decodes greedily, > 0 samples at this temperature (default: %(default)s)",
    )
    ex.add_argument("--top-p", type=float, default=1.0, help="regenerate utilities: nucleus sampling mass (default: %(default)s)")
    ex.add_argument(
        "--num-samples",
        type=_positive_int,
        default=1,
        help="regenerate utilities: sampled answers per coalition (at most 1024), similarities averaged; each "
        "sample's seed derives from --seed, the coalition and the sample index (default: %(default)s)",
    )
    ex.add_argument(
        "--archive",
        metavar="RUN_DIR",
        default=None,
        help="run archive directory: created if new, resumed if it holds this run "
        "(default: a new runs/<UTC time>-<snapshot id>)",
    )
    ex.add_argument("--new-run", action="store_true", help="add a run with other settings to an existing --archive")
    _add_archive_options(ex)
    ex.add_argument("--out", metavar="JSON", default=None, help="write the explanation as JSON here")
    ex.add_argument(
        "--html",
        metavar="PATH",
        default=None,
        help="write the HTML report of the explanation here after the run (as `coalescence report`)",
    )
    ex.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ex.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")

    rp = sub.add_parser(
        "replay",
        help="fit estimators from a run archive, without a model when it covers them",
        description="Fit one or more estimators from the coalitions a run archive holds. With no "
        "--model, every coalition an estimator plans must be in the archive; with --model, the "
        "missing ones are evaluated (and archived) and the rest are served from the archive.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR", help="run archive directory")
    rp.add_argument("--method", required=True, help=f"comma-separated methods ({','.join(METHODS)}). " + methods_help)
    rp.add_argument("--budget", type=_positive_int, default=None, help="sampling methods: distinct evaluations (default: 32 x players)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the sampling plans (default: %(default)s)")
    rp.add_argument("--run", default=None, help="run id in the archive (default: the last run)")
    rp.add_argument("--snapshot", default=None, help="snapshot id or prefix (default: every snapshot of the run)")
    rp.add_argument(
        "--utility",
        choices=UTILITY_KINDS,
        default=None,
        help=_UTILITY_HELP + " (default: the run's). An archive with per-token scores serves every "
        "teacher-forced utility and sub-span, one with generated texts every similarity, with no model",
    )
    _add_span_options(rp)
    rp.add_argument(
        "--whole-answer",
        action="store_true",
        help="score every answer token, end-of-turn included, even if the run used a sub-span "
        "(by default replay keeps the run's --target-span/--target-substring unless new ones are given)",
    )
    _add_model_options(rp, default=None)
    _add_archive_options(rp)
    rp.add_argument("--out", metavar="JSON", default=None, help='write {"explanations": [...]} as JSON here')
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rp.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")

    _add_report_parser(sub)

    ar = sub.add_parser("archive", help="inspect or compact a run archive")
    ar_sub = ar.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    info = ar_sub.add_parser("info", help="summary of a run archive")
    info.add_argument("run_dir", metavar="RUN_DIR")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.add_argument("--skip-corrupt", action="store_true", help="skip unreadable parts")
    cp = ar_sub.add_parser("compact", help="merge the parts of a run archive into one, atomically")
    cp.add_argument("run_dir", metavar="RUN_DIR")
    cp.add_argument("--skip-corrupt", action="store_true", help="drop unreadable parts while compacting")
    return parser


def _add_report_parser(sub: Any) -> None:
    """The ``report`` command's arguments."""
    from .attribution.estimators import METHODS

    rep = sub.add_parser(
        "report",
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
        "--method",
        default=None,
        help=f"run archive: comma-separated methods fitted ({','.join(METHODS)}) (default: the run's method)",
    )
    rep.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="run archive: sampling budget (default: the run's for a one-input run, else 32 x players)",
    )
    rep.add_argument("--seed", type=int, default=None, help="run archive: seed of the sampling plans (default: the run's)")
    rep.add_argument("--run", default=None, help="run archive: run id (default: the last run)")


def _check_html(path: str | None, option: str) -> Path | None:
    """The HTML report's path, checked before any work; the optional dependency checked too."""
    if path is None:
        return None
    from .report import check_available

    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{path!r} is a directory; give a file path", field=option)
    _check_parent(out, option)
    check_available()
    return out


def _write_html(path: Path, document: Any, option: str) -> None:
    """Write the HTML report of an ``--out`` document (any form)."""
    from .report import render_report, write_report

    write_report(path, render_report(document), field=option)


def _report(args: argparse.Namespace) -> int:
    from .report import load_source

    out = _check_html(args.output, "--output")
    assert out is not None
    methods = [m.strip() for m in args.method.split(",") if m.strip()] if args.method is not None else None
    if methods is not None and not methods:
        raise ConfigError("give at least one method, e.g. --method exact", field="--method")
    report = load_source(args.source, methods=methods, budget=args.budget, seed=args.seed, run_id=args.run)
    _write_html(out, report, "--output")
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


def _check_parent(path: Path, option: str) -> None:
    """Refuse a path whose nearest existing ancestor is not a writable directory."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{str(parent)!r} is a file, not a directory; give another path", field=option)
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"{str(parent)!r} is not writable; give another path", field=option)
            return


def _check_out(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{out!r} is a directory; give a file path", field="--out")
    _check_parent(path, "--out")
    return path


def _quiet_transformers(args: argparse.Namespace) -> None:
    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def _load_backend(args: argparse.Namespace, source: Any, **loaded: Any) -> Any:
    """Load the model's weights (``loaded``: the tokenizer, config and fingerprint already at hand)."""
    from .backends.registry import load_backend

    _quiet_transformers(args)
    if not args.no_progress:
        print(f"coalescence: loading {source.model_id} ...", file=sys.stderr, flush=True)
    return load_backend(source, device=args.device, dtype=args.dtype, max_batch_size=args.batch_size, **loaded)


def _model_identity(run_dir: Path | None, model: dict[str, Any], new_run: bool) -> None:
    """Refuse, before the weights load, to resume an archive whose runs used other model content."""
    from .archive.reader import read_manifest

    if run_dir is None or new_run or not (run_dir / "manifest.json").is_file():
        return
    runs = read_manifest(run_dir).get("runs") or []
    if not runs or any(r.get("model") == model for r in runs):
        return
    old = runs[-1].get("model") or {}
    if not isinstance(old, dict) or "id" not in old:
        return  # not a model record this check can compare; opening the archive checks the run
    diffs = "; ".join(
        f"{k}: archive has {str(old.get(k))[:16]!r}, this run has {str(model.get(k))[:16]!r}"
        for k in sorted(set(old) | set(model))
        if old.get(k) != model.get(k)
    )
    raise ArchiveError(
        f"the archive's runs used another model ({diffs}"
        + (": the weight, tokenizer or template files changed" if "sha256" in old and old.get("sha256") != model.get("sha256") else "")
        + "); use --new-run to add a run with this model, or another --archive",
        field="--archive",
    )


def _utility_spec(args: argparse.Namespace) -> Any:
    """The run's :class:`~coalescence.utility.UtilitySpec` from the explain options (checked before the model loads)."""
    from .utility import REGENERATE_KINDS, GenerationConfig, UtilitySpec, parse_span

    span = parse_span(args.target_span) if args.target_span is not None else None
    generation = None
    if args.utility in REGENERATE_KINDS:
        generation = GenerationConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            num_samples=args.num_samples,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        from .similarity import get_similarity

        get_similarity(args.utility)  # a missing optional package is reported now, with its install hint
    else:
        for option, value, default in (
            ("--temperature", args.temperature, 0.0),
            ("--top-p", args.top_p, 1.0),
            ("--num-samples", args.num_samples, 1),
        ):
            if value != default:
                raise ConfigError(
                    f"applies to the regenerate utilities ({', '.join(REGENERATE_KINDS)}); --utility "
                    f"{args.utility} scores the fixed answer. Drop {option} or choose one of those",
                    field=option,
                )
    return UtilitySpec(kind=args.utility, span=span, substring=args.target_substring, generation=generation)


def _same_measurement(run_dir: Path, utility: Any) -> bool:
    """Whether the archive's last run measured what ``utility`` needs (so replay can reduce it)."""
    from .archive.reader import read_manifest
    from .utility import UtilitySpec

    try:
        last = UtilitySpec.from_dict(read_manifest(run_dir)["runs"][-1].get("utility") or {})
    except (CoalescenceError, KeyError, IndexError, TypeError, ValueError):
        return False
    return last.teacher_forced == utility.teacher_forced and last.generation == utility.generation


def _on_line(k: int, is_batch: bool, check: Any, *args: Any) -> Any:
    """Run ``check(*args)``; in a JSONL batch, an input error names the input's line (``line N: FIELD``)."""
    from .errors import InputError

    try:
        return check(*args)
    except InputError as exc:
        if not is_batch:
            raise
        raise InputError(exc.message, field=f"line {k + 1}: {exc.field}" if exc.field else f"line {k + 1}") from None


def _preflight(
    args: argparse.Namespace,
    renderer: Any,
    conversation: Any,
    unit: str,
    roles: Any,
    policy: Any,
    utility: Any,
    hierarchy: Any,
    max_context: int,
) -> None:
    """Check one input's game with the tokenizer alone (see :mod:`coalescence.preflight`)."""
    from .attribution.estimators import make_estimator
    from .attribution.hierarchy import fine_snapshot
    from .conversation import ConversationSnapshot
    from .preflight import check_game

    provisional = conversation.target is None
    if provisional:  # the answer is generated later; its prompts must render now
        conversation = conversation.with_target("\u2063answer\u2063", source="generated")
    snapshot = ConversationSnapshot.build(conversation, unit=unit, roles=roles)
    n = snapshot.n_players
    budget = args.budget if args.budget is not None else 32 * n
    plan = make_estimator(args.method, budget=budget, seed=args.seed).plan(n)
    report = check_game(
        renderer,
        snapshot,
        policy,
        plan,
        max_context=max_context,
        teacher_forced=utility.teacher_forced and not provisional,
        provisional=provisional,
    )
    if report.target is not None:
        utility.resolve(snapshot.target, report.target.offsets)  # a span that covers no token
    if hierarchy is not None and not provisional:
        fine, _ = fine_snapshot(snapshot, hierarchy[1])
        check_game(renderer, fine, policy, None, max_context=max_context, teacher_forced=utility.teacher_forced)


def _run_description(engine: Any, snapshots: Sequence[Any], policy: Any, config: dict[str, Any], target_ids: dict[str, list[int]]) -> dict[str, Any]:
    return {
        "package_version": __version__,
        "snapshot_ids": [s.snapshot_id for s in snapshots],
        "model": engine.model,
        "utility": engine.utility.to_dict(),
        "absence_policy": {"id": policy.id, "params": policy.params()},
        "run_config": config,
        "template_injects_default_system": engine.renderer.injects_default_system,
        "target_token_ids": target_ids,
        # per target token, its characters in the answer: answer sub-spans replay without a tokenizer
        "target_token_offsets": {s.snapshot_id: [list(o) for o in engine.target_tokens(s, policy).offsets] for s in snapshots},
        # what the chat template writes around the answer (prompt, never scored): e.g. Qwen3's empty reasoning block
        "answer_rendering": {s.snapshot_id: engine.target_tokens(s, policy).to_dict() for s in snapshots},
        "snapshots": [s.to_dict() for s in snapshots],
    }


def _finish(engine: Any, run: Any) -> Any:
    """Run ``run`` (an async callable), closing the engine's archive with the right status.

    Signals do not raise while the run or the archive's close is in progress: the first one
    cancels the run inside the event loop, the archive is flushed and closed as ``interrupted``,
    and :class:`~coalescence._interrupts.Stopped` is raised afterwards (see ``_interrupts``). A
    closed standard output or error during the run closes the archive the same way and raises
    :class:`~coalescence._interrupts.OutputClosed`.
    """
    import anyio

    interrupts = _interrupts()
    status = "interrupted"
    with interrupts.deferred():
        try:
            result = anyio.run(interrupts.run, run)
            if result is not STOPPED:
                status = "complete"
        except CoalescenceError:
            status = "failed"
            raise
        except Exception as exc:
            if is_broken_pipe(exc):  # e.g. the progress bar on a closed standard error
                raise OutputClosed() from exc
            raise
        finally:
            progress = engine.progress
            if hasattr(progress, "close"):
                with contextlib.suppress(OSError):  # a closed stderr must not keep the archive open
                    progress.close()
            try:
                engine.close(status=status)
            except ArchiveError as exc:
                raise _RunFailed(exc) from exc
    interrupts.raise_if_stopped()
    return result


def _explain(args: argparse.Namespace) -> int:
    from .archive.reader import check_parts, read_manifest
    from .archive.writer import RunArchive, write_json_atomic
    from .attribution.estimators import make_estimator
    from .attribution.hierarchy import explain_hierarchical, fine_snapshot, parse_hierarchy
    from .backends.registry import load_config, load_tokenizer, model_context, model_fingerprint, resolve_model
    from .conversation import segment_players
    from .engine import Engine
    from .inputs import load_inputs, load_template
    from .masking.policies import get_policy
    from .masking.render import ChatRenderer
    from .scheduler.progress import TqdmProgress
    from .segmentation import count_players

    # 1. everything that can be checked without the model, before loading it
    template = load_template(args.template)
    conversations, is_batch = load_inputs(args.input, template)
    roles = None
    if args.roles is not None:
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        if not roles:
            raise ConfigError("give at least one role, e.g. --roles user,system", field="--roles")
    hierarchy = parse_hierarchy(args.hierarchy) if args.hierarchy is not None else None
    if hierarchy is None and args.top_k is not None:
        raise ConfigError("--top-k applies to --hierarchy COARSE,FINE; add it or drop --top-k", field="--top-k")
    if hierarchy is not None and args.unit is not None:
        raise ConfigError("--hierarchy sets the units; drop --unit", field="--unit")
    top_k = args.top_k if args.top_k is not None else 3
    utility = _utility_spec(args)
    target_stderr = getattr(args, "target_stderr", None)
    if target_stderr is not None:
        if args.method not in ("permutation", "kernelshap", "banzhaf"):
            raise ConfigError(
                f"--method {args.method} reports no standard errors; use one of permutation, kernelshap, banzhaf",
                field="--target-stderr",
            )
        if hierarchy is not None:
            raise ConfigError("--target-stderr does not combine with --hierarchy; drop one", field="--target-stderr")
    for k, conversation in enumerate(conversations):
        if conversation.target is not None:  # a generated target is checked once it exists
            _on_line(k, is_batch, utility.locate, conversation.target)
    if args.method in _UNBUDGETED and args.budget is not None:
        raise ConfigError(
            f"--method {args.method} has a fixed number of evaluations; --budget applies to sampling "
            "methods (permutation, kernelshap, banzhaf, lasso)",
            field="--budget",
        )
    # an estimator's player limit (exact: 16) stops the count early: a long text is refused after
    # a few sentences, not after segmenting all of it
    at_most = getattr(make_estimator(args.method, seed=args.seed), "MAX_PLAYERS", None) if args.method in _UNBUDGETED else None
    units = []
    for k, conversation in enumerate(conversations):
        unit = hierarchy[0] if hierarchy else args.unit or ("document" if conversation.declared else "turn")
        units.append(unit)
        n_players = _on_line(k, is_batch, lambda c=conversation, u=unit: count_players(c, unit=u, roles=roles, at_most=at_most))
        if at_most is not None and n_players > at_most:
            raise EstimatorError(
                f"{f'input line {k + 1}: ' if is_batch else ''}--unit {unit} gives at least {n_players} players "
                f"(counting stopped there), and --method {args.method} allows at most {at_most}; use a coarser "
                "--unit, or --method permutation with --budget N, or --method loo",
                field="--method",
            )
        budget = args.budget if args.budget is not None else 32 * n_players
        make_estimator(args.method, budget=budget, seed=args.seed).validate(n_players)
    merge = {"merge_adjacent": True} if args.merge_adjacent else {}
    if args.absence_policy == "placeholder":
        for option, value in (("--system-absent", args.system_absent), ("--empty-turns", args.empty_turns)):
            if value != "removed":
                raise ConfigError(f"{option} applies to --absence-policy drop (placeholder removes no message)", field=option)
        policy = get_policy("placeholder", text=args.placeholder, **merge)
    else:
        rules = {"system_absent": args.system_absent, "empty_turns": args.empty_turns}
        policy = get_policy(args.absence_policy, **{k: v for k, v in rules.items() if v != "removed"}, **merge)

    def estimator_for(n: int) -> Any:
        return make_estimator(args.method, budget=args.budget if args.budget is not None else 32 * n, seed=args.seed)

    out_path = _check_out(args.out)
    html_path = _check_html(args.html, "--html")
    run_dir = Path(args.archive) if args.archive is not None else None
    if run_dir is not None:
        if run_dir.exists() and (not run_dir.is_dir() or (any(run_dir.iterdir()) and not (run_dir / "manifest.json").is_file())):
            raise ConfigError(
                f"{args.archive!r} exists and is not a run directory; choose a new path or delete it",
                field="--archive",
            )
        if (run_dir / "manifest.json").is_file():
            read_manifest(run_dir)  # a damaged manifest or a newer schema is refused before the model loads
            check_parts(run_dir, skip_corrupt=args.skip_corrupt)  # so is a part that fails its digest or schema
        _check_parent(run_dir, "--archive")
    source = resolve_model(args.model)

    # 2. what the tokenizer and chat template alone can reveal, before the weights load: every
    #    coalition the plans need renders, the answer is located, everything fits the context
    _quiet_transformers(args)
    tokenizer = load_tokenizer(source)
    config = load_config(source)
    max_context = model_context(config, tokenizer)
    fingerprint = model_fingerprint(source)
    _model_identity(
        run_dir,
        {"id": source.model_id, "revision": source.revision, "dtype": args.dtype, "sha256": fingerprint},
        args.new_run,
    )
    renderer = ChatRenderer(tokenizer)
    for k, (conversation, unit) in enumerate(zip(conversations, units, strict=True)):
        _on_line(k, is_batch, _preflight, args, renderer, conversation, unit, roles, policy, utility, hierarchy, max_context)

    # 3. the model, the snapshots and their target tokens
    backend = _load_backend(args, source, tokenizer=tokenizer, config=config, fingerprint=fingerprint)
    engine = Engine(
        backend, progress=TqdmProgress("coalitions", disable=args.no_progress), batch_size=args.batch_size, utility=utility
    )
    snapshots = []
    fines: list[Any] = []
    for k, (conversation, unit) in enumerate(zip(conversations, units, strict=True)):
        snapshot = engine.prepare(conversation, unit=unit, roles=roles, max_new_tokens=args.max_new_tokens)
        estimator_for(snapshot.n_players).validate(snapshot.n_players)
        if conversation.target is None:  # checked with a stand-in answer before; now with the real one
            _on_line(k, is_batch, _preflight, args, engine.renderer, snapshot.conversation, unit, roles, policy, utility, hierarchy, max_context)
        snapshots.append(snapshot)
        if hierarchy is not None:
            fines.append(fine_snapshot(snapshot, hierarchy[1]))
    recorded = snapshots + [f for f, _ in fines]
    for k, snap in enumerate(snapshots):
        _on_line(k, is_batch, engine.resolved_utility, snap, policy)  # a sub-span outside a target fails here, before the archive
    for snap in recorded:
        engine.resolved_utility(snap, policy)
    targets = {s.snapshot_id: list(engine.target_tokens(s, policy).ids) for s in recorded}

    # 4. the archive (created, or resumed after its identity is checked), then the run
    if run_dir is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path("runs") / f"{stamp}-{snapshots[0].snapshot_id[:12]}"
    config = {
        "command": "explain",
        "input": str(args.input),
        "unit": units[0] if len(set(units)) == 1 else units,
        "roles": roles,
        "method": args.method,
        "budget": None if args.method in _UNBUDGETED else (args.budget if args.budget is not None else 32 * snapshots[0].n_players),
        "seed": args.seed,
        "device": args.device,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
    }
    if hierarchy is not None:
        config["hierarchy"] = {"units": list(hierarchy), "top_k": top_k}
    if args.template is not None:
        config["template"] = str(args.template)
    run = _run_description(engine, recorded, policy, config, targets)
    injects = engine.renderer.injects_default_system
    for record, snap in zip(run["snapshots"], recorded, strict=True):
        messages = snap.conversation.messages
        has_system = any(m.role == "system" for m in messages)
        system_players = any(p.role == "system" for p in snap.players)
        record["template_injects_default_system"] = injects
        record["default_system_in_play"] = (
            "never" if not injects
            else "always" if not has_system
            else "when every system player is absent" if system_players and "empty" not in (policy.params().get("system_absent"), policy.params().get("empty_turns"))
            else "never"
        )
    try:
        archive = RunArchive.open(
            run_dir,
            run,
            new_run=args.new_run,
            skip_corrupt=args.skip_corrupt,
            flush_rows=args.flush_rows,
            flush_seconds=args.flush_seconds,
        )
    except ArchiveError as exc:
        if "utility:" in exc.message and not args.new_run and _same_measurement(run_dir, utility):
            raise ArchiveError(
                exc.message + f". For another utility of the same answer, `coalescence replay {run_dir} --method "
                f"{args.method} --utility ...` (or --target-span/--target-substring) needs no model, and "
                "--new-run evaluates only what the archived measurements do not cover",
                field=exc.field,
            ) from None
        raise
    _STATE["archive"], _STATE["engine"] = str(run_dir), engine
    loaded = engine.attach_archive(archive)
    if archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run_dir}: {loaded} coalitions already evaluated", file=sys.stderr)

    async def run_all() -> list[Any]:
        results = []
        for k, snap in enumerate(snapshots):
            if target_stderr is not None:
                budget = args.budget if args.budget is not None else 32 * snap.n_players
                results.append(
                    await engine.explain_until(
                        snap, args.method, policy, budget=budget, target_stderr=target_stderr, seed=args.seed
                    )
                )
            elif hierarchy is None:
                results.append(await engine.explain(snap, estimator_for(snap.n_players), policy))
            else:
                fine, parents = fines[k]
                results.append(
                    await explain_hierarchical(
                        engine, snap, fine, parents, estimator_for=estimator_for, policy=policy, top_k=top_k
                    )
                )
        return results

    try:
        explanations = _finish(engine, run_all)
        documents = [e.to_dict() | {"archive": str(run_dir)} for e in explanations]
        payload = {"archive": str(run_dir), "explanations": documents} if is_batch else documents[0]
        if out_path is not None:
            write_json_atomic(out_path, payload, field="--out")
        if html_path is not None:
            _write_html(html_path, payload, "--html")
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {out_path}: {exc}", field="--out")
        raise _RunFailed(error) from exc
    for k, explanation in enumerate(explanations):
        if is_batch:
            print(f"== input {k + 1} of {len(explanations)} (snapshot {snapshots[k].snapshot_id[:12]}) ==")
        print(explanation.format_table())
        if is_batch:
            print()
    print(f"archive: {run_dir}" + (f"   json: {out_path}" if out_path else "") + (f"   html: {html_path}" if html_path else ""))
    return 0


def _replay(args: argparse.Namespace) -> int:
    import time

    from .archive.manifest import check_replayable
    from .archive.reader import read_manifest, read_rows
    from .archive.writer import RunArchive, write_json_atomic
    from .attribution.estimators import METHODS, make_estimator
    from .attribution.explanation import Explanation
    from .backends.registry import resolve_model
    from .conversation import ConversationSnapshot
    from .engine import Engine, fill_measurements, fill_store, pool_from_store, utility_detail
    from .errors import InputError
    from .masking.policies import get_policy
    from .scheduler.progress import TqdmProgress
    from .scheduler.store import ResultStore
    from .utility import REGENERATE_KINDS, TEACHER_FORCED_KINDS, UtilitySpec, parse_span

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise ConfigError(f"unknown method {unknown[0] if unknown else ''!r}; use a comma-separated subset of {','.join(METHODS)}", field="--method")
    span = parse_span(args.target_span) if args.target_span is not None else None
    out_path = _check_out(args.out)
    manifest = read_manifest(args.run_dir)
    runs = manifest.get("runs") or []
    if not runs:
        raise ArchiveError("the archive records no run", field="RUN_DIR")
    run = next((r for r in runs if r["run_id"] == args.run), None) if args.run else runs[-1]
    if run is None:
        raise ConfigError(f"no run {args.run!r}; the archive has {[r['run_id'] for r in runs]}", field="--run")
    check_replayable(args.run_dir, manifest, run)
    try:
        run_utility = UtilitySpec.from_dict(run.get("utility") or {})
    except (ConfigError, TypeError, ValueError) as exc:
        raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot replay", field="RUN_DIR") from exc
    # the utility replayed: the run's, with --utility / --target-span / --target-substring applied
    kind = args.utility or run_utility.kind
    if kind in REGENERATE_KINDS and run_utility.kind in TEACHER_FORCED_KINDS:
        raise ConfigError(
            f"run {run['run_id']} scored the fixed answer ({run_utility.kind}); it holds no regenerated "
            f"answers to compare, so --utility {kind} needs a new explain run",
            field="--utility",
        )
    if kind in TEACHER_FORCED_KINDS and run_utility.kind in REGENERATE_KINDS:
        raise ConfigError(
            f"run {run['run_id']} regenerated answers ({run_utility.kind}); it holds no per-token scores, "
            f"so --utility {kind} needs a new explain run",
            field="--utility",
        )
    spanned = span is not None or args.target_substring is not None
    if args.whole_answer and spanned:
        raise ConfigError("scores every answer token, so it does not combine with a sub-span; drop one", field="--whole-answer")
    keep = not spanned and not args.whole_answer
    utility = UtilitySpec(
        kind=kind,
        span=run_utility.span if keep else span,
        substring=run_utility.substring if keep else args.target_substring,
        generation=run_utility.generation,
    )
    policy = get_policy(run["absence_policy"]["id"], **run["absence_policy"]["params"])
    records = {s["snapshot_id"]: s for s in manifest.get("snapshots", [])}
    ids = [i for i in run["snapshot_ids"] if args.snapshot is None or i.startswith(args.snapshot)]
    if not ids:
        raise ConfigError(f"no snapshot of run {run['run_id']} starts with {args.snapshot!r}", field="--snapshot")
    snapshots = [ConversationSnapshot.from_dict(records[i]) for i in ids]
    offsets = run.get("target_token_offsets") or {}
    target_ids = run.get("target_token_ids") or {}
    resolved = {}
    for snap in snapshots:
        known = offsets.get(snap.snapshot_id)
        if known is None:
            known = [(0, 0)] * len(target_ids.get(snap.snapshot_id, []))
            if utility.span is not None or utility.substring is not None:
                if args.model is None:
                    raise ConfigError(
                        "this archive does not record the target tokens' characters (it predates answer "
                        f"sub-spans); pass --model {run['model']['id']} to align the span with the tokenizer",
                        field="--target-span" if utility.span is not None else "--target-substring",
                    )
                continue  # the engine aligns it with the model's tokenizer
        resolved[snap.snapshot_id] = utility.resolve(snap.target, [tuple(o) for o in known])
    rows = read_rows(args.run_dir, skip_corrupt=args.skip_corrupt)
    store = ResultStore()
    fill_store(store, rows)
    measurements: dict[str, Any] = {}
    fill_measurements(measurements, rows)
    jobs = []
    for snap in snapshots:
        for m in methods:
            budget = args.budget if args.budget is not None else 32 * snap.n_players
            estimator = make_estimator(m, budget=budget, seed=args.seed)
            estimator.validate(snap.n_players)
            jobs.append((snap, estimator))
    missing = {
        id(e): (
            pool_from_store(
                store, s, policy, run["model"], e.plan(s.n_players), utility=resolved[s.snapshot_id], measurements=measurements
            )[2]
            if s.snapshot_id in resolved
            else 1
        )
        for s, e in jobs
    }
    explanations = []
    if any(missing.values()):
        if args.model is None:
            s, e = next((s, e) for s, e in jobs if missing[id(e)])
            raise EstimatorError(
                f"the archive lacks {missing[id(e)]} of the coalitions {e.name} plans for snapshot "
                f"{s.snapshot_id[:12]} under utility {utility.kind}; pass --model {run['model']['id']} "
                "to evaluate them",
                field="--method",
            )
        source = resolve_model(args.model)
        backend = _load_backend(args, source)
        engine = Engine(
            backend, store=store, progress=TqdmProgress("coalitions", disable=args.no_progress),
            batch_size=args.batch_size, utility=utility,
        )
        engine.measurements.update(measurements)
        if engine.model != run["model"]:
            raise InputError(
                f"--model is {engine.model}, but the run was evaluated with {run['model']}; give the run's model",
                field="--model",
            )
        for snap in snapshots:
            engine.resolved_utility(snap, policy)
        description = {k: v for k, v in run.items() if k not in ("run_id", "started_at", "status", "resumed_at", "statistics")}
        description |= {"utility": utility.to_dict(), "snapshots": [records[i] for i in run["snapshot_ids"]]}
        archive = RunArchive.open(
            args.run_dir,
            description,
            new_run=utility.to_dict() != run.get("utility"),
            skip_corrupt=args.skip_corrupt,
            flush_rows=args.flush_rows,
            flush_seconds=args.flush_seconds,
        )
        _STATE["archive"], _STATE["engine"] = str(args.run_dir), engine
        engine.attach_archive(archive)

        async def run_all() -> list[Any]:
            return [await engine.explain(s, e, policy) for s, e in jobs]

        try:
            explanations = _finish(engine, run_all)
        except ArchiveError as exc:
            raise _RunFailed(exc) from exc
    else:
        for snap, estimator in jobs:
            t0 = time.perf_counter()
            chosen = resolved[snap.snapshot_id]
            masks, utilities, _ = pool_from_store(
                store, snap, policy, run["model"], estimator.plan(snap.n_players), utility=chosen, measurements=measurements
            )
            estimate = estimator.fit(masks, utilities)
            explanations.append(
                Explanation(
                    snapshot=snap,
                    estimate=estimate,
                    model_id=run["model"]["id"],
                    model_revision=run["model"]["revision"],
                    absence_policy=policy.id,
                    absence_params=policy.params(),
                    utility=utility.kind,
                    utility_unit=utility.unit,
                    utility_detail=utility_detail(chosen),
                    utility_description=chosen.describe(),
                    target_token_count=len(target_ids.get(snap.snapshot_id, [])),
                    n_evaluations=0,
                    wall_seconds=time.perf_counter() - t0,
                    notes=chosen.notes() + ("replayed from the archive: no model call",),
                )
            )
    for explanation in explanations:
        print(explanation.format_table())
        print()
    if out_path is not None:
        write_json_atomic(out_path, {"run_dir": str(args.run_dir), "run_id": run["run_id"], "explanations": [e.to_dict() for e in explanations]}, field="--out")
    return 0


def _archive(args: argparse.Namespace) -> int:
    from .archive.reader import archive_info
    from .archive.writer import compact

    if args.archive_command == "info":
        info = archive_info(args.run_dir, skip_corrupt=args.skip_corrupt)
        if args.json:
            print(json.dumps(info, indent=2))
            return 0
        print(f"run directory   {info['run_dir']} (schema version {info['schema_version']}, coalescence {info['package_version']})")
        for r in info["runs"]:
            model, policy, utility = (r.get(k) if isinstance(r.get(k), dict) else {} for k in ("model", "absence_policy", "utility"))
            kind = utility.get("kind")
            print(
                f"run             {r['run_id']} started {r.get('started_at')} [{r.get('status')}] model {model.get('id')} "
                f"policy {policy.get('id')} utility {kind}"
            )
            if r.get("error"):
                print(f"  error         {r['error']}")
        for s in info["snapshots"]:
            print(f"snapshot        {s['snapshot_id'][:16]}  {s['coalitions']} coalitions")
        print(f"coalitions      {info['coalitions']} in {info['parts']} parts, {info['bytes']} bytes")
        if info["unverified_parts"]:
            print(f"unverified      {info['unverified_parts']} parts written before schema version 3 carry no digest; "
                  "`coalescence archive compact` adds them")
        if info["skipped_parts"]:
            print(f"skipped         {len(info['skipped_parts']) } damaged parts: {', '.join(info['skipped_parts'])}")
        if info["quarantined_parts"]:
            print(f"quarantined     {len(info['quarantined_parts'])} parts in quarantine/: {', '.join(info['quarantined_parts'])}")
        print(f"cache-hit rate  {info['cache_hit_rate']:.3f}")
        print(f"tokens          {info['tokens_computed']} computed, {info['tokens_reused']} reused")
        print(f"model time      {info['model_seconds']:.1f} s")
        print(f"writes          first {info['first_write']}, last {info['last_write']}")
        return 0
    before, rows = compact(args.run_dir, skip_corrupt=args.skip_corrupt)
    print(f"compacted {args.run_dir}: {before} parts -> {1 if rows else 0}, {rows} coalitions")
    return 0


def _interrupts() -> Interrupts:
    current = _STATE.get("interrupts")
    if current is None:  # a command function called without main(): no handlers, nothing to watch
        current = _STATE["interrupts"] = Interrupts()
    return current


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring).

    Args:
        argv: the arguments; ``None`` (the console script, ``python -m coalescence``) reads
            ``sys.argv`` and keeps the signal handlers until the process exits, so that a late
            signal during the interpreter's shutdown cannot raise either; a caller passing
            ``argv`` gets its own handlers back on return.
    """
    interrupts = Interrupts()
    interrupts.install()
    _STATE["interrupts"] = interrupts
    try:
        return _main(argv, interrupts)
    finally:
        if argv is None:
            interrupts.finish()
        else:
            interrupts.restore()


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
    """Close an archive that a command left open (a signal or a closed output between opening it
    and the run), as :func:`_finish` would have: buffered rows flushed, status recorded, lock released."""
    engine = _STATE.pop("engine", None)
    archive = getattr(engine, "archive", None)
    if archive is None or archive.closed:
        return
    try:
        engine.close(status="interrupted" if interrupted else "failed")
    except CoalescenceError as exc:
        write_stderr(_error_line(exc))


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
    commands = {"explain": _explain, "replay": _replay, "archive": _archive, "report": _report}
    _STATE.pop("archive", None)
    _STATE.pop("engine", None)
    try:
        code = commands[args.command](args)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's final flush
        return code
    except _RunFailed as exc:  # the exit-code table is in the module docstring
        return _fail(exc.error, 3)
    except BatchFailed as exc:
        return _fail(exc, 1)
    except ArchiveWriteError as exc:
        return _fail(exc, 3)
    except CoalescenceError as exc:
        return _fail(exc, 2)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        where = _STATE.get("archive")
        saved = f"; evaluated coalitions are in {where} (run the same command to resume)" if where else ""
        write_stderr(f"coalescence: {'terminated' if signum == signal.SIGTERM else 'interrupted'}{saved}")
        return exit_code(signum)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
