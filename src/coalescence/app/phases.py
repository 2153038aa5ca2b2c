"""What a run fits: the phases an explain run (:class:`~coalescence.app.explain.ExplainRun`) is given.

An explain run checks its inputs, preflights, loads the model, opens the archive and evaluates its
conversations the same way whatever it fits; what it fits is an object it is given, its *phases*
(:class:`RunPhases`): the player limit, the games it refuses, the plan the preflight renders and
the engine evaluates, a hierarchy's fine games, its output paths, its record in the manifest, and one conversation's
evaluation and fit (restored from, and recorded in, the archive for a resume).

* :class:`ExplainPhases`: one estimator (or a hierarchy, or a target standard error) per
  conversation: ``coalescence explain``, and evaluate's re-created game (whose manifest records
  the explanation it evaluates instead of a fit: ``config``);
* :class:`~coalescence.app.sweeps.SweepPhases`: many estimators, budgets and seeds from one pool.

The run is handed to each phase (``run``, a :class:`PhasedRun`): its settings, inputs, engine,
policy and archive are read there; a phase never sets them.
"""

from __future__ import annotations

import json

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import InputError
from .outputs import html_path, output_path, refuse_overwrite
from .settings import RunSettings, interaction_settings

__all__ = ("ExplainPhases", "PhasedRun", "RunPhases")


class PhasedRun(Protocol):
    """What the phases read of the run they are given (an
    :class:`~coalescence.app.explain.ExplainRun`); they set none of it."""

    source: Any
    settings: RunSettings
    engine: Any  # the Engine, once loaded
    archive: Any  # the RunArchive, once open, or None
    policy: Any
    snapshots: list[Any]
    fines: list[Any]  # a hierarchy's (fine snapshot, parents) per input
    run_dir: Path | None
    out_path: Path | None
    restored_conversations: int


class RunPhases(Protocol):
    """What an explain run is given to fit (module docs). Each method is handed the run."""

    def player_limit(self, run: PhasedRun) -> int | None:
        """The most players an input may have (``None``: no limit), counted in the run's check."""
        ...

    def validate_game(self, run: PhasedRun, n_players: int, *, refused: str | None) -> None:
        """Refuse, before any model call, a game of ``n_players`` the run cannot play (``refused``:
        why no proxy game is played, or ``None`` where it may be).

        Raises:
            EstimatorError, ConfigError: the game is refused.
        """
        ...

    def plan(self, run: PhasedRun, n_players: int) -> Iterable[np.ndarray]:
        """Every coalition (``[n_players]`` bool rows) the run evaluates for a game of ``n_players``."""
        ...

    def fine_game(self, run: PhasedRun, snapshot: Any) -> tuple[Any, tuple[int, ...]] | None:
        """A hierarchy's fine game of ``snapshot`` (the fine snapshot and each fine player's coarse
        parent: :func:`~coalescence.snapshot.fine_snapshot`), or ``None`` where the run plays none."""
        ...

    def outputs(self, run: PhasedRun) -> tuple[Path | None, Path | None]:
        """The ``out`` and ``html`` paths, checked before any work.

        Raises:
            ConfigError: a path that cannot be written or would overwrite an input.
        """
        ...

    def run_config(self, run: PhasedRun) -> dict[str, Any]:
        """What the run fits, as the manifest's ``run_config`` records it (with a ``command`` key)."""
        ...

    def restored(self, run: PhasedRun, snap: Any) -> Any:
        """The result of ``snap`` an earlier session of a resumed run finished, or ``None``."""
        ...

    def record(self, run: PhasedRun, snap: Any, result: Any) -> None:
        """Record a finished conversation's result in the archive, for a resume."""
        ...

    async def explain_one(self, run: PhasedRun, k: int, snap: Any) -> Any:
        """Plan, evaluate (through ``run.engine``) and fit conversation ``k`` (``snap``)."""
        ...


class ExplainPhases:
    """The phases of ``coalescence explain``: the settings' estimator per conversation.

    Args:
        config: the manifest's ``run_config`` to record instead of the fit's (evaluate's
            re-created game holds its game's coalitions and fits nothing), or ``None``.
    """

    def __init__(self, *, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config) if config is not None else None

    def player_limit(self, run: PhasedRun) -> int | None:
        """The method's limit (e.g. exact: 16), or ``None``."""
        return run.settings.capabilities.max_players

    def validate_game(self, run: PhasedRun, n_players: int, *, refused: str | None) -> None:
        """A two-fidelity method at its floor with the proxy game (``refused`` None: it may be
        played), else at its floor on exact rows alone, saying why the proxy game is not played.

        Raises:
            EstimatorError, ConfigError: as the estimator's ``validate``.
        """
        from ..engine.proxy import validate_exact_only

        s = run.settings
        estimator = s.estimator(n_players)
        if not s.capabilities.two_fidelity:
            estimator.validate(n_players)
        elif refused is None:
            estimator.validate(n_players, proxy=True)
        else:
            validate_exact_only(estimator, n_players, refused)
        if s.target_stderr is not None:  # auto's choice is known once n is
            from ..attribution.estimators.base import for_target_stderr

            for_target_stderr(estimator, n_players)

    def plan(self, run: PhasedRun, n_players: int) -> Iterable[np.ndarray]:
        """The estimator's plan for a game of ``n_players``."""
        return run.settings.estimator(n_players).plan(n_players)

    def fine_game(self, run: PhasedRun, snapshot: Any) -> tuple[Any, tuple[int, ...]] | None:
        """With a hierarchy, its fine unit's game inside ``snapshot``'s players; else ``None``.

        Raises:
            InputError: the coarse players hold no fine player.
        """
        from ..snapshot import fine_snapshot

        hierarchy = run.settings.hierarchy
        return None if hierarchy is None else fine_snapshot(snapshot, hierarchy[1])

    def outputs(self, run: PhasedRun) -> tuple[Path | None, Path | None]:
        """``out`` and ``html``, neither overwriting the input or the archive."""
        s = run.settings
        out, html = output_path(s.out, "out"), html_path(s.html, "html")
        refuse_overwrite(
            {"out": out, "html": html},
            sources={"input": run.source} if isinstance(run.source, (str, Path)) else None,
            run_dirs={"archive": s.archive},
        )
        return out, html

    def run_config(self, run: PhasedRun) -> dict[str, Any]:
        """Command ``explain``, the method, its budget and seed, and what else it fits with."""
        if self.config is not None:
            return dict(self.config)
        s = run.settings
        config: dict[str, Any] = {
            "command": "explain",
            "method": s.method_name,
            "budget": s.budget_for(run.snapshots[0].n_players),
            "seed": s.seed,
        }
        if s.interactions is not None:
            config["interactions"] = {"order": s.interactions, "index": interaction_settings(s.method_name, s.interactions, s.index)[1]}
        if s.capabilities.two_fidelity and s.proxy is not None:
            config["proxy"] = {"tail": s.proxy.tail, "budget": s.proxy_budget}
        if s.hierarchy is not None:
            config["hierarchy"] = {"units": list(s.hierarchy), "top_k": s.top_k_or_default}
        return config

    def _result_key(self, run: PhasedRun, snap: Any) -> str:
        s = run.settings
        fit = {"method": s.method_name, "budget": s.budget_for(snap.n_players), "seed": s.seed, "target_stderr": s.target_stderr}
        if s.interactions is not None:
            fit["interactions"] = [s.interactions, s.index]
        if s.capabilities.two_fidelity and s.proxy is not None:
            fit["proxy"] = [s.proxy.tail, s.proxy_budget]
        return json.dumps({"snapshot_id": snap.snapshot_id, "fit": fit}, sort_keys=True)

    def restored(self, run: PhasedRun, snap: Any) -> Any:
        """The explanation an earlier session finished with the same fit, or ``None`` (hierarchies
        are not restored)."""
        from ..attribution.explanation import Explanation

        if run.archive is None or run.settings.hierarchy is not None:
            return None
        document = run.archive.results.get(self._result_key(run, snap))
        if document is None:
            return None
        try:
            return Explanation.from_dict(document, snap, notes=("restored from the archive: finished in an earlier session of this run",))
        except InputError:
            return None  # not restorable: evaluated again (its coalitions are in the archive)

    def record(self, run: PhasedRun, snap: Any, result: Any) -> None:
        """Record a finished explanation of a batch (hierarchies are not)."""
        if run.archive is not None and run.settings.hierarchy is None and len(run.snapshots) > 1:
            run.archive.record_result(self._result_key(run, snap), result.to_dict())

    async def explain_one(self, run: PhasedRun, k: int, snap: Any) -> Any:
        """The explanation of ``snap``: until a target standard error, hierarchical, or one fit."""
        from .hierarchy import explain_hierarchical

        s, engine, policy = run.settings, run.engine, run.policy
        if s.target_stderr is not None:
            return await engine.explain_until(
                snap, s.estimator_for_budget(), policy, budget=s.budget_for(snap.n_players), target_stderr=s.target_stderr
            )
        if s.hierarchy is None:
            return await engine.explain(snap, s.estimator(snap.n_players), policy)
        fine, parents = run.fines[k]
        return await explain_hierarchical(
            engine, snap, fine, parents, estimator_for=s.estimator, policy=policy, top_k=s.top_k_or_default
        )
