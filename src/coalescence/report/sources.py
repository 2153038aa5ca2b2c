"""What a report is made from: an ``--out`` JSON document, or a run archive fitted with no model.

:func:`load_source` reads SOURCE and returns a :class:`ReportInput`: the explanation documents
(the ``--out`` schema of :meth:`~coalescence.attribution.explanation.Explanation.to_dict`) grouped
as the page shows them. A JSON document may be a single explanation, a JSONL batch
``{"archive", "explanations"}``, a hierarchy ``{"hierarchy", "coarse", "fine"}`` or a replay
``{"run_dir", "run_id", "explanations"}``. A run archive directory is fitted with the estimators
asked for from the coalitions it holds (the replay machinery, no model): when it lacks coalitions a
plan needs, one error says to evaluate them with ``coalescence replay RUN_DIR --model``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArchiveError, CoalescenceError, ConfigError, EstimatorError, InputError

__all__ = ("Entry", "ReportInput", "archive_document", "load_source", "read_document")

_FIELD = "SOURCE"
_FORMS = (
    "an --out JSON document (single, JSONL batch, hierarchy or replay) or a run archive directory"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One item of a report: an explanation document, or both levels of a hierarchical run.

    Attributes:
        document: the explanation (``--out`` schema); for a hierarchy, its coarse level.
        fine: the fine level of a hierarchy (``None`` when it refined no fine player, or for a
            plain explanation).
        hierarchy: the ``hierarchy`` object of a hierarchical run (units, top_k, refined,
            n_evaluations), ``None`` otherwise.
    """

    document: dict[str, Any]
    fine: dict[str, Any] | None = None
    hierarchy: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportInput:
    """The explanations of one report, in order.

    Attributes:
        kind: ``"single"``, ``"hierarchy"``, ``"batch"`` (a JSONL run's document), ``"replay"``
            (a replay document) or ``"archive"`` (fitted from a run archive).
        entries: the items shown (one for a single explanation or a hierarchy).
        source: the path the input came from (``""`` for a document given in memory).
        archive: the run archive the explanations came from, when known.
        extra: further facts of the source (``run_id`` of a replay document).
    """

    kind: str
    entries: tuple[Entry, ...]
    source: str = ""
    archive: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_source(
    source: str | Path,
    *,
    methods: Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
) -> ReportInput:
    """Read a report's input: an ``--out`` JSON document, or a run archive directory.

    Args:
        source: a JSON file written by ``explain --out`` or ``replay --out``, or a run directory.
        methods: run archive only: the estimators fitted (default: the run's own method).
        budget: run archive only: the sampling methods' budget (default: the run's, for a run of one
            input with that method; else 32 x players, as ``replay``).
        seed: run archive only: the sampling plans' seed (default: the run's).
        run_id: run archive only: which run (default: the last one).

    Returns:
        The explanations to show.

    Raises:
        InputError: no such file, not JSON, or not a document of the ``--out`` schema (field
            ``SOURCE``, naming the field at fault).
        ConfigError: archive options given with a JSON document, or an unknown method.
        ArchiveError: a damaged or foreign archive.
        EstimatorError: the archive lacks coalitions a plan needs (the message says how to
            evaluate them with ``coalescence replay RUN_DIR --model``).
    """
    path = Path(source)
    if path.is_dir():
        try:
            document = archive_document(path, methods=methods, budget=budget, seed=seed, run_id=run_id)
        except ArchiveError as exc:  # the archive modules name their argument RUN_DIR; here it is SOURCE
            if exc.field != "RUN_DIR":
                raise
            raise type(exc)(exc.message, field=_FIELD) from exc
        return _from_document(document, str(path), kind="archive")
    for option, value in (("method", methods), ("budget", budget), ("seed", seed), ("run", run_id)):
        if value is not None:
            raise ConfigError(f"applies to a run archive directory; {str(source)!r} is a JSON document", field=option)
    return _from_document(read_document(path), str(path))


def read_document(path: str | Path) -> Any:
    """The parsed JSON of an ``--out`` document.

    Raises:
        InputError: the file is missing, unreadable or not JSON (field ``SOURCE``).
    """
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{str(path)!r} does not exist; give {_FORMS}", field=_FIELD) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {str(path)!r}: {_one_line(exc)}", field=_FIELD) from exc
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{str(path)!r} is not valid JSON ({_one_line(exc)}); give {_FORMS}", field=_FIELD) from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _from_document(doc: Any, source: str, *, kind: str | None = None) -> ReportInput:
    """Classify and check a parsed document."""
    base = Path(source).parent if source else Path()
    if not isinstance(doc, Mapping):
        raise InputError(f"expected a JSON object, got {type(doc).__name__}; give {_FORMS}", field=_FIELD)
    if "explanations" in doc:
        items = doc["explanations"]
        if not isinstance(items, list) or not items:
            raise InputError("explanations must be a non-empty list of explanation documents", field=_FIELD)
        entries = tuple(_entry(item, f"explanations[{k}]", base) for k, item in enumerate(items))
        archive = doc.get("archive") or doc.get("run_dir")
        form = kind or ("replay" if "run_dir" in doc else "batch")
        extra = {"run_id": doc.get("run_id")} if doc.get("run_id") else {}
        return ReportInput(kind=form, entries=entries, source=source, archive=_str(archive), extra=extra)
    if "hierarchy" in doc or "players" in doc:
        entry = _entry(doc, "", base)
        archive = doc.get("archive") or entry.document.get("archive")
        return ReportInput(kind=kind or ("hierarchy" if entry.hierarchy else "single"), entries=(entry,), source=source, archive=_str(archive))
    raise InputError(
        f"the JSON object has none of the keys players, hierarchy, explanations; give {_FORMS}", field=_FIELD
    )


def _str(value: Any) -> str | None:
    return str(value) if value else None


def _entry(doc: Any, where: str, base: Path) -> Entry:
    if not isinstance(doc, Mapping):
        raise InputError(f"{where or 'the document'} must be an explanation object", field=_FIELD)
    prefix = f"{where}." if where else ""
    if "hierarchy" in doc:
        info = doc["hierarchy"]
        if not isinstance(info, Mapping):
            raise InputError(f"{prefix}hierarchy must be an object", field=_FIELD)
        archive = doc.get("archive")
        coarse = _explanation(doc.get("coarse"), f"{prefix}coarse", base, archive)
        fine_doc = doc.get("fine")
        fine = None if fine_doc is None else _explanation(fine_doc, f"{prefix}fine", base, archive or coarse.get("archive"))
        return Entry(document=coarse, fine=fine, hierarchy=dict(info))
    return Entry(document=_explanation(doc, where, base, None))


def _need(doc: Mapping[str, Any], key: str, check: Any, what: str, where: str) -> Any:
    value = doc.get(key)
    if not check(value):
        shown = json.dumps(value)[:40] if key in doc else "missing"
        raise InputError(f"{where}{key} must be {what}, got {shown}", field=_FIELD)
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def _explanation(doc: Any, where: str, base: Path, archive: Any) -> dict[str, Any]:
    """Check one explanation document and return it with its messages (recovered from its archive
    for documents written before ``messages`` was recorded)."""
    prefix = f"{where}." if where else ""
    if not isinstance(doc, Mapping):
        raise InputError(f"{where or 'the document'} must be an explanation object", field=_FIELD)
    out = dict(doc)
    _need(out, "target", lambda v: isinstance(v, str), "a string", prefix)
    players = _need(out, "players", lambda v: isinstance(v, list) and bool(v), "a non-empty list", prefix)
    if "messages" not in out:
        out["messages"] = _messages_from_archive(out, base, archive, prefix)
    messages = _need(
        out,
        "messages",
        lambda v: isinstance(v, list) and all(isinstance(m, Mapping) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in v),
        'a list of {"role", "content"} strings',
        prefix,
    )
    for i, p in enumerate(players):
        at = f"{prefix}players[{i}]."
        if not isinstance(p, Mapping):
            raise InputError(f"{prefix}players[{i}] must be an object", field=_FIELD)
        _need(p, "label", lambda v: isinstance(v, str), "a string", at)
        _need(p, "value", _is_number, "a number or null", at)
        if "stderr" in p:
            _need(p, "stderr", _is_number, "a number or null", at)
        m = _need(p, "message_index", lambda v: _is_int(v) and 0 <= v < len(messages), f"a message index (0..{len(messages) - 1})", at)
        n = len(messages[m]["content"])
        start = _need(p, "start", lambda v: _is_int(v) and 0 <= v <= n, f"a character offset in message {m} (0..{n})", at)
        _need(p, "end", lambda v: _is_int(v) and start <= v <= n, f"an offset from start to {n}", at)
        if isinstance(p.get("text"), str) and messages[m]["content"][p["start"] : p["end"]] != p["text"]:
            raise InputError(f"{at}text does not match characters {p['start']}:{p['end']} of message {m}", field=_FIELD)
    tokens = out.get("answer_tokens")
    if tokens is not None and not (
        isinstance(tokens, list)
        and all(isinstance(t, Mapping) and isinstance(t.get("text"), str) and _is_number(t.get("logprob_full")) and _is_number(t.get("logprob_empty")) for t in tokens)
    ):
        raise InputError(f'{prefix}answer_tokens must be a list of {{"text", "logprob_full", "logprob_empty"}} or null', field=_FIELD)
    return out


def _messages_from_archive(doc: Mapping[str, Any], base: Path, archive: Any, prefix: str) -> list[dict[str, str]]:
    """The messages of a document written before ``messages`` was part of it, from its run archive."""
    from ..archive.manifest import read_manifest

    where = doc.get("archive") or archive
    fix = "make the report from its run archive instead (coalescence report RUN_DIR)"
    if not where:
        raise InputError(f"{prefix}messages is missing and the document names no archive; {fix}", field=_FIELD)
    for candidate in (Path(str(where)), base / str(where)):
        if (candidate / "manifest.json").is_file():
            try:
                manifest = read_manifest(candidate)
            except ArchiveError:
                continue
            for record in manifest["snapshots"]:
                if record.get("snapshot_id") == doc.get("snapshot_id") and isinstance(record.get("messages"), list):
                    return [dict(m) for m in record["messages"]]
    raise InputError(
        f"{prefix}messages is missing (a document written before they were recorded) and archive "
        f"{str(where)!r} does not hold snapshot {str(doc.get('snapshot_id'))[:12]}; {fix}",
        field=_FIELD,
    )


# -- a run archive, fitted with no model ------------------------------------------------------


def archive_document(
    run_dir: str | Path,
    *,
    methods: Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Fit estimators from the coalitions a run archive holds, with no model.

    Every snapshot of the run is fitted with every method; a ``--hierarchy`` run is fitted level
    by level (the coarse values choose the refined players, as the run did). The run's utility is
    used as recorded; each explanation carries the answer tokens' log-probabilities in the full and
    the empty coalition from the archived per-token scores.

    Args:
        run_dir: the run directory.
        methods: estimator names (default: the run's method).
        budget: sampling budget (default: the run's, for a run of one input with that method; else
            32 x players).
        seed: plan seed (default: the run's).
        run_id: the run (default: the last).

    Returns:
        A replay-form document ``{"run_dir", "run_id", "explanations": [...]}`` (hierarchy
        documents for a hierarchical run).

    Raises:
        ArchiveError: a damaged or foreign archive, or a run that cannot be replayed.
        ConfigError: an unknown method, or no method given for a run that records none.
        EstimatorError: the archive lacks coalitions a plan needs (with the replay command that
            evaluates them).
    """
    from ..archive.manifest import check_replayable, read_manifest
    from ..archive.reader import read_rows
    from ..attribution.estimators import METHODS
    from ..conversation import ConversationSnapshot
    from ..engine import fill_measurements, fill_store
    from ..masking.policies import get_policy
    from ..utility import UtilitySpec

    manifest = read_manifest(run_dir)
    runs = manifest["runs"]
    if not runs:
        raise ArchiveError("the archive records no run", field=_FIELD)
    run = next((r for r in runs if r["run_id"] == run_id), None) if run_id else runs[-1]
    if run is None:
        raise ConfigError(f"no run {run_id!r}; the archive has {[r['run_id'] for r in runs]}", field="run")
    check_replayable(run_dir, manifest, run)
    config = run.get("run_config") if isinstance(run.get("run_config"), Mapping) else {}
    if not methods:
        if config.get("method") not in METHODS:
            raise ConfigError(f"run {run['run_id']} does not record its method; give one of {','.join(METHODS)}", field="method")
        methods = [config["method"]]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}; use a comma-separated subset of {','.join(METHODS)}", field="method")
    try:
        utility = UtilitySpec.from_dict(run["utility"])
    except (CoalescenceError, TypeError, ValueError) as exc:
        raise ArchiveError(f"run {run['run_id']} used utility {run['utility']}, which this version cannot replay", field=_FIELD) from exc
    policy = get_policy(run["absence_policy"]["id"], **run["absence_policy"]["params"])
    seed = seed if seed is not None else int(config.get("seed", 0) or 0)
    hierarchy = config.get("hierarchy") if isinstance(config.get("hierarchy"), Mapping) else None
    ids = list(run["snapshot_ids"])
    n_inputs = len(ids) // 2 if hierarchy else len(ids)
    records = {s["snapshot_id"]: s for s in manifest["snapshots"]}
    try:
        snapshots = [ConversationSnapshot.from_dict(records[i]) for i in ids[:n_inputs]]
    except InputError as exc:
        raise ArchiveError(f"run {run['run_id']}: {exc.message}", field=_FIELD) from exc
    rows = read_rows(run_dir)
    fit = _Fitter(run_dir=Path(run_dir), run=run, policy=policy, utility=utility, records=records)
    fill_store(fit.store, rows)
    fill_measurements(fit.measurements, rows)
    recorded_budget = config.get("budget") if n_inputs == 1 and not hierarchy and _is_int(config.get("budget")) else None
    explanations: list[dict[str, Any]] = []
    for snap in snapshots:
        for method in methods:
            def budget_for(n: int, method: str = method) -> int:
                if budget is not None:
                    return budget
                if recorded_budget is not None and method == config.get("method"):
                    return int(recorded_budget)
                return 32 * n

            coarse = fit.explain(snap, method, budget_for(snap.n_players), seed)
            if hierarchy is None:
                explanations.append(coarse.to_dict() | {"archive": str(run_dir)})
            else:
                explanations.append(fit.hierarchical(snap, coarse, hierarchy, method, budget_for, seed, ids) | {"archive": str(run_dir)})
    return {"run_dir": str(run_dir), "run_id": run["run_id"], "explanations": explanations}


@dataclass
class _Fitter:
    """Fits estimators on one run's archived coalitions (the replay machinery, no model)."""

    run_dir: Path
    run: dict[str, Any]
    policy: Any
    utility: Any
    records: dict[str, Any]
    store: Any = None
    measurements: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ..scheduler.store import ResultStore

        self.store = ResultStore()

    def resolved(self, snap: Any) -> Any:
        offsets = (self.run.get("target_token_offsets") or {}).get(snap.snapshot_id)
        if offsets is None:
            n = len((self.run.get("target_token_ids") or {}).get(snap.snapshot_id, []))
            if self.utility.span is not None or self.utility.substring is not None:
                raise ArchiveError(
                    "this archive does not record the target tokens' characters (it predates answer "
                    f"sub-spans); make the report with `coalescence replay {self.run_dir} --model "
                    f"{self.run['model']['id']} --out FILE` and report FILE",
                    field=_FIELD,
                )
            offsets = [(0, 0)] * n
        return self.utility.resolve(snap.target, [tuple(o) for o in offsets])

    def pool(self, snap: Any, rows: Any, resolved: Any, method: str) -> tuple[np.ndarray, np.ndarray]:
        from ..engine import pool_from_store

        masks, utilities, missing = pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=resolved, measurements=self.measurements
        )
        if missing:
            raise EstimatorError(
                f"the archive lacks {missing} of the coalitions {method} plans for snapshot {snap.snapshot_id[:12]} "
                f"under utility {self.utility.kind}; evaluate them with `coalescence replay {self.run_dir} "
                f"--method {method} --model {self.run['model']['id']}` (same --budget and --seed), then make "
                "the report again",
                field="method",
            )
        return masks, utilities

    def answer_tokens(self, snap: Any, resolved: Any, full: np.ndarray, empty: np.ndarray) -> Any:
        from ..attribution.explanation import answer_tokens
        from ..engine import key_for
        from ..masking.codec import PackedMask

        offsets = (self.run.get("target_token_offsets") or {}).get(snap.snapshot_id)
        if not resolved.spec.teacher_forced or offsets is None:
            return None
        ekey = resolved.evaluation_utility()
        measured = [
            self.measurements.get(key_for(snap, self.policy, self.run["model"], PackedMask.from_bools(r), utility=ekey))
            for r in (full, empty)
        ]
        if any(m is None or isinstance(m, tuple) or len(m) != len(offsets) for m in measured):
            return None
        rendering = (self.run.get("answer_rendering") or {}).get(snap.snapshot_id) or {}
        return answer_tokens(
            snap.target, [tuple(o) for o in offsets], measured[0], measured[1],
            lead=str(rendering.get("lead") or ""), tail=str(rendering.get("tail") or ""),
        )  # fmt: skip

    def notes(self, snap: Any, resolved: Any) -> tuple[str, ...]:
        record = self.records.get(snap.snapshot_id) or {}
        notes = tuple(resolved.notes())
        when = record.get("default_system_in_play")
        if isinstance(when, str) and when != "never":
            notes += (f"the chat template injects its own default system prompt ({when})",)
        executed = (self.run.get("statistics") or {}).get("executed")
        run_note = f"fitted from run {self.run['run_id']} of the archive with no model call"
        if _is_int(executed):
            run_note += f"; the run evaluated {executed} coalitions with the model"
        return (*notes, run_note)

    def explain(self, snap: Any, method: str, budget: int, seed: int) -> Any:
        from ..attribution.estimators import make_estimator

        t0 = time.perf_counter()
        estimator = make_estimator(method, budget=budget, seed=seed)
        estimator.validate(snap.n_players)
        resolved = self.resolved(snap)
        masks, utilities = self.pool(snap, estimator.plan(snap.n_players), resolved, method)
        n = snap.n_players
        tokens = self.answer_tokens(snap, resolved, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))
        return self._explanation(snap, estimator.fit(masks, utilities), resolved, t0, self.notes(snap, resolved), tokens)

    def _explanation(self, snap: Any, estimate: Any, resolved: Any, t0: float, notes: tuple[str, ...], tokens: Any) -> Any:
        from ..attribution.explanation import Explanation
        from ..engine import utility_detail

        return Explanation(
            snapshot=snap,
            estimate=estimate,
            model_id=self.run["model"]["id"],
            model_revision=self.run["model"]["revision"],
            absence_policy=self.policy.id,
            absence_params=self.policy.params(),
            utility=self.utility.kind,
            utility_unit=self.utility.unit,
            utility_detail=utility_detail(resolved),
            utility_description=resolved.describe(),
            target_token_count=len((self.run.get("target_token_ids") or {}).get(snap.snapshot_id, [])),
            n_evaluations=0,
            wall_seconds=time.perf_counter() - t0,
            notes=notes,
            answer_tokens=tokens,
        )

    def hierarchical(
        self, coarse_snap: Any, coarse: Any, hierarchy: Mapping[str, Any], method: str, budget_for: Any, seed: int, ids: list[str]
    ) -> dict[str, Any]:
        """Both levels of a ``--hierarchy`` run, as :func:`~coalescence.attribution.hierarchy.explain_hierarchical`
        computed them, from the archive (the fine game: the top-k coarse players' fine players,
        every other fine player present)."""
        from dataclasses import replace

        from ..attribution.estimators import make_estimator
        from ..attribution.hierarchy import HierarchicalExplanation, fine_snapshot
        from ..conversation import ConversationSnapshot

        units = hierarchy.get("units") or []
        top_k = hierarchy.get("top_k")
        if not (isinstance(units, list) and len(units) == 2 and _is_int(top_k)):
            raise ArchiveError(f"run {self.run['run_id']}: run_config.hierarchy must be {{units: [coarse, fine], top_k}}", field=_FIELD)
        fine, parents = fine_snapshot(coarse_snap, units[1])
        if fine.snapshot_id not in ids:
            raise ArchiveError(f"run {self.run['run_id']} does not hold the fine snapshot of {coarse_snap.snapshot_id[:12]}", field=_FIELD)
        values = coarse.values
        order = sorted(range(coarse_snap.n_players), key=lambda i: (-abs(float(values[i])), i))
        refined = tuple(order[: min(int(top_k), coarse_snap.n_players)])
        sel = np.array([k for k, parent in enumerate(parents) if parent in set(refined)], dtype=np.intp)
        result = HierarchicalExplanation(coarse=coarse, fine=None, fine_snapshot=fine, refined=refined, top_k=int(top_k))
        if sel.size:
            t0 = time.perf_counter()
            estimator = make_estimator(method, budget=budget_for(int(sel.size)), seed=seed)
            estimator.validate(int(sel.size))

            def lifted(plan: Any) -> Any:
                for row in plan:
                    full = np.ones(fine.n_players, dtype=bool)
                    full[sel] = row
                    yield full

            resolved = self.resolved(fine)
            masks, utilities = self.pool(fine, lifted(estimator.plan(int(sel.size))), resolved, method)
            empty = np.ones(fine.n_players, dtype=bool)
            empty[sel] = False
            tokens = self.answer_tokens(fine, resolved, np.ones(fine.n_players, dtype=bool), empty)
            view = ConversationSnapshot(
                conversation=fine.conversation,
                unit=fine.unit,
                players=tuple(replace(fine.players[int(k)], index=j) for j, k in enumerate(sel)),
            )
            others = fine.n_players - int(sel.size)
            note = (
                f"fine level: {int(sel.size)} of {fine.n_players} fine players refined; "
                f"{'the other one is' if others == 1 else f'the other {others} are'} held present"
            )
            fine_explanation = self._explanation(
                view, estimator.fit(masks[:, sel], utilities), resolved, t0, (*coarse.notes, note), tokens
            )
            result = replace(result, fine=fine_explanation)
        return result.to_dict()
