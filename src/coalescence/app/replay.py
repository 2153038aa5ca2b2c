"""Replay runs: fit estimators from an archive (:func:`replay_run`).

With no model when the archive covers the plans (:class:`~coalescence.app.fit.ArchiveFit`), else
the missing coalitions are evaluated with the run's model through an engine and recorded in the
archive (:class:`ReplayRun`, phase by phase as an explain run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from ..errors import ArchiveError, CoalescenceError, ConfigError, EstimatorError, InputError
from .lifecycle import run_blocking
from .fit import ArchiveFit, select_run
from .outputs import output_path, refuse_overwrite
from .backend import load_model
from .record import check_backend, recorded_now
from .record import recorded_proxy, recorded_run_config
from .settings import ReplaySettings

__all__ = (
    "ReplayRun",
    "replay_run",
)


class ReplayRun:
    """A replay, phase by phase: :meth:`check` (the archive and the plans, no model);
    :meth:`fit` (no model) when nothing is missing, else :meth:`load`, :meth:`open_archive`,
    :meth:`evaluate` (async) and :meth:`close`; then :meth:`write`.

    Args:
        run_dir: the run directory.
        settings: the replay's settings.

    Raises:
        as :meth:`check`.
    """

    def __init__(self, run_dir: str | Path, settings: ReplaySettings) -> None:
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.engine: Any = None
        self.archive: Any = None
        self.check()

    def check(self) -> None:
        """Read the archive, fix the utility replayed, and count what the plans lack.

        Raises:
            ArchiveError: no run, a damaged archive, a run this version cannot replay.
            ConfigError: an unknown run or snapshot, a utility the archive holds no measurement for.
            InputError: a sub-span outside an answer.
        """
        from ..archive.manifest import check_replayable
        from ..archive.reader import read_manifest
        from ..snapshot import ConversationSnapshot
        from ..utility import UtilitySpec, get_utility, parse_span

        s = self.settings
        span = parse_span(s.target_span) if isinstance(s.target_span, str) else s.target_span
        self.out_path = output_path(s.out, "out")
        refuse_overwrite({"out": self.out_path}, run_dirs={"RUN_DIR": self.run_dir})
        manifest = read_manifest(self.run_dir)
        run = select_run(manifest, s.run_id)
        check_replayable(self.run_dir, manifest, run)
        self.run = run
        try:
            run_utility = UtilitySpec.from_dict(run.get("utility") or {})
        except (ConfigError, TypeError, ValueError) as exc:
            raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot replay", field="archive") from exc
        kind = s.utility or run_utility.kind
        forced, run_forced = get_utility(kind).teacher_forced, run_utility.teacher_forced
        if not forced and run_forced:
            raise ConfigError(
                f"run {run['run_id']} scored the fixed answer ({run_utility.kind}); it holds no regenerated "
                f"answers to compare, so utility {kind} needs a new explain run",
                field="utility",
            )
        if forced and not run_forced:
            raise ConfigError(
                f"run {run['run_id']} regenerated answers ({run_utility.kind}); it holds no per-token scores, "
                f"so utility {kind} needs a new explain run",
                field="utility",
            )
        keep = span is None and s.target_substring is None and not s.whole_answer
        self.utility = UtilitySpec(
            kind=kind,
            span=run_utility.span if keep else span,
            substring=run_utility.substring if keep else s.target_substring,
            generation=run_utility.generation,
        )
        self.records = {r["snapshot_id"]: r for r in manifest.get("snapshots", [])}
        ids = [i for i in run["snapshot_ids"] if s.snapshot is None or i.startswith(s.snapshot)]
        if not ids:
            raise ConfigError(f"no snapshot of run {run['run_id']} starts with {s.snapshot!r}", field="snapshot")
        self.snapshots = [ConversationSnapshot.from_dict(self.records[i]) for i in ids]
        self.fit_ = ArchiveFit(self.run_dir, run, self.records, utility=self.utility, skip_corrupt=s.skip_corrupt)
        self.aligned: dict[str, Any] = {}
        offsets = run.get("target_token_offsets") or {}
        for snap in self.snapshots:
            if offsets.get(snap.snapshot_id) is None and (self.utility.span is not None or self.utility.substring is not None):
                if s.model is None:
                    raise ConfigError(
                        "this archive does not record the target tokens' characters (it predates answer "
                        f"sub-spans); pass --model {run['model']['id']} to align the span with the tokenizer",
                        field="target_span" if self.utility.span is not None else "target_substring",
                    )
                continue  # the engine aligns it with the model's tokenizer
            self.aligned[snap.snapshot_id] = self.fit_.resolved(snap)
        self.jobs = []
        for snap in self.snapshots:
            for method in s.methods:
                order, index = s.interactions_for(method, run)
                budget = s.budget_for(snap.n_players, method, run)
                estimator = self.fit_.estimator(method, budget, s.seed_for(run), interactions=order, index=index)
                self.fit_.validate(estimator, snap.n_players)
                self.jobs.append((snap, estimator))
        self.missing = [
            self.fit_.missing(snap, self.fit_.resolve(e, snap.n_players)[0].plan(snap.n_players)) if snap.snapshot_id in self.aligned else 1
            for snap, e in self.jobs
        ]

    @property
    def needs_model(self) -> bool:
        """Whether some plan needs coalitions the archive lacks."""
        return any(self.missing)

    def fit(self) -> list[Any]:
        """Fit every (snapshot, method) from the archive, with no model.

        Raises:
            EstimatorError: the archive lacks coalitions (pass a model to evaluate them).
        """
        if self.needs_model:
            k = next(i for i, m in enumerate(self.missing) if m)
            snap, estimator = self.jobs[k]
            budget = getattr(estimator, "budget", None)
            config = recorded_run_config(self.run)
            own, own_budget = config.get("method"), config.get("budget")
            held = ""
            if isinstance(own, str) and own != estimator.name:  # another method's plan: the run's own is held
                held = f", or replay the run's own method (--method {own}" + (f" --budget {own_budget}" if isinstance(own_budget, int) else "") + "), whose coalitions it holds"
            raise EstimatorError(
                f"the archive lacks {self.missing[k]} of the coalitions {estimator.name} plans"
                + (f" at budget {budget}" if isinstance(budget, int) else "")
                + f" for snapshot {snap.snapshot_id[:12]} under utility {self.utility.kind}; pass --model "
                f"{self.run['model']['id']} to evaluate them{held}",
                field="method",
            )
        return [
            self.fit_.explain(
                snap, e.name, getattr(e, "budget", None), self.settings.seed_for(self.run),
                interactions=getattr(e, "interactions", None), index=getattr(e, "index", None),
            )  # fmt: skip
            for snap, e in self.jobs
        ]

    def load(self, *, progress: Any = None, notify: Callable[[str], None] | None = None) -> Any:
        """Load the run's model to evaluate what the archive lacks
        (:func:`~coalescence.app.backend.load_model`).

        Args:
            progress: the engine's progress callbacks.
            notify: told in one line what is being loaded or started (the CLI prints it).

        Raises:
            ConfigError: no model given.
            InputError: a model other than the run's (its identity differs).
        """
        from ..backends.registry import resolve_model
        from ..engine import Engine, ProxyGame

        s = self.settings
        if s.model is None:
            raise ConfigError(f"the archive lacks coalitions; pass --model {self.run['model']['id']} to evaluate them", field="model")
        source = resolve_model(s.model)
        backend = load_model(s.backend_settings(), source, notify=notify)
        pinned = self.run.get("template_now")  # one date per run: a replay renders the run's
        now = recorded_now(self.run_dir, pinned) if pinned is not None else None
        recorded = recorded_proxy(self.run)  # a two-fidelity method plays the run's proxy game again
        engine = Engine(
            backend, store=self.fit_.store, progress=progress, utility=self.utility, now=now,
            proxy_game=None if recorded is None else ProxyGame(tail=recorded[0]),
        )  # fmt: skip
        engine.measurements.update(self.fit_.measurements)
        if engine.model != self.run["model"]:
            if backend.shutdown_with_engine:
                backend.shutdown()
            raise InputError(
                f"the model is {engine.model}, but the run was evaluated with {self.run['model']}; give the run's model",
                field="model",
            )
        try:
            check_backend(self.run_dir, backend.identity())  # the archive holds one engine's values
        except BaseException:
            if backend.shutdown_with_engine:
                backend.shutdown()
            raise
        for snap in self.snapshots:
            engine.resolved_utility(snap, self.fit_.policy)
        self.engine = engine
        return engine

    def open_archive(self) -> Any:
        """Open the archive for the evaluated coalitions (a new run when the utility differs)."""
        from ..archive.writer import RunArchive

        s, run = self.settings, self.run
        description = {k: v for k, v in run.items() if k not in ("run_id", "started_at", "status", "resumed_at", "statistics")}
        description |= {"utility": self.utility.to_dict(), "snapshots": [self.records[i] for i in run["snapshot_ids"]]}
        description["backend"] = dict(self.engine.backend.identity())
        self.archive = RunArchive.open(
            self.run_dir,
            description,
            new_run=self.utility.to_dict() != run.get("utility"),
            skip_corrupt=s.skip_corrupt,
            flush_rows=s.flush_rows,
            flush_seconds=s.flush_seconds,
        )
        self.engine.attach_archive(self.archive)
        return self.archive

    async def evaluate(self) -> list[Any]:
        """Evaluate what the archive lacks and fit every (snapshot, method)."""
        return [await self.engine.explain(snap, e, self.fit_.policy) for snap, e in self.jobs]

    def close(self, status: str) -> None:
        """Close the engine and archive with ``status``."""
        if self.engine is not None:
            self.engine.close(status=status)

    def document(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """The replay's ``--out`` document."""
        documents = [e.to_dict() | {"archive": str(self.run_dir)} for e in explanations]
        return {"run_dir": str(self.run_dir), "run_id": self.run["run_id"], "explanations": documents}

    def write(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document when asked for; returns it."""
        from ..archive.writer import write_json_atomic

        payload = self.document(explanations)
        if self.out_path is not None:
            write_json_atomic(self.out_path, payload, field="out")
        return payload


def replay_run(run_dir: str | Path, settings: ReplaySettings, *, progress: Any = None) -> list[Any]:
    """A whole replay, synchronously: fitted with no model when the archive covers the plans,
    else the missing coalitions evaluated with ``settings.model`` (and archived).

    Returns:
        The explanations, one per (snapshot, method).
    """

    replay = ReplayRun(run_dir, settings)
    if not replay.needs_model:
        explanations = replay.fit()
    else:
        replay.load(progress=progress)
        replay.open_archive()
        status = "interrupted"
        try:
            explanations = run_blocking(replay.evaluate)
            status = "complete"
        except CoalescenceError:
            status = "failed"
            raise
        finally:
            replay.close(status)
    replay.write(explanations)
    return explanations
