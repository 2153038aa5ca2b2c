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
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._version import __version__
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
from .backends.base import DEFAULT_BATCH_SIZE
from .errors import ArchiveError, ArchiveWriteError, BatchFailed, CoalescenceError, ConfigError, ReportError

__all__ = ("build_parser", "main")

logger = logging.getLogger("coalescence")

_STATE: dict[str, Any] = {}  # the command's Interrupts, and the run directory and engine being written


EXIT_CODES = "exit codes:\n" + re.sub(
    r":\w+:`~?([^`]+)`|``([^`]+)``", lambda m: m.group(1) or m.group(2), __doc__.split("::\n\n", 1)[1].rstrip()
)
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


def _seed(text: str) -> int:
    """A seed: a non-negative integer of any size (the rule of every method)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (any size), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (any size), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def _add_model_options(p: argparse.ArgumentParser, *, default: str | None) -> None:
    p.add_argument(
        "--model",
        default=default,
        help="model alias (smollm2-135m), local model directory, .gguf file or hub id"
        + (" (default: %(default)s)" if default else " (replay: evaluate coalitions the archive lacks)"),
    )
    from .backends.registry import BACKENDS

    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="hf",
        help="the model backend by name: hf (transformers, CPU or GPU), vllm (vLLM's engine in this process: pip install 'coalescence[vllm]'; float32 on the CPU) (default: %(default)s)",
    )
    p.add_argument(
        "--vllm-url",
        default=None,
        metavar="URL",
        help="score against a running `vllm serve` at http://HOST:PORT (its OpenAI-compatible completions "
        "endpoint) instead of loading the weights here; --model names the same model, whose tokenizer, "
        "chat template and context the server must match (checked before any coalition is scored)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype (default: %(default)s)"
    )
    p.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, help="rows per model call (default: %(default)s)")


def _add_ray_options(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group(
        "Ray workers",
        "run the model in Ray actors (pip install 'coalescence[ray]'): the driver plans, renders and archives; "
        "each worker holds one copy of the model and takes conversations whole",
    )
    ray.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="N model workers: on a local Ray cluster started for the run, or on the --ray-address cluster "
        "(default: in this process; with --ray-address, one per GPU with --gpus-per-worker, else 2)",
    )
    ray.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="join this Ray cluster (auto, HOST:PORT) instead of starting one"
    )
    ray.add_argument(
        "--gpus-per-worker",
        type=float,
        default=0.0,
        metavar="G",
        help="accelerators each worker reserves (with --device cuda) (default: %(default)s)",
    )
    ray.add_argument(
        "--threads-per-worker",
        type=_positive_int,
        default=None,
        metavar="T",
        help="torch threads per worker (default: its node's CPUs divided among the workers there)",
    )


def _add_archive_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flush-rows", type=_positive_int, default=4096, help="rows per archive part (default: %(default)s)")
    p.add_argument(
        "--flush-seconds",
        type=_positive_float,
        default=30.0,
        help="longest time evaluated rows wait before a part is written (default: %(default)s)",
    )
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="set aside archive parts that fail verification (moved to RUN_DIR/quarantine/; a run evaluates "
        "their coalitions again)",
    )


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


def _add_game_options(p: argparse.ArgumentParser) -> None:
    """The options of the game an explain run or a sweep plays: players, absence policy, utility."""
    from .conversation import ROLES, UNITS
    from .masking.policies import available_policies
    from .utility import UTILITY_KINDS

    p.add_argument(
        "--unit",
        choices=UNITS,
        default=None,
        help="player unit: turn, paragraph, sentence, word, tool (a tool call and its results), "
        "exchange (a user turn and the reply to it; the last user turn stays), document (the input's "
        "declared players or RAG documents) (default: document when the input declares players, else turn)",
    )
    p.add_argument(
        "--template",
        metavar="JSON",
        default=None,
        help='RAG prompt template, a JSON file {"system", "user", "document", "separator"} '
        "(default: the one in the README)",
    )
    p.add_argument(
        "--system-absent",
        choices=("removed", "empty"),
        default="removed",
        help="drop policy: a system message whose players are all absent is removed, or kept "
        "with empty content (default: %(default)s)",
    )
    p.add_argument(
        "--empty-turns",
        choices=("removed", "empty"),
        default="removed",
        help="drop policy: a message (any role) whose players are all absent is removed, or kept with "
        "empty content so every coalition keeps the conversation's sequence of roles, as templates "
        "that require alternating roles need for units finer than a turn (default: %(default)s)",
    )
    p.add_argument(
        "--merge-adjacent",
        action="store_true",
        help="render adjacent messages of the same role (system, user, assistant) as one message, "
        "joined by a blank line, in every coalition: dropping a turn then never puts two user turns "
        "side by side (templates that require alternating roles)",
    )
    p.add_argument(
        "--roles",
        default=None,
        help=f"comma-separated roles whose messages are players (default: all of {','.join(ROLES)}); "
        "messages of other roles stay in every coalition",
    )
    p.add_argument(
        "--absence-policy",
        choices=available_policies(),
        default="drop",
        help="how an absent player disappears: drop its text (a turn removes its message) or "
        "replace it with --placeholder (default: %(default)s)",
    )
    p.add_argument("--placeholder", default="[removed]", help="placeholder text (default: %(default)s)")
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        help="length limit when the answer is generated, and of each regenerated answer; with the prompt it must "
        "fit the model's context (default: %(default)s)",
    )
    p.add_argument("--utility", choices=UTILITY_KINDS, default="logprob", help=_UTILITY_HELP + " (default: %(default)s)")
    _add_span_options(p)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="regenerate utilities: 0 decodes greedily, > 0 samples at this temperature (default: %(default)s)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="regenerate utilities: nucleus sampling mass (default: %(default)s)")
    p.add_argument(
        "--num-samples",
        type=_positive_int,
        default=1,
        help="regenerate utilities: sampled answers per coalition (at most 1024), similarities averaged; each "
        "sample's seed derives from --seed, the coalition and the sample index (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``coalescence`` command."""
    from .attribution.estimators import METHODS
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
        "efficiency imposed, standard errors); regression-msr: regression-adjusted KernelSHAP (Witter, "
        "Liu & Musco 2025: KernelSHAP's coalitions and fit, its residuals corrected by stratified Monte "
        "Carlo; the lowest error of the sampling methods on real games, standard errors); banzhaf: Banzhaf values (maximum sample reuse); "
        "lasso: ContextCite-style sparse linear surrogate; loo: leave-one-out; auto: chosen by players and "
        "budget (the output says which ran and why); shapiq:NAME: "
        "a shapiq approximator through this engine (e.g. shapiq:SVARM, shapiq:KernelSHAPIQ, "
        "shapiq:ProxySPEX; needs the shapiq extra; shapiq:RegressionMSR and the other approximators of "
        "shapiq 1.5+ run in the external shapiq that make install sets up, or COALESCENCE_SHAPIQ_PYTHON names)"
    )
    interactions_help = (
        "also compute interactions of sets of 2..ORDER players (--method exact, or a shapiq "
        "interaction approximator such as shapiq:KernelSHAPIQ, shapiq:SVARMIQ, shapiq:SHAPIQ); the "
        "--out document gets an interactions list and the table the top ones"
    )
    index_help = "--interactions: the interaction index: SII, k-SII, FSII or STII (default: k-SII)"
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
        'form {"documents", "question", "answer"}), a .jsonl file with one input per line, or a .parquet '
        "dataset with one input per row (a messages column and the optional fields as columns)",
    )
    _add_model_options(ex, default="smollm2-135m")
    _add_game_options(ex)
    ex.add_argument(
        "--hierarchy",
        metavar="COARSE,FINE",
        default=None,
        help="hierarchical attribution: attribute at COARSE, then refine the --top-k coarse players "
        "at FINE with the rest held present (e.g. document,sentence)",
    )
    ex.add_argument("--top-k", type=_positive_int, default=None, help="--hierarchy: coarse players refined (default: 3)")
    ex.add_argument(
        "--method", default=None, metavar="METHOD",
        help=f"{', '.join(METHODS)} or shapiq:NAME. " + methods_help + " (default: exact; auto when --budget is given: "
        "lasso's sparse surrogate for many players on a budget under 5 per player, else regression-msr)",
    )  # fmt: skip
    ex.add_argument("--interactions", type=_positive_int, default=None, metavar="ORDER", help=interactions_help)
    ex.add_argument("--index", default=None, choices=("SII", "k-SII", "FSII", "STII"), help=index_help)
    ex.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="sampling methods (permutation, kernelshap, regression-msr, banzhaf, lasso, shapiq:NAME): the most distinct "
        "model evaluations (default: 32 x players)",
    )
    ex.add_argument("--seed", type=_seed, default=0, help="seed of the sampling plan (default: %(default)s)")
    ex.add_argument(
        "--target-stderr",
        type=_positive_float,
        default=None,
        metavar="NATS",
        help="permutation, kernelshap, regression-msr, banzhaf: sample in doubling rounds until every player's "
        "standard error is below NATS or --budget is spent (the output says which)",
    )
    ex.add_argument(
        "--archive",
        metavar="RUN_DIR",
        default=None,
        help="run archive directory: created if new, resumed if it holds this run "
        "(default: a new runs/<UTC time>-<snapshot id>)",
    )
    ex.add_argument("--new-run", action="store_true", help="add a run with other settings to an existing --archive")
    ex.add_argument(
        "--max-conversations-in-flight",
        type=_positive_int,
        default=8,
        metavar="N",
        help="a dataset (.jsonl, .parquet): conversations evaluated at once through one scheduler, their "
        "coalitions filling the same batches (bounds memory) (default: %(default)s)",
    )
    _add_ray_options(ex)
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
    rp.add_argument(
        "--budget", type=_positive_int, default=None,
        help="sampling methods: distinct evaluations (default: the run's, for the run's method in a one-input run; else 32 x players)",
    )  # fmt: skip
    rp.add_argument("--seed", type=_seed, default=None, help="seed of the sampling plans (default: the run's)")
    rp.add_argument("--interactions", type=_positive_int, default=None, metavar="ORDER", help=interactions_help + " (default: the run's, for its method)")
    rp.add_argument("--index", default=None, choices=("SII", "k-SII", "FSII", "STII"), help=index_help)
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
    _add_ray_options(rp)
    _add_archive_options(rp)
    rp.add_argument("--out", metavar="JSON", default=None, help='write {"explanations": [...]} as JSON here')
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rp.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")

    _add_sweep_parser(sub, methods_help)
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


def _add_sweep_parser(sub: Any, methods_help: str) -> None:
    """The ``sweep`` command's arguments."""
    from .attribution.estimators import METHODS

    sw = sub.add_parser(
        "sweep",
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
    sw.add_argument(
        "--methods", required=True, help=f"comma-separated methods ({','.join(METHODS)}). " + methods_help
    )
    sw.add_argument(
        "--budgets",
        default="",
        help="comma-separated budgets of the sampling methods (permutation, kernelshap, regression-msr, banzhaf, lasso): "
        "the most distinct model evaluations, e.g. 64,128,256; a budget a method refuses for a "
        "conversation's number of players is a recorded skip",
    )
    sw.add_argument("--seeds", default="0", help="comma-separated seeds of the sampling plans (default: %(default)s)")
    sw.add_argument(
        "--out", metavar="DIR", required=True, help="output directory: results.parquet, and the run archive DIR/archive by default"
    )
    _add_model_options(sw, default="smollm2-135m")
    _add_game_options(sw)
    sw.add_argument(
        "--archive", metavar="RUN_DIR", default=None, help="run archive directory (default: DIR/archive); resumed if it holds this run"
    )
    sw.add_argument("--new-run", action="store_true", help="add a run with other settings to an existing --archive")
    sw.add_argument(
        "--max-conversations-in-flight",
        type=_positive_int,
        default=8,
        metavar="N",
        help="conversations evaluated at once through one scheduler, their coalitions filling the same "
        "batches (bounds memory) (default: %(default)s)",
    )
    _add_archive_options(sw)
    sw.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sw.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")


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
    rep.add_argument("--seed", type=_seed, default=None, help="run archive: seed of the sampling plans (default: the run's)")
    rep.add_argument("--run", default=None, help="run archive: run id (default: the last run)")


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
        page = render_report(report)
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


def _load_backend(args: argparse.Namespace, source: Any, **loaded: Any) -> Any:
    """Load the model's weights (``loaded``: the tokenizer, config and fingerprint already at hand)."""
    from .backends.registry import load_backend

    _quiet_transformers(args)
    if getattr(args, "vllm_url", None):
        from .backends.registry import load_config, load_tokenizer, model_context, model_fingerprint
        from .backends.vllm import VLLMServerBackend

        tokenizer = loaded.get("tokenizer") or load_tokenizer(source)
        config = loaded.get("config") or load_config(source)
        fingerprint = loaded.get("fingerprint")
        return VLLMServerBackend(
            args.vllm_url,
            tokenizer,
            model_id=source.model_id,
            revision=source.revision,
            fingerprint=fingerprint if fingerprint is not None else model_fingerprint(source),
            max_context=model_context(config, tokenizer),
            max_batch_size=args.batch_size,
        )
    if not args.no_progress:
        print(f"coalescence: loading {source.model_id} ...", file=sys.stderr, flush=True)
    return load_backend(
        source, backend=args.backend, device=args.device, dtype=args.dtype, max_batch_size=args.batch_size, **loaded
    )


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


def _game_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings an explain run and a sweep share (model, game, archive), by their library names."""
    return {
        "model": args.model,
        "backend": args.backend,
        "unit": args.unit,
        "roles": args.roles,
        "absence_policy": args.absence_policy,
        "placeholder": args.placeholder,
        "system_absent": args.system_absent,
        "empty_turns": args.empty_turns,
        "merge_adjacent": args.merge_adjacent,
        "utility": args.utility,
        "target_span": args.target_span,
        "target_substring": args.target_substring,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "num_samples": args.num_samples,
        "max_new_tokens": args.max_new_tokens,
        "template": args.template,
        "device": args.device,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "archive": args.archive if args.archive is not None else True,  # the CLI always keeps a run archive
        "new_run": args.new_run,
        "flush_rows": args.flush_rows,
        "flush_seconds": args.flush_seconds,
        "skip_corrupt": args.skip_corrupt,
        "max_conversations_in_flight": args.max_conversations_in_flight,
    }


def _explain_settings(args: argparse.Namespace) -> Any:
    from .app.settings import RunSettings

    return RunSettings(
        **_game_settings(args),
        method=args.method,
        budget=args.budget,
        seed=args.seed,
        interactions=args.interactions,
        index=args.index,
        target_stderr=args.target_stderr,
        hierarchy=args.hierarchy,
        top_k=args.top_k,
        out=args.out,
        html=args.html,
        workers=args.workers,
        ray_address=args.ray_address,
        gpus_per_worker=args.gpus_per_worker,
        threads_per_worker=args.threads_per_worker,
    )


def _explain(args: argparse.Namespace) -> int:
    from .app.explain import ExplainRun
    from .scheduler.progress import TqdmProgress

    # 1. inputs and settings; 2. the tokenizer and template, every coalition rendered: no weights yet
    run = ExplainRun(args.input, _explain_settings(args))
    _quiet_transformers(args)
    run.preflight()
    # 3. the weights, snapshots and targets; 4. the archive, created or resumed
    if run.settings.distributed and not args.no_progress:
        where = f"on the Ray cluster at {args.ray_address}" if args.ray_address else "on a local Ray cluster"
        n = f"{args.workers} " if args.workers else ""
        print(f"coalescence: starting {n}Ray workers with {run.settings.model} {where} ...", file=sys.stderr, flush=True)
    run.load(
        progress=TqdmProgress("coalitions", disable=args.no_progress),
        loader=lambda source, **preloaded: _load_backend(args, source, **preloaded),
    )
    run.open_archive()
    _STATE["archive"], _STATE["engine"] = str(run.run_dir), run.engine
    if run.archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run.run_dir}: {run.resumed_coalitions} coalitions already evaluated", file=sys.stderr)
        if run.archive.results:
            print(f"coalescence: {len(run.archive.results)} conversations finished before are restored, not planned again", file=sys.stderr)
    # 5. the run, closed with its status; 6. the documents
    explanations = _finish(run.engine, run.evaluate)
    try:
        payload = run.write_out(explanations)
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {run.out_path}: {exc}", field="out")
        raise _RunFailed(error) from exc
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
    from .app.settings import RunSettings
    from .scheduler.progress import TqdmProgress
    from .app.sweeps import SweepRun, SweepSettings

    game = _game_settings(args)
    if args.archive is None:
        game.pop("archive")  # the sweep's default: OUT/archive
    settings = SweepSettings(methods=args.methods, budgets=args.budgets, seeds=args.seeds, out=args.out, run=RunSettings(**game))
    # the explain run's phases: inputs and settings, the tokenizer and template (every coalition
    # of every plan rendered), the weights, the archive created or resumed
    run = SweepRun(args.input, settings)
    _quiet_transformers(args)
    run.preflight()
    run.load(
        progress=TqdmProgress("coalitions", disable=args.no_progress),
        loader=lambda source, **preloaded: _load_backend(args, source, **preloaded),
    )
    run.open_archive()
    _STATE["archive"], _STATE["engine"] = str(run.run_dir), run.engine
    if run.archive.resumed and not args.no_progress:
        print(f"coalescence: resuming {run.run_dir}: {run.resumed_coalitions} coalitions already evaluated", file=sys.stderr)
    results = _finish(run.engine, run.evaluate)
    try:
        result = run.write(results)
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {run.out_path}: {exc}", field="out")
        raise _RunFailed(error) from exc
    print(result.summary)
    print(
        f"conversations {len(results)} ({result.restored_conversations} restored from the archive)   "
        f"model evaluations this session {result.model_evaluations}"
    )
    print(f"results: {result.path}   archive: {result.run_dir}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .app.replay import ReplayRun
    from .app.settings import ReplaySettings
    from .scheduler.progress import TqdmProgress

    settings = ReplaySettings(
        methods=args.method,
        budget=args.budget,
        seed=args.seed,
        interactions=args.interactions,
        index=args.index,
        run_id=args.run,
        snapshot=args.snapshot,
        utility=args.utility,
        target_span=args.target_span,
        target_substring=args.target_substring,
        whole_answer=args.whole_answer,
        model=args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        batch_size=args.batch_size,
        flush_rows=args.flush_rows,
        flush_seconds=args.flush_seconds,
        skip_corrupt=args.skip_corrupt,
        out=args.out,
        workers=args.workers,
        ray_address=args.ray_address,
        gpus_per_worker=args.gpus_per_worker,
        threads_per_worker=args.threads_per_worker,
    )
    replay = ReplayRun(args.run_dir, settings)
    if not replay.needs_model or args.model is None:
        explanations = replay.fit()  # with no model; names the missing coalitions when there are some
    else:
        _quiet_transformers(args)
        replay.load(
            progress=TqdmProgress("coalitions", disable=args.no_progress),
            loader=lambda source: _load_backend(args, source),
        )
        replay.open_archive()
        _STATE["archive"], _STATE["engine"] = str(args.run_dir), replay.engine
        try:
            explanations = _finish(replay.engine, replay.evaluate)
        except ArchiveError as exc:
            raise _RunFailed(exc) from exc
    try:
        replay.write(explanations)  # before printing: a closed output must not lose the document
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {replay.out_path}: {exc}", field="out")
        raise _RunFailed(error) from exc
    for explanation in explanations:
        print(explanation.format_table())
        print()
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
            sha = f" (sha256 {model['sha256'][:12]})" if isinstance(model.get("sha256"), str) and model["sha256"] else ""
            print(
                f"run             {r['run_id']} started {r.get('started_at')} [{r.get('status')}] model {model.get('id')}{sha} "
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
            signal during the interpreter's shutdown cannot raise either, and after a signal
            stopped the command it ends the process with that code itself (outputs flushed,
            ``os._exit``), so a further signal cannot change the exit status; a caller passing
            ``argv`` gets its own handlers back on return.
    """
    interrupts = Interrupts()
    interrupts.install()
    _STATE["interrupts"] = interrupts
    try:
        code = _main(argv, interrupts)
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
    commands = {"explain": _explain, "replay": _replay, "sweep": _sweep, "archive": _archive, "report": _report}
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
    except ReportError as exc:
        return _fail(exc, 4)
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
