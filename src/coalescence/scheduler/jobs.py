"""What the coalition scheduler takes and gives: a coalition job, an evaluation's outcome, a
job's result, and the scheduler's counters."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError, MaskError
from ..masking.codec import PackedMask

__all__ = ("CoalitionJob", "EvalOutcome", "Evaluate", "JobResult", "SchedulerStatistics")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoalitionJob:
    """One coalition to evaluate.

    Attributes:
        coalition_key: 64-hex-digit SHA-256 coalition key (see
            :func:`~coalescence.masking.codec.coalition_key`); equal keys are evaluated once.
        snapshot_id: the conversation snapshot's id.
        request: what ``evaluate`` needs (e.g. a rendered ``ScoreRequest``); opaque here.
        absence_policy: the absence policy id.
        mask: the coalition's packed mask.
        model_id: the model's id.
        prefix_hash: hash of the rendered prompt's shared prefix (for KV reuse grouping), or "".
        game: ``"exact"``, or the proxy game whose row it is (archived with the row).

    Raises:
        ConfigError: an empty or non-string key, snapshot id, policy or model id.
        MaskError: ``mask`` is not a :class:`~coalescence.masking.codec.PackedMask`.
    """

    coalition_key: str
    snapshot_id: str
    request: Any
    absence_policy: str
    mask: PackedMask
    model_id: str
    prefix_hash: str = ""
    game: str = "exact"

    def __post_init__(self) -> None:
        if (  # the common case, in one expression (exact types; subclasses take the checks below)
            type(self.coalition_key) is str and self.coalition_key and type(self.snapshot_id) is str and self.snapshot_id
            and type(self.absence_policy) is str and self.absence_policy and type(self.model_id) is str and self.model_id
            and type(self.game) is str and self.game and type(self.prefix_hash) is str and type(self.mask) is PackedMask
        ):
            return
        for name in ("coalition_key", "snapshot_id", "absence_policy", "model_id", "game"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"must be a non-empty string, got {value!r}", field=f"job.{name}")
        if not isinstance(self.prefix_hash, str):
            raise ConfigError(f"must be a string, got {self.prefix_hash!r}", field="job.prefix_hash")
        if not isinstance(self.mask, PackedMask):
            raise MaskError(f"must be a PackedMask, got {type(self.mask).__name__}", field="job.mask")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalOutcome:
    """What an ``evaluate`` function returns for one job.

    Attributes:
        utility: the coalition's utility in nats.
        batch_size: rows in the model call that evaluated it (>= 1).
        kv_cache_hits: prompt tokens served from the backend's KV/prefix cache for this job (>= 0).
        tokens_computed: token positions the model ran for this job, archived; ``None`` if unknown.
        tokens_reused: token positions served from a shared prefix, archived; ``None`` if unknown.
        batch_id: the model call that evaluated it, archived; ``None`` if unknown.
        batch_seconds: wall time of that model call (seconds), archived as ``elapsed_ms``; when
            ``None`` the time of the ``evaluate`` call (queueing included) is archived instead.
        cache_hit: the value was derived without a model call (e.g. from the archived per-token
            scores of the same evaluation under another utility); counted and archived as a
            cache hit, with ``batch_size`` 0.
        evaluation_key: the key of the model evaluation the value was reduced from, archived.
        token_logprobs: ``[n_target]`` float32 per-token log-probabilities (nats), archived.
        generated_texts: the regenerated answers the value compares, archived.

    Raises:
        ConfigError: a non-numeric utility, ``batch_size`` < 1 (< 0 for a cache hit) or
            ``kv_cache_hits`` < 0.
    """

    utility: float
    batch_size: int = 1
    kv_cache_hits: int = 0
    tokens_computed: int | None = None
    tokens_reused: int | None = None
    batch_id: int | None = None
    batch_seconds: float | None = None
    cache_hit: bool = False
    evaluation_key: str | None = None
    token_logprobs: Any = None  # [n_target] float32 nats, or None
    generated_texts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if (  # the common case, in one expression (exact types; others take the checks below)
            type(self.utility) is float and type(self.batch_size) is int and type(self.kv_cache_hits) is int
            and self.batch_size >= (0 if self.cache_hit else 1) and self.kv_cache_hits >= 0
        ):
            return
        if isinstance(self.utility, bool) or not isinstance(self.utility, int | float):
            raise ConfigError(f"must be a float (nats), got {self.utility!r}", field="utility")
        if not isinstance(self.batch_size, int) or self.batch_size < (0 if self.cache_hit else 1):
            raise ConfigError(f"must be an int >= 1, got {self.batch_size!r}", field="batch_size")
        if not isinstance(self.kv_cache_hits, int) or self.kv_cache_hits < 0:
            raise ConfigError(f"must be an int >= 0, got {self.kv_cache_hits!r}", field="kv_cache_hits")


Evaluate = Callable[[CoalitionJob], Awaitable[EvalOutcome]]
"""The scheduler's one road to the model: evaluate one job (the engine passes the collator's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobResult:
    """The outcome of one job.

    Attributes:
        job: the job.
        utility: utility in nats; NaN when ``error`` is set.
        elapsed_s: seconds of the evaluation that produced the value (the leader's for a
            deduplicated job, 0 for a store hit or a failure).
        cache_hit: served by the hot result store.
        deduplicated: shared another job's in-flight evaluation.
        kv_cache_hits: KV-cache hits reported by this job's own evaluation (0 unless executed).
        batch_size: rows in the model call that produced the value (0 for a store hit).
        error: the evaluation's exception, or ``None`` on success.

    Raises:
        ConfigError: negative ``elapsed_s``, ``kv_cache_hits`` or ``batch_size``, or both flags set.
    """

    job: CoalitionJob
    utility: float
    elapsed_s: float
    cache_hit: bool
    deduplicated: bool
    kv_cache_hits: int = 0
    batch_size: int = 1
    error: Exception | None = None

    def __post_init__(self) -> None:
        if self.elapsed_s < 0 or self.kv_cache_hits < 0 or self.batch_size < 0:
            raise ConfigError(
                f"elapsed_s={self.elapsed_s!r}, kv_cache_hits={self.kv_cache_hits!r} and "
                f"batch_size={self.batch_size!r} must be >= 0",
                field="result",
            )
        if self.cache_hit and self.deduplicated:
            raise ConfigError("a result is a cache hit or deduplicated, not both", field="result")

    @property
    def ok(self) -> bool:
        """``True`` when the job has a value (``error`` is ``None``)."""
        return self.error is None


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStatistics:
    """Counters of a scheduler, as a frozen snapshot (all runs of the scheduler together).

    Every job is counted once, when it reaches its outcome, in exactly one of ``executed``,
    ``deduplicated``, ``cache_hits`` or ``failed``; so at every instant

        ``requested == executed + deduplicated + cache_hits + failed``

    A job cancelled before its outcome is not counted at all.

    Attributes:
        requested: jobs that reached an outcome.
        executed: jobs whose own ``evaluate`` call returned a value.
        deduplicated: jobs that shared another job's in-flight evaluation, whatever its outcome
            (a follower of a failed flight also ends with the error but is counted here).
        cache_hits: jobs served by the hot result store.
        kv_cache_hits: sum of ``EvalOutcome.kv_cache_hits`` over executed jobs.
        failed: jobs whose own ``evaluate`` call raised (failed without producing a value; each is
            one evaluation attempt, so ``executed + failed`` is the number of ``evaluate`` calls
            that finished).
    """

    requested: int = 0
    executed: int = 0
    deduplicated: int = 0
    cache_hits: int = 0
    kv_cache_hits: int = 0
    failed: int = 0

    def plus(self, other: SchedulerStatistics) -> SchedulerStatistics:
        """These counters plus ``other``'s (e.g. a total plus one run's)."""
        return SchedulerStatistics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        """The counters by name (as an archive's run record keeps them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
