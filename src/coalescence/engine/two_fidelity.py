"""One game played and fitted: the estimator's exact plan, and the proxy game beside it where it
is played and pays for itself (:func:`play`).

**Where the proxy game pays.** A two-fidelity estimator fits the exact rows with the proxy game as a
control variate: its proxy rows are many (``K``, :func:`~.proxy_plan_size`) and each costs a share
``r`` of an exact row's time, a share that depends on the backend and the conversation (a proxy row
of a long shared context runs a short tail: ~1/30 of an exact row on the CPU for 1,900 shared
tokens; on a short conversation about half). The proxy rows are worth their time where they cost at
most :data:`PROXY_COST_MULTIPLE` times the exact rows' (``K r <= 3 m`` for ``m`` exact coalitions;
the :class:`~coalescence.engine.proxy.ProxyGame`'s ``cost_limit``, which ``--proxy-game auto``, the
default, sets to it; a tail rule named explicitly plays the proxy game whatever it costs):
at 1/30 the long games' 268-292 proxy rows cost about the 8 exact rows' time and raise the LDS
above 64 exact rows' (``benchmarks/RESULTS.md``); at one half, the 512 proxy rows of ``--budget 32``
on a 10-player conversation cost 8 times the exact rows' time for no gain a fit of more exact rows
would not give. ``r`` is measured on the run's own rows, never assumed: the exact plan's rows, then
the proxy game on the exact coalitions (its first call also computes the shared KV, a cost paid
once), then the first :data:`PROBE_ROWS` rows of the proxy plan, whose mean time is the proxy row's
cost. Each row's time is its archived model time (its batch's time shared among its rows: the same
in a resumed run, so a resume decides as the first run did), else this session's wall time over
the rows it computed. Where the proxy does not pay, the rest of its plan is not evaluated and the
values are the exact rows' fit, with a note giving the measured share; where the budget is below
the estimator's floor on exact rows alone (e.g. the surrogate at 8 exact coalitions), the proxy is
played all the same, with a note.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..masking.codec import PackedMask
from .counting import counting_evaluations
from .proxy import PROXY_COST_MULTIPLE, proxy_agreement, validate_exact_only

if TYPE_CHECKING:
    from ..snapshot import ConversationSnapshot
    from ..masking.policies import AbsencePolicy

__all__ = ("PROBE_ROWS", "PROXY_COST_MULTIPLE", "Played", "play")

PROBE_ROWS = 16
"""Rows of the proxy plan whose mean time is a proxy row's cost (module docs)."""


@dataclass(frozen=True, slots=True)
class Played:
    """A game played and fitted.

    Attributes:
        estimate: the estimator's fit (its notes say where the proxy game was not played, and why).
        proxy: the proxy game's record where it was played (``{"game", "coalitions",
            "evaluations", "shared", "pearson", "spearman"}``), else None.
        executed: exact model evaluations computed in this session.
        proxy_executed: proxy rows computed in this session (played or only measured).
    """

    estimate: Any
    proxy: dict[str, Any] | None
    executed: int
    proxy_executed: int


async def play(
    engine: Any,
    snapshot: ConversationSnapshot,
    estimator: Any,
    policy: AbsencePolicy,
    *,
    select: np.ndarray | None = None,
) -> Played:
    """Plan, evaluate and fit ``estimator`` on ``snapshot``'s game (module docs for the proxy game;
    the default method, :class:`~coalescence.attribution.estimators.default.DefaultMethod`, is
    resolved first, by the game's size and whether the proxy game is played, and its note added).

    Args:
        engine: the :class:`~coalescence.engine.Engine` that evaluates (its store, archive,
            proxy game and cost limit; this module sits below it).
        snapshot: the conversation and its players.
        estimator: the estimator of the game.
        policy: the absence policy.
        select: ``[k]`` indices of the players of the game (the others held present: a
            hierarchy's fine level), or None for every player.

    Raises:
        EstimatorError, ConfigError: the estimator cannot run on this many players or budget
            (raised before any model call; on exact rows alone, naming why the proxy is not played).
        InputError: the conversation does not fit the model.
        BatchFailed: a model call failed.
    """
    n = snapshot.n_players if select is None else int(select.size)
    chose = None
    if hasattr(estimator, "resolve"):  # the default method: its plan depends on whether the proxy game is played
        two_asked = engine.proxy_refusal(snapshot, policy) is None
        estimator, chose = estimator.resolve(n, proxy=two_asked)
    played = await _play(engine, snapshot, estimator, policy, n, select)
    if chose is None:
        return played
    return replace(played, estimate=replace(played.estimate, notes=(*played.estimate.notes, chose)))


async def _play(
    engine: Any, snapshot: ConversationSnapshot, estimator: Any, policy: AbsencePolicy, n: int, select: np.ndarray | None
) -> Played:
    two = estimator.capabilities.two_fidelity
    if two:  # the floor with the proxy game; the exact-only one below where it is not played
        estimator.validate(n, proxy=True)
    else:
        estimator.validate(n)
    engine.resolved_utility(snapshot, policy)
    refused = engine.proxy_refusal(snapshot, policy) if two else None
    if refused is not None:  # exact rows alone: the floor without the proxy game, and why
        validate_exact_only(estimator, n, refused)

    def lifted(rows: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        if select is None:
            yield from rows
            return
        for row in rows:
            full = np.ones(snapshot.n_players, dtype=bool)
            full[select] = row
            yield full

    def own(masks: np.ndarray) -> np.ndarray:
        return masks if select is None else masks[:, select]

    t0 = time.perf_counter()
    with counting_evaluations() as executed:
        masks, utilities = await engine.evaluate(snapshot, policy, lifted(estimator.plan(n)))
    exact_wall = time.perf_counter() - t0
    if not two or refused is not None:
        estimate = estimator.fit(own(masks), utilities)
        if two and engine.proxy_game is not None:  # asked for, not playable here: say why
            estimate = replace(estimate, notes=(*estimate.notes, f"exact rows only: {refused}"))
        return Played(estimate, None, executed[0], 0)
    if n < 62 and len(masks) >= (1 << n):  # every coalition exact: nothing for a control variate to do
        estimate = estimator.fit(own(masks), utilities)
        note = f"the proxy game was not played: the budget covers all {1 << n} coalitions, which were evaluated exactly"
        return Played(replace(estimate, notes=(*estimate.notes, note)), None, executed[0], 0)
    game = engine.proxy_game.name
    plan = list(estimator.proxy_plan(n))
    with counting_evaluations() as proxied:
        # the proxy on every exact coalition (the control variate needs c(S) where v(S) is known;
        # its first call computes the shared KV), then a probe of its own plan, timed
        on_exact = await engine.evaluate(snapshot, policy, masks, game=game)
        t1, before = time.perf_counter(), proxied[0]
        probe = await engine.evaluate(snapshot, policy, lifted(plan[:PROBE_ROWS]), game=game)
        probe_wall, probe_executed = time.perf_counter() - t1, proxied[0] - before
        # measured whether or not it decides (a named tail rule is played whatever it costs, and says so)
        limit = engine.proxy_game.cost_limit
        exact_row = _row_seconds(engine, snapshot, policy, masks, "exact", exact_wall, executed[0])
        proxy_row = _row_seconds(engine, snapshot, policy, probe[0], game, probe_wall, probe_executed)
        costly = _costly(
            exact_row, proxy_row, proxy_rows=len(plan), exact_rows=len(masks), limit=PROXY_COST_MULTIPLE if limit is None else limit
        )
        floor = "it was named for this run (a tail rule given)" if limit is None else _below_exact_floor(estimator, n)
        if costly is None or floor is not None:
            rest = await engine.evaluate(snapshot, policy, lifted(plan[PROBE_ROWS:]), game=game)
        else:
            rest = (np.zeros((0, snapshot.n_players), dtype=bool), np.zeros(0))
    pmasks, putilities = _union(on_exact, probe, rest)
    if costly is not None and floor is None:
        estimate = estimator.fit(own(masks), utilities)
        note = (
            f"the proxy game was not played: {costly} (measured on {proxied[0]} proxy rows this session); the values are "
            "of the exact rows alone (--proxy-game none skips the measurement)"
        )
        return Played(replace(estimate, notes=(*estimate.notes, note)), None, executed[0], proxied[0])
    estimate = estimator.fit_two_fidelity(own(masks), utilities, own(pmasks), putilities)
    if costly is not None:
        estimate = replace(estimate, notes=(*estimate.notes, f"the proxy game was played although {costly}: {floor}"))
    proxy = {"game": game, "coalitions": len(pmasks), "evaluations": proxied[0]} | proxy_agreement(
        own(masks), utilities, own(pmasks), putilities
    )
    return Played(estimate, proxy, executed[0], proxied[0])


def _row_seconds(
    engine: Any, snapshot: ConversationSnapshot, policy: AbsencePolicy, masks: np.ndarray, game: str, wall: float, computed: int
) -> float | None:
    """The mean model time of a row of ``masks`` (seconds): their archived times where the archive
    has them (the same in a resumed run), else this session's ``wall`` over the ``computed`` rows;
    None where neither says (no row computed, none archived with a time)."""
    archive = engine.archive
    if archive is not None:
        times = [archive.model_seconds(engine.key(snapshot, policy, PackedMask.from_bools(row), game=game)) for row in masks]
        known = [t for t in times if t]
        if known:
            return float(np.mean(known))
    return wall / computed if computed else None


def _costly(exact_row: float | None, proxy_row: float | None, *, proxy_rows: int, exact_rows: int, limit: float) -> str | None:
    """Why the proxy's rows cost more than they pay, as a clause, or None where they pay or the
    cost is unknown (module docs)."""
    if exact_row is None or proxy_row is None or not exact_row > 0:
        return None
    share = proxy_row / exact_row
    multiple = share * proxy_rows / max(exact_rows, 1)
    if multiple <= limit:
        return None
    return (
        f"a proxy row took {share:.2f} of an exact row's time here, so its {proxy_rows} coalitions would cost "
        f"{multiple:.1f}x the {exact_rows} exact ones' time, above the {limit:g}x where it pays"
    )


def _below_exact_floor(estimator: Any, n: int) -> str | None:
    """Why the estimator cannot fit the exact rows alone (its budget below that floor), or None."""
    try:
        estimator.validate(n, proxy=False)
    except ConfigError as exc:
        return exc.message
    return None


def _union(*pools: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of several ``(masks, utilities)`` pools, first seen first."""
    seen: dict[bytes, int] = {}
    rows, values = [], []
    for masks, utilities in pools:
        for row, u in zip(masks, utilities, strict=True):
            words = PackedMask.from_bools(row).words
            if words not in seen:
                seen[words] = len(rows)
                rows.append(np.asarray(row, dtype=bool))
                values.append(float(u))
    width = pools[0][0].shape[1]
    return np.array(rows, dtype=bool).reshape(len(rows), width), np.array(values, dtype=np.float64)
