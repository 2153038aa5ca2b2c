"""How faithful is an explanation? Its values checked against fresh exact coalitions of its game.

``coalescence evaluate RUN_OR_DOC`` re-creates the game an explanation was fitted on (the same
conversation snapshot, model, absence policy and utility, read from the run archive's manifest as
``replay`` reads it), evaluates held-out coalitions of it exactly through the engine, and reports:

the measures of :mod:`coalescence.attribution.faithfulness`: the **LDS** (Spearman's rank
correlation of ``sum_{i in S} phi_i`` against ``v(S)`` over ``coalitions`` distinct random
keep-half coalitions) and the **top-k removal drops**, k = 1, 3, 5, against k random players (the
mean over ``random_draws`` draws), each with a percentile-bootstrap 95% interval.

The held-out coalitions are none of the plans the archive holds (:mod:`coalescence.app.heldout`:
every exact row of the snapshot but those evaluate wrote is skipped by the draw), distinct, and
capped at the coalitions that lie outside the plans; fewer than
:data:`~coalescence.attribution.faithfulness.MIN_COALITIONS` of them is refused (an exact run's
plan holds every coalition: its ``--out`` document is evaluated in a new archive instead). The
result says how many were drawn fresh and what the draw skipped. Every coalition is deterministic
given ``seed`` and the archive's plans (so later evaluations of the same game reuse them) and is an
ordinary exact coalition of the game: it is written into the run archive under its coalition key
(its row's ``run_id`` is ``evaluate:<run id>``), where a later ``evaluate`` or a ``replay`` finds it
with no model call. Replays fit on their estimator's plan only
(:func:`~coalescence.engine.pool_from_store` looks up the plan's rows), so the added rows cannot
change what they fit. An explanation of another model than the archive's is refused. A
hierarchical explanation is evaluated at its coarse level. A document that names no run archive
re-creates its game in a new one (``archive``): its conversation segmented again by its unit (the
snapshot id must come back), its model, policy and utility; that run records ``command: evaluate``
and no method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attribution.faithfulness import (
    CONFIDENCE,
    Drop,
    HeldOut,
    Interval,
    linear_datamodeling_score,
    removal_drops,
    removal_rows,
)
from ..backends.settings import BackendSettings
from ..errors import ArchiveError, CoalescenceError, ConfigError, InputError
from .groups import RaySettings

if TYPE_CHECKING:
    from .settings import EvaluateSettings

__all__ = ("Evaluation", "Faithfulness", "evaluate_source")

# the model options a re-created run takes from the command: every field of the backend settings
# but the model (the document's unless given) and the Ray workers (the loaded backend is passed on)
_MODEL_OPTIONS = tuple(f.name for f in dataclasses.fields(BackendSettings) if f.name not in {"model", *(g.name for g in dataclasses.fields(RaySettings))})


@dataclass(frozen=True, slots=True, kw_only=True)
class Faithfulness:
    """One explanation's faithfulness on fresh coalitions of its game.

    Attributes:
        method: the explanation's estimator.
        snapshot_id: its conversation snapshot.
        unit: the values' unit (``nats`` for ``logprob``).
        n_players: players of the game.
        coalitions: held-out keep-half coalitions the LDS is computed over, distinct, each drawn
            fresh: none of them in a plan the archive holds (:mod:`coalescence.app.heldout`).
        asked: the coalitions asked for (``coalitions`` is fewer when capped: only that many
            coalitions of the game lie outside the plans, and every one is taken).
        plan_coalitions: coalitions of the game the archive holds as plan rows (excluded).
        skipped_plan: draws skipped because a plan held them.
        skipped_repeat: draws skipped because an earlier draw gave the same coalition.
        lds: Spearman's rank correlation of ``sum_{i in S} phi_i`` against ``v(S)``.
        v_full: ``v(N)``, every player present.
        drops: one per k of :data:`~coalescence.attribution.faithfulness.DROP_KS` below ``n_players``.
        notes: how the explanation was fitted where it matters to its score (e.g. ``exact rows
            only: ...`` for a two-fidelity method fitted without proxy rows).
    """

    method: str
    snapshot_id: str
    unit: str
    n_players: int
    coalitions: int
    asked: int
    plan_coalitions: int
    skipped_plan: int
    skipped_repeat: int
    lds: Interval
    v_full: float
    drops: tuple[Drop, ...]
    notes: tuple[str, ...] = ()

    @property
    def capped(self) -> bool:
        """Whether fewer coalitions than asked lie outside the plans (all of them were taken)."""
        return self.coalitions < self.asked

    def held_out_line(self) -> str:
        """One line: how many held-out coalitions were drawn fresh and what the draw skipped."""
        plans = f"{self.plan_coalitions} coalition{'s' if self.plan_coalitions != 1 else ''} in the archive's plans"
        if self.capped:
            return (
                f"held out: capped at the {self.coalitions} coalitions of the game outside the {plans} "
                f"({self.asked} asked, {2**self.n_players} in all): every one of them"
            )
        if self.coalitions == 2**self.n_players - self.plan_coalitions:
            return f"held out: every one of the {self.coalitions} coalitions of the game outside the {plans}"
        return (
            f"held out: {self.coalitions} distinct coalitions drawn fresh, none of the {plans}; "
            f"skipped {self.skipped_plan} draw{'s' if self.skipped_plan != 1 else ''} a plan held "
            f"and {self.skipped_repeat} repeat{'s' if self.skipped_repeat != 1 else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "snapshot_id": self.snapshot_id,
            "value_unit": self.unit,  # as an explanation document names it ("unit" there is the players')
            "n_players": self.n_players,
            "coalitions": self.coalitions,
            "held_out": {
                "asked": self.asked,
                "fresh": self.coalitions,
                "capped": self.capped,
                "plan_coalitions": self.plan_coalitions,
                "skipped_in_plans": self.skipped_plan,
                "skipped_repeats": self.skipped_repeat,
            },
            "lds": self.lds.to_dict(),
            "v_full": self.v_full if math.isfinite(self.v_full) else None,
            "drops": [d.to_dict() for d in self.drops],
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """What ``coalescence evaluate`` reports.

    Attributes:
        source: the run archive or document evaluated.
        archive: the run archive holding the game's coalitions (the held-out ones added).
        results: one per explanation evaluated.
        seed: the seed of the coalitions and of the bootstrap.
        random_draws: random k-subsets per k.
        model_evaluations: coalitions evaluated with the model in this call.
        from_archive: distinct coalitions served from the archive, with no model call.
    """

    source: str
    archive: str
    results: tuple[Faithfulness, ...]
    seed: int
    random_draws: int
    model_evaluations: int
    from_archive: int

    def format(self) -> str:
        """A table: LDS per explanation, then the drops per k, then where the coalitions came from."""
        several = len({r.snapshot_id for r in self.results}) > 1
        lines = []
        for r in self.results:
            head = f"{r.method}" + (f" (snapshot {r.snapshot_id[:12]})" if several else "")
            lines.append(f"{head}: {r.n_players} players, v(full) {r.v_full:+.4f} {r.unit}")
            lines.append(f"  LDS (Spearman, {r.coalitions} keep-half coalitions): {r.lds.format()}   95% bootstrap interval")
            lines.append(f"  {r.held_out_line()}")
            if r.drops:
                lines.append(f"  {'k':>3}  {'drop top-k':>11}  {'drop random k (mean [95%])':>30}  {'top - random [95%]':>28}  removed")
                for d in r.drops:
                    removed = ", ".join(d.removed)
                    lines.append(
                        f"  {d.k:>3}  {d.top:>+11.4f}  {d.random.format('+.4f'):>30}  {d.difference.format('+.4f'):>28}  {removed}"
                    )
            lines.extend(f"  note: {note}" for note in r.notes)
            lines.append("")
        lines.append(
            f"drops in {self.results[0].unit if self.results else 'nats'}; random k: mean of {self.random_draws} draws; seed {self.seed}; "
            f"coalitions: {self.model_evaluations} evaluated with the model, {self.from_archive} from the archive {self.archive}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, strict (no NaN or infinity: ``null`` instead)."""
        return {
            "source": self.source,
            "archive": self.archive,
            "seed": self.seed,
            "random_draws": self.random_draws,
            "confidence": CONFIDENCE,
            "model_evaluations": self.model_evaluations,
            "from_archive": self.from_archive,
            "results": [r.to_dict() for r in self.results],
        }


# -- the application ---------------------------------------------------------------------------
@dataclass(slots=True)
class _Item:
    """One explanation to evaluate: its document, the game's run and snapshot."""

    document: Mapping[str, Any]
    values: list[float]
    snapshot: Any


def evaluate_source(
    source: str | Path, settings: EvaluateSettings, *, backend: Any = None, progress: Any = None, notify: Callable[[str], None] | None = None
) -> Evaluation:
    """Evaluate the explanations of ``source`` on fresh exact coalitions (module docs).

    Args:
        source: a run archive directory (its run's method fitted with no model, or ``methods``),
            or an ``--out`` JSON document (its explanations; the run archive it names, or
            ``settings.archive``, holds the game).
        settings: an :class:`~coalescence.app.settings.EvaluateSettings`.
        backend: a loaded backend to evaluate missing coalitions with, instead of loading
            ``settings.model`` (default: the run's model).
        progress: the engine's progress callbacks.
        notify: told in one line what model is being loaded, when one is (the CLI prints it).

    Returns:
        The :class:`Evaluation`; ``settings.out`` is written when given.

    Raises:
        InputError: not a run archive or an explanation document; a document whose archive does not
            hold its conversation, or holds another model's game; a conversation number out of
            range; fewer than ``MIN_COALITIONS`` coalitions of a game outside the archive's plans.
        ArchiveError: a damaged archive (unless ``skip_corrupt``); an archive locked by a running command.
        ConfigError: an unknown method; a document that names no archive and no ``archive`` given.
        EstimatorError: the archive lacks coalitions a method's plan needs.
        BackendUnavailable, BatchFailed: the model cannot be loaded or a model call failed.
    """
    from .outputs import output_path, refuse_overwrite
    from .report import report_source

    s = settings
    path = Path(source)
    out_path = output_path(s.out, "out")
    is_dir = path.is_dir()
    if is_dir and not (path / "manifest.json").is_file():
        raise InputError(f"{str(source)!r} is a directory but no run archive (it has no manifest.json); give a run directory or an --out document", field="RUN_OR_DOC")
    if not is_dir and not path.is_file():
        raise InputError(f"{str(source)!r} does not exist; give a run archive directory or an --out JSON document", field="RUN_OR_DOC")
    refuse_overwrite({"out": out_path}, sources={} if is_dir else {"RUN_OR_DOC": source}, run_dirs={"RUN_OR_DOC": source} if is_dir else None)
    if is_dir:
        try:
            report = report_source(
                path, methods=s.methods, budget=s.budget, run_id=s.run_id, conversation=s.conversation, skip_corrupt=s.skip_corrupt
            )
        except CoalescenceError as exc:  # the report names its argument SOURCE; here it is RUN_OR_DOC
            if exc.field != "SOURCE":
                raise
            raise type(exc)(exc.message, field="RUN_OR_DOC") from exc
        run_dir = path
    else:
        if s.methods is not None or s.budget is not None or s.run_id is not None:
            field = "method" if s.methods is not None else "budget" if s.budget is not None else "run"
            raise ConfigError(f"applies to a run archive directory; {str(source)!r} is an --out document", field=field)
        try:
            report = report_source(path)
        except CoalescenceError as exc:
            if exc.field != "SOURCE":
                raise
            raise type(exc)(exc.message, field="RUN_OR_DOC") from exc
        if s.archive is not None:
            run_dir = Path(s.archive)
        elif not report.archive:
            raise ConfigError(
                f"{str(source)!r} names no run archive; give --archive RUN_DIR: the run archive of its run (or a new "
                "directory: the game is re-created from the document there)",
                field="archive",
            )
        else:  # as written (relative to where explain ran), else relative to the document
            named = Path(report.archive)
            run_dir = named if named.is_absolute() or (named / "manifest.json").is_file() else path.parent / named
            if not (run_dir / "manifest.json").is_file():
                raise InputError(
                    f"the run archive the document names, {report.archive!r}, is not there; give --archive RUN_DIR (its run "
                    "archive, or a new directory: the game is re-created from the document there)",
                    field="archive",
                )
    if not is_dir:  # the output may not land inside the archive the coalitions go to
        refuse_overwrite({"out": out_path}, run_dirs={"archive": run_dir})
    documents = [e.document for e in report.entries]
    if not is_dir and s.conversation is not None:
        ids = list(dict.fromkeys(str(d.get("snapshot_id")) for d in documents))
        if not 0 <= s.conversation < len(ids):
            raise InputError(f"the document holds {len(ids)} conversation(s), numbered from 0; got {s.conversation}", field="conversation")
        documents = [d for d in documents if str(d.get("snapshot_id")) == ids[s.conversation]]
    game = _Game(run_dir, documents, s, backend=backend, source_dir=is_dir)
    results, executed, served = game.measure(progress=progress, notify=notify)
    evaluation = Evaluation(
        source=str(source),
        archive=str(run_dir),
        results=tuple(results),
        seed=s.seed,
        random_draws=s.random_draws,
        model_evaluations=executed,
        from_archive=served,
    )
    if out_path is not None:
        from ..archive.writer import write_json_atomic

        write_json_atomic(out_path, evaluation.to_dict(), field="out")
    return evaluation


class _Game:
    """The explanations' games in one run archive: the coalitions they need, served from the
    archive or evaluated (and archived) with the run's model."""

    def __init__(self, run_dir: Path, documents: Sequence[Mapping[str, Any]], settings: EvaluateSettings, *, backend: Any, source_dir: bool) -> None:
        from ..archive.reader import read_manifest, read_rows
        from ..utility import UtilitySpec
        from .fit import ArchiveFit
        from .heldout import fitted_plans, held_out_of, plan_coalitions

        self.run_dir, self.settings, self.backend = run_dir, settings, backend
        self.where = "RUN_OR_DOC" if source_dir else "archive"  # the argument that named the archive
        self.source_dir = source_dir
        if not (run_dir / "manifest.json").is_file():
            if source_dir:
                raise InputError(f"{str(run_dir)!r} is no run archive", field="RUN_OR_DOC")
            self._create(documents)
        manifest = read_manifest(run_dir)
        self.records = {r["snapshot_id"]: r for r in manifest.get("snapshots") or []}
        first = documents[0] if documents else {}
        run = self._run_of(manifest, first)
        self.run = run
        try:
            self.utility = UtilitySpec.from_dict(run.get("utility") or {})
        except (CoalescenceError, TypeError, ValueError) as exc:
            raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot evaluate", field="archive") from exc
        table = read_rows(run_dir, skip_corrupt=settings.skip_corrupt)
        self.fit = ArchiveFit(run_dir, run, self.records, utility=self.utility, rows=table, skip_corrupt=settings.skip_corrupt)
        self.items = [self._item(d) for d in documents]
        self.held: dict[str, tuple[HeldOut, int]] = {}  # by snapshot: the held-out draw, the plans' coalitions
        for item in self.items:
            snap = item.snapshot
            if snap.snapshot_id not in self.held:
                plans = plan_coalitions(table, snap.snapshot_id, snap.n_players)
                if source_dir:  # the plans fitted here, whose rows may be an earlier evaluate's
                    plans |= fitted_plans(self.fit, run, snap.n_players, methods=settings.methods, budget=settings.budget)
                held = held_out_of(snap, plans, coalitions=settings.coalitions, seed=settings.seed, field=self.where)
                self.held[snap.snapshot_id] = (held, len(plans))

    def _run_of(self, manifest: Mapping[str, Any], doc: Mapping[str, Any]) -> dict[str, Any]:
        """The archive's run that evaluated ``doc``'s game: the chosen run, else the last run
        holding its snapshot with its utility."""
        from ..utility import UtilitySpec
        from .fit import select_run

        runs = manifest.get("runs") or []
        if not runs:
            raise ArchiveError(f"{self.run_dir} records no run", field=self.where)
        if self.settings.run_id is not None:
            return select_run(manifest, self.settings.run_id)
        sid = doc.get("snapshot_id")
        holding = [r for r in runs if sid in (r.get("snapshot_ids") or ())]
        if not holding:
            raise InputError(
                f"run archive {str(self.run_dir)!r} does not hold snapshot {str(sid)[:12]} of the explanation; give the archive of its run",
                field=self.where,
            )
        detail = doc.get("utility_detail") or {"kind": doc.get("utility")}
        try:
            wanted = UtilitySpec.from_dict(dict(detail)).to_dict()
        except (CoalescenceError, TypeError, ValueError):
            wanted = None
        same = [r for r in holding if r.get("utility") == wanted]
        return (same or holding)[-1]

    def _item(self, doc: Mapping[str, Any]) -> _Item:
        from ..snapshot import ConversationSnapshot
        from ..utility import UtilitySpec

        sid = doc.get("snapshot_id")
        if sid not in (self.run.get("snapshot_ids") or ()) or sid not in self.records:
            raise InputError(
                f"run {self.run['run_id']} of {str(self.run_dir)!r} does not hold snapshot {str(sid)[:12]} of the explanation",
                field=self.where,
            )
        detail = doc.get("utility_detail") or {"kind": doc.get("utility")}
        try:
            wanted = UtilitySpec.from_dict(dict(detail)).to_dict()
        except (CoalescenceError, TypeError, ValueError) as exc:
            raise InputError(f"the explanation's utility {detail} cannot be read: {exc}", field="RUN_OR_DOC") from exc
        if wanted != self.utility.to_dict():
            raise InputError(
                f"the {doc.get('method')} explanation is of utility {wanted}; run {self.run['run_id']} measured "
                f"{self.utility.to_dict()}: evaluate it against the run of its own utility (--run), or replay that utility first",
                field="run",
            )
        try:
            snap = ConversationSnapshot.from_dict(self.records[sid])
        except InputError as exc:
            raise ArchiveError(f"run {self.run['run_id']}: {exc.message}", field="archive") from exc
        model = self.run.get("model") or {}
        if doc.get("model_id") is not None and (doc.get("model_id"), doc.get("model_revision")) != (model.get("id"), model.get("revision")):
            raise InputError(
                f"the explanation's model {doc.get('model_id')} (revision {doc.get('model_revision')}) is not the archive's "
                f"model {model.get('id')} (revision {model.get('revision')}, run {self.run['run_id']}); give the archive of "
                "the explanation's own run, or a new directory to re-create its game there",
                field=self.where,
            )
        players = doc.get("players") or []
        if len(players) != snap.n_players:
            raise InputError(f"the explanation has {len(players)} players, its snapshot {snap.n_players}", field="RUN_OR_DOC")
        values = [math.nan if p.get("value") is None else float(p["value"]) for p in players]
        return _Item(document=doc, values=values, snapshot=snap)

    def rows(self, item: _Item) -> list[np.ndarray]:
        """The coalitions ``item`` needs: its game's held-out ones, then its removals."""
        s = self.settings
        held = self.held[item.snapshot.snapshot_id][0]
        return [*held.masks, *removal_rows(item.values, draws=s.random_draws, seed=s.seed)]

    def measure(self, *, progress: Any = None, notify: Callable[[str], None] | None = None) -> tuple[list[Faithfulness], int, int]:
        """Evaluate what the archive lacks, then compute every explanation's statistics.

        Returns:
            The results, the coalitions evaluated with the model, those served from the archive.
        """
        needed: dict[str, tuple[Any, dict[bytes, np.ndarray]]] = {}
        for item in self.items:
            snap = item.snapshot
            rows = needed.setdefault(snap.snapshot_id, (snap, {}))[1]
            for row in self.rows(item):
                rows.setdefault(np.packbits(row).tobytes(), row)
        total = sum(len(rows) for _, rows in needed.values())
        missing = {sid: self.fit.missing(snap, rows.values()) for sid, (snap, rows) in needed.items()}
        executed = 0
        if any(missing.values()):
            # the engine shares the fit's store: what it evaluates is served to the fit below
            executed = self._evaluate([(snap, list(rows.values())) for sid, (snap, rows) in needed.items() if missing[sid]], progress, notify)

        from .heldout import unknown_plan

        results = []
        for item in self.items:
            snap = item.snapshot
            resolved = self.fit.resolved(snap)
            rows = self.rows(item)
            masks, utilities = self.fit.pool(snap, rows, resolved, str(item.document.get("method")))
            value_of = {np.packbits(m).tobytes(): float(u) for m, u in zip(masks, utilities, strict=True)}
            s = self.settings
            held, plans = self.held[snap.snapshot_id]
            v = [value_of[np.packbits(r).tobytes()] for r in held.masks]
            labels = [p.label for p in snap.players]
            results.append(
                Faithfulness(
                    method=str(item.document.get("method")),
                    snapshot_id=snap.snapshot_id,
                    unit=self.utility.unit,
                    n_players=snap.n_players,
                    coalitions=held.coalitions,
                    asked=held.asked,
                    plan_coalitions=plans,
                    skipped_plan=held.skipped_plan,
                    skipped_repeat=held.skipped_repeat,
                    lds=linear_datamodeling_score(item.values, held.masks, v, seed=s.seed),
                    v_full=value_of[np.packbits(np.ones(snap.n_players, dtype=bool)).tobytes()],
                    drops=removal_drops(item.values, labels, value_of, draws=s.random_draws, seed=s.seed),
                    notes=tuple(str(n) for n in item.document.get("notes") or () if str(n).startswith("exact rows only"))
                    + unknown_plan(str(item.document.get("method")), plans, source_dir=self.source_dir),
                )
            )
        return results, executed, total - executed

    def _evaluate(self, games: list[tuple[Any, list[np.ndarray]]], progress: Any, notify: Callable[[str], None] | None = None) -> int:
        """Evaluate ``games``' coalitions with the run's model (archived); returns the model evaluations."""
        from ..backends.registry import resolve_model
        from ..engine import Engine, counting_evaluations
        from .backend import load_model
        from .heldout import EvaluationArchive
        from .lifecycle import run_blocking
        from .record import recorded_now

        s, run = self.settings, self.run
        owned = self.backend is None
        if owned:
            model = s.model or run["model"]["id"]
            backend = load_model(s.backend_settings(), resolve_model(model), notify=notify)
        else:
            backend = self.backend
        pinned = run.get("template_now")
        now = recorded_now(self.run_dir, pinned) if pinned is not None else None
        try:
            engine = Engine(backend, store=self.fit.store, progress=progress, batch_size=s.batch_size, utility=self.utility, now=now)
            engine.measurements.update(self.fit.measurements)
            if engine.model != run["model"]:
                raise InputError(
                    f"the model is {engine.model}, but the run was evaluated with {run['model']}; give the run's model",
                    field="model",
                )
            for snap, _ in games:
                engine.resolved_utility(snap, self.fit.policy)
        except BaseException:
            if owned and backend.shutdown_with_engine:
                backend.shutdown()
            raise
        description = {k: v for k, v in run.items() if k not in ("run_id", "started_at", "status", "resumed_at", "statistics", "error")}
        description["snapshots"] = [self.records[i] for i in run["snapshot_ids"]]
        archive = EvaluationArchive.open(
            self.run_dir, description, new_run=False, skip_corrupt=s.skip_corrupt, flush_rows=s.flush_rows, flush_seconds=s.flush_seconds
        )
        engine.attach_archive(archive)

        async def evaluate() -> int:
            with counting_evaluations() as executed:
                for snap, rows in games:
                    await engine.evaluate(snap, self.fit.policy, rows)
            return executed[0]

        # the run's record keeps its own status and statistics whatever happens here: these rows
        # only add to its pool (an interrupted or failed evaluation keeps what it evaluated)
        try:
            executed = run_blocking(evaluate)
        finally:
            engine.archive = None
            try:
                if hasattr(progress, "close"):
                    progress.close()
                archive.close(status=str(run.get("status") or "complete"), statistics=run.get("statistics") or {})
            finally:
                engine.close()
        return executed

    def _create(self, documents: Sequence[Mapping[str, Any]]) -> None:
        """Re-create the explanation's game from its document in the new archive ``run_dir``: the
        conversation segmented again by its unit (its snapshot id must come back), its model, absence
        policy and utility; the run is recorded there with its snapshot (no coalition yet)."""
        from ..masking.policies import get_policy
        from ..utility import UtilitySpec
        from .explain import ExplainRun
        from .phases import ExplainPhases
        from .settings import RunSettings

        ids = list(dict.fromkeys(str(d.get("snapshot_id")) for d in documents))
        doc = documents[0]
        if len(ids) != 1:
            raise InputError(
                f"the document explains {len(ids)} conversations and names no run archive; re-create one at a time with --conversation K",
                field="conversation",
            )
        if any("extra" in p for p in doc.get("players") or ()):
            raise InputError("the document's players were declared over several spans; evaluate it with the run archive of its run", field="archive")
        s = self.settings
        try:
            policy = get_policy(str(doc.get("absence_policy")), **dict(doc.get("absence_params") or {}))
            utility = UtilitySpec.from_dict(dict(doc.get("utility_detail") or {"kind": doc.get("utility")}))
        except (CoalescenceError, TypeError, ValueError) as exc:
            raise InputError(f"the document's absence policy or utility cannot be re-created: {exc}", field="RUN_OR_DOC") from exc
        source = {"messages": list(doc.get("messages") or ()), "target": doc.get("target")}
        roles = tuple(dict.fromkeys(str(p.get("role")) for p in doc.get("players") or ()))
        model = s.model or str(doc.get("model_id"))
        # every model option the command has (a new one comes along unlisted), and the archive's
        options = {k: getattr(s, k) for k in _MODEL_OPTIONS + ("flush_rows", "flush_seconds") if hasattr(s, k)}
        settings = RunSettings(
            model=model, unit=str(doc.get("unit")), roles=roles, absence_policy=policy, utility=utility, method="loo",
            archive=self.run_dir, **options,
        )  # fmt: skip
        # no method fitted here: the run holds the game's coalitions only
        recorded = {"command": "evaluate", "explanation": {"method": doc.get("method"), "snapshot_id": ids[0]}}
        run = ExplainRun(source, settings, backend=self.backend, phases=ExplainPhases(config=recorded))
        if not run.conversations:
            raise InputError("the document holds no conversation", field="RUN_OR_DOC")
        run.preflight()
        run.load()
        try:
            snap = run.snapshots[0]
            if snap.snapshot_id != ids[0]:
                raise InputError(
                    f"segmenting the document's conversation again gives snapshot {snap.snapshot_id[:12]}, not its "
                    f"{ids[0][:12]} (a generated answer, or players declared by hand); evaluate it with the run archive of its run",
                    field="archive",
                )
            model_record = run.engine.model
            if (model_record.get("id"), model_record.get("revision")) != (doc.get("model_id"), doc.get("model_revision")):
                raise InputError(
                    f"the model is {model_record.get('id')} {model_record.get('revision')}, the explanation's "
                    f"{doc.get('model_id')} {doc.get('model_revision')}; give its model",
                    field="model",
                )
            run.open_archive()
        finally:
            if run.archive is not None:
                run.archive.close(status="complete")
        self.backend = run.backend  # loaded once: it evaluates the coalitions too
