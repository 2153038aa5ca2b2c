"""Scheduling coalition evaluations: hot result store, single-flight dedup, bounded concurrency,
the lock-leader collator that batches concurrent requests into backend calls, and progress."""

from .collator import Collator, CollatorBackend, CollatorRecord, CollatorStatistics, batch_key, scoring_backend
from .dedup import SingleFlight
from .progress import NullProgress, Progress, ProgressTally, TqdmProgress
from .scheduler import CoalitionJob, CoalitionScheduler, EvalOutcome, JobResult, SchedulerStatistics
from .store import ResultStore

__all__ = (
    "CoalitionJob",
    "CoalitionScheduler",
    "Collator",
    "CollatorBackend",
    "CollatorRecord",
    "CollatorStatistics",
    "EvalOutcome",
    "JobResult",
    "NullProgress",
    "Progress",
    "ProgressTally",
    "ResultStore",
    "SchedulerStatistics",
    "SingleFlight",
    "TqdmProgress",
    "batch_key",
    "scoring_backend",
)
