"""The engine: wires snapshot, planner, masking, scheduler, collator, backend, store and archive.

Flow of :meth:`Engine.explain`: the estimator's plan emits coalition masks lazily; duplicates
within the plan are folded; each distinct coalition becomes a
:class:`~coalescence.scheduler.scheduler.CoalitionJob` keyed by its coalition key. The
:class:`~coalescence.scheduler.scheduler.CoalitionScheduler` serves it from the hot result store,
shares an identical evaluation in flight (single flight), or evaluates it: the job renders its
masked prompt with the absence policy and the chat template and submits it to the lock-leader
:class:`~coalescence.scheduler.collator.Collator`, which turns concurrent jobs into batched calls of
the synchronous backend from a worker thread, one call in flight at a time. Every evaluated
coalition is archived; the estimator then fits values from the pool.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

import numpy as np

from ..archive.writer import RunArchive
from ..attribution.estimators.base import Estimator, for_target_stderr
from ..attribution.explanation import AnswerToken, Explanation, answer_tokens
from ..backends.base import ScoringBackend, check_backend, run_record_of
from ..conversation import Conversation
from ..snapshot import ConversationSnapshot
from ..segmentation import segment_players
from ..errors import ConfigError, EngineClosed, InputError, MaskError
from ..masking.codec import PackedMask
from ..masking.policies import AbsencePolicy
from ..masking.proxy import ProxyLayout
from ..masking.render import ChatRenderer, TargetTokens
from ..pipeline import BackendCall, CoalitionRequest, Measurement, ScoringPipeline
from ..scheduler.buckets import LengthBuckets, share_order
from ..scheduler.collator import Collator, CollatorBackend
from ..scheduler.progress import NullProgress, Progress, ProgressTally
from ..scheduler.scheduler import CoalitionJob, CoalitionScheduler, SchedulerStatistics
from ..scheduler.store import ResultStore
from ..utility import ResolvedUtility, UtilitySpec
from .hydrate import fill_measurements, fill_store
from .keys import game_utility, key_for, model_identity
from .lanes import LanePipelines, default_buckets
from .notes import template_notes, utility_detail
from .counting import counted, counting_evaluations
from .proxy import PROXY_OFF, ProxyGame
from .rounds import sample_until
from .targets import check_room, generated_target

__all__ = ("Engine", "counting_evaluations")

logger = logging.getLogger(__name__)

class Engine:
    """Evaluates coalitions of conversation snapshots on one backend, each distinct key once.

    Args:
        backend: the scoring backend (see :class:`~coalescence.backends.base.ScoringBackend`).
        archive: where every evaluated coalition is recorded, or ``None``.
        store: the hot result store (a new unbounded one by default).
        progress: progress callbacks (no-op by default).
        batch_size: rows per backend call, at most the backend's ``max_batch_size`` (default:
            that, the batch the backend declares it does best at; one knob: set the backend's
            ``max_batch_size`` to change both).
        buckets: length buckets and padded-token budget of the collator (default, for a backend
            that pads its rows: 128, 512, 2048 and 8192-token buckets, a 16,384-token budget,
            capped at the model's context; for one that does not (``pads_rows`` false: vLLM), one
            bucket of the model's context taking ``batch_size`` rows).
        utility: the utility v(S) (default: ``logprob``, the target's log-probability in nats;
            see :mod:`coalescence.utility`).
        now: the instant chat templates that write the date render (default: pinned when the
            engine is made, see :class:`~coalescence.masking.render.ChatRenderer`); a resumed or
            replayed run passes the one its manifest records.
        proxy_game: the shared-KV proxy game that two-fidelity estimators use
            (:class:`~coalescence.engine.proxy.ProxyGame`: its tail rule, and the cost limit
            where it is played only where it pays), or ``None`` (the default): exact rows only.
            It is played only where it is defined and measured (:meth:`proxy_refusal`).

    Every model evaluation's measurement (per-token log-probabilities, or generated texts) is
    kept by its evaluation key (:attr:`measurements`, filled from an attached archive too), so a
    coalition whose evaluation is known is served under any utility reduced from it with no
    model call (counted as a cache hit).

    Raises:
        ConfigError: ``batch_size`` < 1 or above the backend's ``max_batch_size`` (which would
            split each call again), a backend that lacks a member of
            :class:`~coalescence.backends.base.ScoringBackend` (naming them), or a ``proxy_game``
            that is not a :class:`~coalescence.engine.proxy.ProxyGame` (e.g. a tail rule's name).
        InputError: the backend's tokenizer has no chat template.
    """

    def __init__(
        self,
        backend: ScoringBackend,
        *,
        archive: RunArchive | None = None,
        store: ResultStore | None = None,
        progress: Progress | None = None,
        batch_size: int | None = None,
        buckets: LengthBuckets | None = None,
        utility: UtilitySpec | None = None,
        now: datetime | None = None,
        proxy_game: ProxyGame | None = None,
    ) -> None:
        check_backend(backend)
        if proxy_game is not None and not isinstance(proxy_game, ProxyGame):
            raise ConfigError(
                f"must be a ProxyGame or None, got {proxy_game!r}; e.g. ProxyGame(tail={proxy_game!r})"
                if isinstance(proxy_game, str) else f"must be a ProxyGame or None, got {type(proxy_game).__name__}",
                field="proxy_game",
            )  # fmt: skip
        self.proxy_game = proxy_game
        self.backend = backend
        self.utility = utility if utility is not None else UtilitySpec()
        self.measurements: dict[str, Measurement] = {}
        self._resolved: dict[str, ResolvedUtility] = {}
        self.buckets = buckets
        self.archive = archive
        self.store = store if store is not None else ResultStore()
        self.progress: Progress = progress if progress is not None else NullProgress()
        # one monotone count over every evaluation of this engine (conversations in flight at once)
        self._progress_tally = ProgressTally(self.progress)
        limit = int(backend.max_batch_size)
        self.batch_size = limit if batch_size is None else batch_size
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {self.batch_size!r}", field="batch_size")
        if self.batch_size > limit:
            raise ConfigError(
                f"{self.batch_size} rows per call exceed the backend's max_batch_size of {limit}, which would split "
                "each call again; load the backend with max_batch_size (--batch-size) instead",
                field="batch_size",
            )
        self.renderer = ChatRenderer(backend.tokenizer, now=now)
        if archive is not None:
            fill_store(self.store, archive.loaded)
            fill_measurements(self.measurements, archive.loaded)
        self._totals = SchedulerStatistics()
        self._batch_ids = itertools.count()
        self._lanes = LanePipelines(backend, self._pipeline)
        self._targets: dict[str, TargetTokens] = {}
        self._layouts: dict[Any, ProxyLayout] = {}
        self._closed = False

    # -- statistics ---------------------------------------------------------------------------
    def statistics(self) -> SchedulerStatistics:
        """A snapshot of the counters (the scheduler's, plus duplicates folded within a plan)."""
        return self._totals

    # -- preparation --------------------------------------------------------------------------
    def prepare(
        self,
        conversation: Conversation,
        *,
        unit: str = "turn",
        roles: Iterable[str] | None = None,
        max_new_tokens: int = 64,
    ) -> ConversationSnapshot:
        """Segment a conversation into a snapshot, generating its target first if it has none.

        The target is generated once, greedily, from the full prompt (at most ``max_new_tokens``
        tokens). Its ids are the target (:attr:`~coalescence.conversation.Conversation.target_ids`,
        the stop token the model ended with excluded: the template's end-of-turn is scored after
        them, see :mod:`coalescence.masking.render`); its text is their decoding, special tokens
        kept, not stripped (shown, never encoded again).

        Raises:
            InputError: bad unit/roles, no players, or an empty generated answer.
            ConfigError: ``max_new_tokens`` < 1, or the prompt plus ``max_new_tokens`` exceeds the
                model's context (checked before generating; :class:`InputError` when the prompt
                alone fills it).
        """
        # validate the segmentation before spending a generation on it
        segment_players(conversation, unit=unit, roles=roles)
        if conversation.target is None:
            conversation = generated_target(self.backend, self.renderer, conversation, max_new_tokens)
        return ConversationSnapshot.build(conversation, unit=unit, roles=roles)

    def target_tokens(self, snapshot: ConversationSnapshot, policy: AbsencePolicy | None = None) -> TargetTokens:
        """The scored target tokens of a snapshot (cached), checked against the model's context.

        Args:
            snapshot: the conversation and its answer.
            policy: the absence policy whose full coalition is scored (``None``: the snapshot's
                messages as they are; they differ only under ``merge_adjacent``).

        Raises:
            InputError: the full conversation does not fit the model's context (field
                ``messages``), or the template/tokenizer cannot separate prompt and answer.
            TemplateRefused: the chat template refuses the full conversation or changes the answer.
        """
        cache_key = (snapshot.snapshot_id, policy)
        cached = self._targets.get(cache_key)
        if cached is not None:
            return cached
        target = self.renderer.target_tokens(snapshot, policy)
        total = len(target.full_prompt_ids) + len(target.ids)
        limit = int(self.backend.max_context)
        if total > limit:
            raise InputError(
                f"the conversation renders to {total} tokens with its answer, more than the "
                f"model's context of {limit}; shorten the conversation or use a longer-context model",
                field="messages",
            )
        self._targets[cache_key] = target
        return target

    @property
    def model(self) -> dict[str, str]:
        """The model identity that enters coalition keys (:func:`.keys.model_identity`)."""
        return model_identity(self.backend, self.renderer)

    def resolved_utility(self, snapshot: ConversationSnapshot, policy: AbsencePolicy | None = None) -> ResolvedUtility:
        """The engine's utility fixed for ``snapshot``'s target (cached).

        Raises:
            InputError: an answer sub-span outside the target (see :meth:`UtilitySpec.resolve`).
            ConfigError: a regenerate utility whose ``max_new_tokens`` with the full prompt
                exceeds the model's context (``--max-new-tokens``).
        """
        cache_key = (snapshot.snapshot_id, policy)
        cached = self._resolved.get(cache_key)
        if cached is None:
            target = self.target_tokens(snapshot, policy)
            if self.utility.generation is not None:  # each coalition's answer is generated anew
                check_room(len(target.full_prompt_ids), self.utility.generation.max_new_tokens, int(self.backend.max_context))
            cached = self.utility.resolve(snapshot.target, target.offsets)
            self._resolved[cache_key] = cached
        return cached

    def key(self, snapshot: ConversationSnapshot, policy: AbsencePolicy, mask: PackedMask, *, game: str = "exact") -> str:
        """The coalition key of ``mask`` under this engine's model and utility, in ``game``
        (``"exact"``, or a proxy game's name: its rows are keyed apart, :func:`game_utility`)."""
        utility = game_utility(self.resolved_utility(snapshot, policy).coalition_utility(), game)
        return key_for(snapshot, policy, self.model, mask, utility=utility)

    def evaluation_key(self, snapshot: ConversationSnapshot, policy: AbsencePolicy, mask: PackedMask, *, game: str = "exact") -> str:
        """The key of ``mask``'s model evaluation (its measurement, whatever the reduction), in ``game``."""
        utility = game_utility(self.resolved_utility(snapshot, policy).evaluation_utility(), game)
        return key_for(snapshot, policy, self.model, mask, utility=utility)

    # -- the proxy game -------------------------------------------------------------------------
    def proxy_refusal(self, snapshot: ConversationSnapshot, policy: AbsencePolicy) -> str | None:
        """Why this engine does not play the proxy game for ``snapshot`` under ``policy``, as a
        sentence, or ``None`` when it does (where it is defined and measured: :meth:`.ProxyGame.refusal`)."""
        if self.proxy_game is None:
            return PROXY_OFF
        return self.proxy_game.refusal(
            self.backend,
            teacher_forced=self.resolved_utility(snapshot, policy).spec.teacher_forced,
            policy_id=policy.id,
            lay_out=lambda: self.proxy_layout(snapshot, policy),
        )

    def proxy_layout(self, snapshot: ConversationSnapshot, policy: AbsencePolicy) -> ProxyLayout:
        """The proxy game's layout of ``snapshot`` (cached): the full prompt, its players' token
        ranges and the tail's start by this engine's tail rule (:meth:`.ProxyGame.layout`)."""
        cache_key = (snapshot.snapshot_id, policy)
        layout = self._layouts.get(cache_key)
        if layout is None:
            assert self.proxy_game is not None
            layout = self.proxy_game.layout(self.renderer, snapshot, self.target_tokens(snapshot, policy), policy)
            self._layouts[cache_key] = layout
        return layout

    def attach_archive(self, archive: RunArchive) -> int:
        """Record results in ``archive`` and serve the coalitions it already holds from the store.

        Returns:
            The number of archived coalitions loaded into the hot store.
        """
        self.archive = archive
        fill_measurements(self.measurements, archive.loaded)
        return fill_store(self.store, archive.loaded)

    def answer_tokens(
        self,
        snapshot: ConversationSnapshot,
        policy: AbsencePolicy,
        *,
        full: np.ndarray | None = None,
        empty: np.ndarray | None = None,
    ) -> tuple[AnswerToken, ...] | None:
        """The scored answer tokens with their log-probabilities in a game's full and empty coalition.

        Args:
            snapshot: the conversation and its answer.
            policy: the absence policy.
            full: ``[n_players]`` bool, the game's full coalition (default: every player present).
            empty: ``[n_players]`` bool, the game's empty coalition (default: every player absent).

        Returns:
            One :class:`~coalescence.attribution.explanation.AnswerToken` per scored token, from
            the measurements of the two coalitions (evaluated or loaded from the archive), or
            ``None`` for a regenerate utility or when either measurement is unknown.
        """
        if not self.resolved_utility(snapshot, policy).spec.teacher_forced:
            return None
        n = snapshot.n_players
        rows = (np.ones(n, dtype=bool) if full is None else full, np.zeros(n, dtype=bool) if empty is None else empty)
        measured = [self.measurements.get(self.evaluation_key(snapshot, policy, PackedMask.from_bools(r))) for r in rows]
        if any(m is None or isinstance(m, tuple) for m in measured):
            return None
        target = self.target_tokens(snapshot, policy)
        return answer_tokens(target.answer, target.offsets, measured[0], measured[1], lead=target.lead, tail=target.tail)

    # -- evaluation ---------------------------------------------------------------------------
    def _pipeline(self, lane: Any) -> ScoringPipeline:
        """A new scoring pipeline for ``lane``: its own lock-leader collator over the lane's backend."""
        buckets = self.buckets or default_buckets(self.backend, self.batch_size)
        collator = Collator(
            CollatorBackend(fn=BackendCall(self.backend.lane(lane), self._batch_ids)), max_batch_size=self.batch_size, buckets=buckets
        )
        return ScoringPipeline(
            backend=self.backend,
            renderer=self.renderer,
            collator=collator,
            target_tokens=self.target_tokens,
            resolved_utility=self.resolved_utility,
            measurements=self.measurements,
            proxy_layout=self.proxy_layout,
        )

    async def evaluate(
        self,
        snapshot: ConversationSnapshot,
        policy: AbsencePolicy,
        coalitions: Iterable[np.ndarray],
        *,
        game: str = "exact",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Utilities of the distinct coalitions among ``coalitions``.

        Each distinct coalition becomes one :class:`~coalescence.scheduler.scheduler.CoalitionJob`;
        the scheduler serves it from the hot store, shares an identical one in flight, or evaluates
        it through the lock-leader collator, which batches concurrent jobs into backend calls.

        Args:
            snapshot: the conversation and its players.
            policy: the absence policy.
            coalitions: 1-D bool rows ``[n_players]`` (True = present), possibly repeated.
            game: ``"exact"`` (default), or the engine's proxy game's name
                (:attr:`.ProxyGame.name`): its rows are keyed, scored and archived as that game's.

        Returns:
            ``masks`` ``[m, n_players]`` bool (distinct, first-seen order) and ``utilities``
            ``[m]`` float64 in the utility's unit (default: log p(target | masked prompt), nats).

        Raises:
            EngineClosed: the engine was closed.
            MaskError: a coalition of the wrong width.
            BatchFailed: a model call failed (every other coalition is still evaluated and archived).
        """
        if self._closed:
            raise EngineClosed("the engine is closed")
        self.resolved_utility(snapshot, policy)
        if game != "exact":
            refused = self.proxy_refusal(snapshot, policy)
            if refused is not None or self.proxy_game is None or game != self.proxy_game.name:
                raise ConfigError(f"cannot evaluate rows of {game}: {refused or 'not this engine’s proxy game'}", field="proxy_game")
        distinct: dict[bytes, np.ndarray] = {}
        requested = 0
        for row in coalitions:
            requested += 1
            row = np.asarray(row, dtype=bool)
            if row.shape != (snapshot.n_players,):
                raise MaskError(
                    f"a coalition has shape {row.shape} for {snapshot.n_players} players", field="mask"
                )
            distinct.setdefault(PackedMask.from_bools(row).words, row)
        # submit in depth-first order over the player trie (player 0 first, present before absent)
        # so that coalitions sharing their leading players, hence long token prefixes, are adjacent
        # and land in the same or consecutive batches; which coalitions run, and every result, is
        # unchanged (results are mapped back to first-seen order below)
        rows_seen = list(distinct.values())
        order = share_order(np.array(rows_seen, dtype=bool).reshape(len(rows_seen), snapshot.n_players))
        folded = requested - len(distinct)
        self._totals = replace(self._totals, requested=self._totals.requested + folded, deduplicated=self._totals.deduplicated + folded)
        jobs = []
        words_seen = list(distinct)
        for i in order:
            words, row = words_seen[i], rows_seen[i]
            mask = PackedMask(words, snapshot.n_players)
            jobs.append(
                CoalitionJob(
                    coalition_key=self.key(snapshot, policy, mask, game=game),
                    snapshot_id=snapshot.snapshot_id,
                    request=CoalitionRequest(
                        snapshot=snapshot,
                        policy=policy,
                        present=row,
                        evaluation_key=self.evaluation_key(snapshot, policy, mask, game=game),
                        game=game,
                    ),
                    absence_policy=policy.id,
                    mask=mask,
                    model_id=self.backend.model_id,
                    game=game,
                )
            )
        lane, pipeline = self._lanes.acquire(snapshot.snapshot_id)
        # two batches in flight (one scored, one queued) and no job alive beyond them, which would
        # only wait for a slot: one event-loop wake-up more per coalition (store hits take none)
        inflight = 2 * self.batch_size
        scheduler = CoalitionScheduler(
            pipeline, store=self.store, archive=self.archive, progress=self._progress_tally, max_inflight=inflight, pending_limit=inflight
        )
        try:
            results = await scheduler.run(jobs) if jobs else []
        finally:
            self._lanes.release(lane)
            run_stats = scheduler.statistics()
            self._totals = self._totals.plus(run_stats)
            counted(run_stats.executed)
        masks = np.array(rows_seen, dtype=bool).reshape(len(distinct), snapshot.n_players)
        utilities = np.empty(len(results), dtype=np.float64)
        utilities[order] = [r.utility for r in results]  # back to first-seen order
        return masks, utilities

    async def explain(
        self, snapshot: ConversationSnapshot, estimator: Estimator, policy: AbsencePolicy
    ) -> Explanation:
        """Plan, evaluate and fit: the attribution of ``snapshot``'s players (with the proxy game
        beside the exact plan where it is played and pays for itself: :func:`.two_fidelity.play`).

        Raises:
            EstimatorError, ConfigError: the estimator cannot run on this many players or budget
                (raised before any model call).
            InputError: the conversation does not fit the model.
            BatchFailed: a model call failed.
        """
        from .two_fidelity import play

        t0 = time.perf_counter()
        played = await play(self, snapshot, estimator, policy)
        return self._explanation(snapshot, policy, played.estimate, t0, played.executed, proxy=played.proxy)

    async def explain_until(
        self,
        snapshot: ConversationSnapshot,
        estimator_for: Callable[[int], Estimator],
        policy: AbsencePolicy,
        *,
        budget: int,
        target_stderr: float,
        first_budget: int | None = None,
    ) -> Explanation:
        """Sample in rounds until every player's standard error is below ``target_stderr``.

        Round k fits ``estimator_for(first_budget * 2**k)`` (the budget capped at ``budget``; the
        factory keeps the seed). Earlier rounds' coalitions are served from the hot store, and
        ``budget`` caps the distinct coalitions of all rounds together: where a round's plan would
        take them past it (two budgets' plans need not nest: KernelSHAP's larger budget enumerates
        more coalition sizes), the round samples at the largest budget whose plan still fits
        (``_fitting_round``), and is the last. A method that chooses its estimator by the game
        (``capabilities.chooses``, e.g. ``auto``) runs its rounds with the estimator it chooses for
        ``budget``, and is refused only when that one reports no standard errors. :attr:`Explanation.stopping` says why sampling stopped: ``"target"``
        (every standard error known and below the target), ``"exact"`` (the budget covered every
        coalition, so the values are exact) or ``"budget"`` (the budget was spent first). A NaN
        (unknown) standard error never meets the target: the estimators report NaN where their
        samples cannot say (too few pairs, no spread, a budget within 4n of 2^n; see each
        estimator's docstring), and ``stopping["unknown_stderr"]`` counts them in the last round
        (``max_stderr`` is then None).

        Args:
            snapshot: the conversation and its players.
            estimator_for: ``budget -> estimator`` of a method with standard errors (its
                capabilities say ``reports_stderr``: permutation, kernelshap, regression-msr,
                banzhaf), e.g. ``lambda b: make_estimator("kernelshap", budget=b, seed=0)``.
            policy: the absence policy.
            budget: the most distinct model evaluations over all rounds.
            target_stderr: the standard error (nats) every player must get below (> 0).
            first_budget: the first round's budget (default ``max(16, 4 n)``, at most ``budget``).

        Raises:
            ConfigError: a method without standard errors, a non-positive target, or a budget
                below the method's minimum.
        """
        n = snapshot.n_players
        last, chosen = for_target_stderr(estimator_for(budget), n)
        if chosen is not None:  # the rounds sample with the estimator chosen for the whole budget
            picked = last
            estimator_for = lambda b: replace(picked, budget=b)  # noqa: E731
        if not target_stderr > 0:
            raise ConfigError(f"must be > 0, got {target_stderr!r}", field="target_stderr")
        last.validate(n)
        self.resolved_utility(snapshot, policy)
        t0 = time.perf_counter()
        with counting_evaluations() as executed:
            estimate, stopping = await sample_until(
                estimator_for,
                n,
                lambda rows: self.evaluate(snapshot, policy, rows),
                budget=budget,
                target_stderr=target_stderr,
                first_budget=first_budget,
            )
        if chosen is not None:
            estimate = replace(estimate, method=chosen[0], notes=(*estimate.notes, chosen[1]))
        return self._explanation(snapshot, policy, estimate, t0, executed[0], stopping=stopping)

    def _explanation(
        self,
        snapshot: ConversationSnapshot,
        policy: AbsencePolicy,
        estimate: Any,
        t0: float,
        executed: int,
        *,
        stopping: dict[str, Any] | None = None,
        proxy: dict[str, Any] | None = None,
    ) -> Explanation:
        return Explanation(
            snapshot=snapshot,
            estimate=estimate,
            model_id=self.backend.model_id,
            model_revision=self.backend.revision,
            absence_policy=policy.id,
            absence_params=policy.params(),
            utility=self.utility.kind,
            utility_unit=self.utility.unit,
            utility_detail=utility_detail(self.resolved_utility(snapshot, policy)),
            utility_description=self.resolved_utility(snapshot, policy).describe(),
            target_token_count=len(self.target_tokens(snapshot, policy).ids),
            n_evaluations=executed,
            wall_seconds=time.perf_counter() - t0,
            notes=self.conversation_notes(snapshot, policy) + tuple(estimate.notes),
            stopping=stopping,
            answer_tokens=self.answer_tokens(snapshot, policy),
            proxy=proxy,
        )

    def conversation_notes(
        self, snapshot: ConversationSnapshot, policy: AbsencePolicy, *, empty: np.ndarray | None = None
    ) -> tuple[str, ...]:
        """The notes of every explanation of ``snapshot`` under ``policy`` that are not its
        estimator's: the utility's, the template's and the backend's (``empty``: the game's
        emptiest coalition where some players are held present, :func:`.notes.template_notes`)."""
        extra = tuple(self.backend.run_notes(snapshot.snapshot_id))
        target = self.target_tokens(snapshot, policy)
        return self.resolved_utility(snapshot, policy).notes() + template_notes(self.renderer, target, snapshot, policy, empty=empty) + extra

    def close(self, *, status: str = "complete") -> None:
        """Refuse new work and close the archive (flushing buffered rows, recording ``status``).

        The backend's :meth:`~coalescence.backends.base.ScoringBackend.run_record` is kept in
        the archive's run record (Ray workers: ``ray``, with workers, threads, calls, lost
        workers), and a backend that shuts down with its engine (``shutdown_with_engine``: Ray
        workers) is shut down.
        """
        self._closed = True
        try:
            extra = run_record_of(self.backend)
        except BaseException:
            if self.backend.shutdown_with_engine:
                self.backend.shutdown()
            raise
        try:
            if self.archive is not None:
                self.archive.close(status=status, statistics=self.statistics().as_dict(), **extra)
        finally:
            if self.backend.shutdown_with_engine:
                self.backend.shutdown()
