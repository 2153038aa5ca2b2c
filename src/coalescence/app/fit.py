"""Fits from a run archive with no model: :class:`ArchiveFit` fits estimators on one run's
archived coalitions (replay, and the report of a run directory through :func:`fit_archive`).

Errors name the settings by their names here (``budget``, ``archive``); the CLI maps them to its
options (``--budget``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArchiveError, CoalescenceError, ConfigError, EstimatorError, InputError
from ..userinput import did_you_mean
from .record import recorded_budget, recorded_interactions, recorded_proxy, recorded_run_config, recorded_seed

__all__ = (
    "ArchiveFit",
    "fit_archive",
    "select_run",
)


class ArchiveFit:
    """Fits estimators on one run's archived coalitions, with no model (replay and the report).

    Args:
        run_dir: the run directory.
        run: the run's manifest record.
        records: the manifest's snapshot records by id.
        utility: the utility replayed (default: the run's).
        skip_corrupt: skip unreadable parts instead of refusing.

    Raises:
        ArchiveError: the run's utility cannot be replayed by this version; a part is corrupt.
    """

    def __init__(
        self,
        run_dir: str | Path,
        run: Mapping[str, Any],
        records: Mapping[str, Any],
        *,
        utility: Any = None,
        skip_corrupt: bool = False,
        rows: Any = None,
    ) -> None:
        from ..archive.reader import read_rows
        from ..engine import fill_measurements, fill_store
        from ..masking.policies import get_policy
        from ..scheduler.store import ResultStore
        from ..utility import UtilitySpec

        self.run_dir = Path(run_dir)
        self.run = dict(run)
        self.records = dict(records)
        if utility is None:
            try:
                utility = UtilitySpec.from_dict(run.get("utility") or {})
            except (CoalescenceError, TypeError, ValueError) as exc:
                raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot replay", field="archive") from exc
        self.utility = utility
        self.policy = get_policy(run["absence_policy"]["id"], **run["absence_policy"]["params"])
        self.store = ResultStore()
        self.measurements: dict[str, Any] = {}
        self.skip_corrupt = skip_corrupt  # named again in the command a refusal suggests
        rows = rows if rows is not None else read_rows(self.run_dir, skip_corrupt=skip_corrupt)
        fill_store(self.store, rows)
        fill_measurements(self.measurements, rows)
        self.evaluated = _evaluated(rows, self.run["run_id"])

    def resolved(self, snap: Any) -> Any:
        """The utility fixed for ``snap``'s answer from the recorded token offsets.

        Raises:
            ArchiveError: a sub-span asked of an archive that predates recorded offsets.
        """
        offsets = (self.run.get("target_token_offsets") or {}).get(snap.snapshot_id)
        if offsets is None:
            n = len((self.run.get("target_token_ids") or {}).get(snap.snapshot_id, []))
            if self.utility.span is not None or self.utility.substring is not None:
                raise ArchiveError(
                    "this archive does not record the target tokens' characters (it predates answer "
                    f"sub-spans); replay it with `--model {self.run['model']['id']}` to align the span with the tokenizer",
                    field="archive",
                )
            offsets = [(0, 0)] * n
        return self.utility.resolve(snap.target, [tuple(o) for o in offsets])

    def missing(self, snap: Any, rows: Iterable[np.ndarray]) -> int:
        """How many distinct coalitions of ``rows`` the archive lacks under the utility."""
        from ..engine import pool_from_store

        return pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=self.resolved(snap), measurements=self.measurements
        )[2]

    def pool(self, snap: Any, rows: Iterable[np.ndarray], resolved: Any, method: str) -> tuple[np.ndarray, np.ndarray]:
        """The archived utilities of ``rows``.

        Raises:
            EstimatorError: the archive lacks some (naming the replay command that evaluates them).
        """
        from ..engine import pool_from_store

        masks, utilities, missing = pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=resolved, measurements=self.measurements
        )
        if missing:
            raise EstimatorError(
                f"the archive lacks {missing} of the coalitions {method} plans for snapshot {snap.snapshot_id[:12]} "
                f"under utility {self.utility.kind}; evaluate them with `coalescence replay {self.run_dir} "
                f"--method {method} --model {self.run['model']['id']}{' --skip-corrupt' if self.skip_corrupt else ''}` "
                "(same --budget and --seed)",
                field="method",
            )
        return masks, utilities

    def answer_tokens(self, snap: Any, resolved: Any, full: np.ndarray, empty: np.ndarray) -> Any:
        """The answer's tokens with their log-probabilities in the full and the empty coalition
        (from the archived per-token scores), or ``None`` when they are not archived."""
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
        """The notes of a replayed explanation: the utility's, the template's default system
        prompt, and where the values came from."""
        record = self.records.get(snap.snapshot_id) or {}
        notes = tuple(resolved.notes())
        when = record.get("default_system_in_play")
        if isinstance(when, str) and when != "never":
            notes += (f"the chat template injects its own default system prompt ({when})",)
        target_notes = (self.run.get("target_notes") or {}).get(snap.snapshot_id)
        if isinstance(target_notes, list):
            notes += tuple(str(n) for n in target_notes)
        now = self.run.get("template_now")
        if self.run.get("template_renders_date") is True and isinstance(now, str):
            notes += (f"the template renders a date: pinned to {now[:10]}",)
        exact, proxy = self.evaluated
        run_note = f"replayed from run {self.run['run_id']} of the archive: no model call"
        if exact or proxy:  # every session of the run together (a resumed run's too)
            run_note += f"; the run evaluated {exact} exact coalitions" + (f" and {proxy} proxy rows" if proxy else "") + " with the model"
        return (*notes, run_note)

    def explain(
        self, snap: Any, method: str, budget: int | None, seed: int, *, interactions: int | None = None, index: str | None = None
    ) -> Any:
        """Fit ``method`` on ``snap`` from the archive (with interactions of orders 2..``interactions``
        of ``index`` when given).

        Raises:
            EstimatorError: the archive lacks coalitions of the plan.
        """
        t0 = time.perf_counter()
        estimator, chose = self.resolve(self.estimator(method, budget, seed, interactions=interactions, index=index), snap.n_players)
        self.validate(estimator, snap.n_players)
        resolved = self.resolved(snap)
        masks, utilities = self.pool(snap, estimator.plan(snap.n_players), resolved, method)
        n = snap.n_players
        tokens = self.answer_tokens(snap, resolved, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))
        estimate, proxy = self.fit_two_fidelity(snap, estimator, masks, utilities, resolved)
        if chose is not None:
            estimate = replace(estimate, notes=(*estimate.notes, chose))
        return self._explanation(snap, estimate, resolved, t0, self.notes(snap, resolved), tokens, proxy=proxy)

    def resolve(self, estimator: Any, n_players: int) -> tuple[Any, str | None]:
        """The estimator the run used on a game of ``n_players``: the default method resolved as
        the run resolved it (:meth:`~coalescence.attribution.estimators.default.DefaultMethod.resolve`,
        with the proxy game where the run played it), with its note; any other as it is."""
        if not hasattr(estimator, "resolve"):
            return estimator, None
        return estimator.resolve(n_players, proxy=recorded_proxy(self.run) is not None)

    def estimator(self, method: str, budget: int | None, seed: int, *, interactions: int | None = None, index: str | None = None) -> Any:
        """The estimator of ``method`` as the run made it (a two-fidelity method takes the run's
        proxy budget when the run played the proxy game with it)."""
        from ..attribution.estimators import estimator_class, make_estimator

        recorded = recorded_proxy(self.run)
        proxy = {}
        if recorded is not None and recorded[1] is not None and estimator_class(method).capabilities.two_fidelity:
            proxy = {"proxy_budget": recorded[1]}
        return make_estimator(method, budget=budget, seed=seed, interactions=interactions, index=index, **proxy)

    def validate(self, estimator: Any, n_players: int) -> None:
        """``estimator.validate`` for a fit from this archive: a two-fidelity estimator at its floor
        with the proxy game where the run played it (whether the archive holds its rows is known
        when fitted: :meth:`fit_two_fidelity`), else at its floor on exact rows alone.

        Raises:
            EstimatorError, ConfigError: as the estimator's ``validate``.
        """
        from ..engine.proxy import validate_exact_only

        if not estimator.capabilities.two_fidelity:
            estimator.validate(n_players)
        elif recorded_proxy(self.run) is None:
            validate_exact_only(estimator, n_players, "the run played none")
        else:
            estimator.validate(n_players, proxy=True)

    def fit_two_fidelity(
        self, snap: Any, estimator: Any, masks: np.ndarray, utilities: np.ndarray, resolved: Any, *, select: np.ndarray | None = None
    ) -> tuple[Any, dict[str, Any] | None]:
        """The estimate from the archive, and its proxy record: a two-fidelity estimator refits both
        games when the run played the proxy game and the archive holds every proxy row its plan
        needs; otherwise the exact pool alone, with a note (``exact rows only: ...``) where a
        two-fidelity estimator is fitted on another method's run that played no proxy game, or the
        archive lacks proxy rows of its plan (e.g. where the run measured that the proxy did not
        pay: :mod:`coalescence.engine.two_fidelity`). ``select``: the players of the game (a
        hierarchy's fine level, the others held present), ``masks`` being of every player of ``snap``."""
        from ..engine import pool_from_store, proxy_agreement, proxy_game_name

        def own(rows: np.ndarray) -> np.ndarray:
            return rows if select is None else rows[:, select]

        n = snap.n_players if select is None else int(select.size)
        recorded = recorded_proxy(self.run)
        if not estimator.capabilities.two_fidelity or recorded is None:
            estimate = estimator.fit(own(masks), utilities)
            # fitted on the exact rows alone: said where the proxy game was wanted (another method's
            # run), as explain says it where asked for; a run of this method (or the default plan,
            # resolved to it) with the proxy game off asked for none (explain says nothing then either)
            own_method = recorded_run_config(self.run).get("method")
            if estimator.capabilities.two_fidelity and own_method not in (estimator.name, "default"):
                note = "exact rows only: the run played no proxy game, so the archive holds no proxy rows"
                estimate = replace(estimate, notes=(*estimate.notes, note))
            return estimate, None
        if n < 62 and len(masks) >= (1 << n):  # as the run: every coalition exact, no proxy game played
            estimate = estimator.fit(own(masks), utilities)
            note = f"the proxy game was not played: the budget covers all {1 << n} coalitions, which were evaluated exactly"
            return replace(estimate, notes=(*estimate.notes, note)), None
        game = proxy_game_name(recorded[0])
        rows = itertools.chain(_lifted(estimator.proxy_plan(n), snap.n_players, select), masks)
        pmasks, putilities, missing = pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=resolved, measurements=self.measurements, game=game
        )
        if missing:
            from ..engine.proxy import validate_exact_only

            why = f"the archive lacks {missing} of the {game} coalitions this plan uses"
            validate_exact_only(estimator, n, why)
            estimate = estimator.fit(own(masks), utilities)
            note = f"exact rows only: {why}"
            return replace(estimate, notes=(*estimate.notes, note)), None
        estimate = estimator.fit_two_fidelity(own(masks), utilities, own(pmasks), putilities)
        agreement = proxy_agreement(own(masks), utilities, own(pmasks), putilities)
        return estimate, {"game": game, "coalitions": len(pmasks), "evaluations": 0} | agreement

    def _explanation(
        self, snap: Any, estimate: Any, resolved: Any, t0: float, notes: tuple[str, ...], tokens: Any, *, proxy: dict[str, Any] | None = None
    ) -> Any:
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
            notes=(*notes, *estimate.notes),
            answer_tokens=tokens,
            proxy=proxy,
        )

    def hierarchical(
        self, coarse_snap: Any, coarse: Any, hierarchy: Mapping[str, Any], method: str, budget_for: Any, seed: int, ids: list[str]
    ) -> Any:
        """Both levels of a hierarchy run, as :func:`~coalescence.app.hierarchy.explain_hierarchical`
        computed them, from the archive (the fine game: the top-k coarse players' fine players,
        every other fine player present).

        Returns:
            A :class:`~coalescence.app.hierarchy.HierarchicalExplanation`.
        """
        from ..snapshot import fine_snapshot
        from .hierarchy import HierarchicalExplanation, _others
        from ..snapshot import ConversationSnapshot

        units = hierarchy.get("units") or []
        top_k = hierarchy.get("top_k")
        if not (isinstance(units, list) and len(units) == 2 and isinstance(top_k, int) and not isinstance(top_k, bool)):
            raise ArchiveError(f"run {self.run['run_id']}: run_config.hierarchy must be {{units: [coarse, fine], top_k}}", field="archive")
        fine, parents = fine_snapshot(coarse_snap, units[1])
        if fine.snapshot_id not in ids:
            raise ArchiveError(f"run {self.run['run_id']} does not hold the fine snapshot of {coarse_snap.snapshot_id[:12]}", field="archive")
        values = coarse.values
        order = sorted(range(coarse_snap.n_players), key=lambda i: (-abs(float(values[i])), i))
        refined = tuple(order[: min(int(top_k), coarse_snap.n_players)])
        sel = np.array([k for k, parent in enumerate(parents) if parent in set(refined)], dtype=np.intp)
        result = HierarchicalExplanation(coarse=coarse, fine=None, fine_snapshot=fine, refined=refined, top_k=int(top_k))
        if sel.size:
            t0 = time.perf_counter()
            estimator, chose = self.resolve(self.estimator(method, budget_for(int(sel.size)), seed), int(sel.size))
            self.validate(estimator, int(sel.size))
            resolved = self.resolved(fine)
            masks, utilities = self.pool(fine, _lifted(estimator.plan(int(sel.size)), fine.n_players, sel), resolved, method)
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
                f"{_others(others)} held present"
            )
            estimate, proxy = self.fit_two_fidelity(fine, estimator, masks, utilities, resolved, select=sel)
            if chose is not None:
                estimate = replace(estimate, notes=(*estimate.notes, chose))
            fine_explanation = self._explanation(view, estimate, resolved, t0, (*self.notes(fine, resolved), note), tokens, proxy=proxy)
            result = replace(result, fine=fine_explanation)
        return result


def _evaluated(rows: Any, run_id: str) -> tuple[int, int]:
    """``(exact, proxy)``: the archive's rows that run ``run_id`` evaluated with the model (not
    served from its store), over all of its sessions, by game."""
    import pyarrow.compute as pc

    if not rows.num_rows or "run_id" not in rows.column_names:
        return 0, 0
    mine = rows.filter(pc.and_(pc.equal(rows["run_id"], run_id), pc.invert(rows["cache_hit"])))
    games = mine["game"].to_pylist() if "game" in mine.column_names else [None] * mine.num_rows
    proxy = sum(1 for g in games if g not in (None, "exact"))
    return mine.num_rows - proxy, proxy


def _lifted(plan: Any, n_players: int, select: np.ndarray | None) -> Any:
    """The rows of ``plan`` over every one of ``n_players`` players, those outside ``select`` present
    (``select`` None: the rows as they are)."""
    for row in plan:
        if select is None:
            yield row
            continue
        full = np.ones(n_players, dtype=bool)
        full[select] = row
        yield full


def select_run(manifest: Mapping[str, Any], run_id: str | None) -> dict[str, Any]:
    runs = manifest.get("runs") or []
    if not runs:
        raise ArchiveError("the archive records no run", field="archive")
    run = next((r for r in runs if r["run_id"] == run_id), None) if run_id else runs[-1]
    if run is None:
        raise ConfigError(f"no run {run_id!r}; the archive has {[r['run_id'] for r in runs]}", field="run")
    return run


def fit_archive(
    run_dir: str | Path,
    *,
    methods: Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
    conversation: int | None = None,
    skip_corrupt: bool = False,
) -> dict[str, Any]:
    """Fit estimators from the coalitions a run archive holds, with no model (the report's source).

    Every snapshot of the run is fitted with every method; a hierarchy run is fitted level by level
    (the coarse values choose the refined players, as the run did). The run's utility is used as
    recorded.

    Args:
        run_dir: the run directory.
        methods: estimator names (default: the run's method).
        budget: sampling budget (default: the run's, for a run of one input with that method; else
            32 x players).
        seed: plan seed (default: the run's).
        run_id: the run (default: the last).
        conversation: fit only this conversation of the run (0-based; default: every one).
        skip_corrupt: leave out a part that fails verification (with a warning) instead of refusing.

    Returns:
        A replay-form document ``{"run_dir", "run_id", "explanations": [...]}``.

    Raises:
        ArchiveError: a damaged (unless ``skip_corrupt``) or foreign archive, or a run that cannot be replayed.
        ConfigError: an unknown method, or no method given for a run that records none.
        EstimatorError: the archive lacks coalitions a plan needs.
    """
    from ..archive.manifest import check_replayable, read_manifest
    from ..attribution.estimators import ESTIMATORS, is_method
    from ..snapshot import ConversationSnapshot

    manifest = read_manifest(run_dir)
    run = select_run(manifest, run_id)
    check_replayable(run_dir, manifest, run)
    config = recorded_run_config(run)
    if not methods:
        if not is_method(config.get("method")):
            raise ConfigError(f"run {run['run_id']} does not record its method; give one of {','.join(ESTIMATORS)}", field="method")
        methods = [config["method"]]
    unknown = [m for m in methods if not is_method(m)]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}{did_you_mean(unknown[0], ESTIMATORS)}; use a comma-separated subset of {','.join(ESTIMATORS)}", field="method")
    fit = ArchiveFit(run_dir, run, {s["snapshot_id"]: s for s in manifest["snapshots"]}, skip_corrupt=skip_corrupt)
    seed = seed if seed is not None else recorded_seed(run)
    hierarchy = config.get("hierarchy") if isinstance(config.get("hierarchy"), Mapping) else None
    ids = list(run["snapshot_ids"])
    n_inputs = len(ids) // 2 if hierarchy else len(ids)
    try:
        snapshots = [ConversationSnapshot.from_dict(fit.records[i]) for i in ids[:n_inputs]]
    except InputError as exc:
        raise ArchiveError(f"run {run['run_id']}: {exc.message}", field="archive") from exc
    if conversation is not None:
        if not 0 <= conversation < len(snapshots):
            raise InputError(f"the run holds {len(snapshots)} conversation(s), numbered from 0; got {conversation}", field="conversation")
        snapshots = [snapshots[conversation]]
    explanations: list[dict[str, Any]] = []
    for snap in snapshots:
        for method in methods:

            def budget_for(n: int, method: str = method) -> int:
                if budget is not None:
                    return budget
                recorded = recorded_budget(run, method)
                return recorded if recorded is not None else 32 * n

            order, index = recorded_interactions(run, method)
            coarse = fit.explain(snap, method, budget_for(snap.n_players), seed, interactions=order, index=index)
            if hierarchy is None:
                explanations.append(coarse.to_dict() | {"archive": str(run_dir)})
            else:
                explanations.append(fit.hierarchical(snap, coarse, hierarchy, method, budget_for, seed, ids).to_dict() | {"archive": str(run_dir)})
    return {"run_dir": str(run_dir), "run_id": run["run_id"], "explanations": explanations}
