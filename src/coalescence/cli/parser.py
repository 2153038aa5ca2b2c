"""The ``coalescence`` command's argument parser: every run command's options generated from its
settings (:mod:`coalescence.app.groups`, one ``--help`` section per group), one example command and
the exit codes at the end of every ``--help``."""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from .._version import __version__
from .exit_codes import EXIT_CODES

__all__ = ("build_parser",)


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
        choice = re.match(r"invalid choice: ('[^']*') \(choose from (.*)\)", text, re.S)
        if choice:  # the one "did you mean" of the package (userinput.closest), for argparse's choices too
            from ..userinput import did_you_mean

            hint = did_you_mean(choice.group(1)[1:-1], re.findall(r"'([^']*)'", choice.group(2)))
            text = text.replace(f"invalid choice: {choice.group(1)}", f"invalid choice: {choice.group(1)}{hint}", 1)
        self.exit(2, f"coalescence: error: {field}: {' '.join(text.split())} (see {self.prog} --help)\n")


def _subcommand(sub: Any, name: str, *, example: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with one example command, then the exit codes."""
    return sub.add_parser(name, epilog=f"example:\n  {example}\n\n{EXIT_CODES}", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``coalescence`` command: each run command's options are generated
    from its settings (:mod:`coalescence.app.settings`), grouped in ``--help`` as the settings are."""
    from ..app.compare import CompareSettings
    from ..app.groups import ProgressSettings
    from ..app.options import add_options
    from ..app.report import ReportSettings
    from ..app.settings import EvaluateSettings, ReplaySettings, RunSettings
    from ..app.show import RENDER_OPTIONS, ShowSettings
    from ..app.sweeps import RUN_OPTIONS, SweepSettings

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
    add_options(ex, ProgressSettings)

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
    add_options(rp, ProgressSettings)

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
    RUN_OPTIONS.add(sw)
    add_options(sw, ProgressSettings)

    rep = _subcommand(
        sub,
        "report",
        example="coalescence report runs/eiffel -o eiffel.html --image eiffel.png",
        help="write explanations as one self-contained HTML page",
        description="Write the explanations of SOURCE as one self-contained HTML page (no script, no "
        "network request; opens from disk offline): the conversation with each player highlighted by "
        "its value, the answer's tokens, a ranked bar chart, the pairwise interactions of an --interactions "
        "run as a heatmap, and the run's facts; --image writes the ranked bar chart as a PNG or SVG file. "
        "SOURCE is a JSON document written by explain --out or replay --out (single, JSONL batch, hierarchy, "
        "replay), or a run archive directory, fitted with --method from the coalitions it holds, with no model.",
    )
    rep.add_argument("source", metavar="SOURCE", help="an --out JSON document or a run archive directory")
    add_options(rep, ReportSettings)

    cm = _subcommand(
        sub,
        "compare",
        example="coalescence compare runs/eiffel --method exact,kernelshap,lasso --budget 64 --html compare.html",
        help="compare explanations of one conversation side by side",
        description="Print the values of several explanations of one conversation side by side, players in the "
        "first one's rank order, with each one's agreement with the first (Spearman rank correlation, top-k "
        "overlap) and, where an exact explanation is among them, each one's error against it. SOURCE is an --out "
        "document or a run archive (fitted with no model, as `coalescence report`); one archive with --method a,b,c "
        "compares the methods.",
    )
    cm.add_argument("sources", metavar="SOURCE", nargs="+", help="--out JSON documents or run archive directories")
    add_options(cm, CompareSettings)

    ev = _subcommand(
        sub,
        "evaluate",
        example="coalescence evaluate docs/demo/eiffel.json --archive docs/demo/eiffel-held-out --coalitions 32",
        help="measure an explanation's faithfulness on fresh exact coalitions (LDS, top-k removal drops)",
        description="Re-create the game an explanation was fitted on (its conversation, model, absence policy and "
        "utility, from the run archive), evaluate held-out coalitions of it exactly, and print: the LDS (Spearman "
        "rank correlation of the sum of the present players' values against v(S) over distinct random keep-half "
        "coalitions, none of them one the archive holds as a row of a plan: it says how many it drew fresh and how "
        "many draws a plan held) and the drop v(full) - v(full without the top k players) for k = 1, 3, 5 against "
        "removing k random players, each with a 95% bootstrap interval. An exact run's plan is every coalition: "
        "evaluate its --out document with --archive NEW_DIR (its game re-created there). The coalitions are written "
        "into the run archive: a later evaluate or replay finds them with no model call, and replays fit only their "
        "own plan's coalitions.",
    )
    ev.add_argument("source", metavar="RUN_OR_DOC", help="a run archive directory or an --out JSON document")
    add_options(ev, EvaluateSettings)
    add_options(ev, ProgressSettings)

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
    add_options(sh, ShowSettings)
    RENDER_OPTIONS.add(sh)

    ar = _subcommand(sub, "archive", example="coalescence archive info runs/eiffel", help="inspect or compact a run archive",
                     description="Inspect a run archive (info) or merge its parts into one (compact).")  # fmt: skip
    ar_sub = ar.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    info = _subcommand(ar_sub, "info", example="coalescence archive info runs/eiffel --json", help="summary of a run archive",
                       description="Its runs, snapshots, coalitions, parts and bytes, cache hits, tokens and model time.")  # fmt: skip
    info.add_argument("run_dir", metavar="RUN_DIR", help="run archive directory")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.add_argument("--skip-corrupt", action="store_true", help="skip unreadable parts")
    cp = _subcommand(ar_sub, "compact", example="coalescence archive compact runs/eiffel",
                     help="merge the parts of a run archive into one, atomically")  # fmt: skip
    cp.add_argument("run_dir", metavar="RUN_DIR", help="run archive directory (not in use by a run)")
    cp.add_argument("--skip-corrupt", action="store_true", help="drop unreadable parts while compacting")
    return parser
