"""The ``coalescence`` command line.

- ``coalescence explain INPUT``: attribute a model's answer to the parts of a chat conversation,
  print a ranked table, write the run archive (``--archive``; an existing run is resumed) and the
  JSON document (``--out``).
- ``coalescence replay RUN_DIR --method a,b``: fit estimators from an archive, with no model when
  the archive covers their plans (``--model`` evaluates only what is missing).
- ``coalescence archive info RUN_DIR`` / ``coalescence archive compact RUN_DIR``.

Exit codes: 0 success; 2 bad input or settings (one line on stderr naming the field and the fix,
nothing written); 1 a model, archive or output failure once the run has started (what was
evaluated stays in the archive); 130 interrupted.
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .errors import ArchiveError, BatchFailed, CoalescenceError, ConfigError, EstimatorError

__all__ = ("build_parser", "main")

logger = logging.getLogger("coalescence")

_UNBUDGETED = ("exact", "loo")
_STATE: dict[str, Any] = {}  # the run directory being written, for the interrupt message


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: the archive is flushed and closed before exiting (143)."""


def _on_sigterm() -> Any:
    """Turn SIGTERM into :class:`_Terminated` in the main thread; returns the previous handler."""

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated()

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a test thread)
        return None


class _RunFailed(Exception):
    """A failure after the run started (exit 1), wrapping the library error."""

    def __init__(self, error: CoalescenceError) -> None:
        super().__init__(str(error))
        self.error = error


class _Parser(argparse.ArgumentParser):
    """argparse with the command's error contract: one line naming the option, exit code 2."""

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
        "document (the input's declared players or RAG documents) (default: document when the "
        "input declares players, else turn)",
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


def _fail(exc: CoalescenceError, code: int) -> int:
    print(f"coalescence: error: {exc}", file=sys.stderr)
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


def _load_backend(args: argparse.Namespace, source: Any) -> Any:
    from .backends.registry import load_backend

    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    if not args.no_progress:
        print(f"coalescence: loading {source.model_id} ...", file=sys.stderr, flush=True)
    return load_backend(source, device=args.device, dtype=args.dtype, max_batch_size=args.batch_size)


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
        "target_token_offsets": {s.snapshot_id: [list(o) for o in engine.target_tokens(s).offsets] for s in snapshots},
        "snapshots": [s.to_dict() for s in snapshots],
    }


def _finish(engine: Any, run: Any) -> Any:
    """Run ``run`` (an async callable), closing the engine's archive with the right status."""
    import anyio

    status = "interrupted"
    try:
        result = anyio.run(run)
        status = "complete"
        return result
    except CoalescenceError:
        status = "failed"
        raise
    finally:
        progress = engine.progress
        if hasattr(progress, "close"):
            progress.close()
        try:
            engine.close(status=status)
        except ArchiveError as exc:
            raise _RunFailed(exc) from exc


def _explain(args: argparse.Namespace) -> int:
    from .archive.reader import corrupt_parts, read_manifest
    from .archive.writer import RunArchive, write_json_atomic
    from .attribution.estimators import make_estimator
    from .attribution.hierarchy import explain_hierarchical, fine_snapshot, parse_hierarchy
    from .backends.registry import resolve_model
    from .engine import Engine
    from .inputs import load_inputs, load_template
    from .masking.policies import get_policy
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
    if args.absence_policy == "placeholder":
        if args.system_absent != "removed":
            raise ConfigError("--system-absent applies to --absence-policy drop", field="--system-absent")
        policy = get_policy("placeholder", text=args.placeholder)
    else:
        policy = get_policy(args.absence_policy, **({"system_absent": args.system_absent} if args.system_absent != "removed" else {}))

    def estimator_for(n: int) -> Any:
        return make_estimator(args.method, budget=args.budget if args.budget is not None else 32 * n, seed=args.seed)

    out_path = _check_out(args.out)
    run_dir = Path(args.archive) if args.archive is not None else None
    if run_dir is not None:
        if run_dir.exists() and (not run_dir.is_dir() or (any(run_dir.iterdir()) and not (run_dir / "manifest.json").is_file())):
            raise ConfigError(
                f"{args.archive!r} exists and is not a run directory; choose a new path or delete it",
                field="--archive",
            )
        if (run_dir / "manifest.json").is_file():
            read_manifest(run_dir)  # a newer schema is refused before the model loads
            bad = corrupt_parts(run_dir)
            if bad and not args.skip_corrupt:
                raise ArchiveError(
                    f"part {bad[0]} of {args.archive!r} is corrupt or truncated ({len(bad)} in all); rerun "
                    "with --skip-corrupt to skip it (its coalitions are evaluated again)",
                    field="--archive",
                )
        _check_parent(run_dir, "--archive")
    source = resolve_model(args.model)

    # 2. the model, the snapshots and their target tokens (context-length check)
    backend = _load_backend(args, source)
    engine = Engine(
        backend, progress=TqdmProgress("coalitions", disable=args.no_progress), batch_size=args.batch_size, utility=utility
    )
    snapshots = []
    fines: list[Any] = []
    for conversation, unit in zip(conversations, units, strict=True):
        snapshot = engine.prepare(conversation, unit=unit, roles=roles, max_new_tokens=args.max_new_tokens)
        estimator_for(snapshot.n_players).validate(snapshot.n_players)
        snapshots.append(snapshot)
        if hierarchy is not None:
            fines.append(fine_snapshot(snapshot, hierarchy[1]))
    recorded = snapshots + [f for f, _ in fines]
    for k, snap in enumerate(snapshots):
        _on_line(k, is_batch, engine.resolved_utility, snap)  # a sub-span outside a target fails here, before the archive
    for snap in recorded:
        engine.resolved_utility(snap)
    targets = {s.snapshot_id: list(engine.target_tokens(s).ids) for s in recorded}

    # 3. the archive (created, or resumed after its identity is checked), then the run
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
            else "when every system player is absent" if system_players and policy.params().get("system_absent") != "empty"
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
    _STATE["archive"] = str(run_dir)
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
        if out_path is not None:
            write_json_atomic(out_path, {"archive": str(run_dir), "explanations": documents} if is_batch else documents[0])
    except (ArchiveError, OSError) as exc:
        error = exc if isinstance(exc, ArchiveError) else ArchiveError(f"cannot write {out_path}: {exc}", field="--out")
        raise _RunFailed(error) from exc
    for k, explanation in enumerate(explanations):
        if is_batch:
            print(f"== input {k + 1} of {len(explanations)} (snapshot {snapshots[k].snapshot_id[:12]}) ==")
        print(explanation.format_table())
        if is_batch:
            print()
    print(f"archive: {run_dir}" + (f"   json: {out_path}" if out_path else ""))
    return 0


def _replay(args: argparse.Namespace) -> int:
    import time

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
            engine.resolved_utility(snap)
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
        _STATE["archive"] = str(args.run_dir)
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
        write_json_atomic(out_path, {"run_dir": str(args.run_dir), "run_id": run["run_id"], "explanations": [e.to_dict() for e in explanations]})
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
            model = r.get("model") or {}
            policy = r.get("absence_policy") or {}
            kind = (r.get("utility") or {}).get("kind")
            print(
                f"run             {r['run_id']} started {r['started_at']} [{r.get('status')}] model {model.get('id')} "
                f"policy {policy.get('id')} utility {kind}"
            )
        for s in info["snapshots"]:
            print(f"snapshot        {s['snapshot_id'][:16]}  {s['coalitions']} coalitions")
        print(f"coalitions      {info['coalitions']} in {info['parts']} parts, {info['bytes']} bytes")
        print(f"cache-hit rate  {info['cache_hit_rate']:.3f}")
        print(f"tokens          {info['tokens_computed']} computed, {info['tokens_reused']} reused")
        print(f"model time      {info['model_seconds']:.1f} s")
        print(f"writes          first {info['first_write']}, last {info['last_write']}")
        return 0
    before, rows = compact(args.run_dir, skip_corrupt=args.skip_corrupt)
    print(f"compacted {args.run_dir}: {before} parts -> {1 if before else 0}, {rows} coalitions")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    # third-party loading bars (e.g. GGUF de-quantization) read TQDM_* defaults when tqdm is first
    # imported; our own bar passes its setting explicitly, so this silences only theirs
    os.environ.setdefault("TQDM_DISABLE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    commands = {"explain": _explain, "replay": _replay, "archive": _archive}
    previous = _on_sigterm()
    _STATE.pop("archive", None)
    try:
        return commands[args.command](args)
    except (BatchFailed, _RunFailed) as exc:
        return _fail(exc.error if isinstance(exc, _RunFailed) else exc, 1)
    except CoalescenceError as exc:
        return _fail(exc, 2)
    except KeyboardInterrupt as exc:
        where = _STATE.get("archive")
        saved = f"; evaluated coalitions are in {where} (run the same command to resume)" if where else ""
        print(f"coalescence: {'terminated' if isinstance(exc, _Terminated) else 'interrupted'}{saved}", file=sys.stderr)
        return 143 if isinstance(exc, _Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
