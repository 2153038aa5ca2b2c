"""The ``coalescence`` command line.

``coalescence explain INPUT`` attributes a model's answer to the parts of a chat conversation and
prints a ranked table; ``--out`` writes the stable JSON document, ``--archive`` the run archive.

Exit codes: 0 success; 2 bad input or settings (one line on stderr naming the field and the fix,
nothing written); 1 a model, archive or output failure once the run has started (what was
evaluated stays in the archive); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from . import __version__
from .errors import ArchiveError, BatchFailed, CoalescenceError, ConfigError

__all__ = ("build_parser", "main")

logger = logging.getLogger("coalescence")


class _RunFailed(Exception):
    """A failure after the run started (exit 1), wrapping the library error."""

    def __init__(self, error: CoalescenceError) -> None:
        super().__init__(str(error))
        self.error = error


_UNBUDGETED = ("exact", "loo")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``coalescence`` command."""
    from .attribution.estimators import METHODS
    from .conversation import ROLES, UNITS
    from .masking.policies import available_policies

    parser = argparse.ArgumentParser(
        prog="coalescence",
        description="Coalition attribution for language models: how much each part of a chat "
        "conversation drives the model's answer (Shapley-style values, in nats of log-probability).",
    )
    parser.add_argument("--version", action="version", version=f"coalescence {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser(
        "explain",
        help="attribute an answer to the parts of a conversation",
        description="Attribute the target answer of a chat conversation to its players. INPUT is a "
        'JSON file {"messages": [{"role", "content"}, ...], "target"?}: the last assistant message '
        'is the answer explained, or the "target" string; if the conversation ends on another role '
        "the model generates the answer once, greedily.",
    )
    ex.add_argument("input", metavar="INPUT", help="conversation JSON file (OpenAI chat format)")
    ex.add_argument(
        "--model",
        default="smollm2-135m",
        help="model alias (smollm2-135m), local model directory, .gguf file or hub id (default: %(default)s)",
    )
    ex.add_argument("--unit", choices=UNITS, default="turn", help="player unit (default: %(default)s)")
    ex.add_argument(
        "--roles",
        default=None,
        help=f"comma-separated roles whose messages are players (default: all of {','.join(ROLES)}); "
        "messages of other roles stay in every coalition",
    )
    ex.add_argument(
        "--method",
        choices=METHODS,
        default="exact",
        help="exact: exact Shapley values, all 2^n coalitions (n <= 16); permutation: antithetic "
        "permutation sampling with standard errors; kernelshap: KernelSHAP (paired sampling, "
        "efficiency imposed, standard errors); banzhaf: Banzhaf values (maximum sample reuse); "
        "lasso: ContextCite-style sparse linear surrogate; loo: leave-one-out (default: %(default)s)",
    )
    ex.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="sampling methods (permutation, kernelshap, banzhaf, lasso): the most distinct model "
        "evaluations (default: 32 x players)",
    )
    ex.add_argument("--seed", type=int, default=0, help="seed of the sampling plan (default: %(default)s)")
    ex.add_argument(
        "--absence-policy",
        choices=available_policies(),
        default="drop",
        help="how an absent player disappears: drop its text (a turn removes its message) or "
        "replace it with --placeholder (default: %(default)s)",
    )
    ex.add_argument("--placeholder", default="[removed]", help="placeholder text (default: %(default)s)")
    ex.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    ex.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype (default: %(default)s)"
    )
    ex.add_argument("--batch-size", type=_positive_int, default=4, help="rows per model call (default: %(default)s)")
    ex.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        help="length limit when the answer is generated (default: %(default)s)",
    )
    ex.add_argument(
        "--archive",
        metavar="RUN_DIR",
        default=None,
        help="run archive directory to create (default: runs/<UTC time>-<snapshot id>)",
    )
    ex.add_argument("--out", metavar="JSON", default=None, help="write the explanation as JSON here")
    ex.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ex.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    return parser


def _check_parent(path: Path, option: str) -> None:
    """Refuse a path whose nearest existing ancestor is not a writable directory."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{str(parent)!r} is a file, not a directory; give another path", field=option)
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"{str(parent)!r} is not writable; give another path", field=option)
            return


def _fail(exc: CoalescenceError, code: int) -> int:
    print(f"coalescence: error: {exc}", file=sys.stderr)
    return code


def _explain(args: argparse.Namespace) -> int:
    import anyio

    from .archive.writer import RunArchive, write_json_atomic
    from .attribution.estimators import make_estimator
    from .backends.registry import load_backend, resolve_model
    from .conversation import load_conversation, segment_players
    from .engine import UTILITY, Engine
    from .masking.policies import get_policy
    from .scheduler.progress import TqdmProgress

    # 1. everything that can be checked without the model, before loading it
    conversation = load_conversation(args.input)
    roles = None
    if args.roles is not None:
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        if not roles:
            raise ConfigError("give at least one role, e.g. --roles user,system", field="--roles")
    n_players = len(segment_players(conversation, unit=args.unit, roles=roles))
    policy_params = {"text": args.placeholder} if args.absence_policy == "placeholder" else {}
    policy = get_policy(args.absence_policy, **policy_params)
    budget = args.budget if args.budget is not None else 32 * n_players
    if args.method in _UNBUDGETED and args.budget is not None:
        raise ConfigError(
            f"--method {args.method} has a fixed number of evaluations; --budget applies to sampling "
            "methods (permutation, kernelshap, banzhaf, lasso)",
            field="--budget",
        )
    estimator = make_estimator(args.method, budget=budget, seed=args.seed)
    estimator.validate(n_players)
    out_path = Path(args.out) if args.out else None
    if out_path is not None:
        if out_path.is_dir():
            raise ConfigError(f"{args.out!r} is a directory; give a file path", field="--out")
        _check_parent(out_path, "--out")
    if args.archive is not None:
        run_dir = Path(args.archive)
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ConfigError(
                f"{args.archive!r} already exists and is not empty; choose a new path or delete it",
                field="--archive",
            )
        _check_parent(run_dir, "--archive")
    source = resolve_model(args.model)

    # 2. the model
    if not args.verbose:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    if not args.no_progress:
        print(f"coalescence: loading {source.model_id} ...", file=sys.stderr, flush=True)
    saved = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # silence third-party loading bars (GGUF de-quantization)
    try:
        backend = load_backend(source, device=args.device, dtype=args.dtype, max_batch_size=args.batch_size)
    finally:
        if saved is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = saved
    progress = TqdmProgress("coalitions", disable=args.no_progress)
    engine = Engine(backend, progress=progress, batch_size=args.batch_size)
    snapshot = engine.prepare(conversation, unit=args.unit, roles=roles, max_new_tokens=args.max_new_tokens)
    estimator.validate(snapshot.n_players)
    target = engine.target_tokens(snapshot)  # context-length check, before anything is written

    # 3. the run: only now is anything written
    if args.archive is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path("runs") / f"{stamp}-{snapshot.snapshot_id[:12]}"
    manifest = {
        "package_version": __version__,
        "run_config": {
            "command": "explain",
            "input": str(args.input),
            "unit": args.unit,
            "roles": roles,
            "method": args.method,
            "budget": None if args.method in _UNBUDGETED else budget,
            "seed": args.seed,
            "absence_policy": {"id": policy.id, "params": policy.params()},
            "device": args.device,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
        },
        "model": {"id": backend.model_id, "revision": backend.revision, "dtype": backend.dtype},
        "utility": UTILITY,
        "template_injects_default_system": engine.renderer.injects_default_system,
        "target_token_ids": list(target.ids),
        "snapshots": [snapshot.to_dict()],
    }
    engine.archive = RunArchive.create(run_dir, manifest)
    try:
        try:
            explanation = anyio.run(engine.explain, snapshot, estimator, policy)
        finally:
            progress.close()
            engine.close()
        document = explanation.to_dict()
        document["archive"] = str(run_dir)
        if out_path is not None:
            write_json_atomic(out_path, document)
    except ArchiveError as exc:
        raise _RunFailed(exc) from exc
    except OSError as exc:
        raise _RunFailed(ArchiveError(f"cannot write {out_path}: {exc}", field="--out")) from exc
    print(explanation.format_table())
    print(f"archive: {run_dir}" + (f"   json: {out_path}" if out_path else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command == "explain":
            return _explain(args)
        parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse enforces it
    except BatchFailed as exc:
        return _fail(exc, 1)
    except _RunFailed as exc:
        return _fail(exc.error, 1)
    except CoalescenceError as exc:
        return _fail(exc, 2)
    except KeyboardInterrupt:
        print("coalescence: interrupted; evaluated coalitions are in the archive", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
