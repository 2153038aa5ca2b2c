"""The coalitions ``coalescence evaluate`` holds out: none of them in a plan the archive holds.

An explanation's LDS is only a yardstick on coalitions it was not fitted on. What it could have
been fitted on is whatever its run archive holds for the game: every plan that ever ran there
(the run's own, a resumed run's larger budget, a ``replay --method X --model`` that evaluated
another method's plan) left its coalitions as exact rows, and no record of method, budget and
seed names them all (a replay records none; a resumed run records its last budget; an adaptive
plan depends on more than its seed). So the plans are read from the rows themselves
(:func:`plan_coalitions`): every exact-game row of the snapshot, whatever its utility or run,
except the rows ``evaluate`` itself wrote, which carry :data:`EVALUATE_ROWS` before their run id
(:class:`EvaluationArchive`). Proxy-game rows are not excluded: a fit never sees a proxy row's
value as ``v(S)`` (the two fidelities are never mixed; the proxy only reduces the variance of the
exact rows' fit), and a proxy plan often holds every coalition of a small game. The held-out draw
(:func:`~coalescence.attribution.faithfulness.held_out_coalitions`) skips those coalitions, which
makes it disjoint from every plan the archive holds when it is drawn, by construction; and since
evaluate's own rows are not plans, a later evaluation with the same seed draws the same
coalitions and finds them in the archive.

A plan evaluated after an ``evaluate`` finds the coalitions the two share in the archive, under
evaluate's id. For a run directory the plans fitted and evaluated are therefore also regenerated
from the run's method, budget, seed and interactions, as :func:`~coalescence.app.fit.fit_archive`
makes them (:func:`fitted_plans`), and skipped too: the explanation scored is never scored on its
own plan's coalitions. An ``--out`` document records no budget or seed, so there the rows alone
name the plans (evaluate a document before you replay other plans into its archive, or in a copy).
Rows written by an ``evaluate`` of an earlier version carry the run's own id, so they count as plan
rows (the draw skips them: still disjoint, only not reused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..archive.writer import RunArchive
from ..attribution.faithfulness import MIN_COALITIONS, HeldOut, held_out_coalitions
from ..errors import InputError

__all__ = ("EVALUATE_ROWS", "EvaluationArchive", "fitted_plans", "held_out_of", "plan_coalitions", "unknown_plan")

EVALUATE_ROWS = "evaluate:"
"""The prefix of the ``run_id`` of every row ``evaluate`` writes (``evaluate:<run id>``): held-out
and removal coalitions, never a plan's."""


class EvaluationArchive(RunArchive):
    """A :class:`~coalescence.archive.writer.RunArchive` whose rows carry ``evaluate:<run id>``
    as their ``run_id`` (the run's record and status are the run's own)."""

    def append(self, row: Mapping[str, Any]) -> bool:
        """As :meth:`RunArchive.append`, the row's ``run_id`` set to :data:`EVALUATE_ROWS` + the run's."""
        return super().append({**row, "run_id": EVALUATE_ROWS + self.run_id})


def plan_coalitions(table: Any, snapshot_id: str, n_players: int) -> set[bytes]:
    """The coalitions the archive holds for ``snapshot_id`` as rows of some plan (module docs).

    Args:
        table: the archive's rows (a ``pyarrow.Table`` of :data:`~coalescence.archive.schema.ROW_SCHEMA`,
            as :func:`~coalescence.archive.reader.read_rows` returns them).
        snapshot_id: the game's snapshot.
        n_players: its players (rows of another width are no coalitions of it).

    Returns:
        Each coalition as ``np.packbits(row).tobytes()`` of its ``[n_players]`` bool row: every
        exact-game row of the snapshot (``game`` null or ``exact``), of any utility or run, but those
        whose ``run_id`` starts with :data:`EVALUATE_ROWS`.
    """
    import pyarrow.compute as pc

    if table is None or not table.num_rows:
        return set()
    rows = table.filter(pc.equal(table["snapshot_id"], snapshot_id)).select(["mask", "n_bits", "run_id", "game"]).to_pydict()
    out = set()
    for mask, n_bits, run_id, game in zip(rows["mask"], rows["n_bits"], rows["run_id"], rows["game"], strict=True):
        if n_bits != n_players or game not in (None, "exact") or (isinstance(run_id, str) and run_id.startswith(EVALUATE_ROWS)):
            continue
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:n_players].astype(bool)
        out.add(np.packbits(bits).tobytes())
    return out


def fitted_plans(fit: Any, run: Mapping[str, Any], n_players: int, *, methods: Any, budget: int | None) -> set[bytes]:
    """The coalitions of the plans a run directory's explanations are fitted on, regenerated as
    :func:`~coalescence.app.fit.fit_archive` makes them: each method (``methods``, default the
    run's) at ``budget`` (default the run's for its method, else 32 x players), the run's seed and
    interactions.

    Args:
        fit: the archive's :class:`~coalescence.app.fit.ArchiveFit`.
        run: the run's manifest record.
        n_players: players of the game.
        methods: method names, or a comma-separated string, or ``None``.
        budget: the sampling budget, or ``None``.

    Returns:
        Each coalition as ``np.packbits(row).tobytes()`` of its ``[n_players]`` bool row.

    Raises:
        ConfigError, EstimatorError: as the estimators' construction (already raised by the fit).
    """
    from .options import names
    from .record import recorded_budget, recorded_interactions, recorded_run_config, recorded_seed

    chosen = names(methods) if methods else (recorded_run_config(run).get("method"),)
    out: set[bytes] = set()
    for method in chosen:
        if not isinstance(method, str):
            continue
        b = budget if budget is not None else recorded_budget(run, method)
        order, index = recorded_interactions(run, method)
        estimator = fit.estimator(method, b if b is not None else 32 * n_players, recorded_seed(run), interactions=order, index=index)
        out.update(np.packbits(np.asarray(row, dtype=bool)).tobytes() for row in estimator.plan(n_players))
    return out


def held_out_of(snap: Any, plans: set[bytes], *, coalitions: int, seed: int, field: str) -> HeldOut:
    """The held-out coalitions of ``snap``'s game: ``coalitions`` drawn from ``seed``, none in ``plans``
    (:func:`~coalescence.attribution.faithfulness.held_out_coalitions`).

    Args:
        snap: the game's :class:`~coalescence.snapshot.ConversationSnapshot`.
        plans: the plans' coalitions (:func:`plan_coalitions`).
        coalitions, seed: as ``evaluate``'s settings.
        field: the argument that named the archive (named by a refusal).

    Returns:
        A :class:`~coalescence.attribution.faithfulness.HeldOut` of ``[m, n_players]`` bool masks,
        ``m = min(coalitions, 2^n_players - len(plans))``.

    Raises:
        InputError: fewer than :data:`~coalescence.attribution.faithfulness.MIN_COALITIONS`
            coalitions lie outside the plans (an exact run's plan holds every one).
    """
    held = held_out_coalitions(snap.n_players, coalitions, seed, exclude=plans)
    if held.coalitions < MIN_COALITIONS:
        raise InputError(
            f"the archive's plans hold {len(plans)} of the {2**snap.n_players} coalitions of snapshot "
            f"{snap.snapshot_id[:12]} ({snap.n_players} players), so {held.available} are left to hold out, fewer than "
            f"the {MIN_COALITIONS} an LDS interval needs; evaluate the --out document in a new archive "
            "(--archive NEW_DIR re-creates its game there), or the archive of a run that sampled fewer coalitions",
            field=field,
        )
    return held


def unknown_plan(method: str, plans: int, *, source_dir: bool) -> tuple[str, ...]:
    """A note where a sampled explanation's ``--out`` document is evaluated in an archive that holds
    none of its plan (a new one, ``plans`` 0): the document names no budget or seed, so its held-out
    coalitions cannot be kept apart from those it was fitted on; else ``()``.

    Args:
        method: the explanation's method (an exact one has no plan to keep apart: all 2^n).
        plans: the archive's plan coalitions of its game.
        source_dir: whether a run directory was evaluated (its plans are regenerated).
    """
    from ..attribution.estimators.registry import is_exact

    if source_dir or plans or is_exact(method):
        return ()
    return (
        f"the document names no plan of {method} (its budget and seed) and this archive holds none of it, so some "
        "held-out coalitions may be among those it was fitted on; evaluate its run archive for an LDS held out by construction",
    )
