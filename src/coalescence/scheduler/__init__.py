"""Scheduling coalition evaluations: the hot result store and progress reporting."""

from .progress import NullProgress, Progress, TqdmProgress
from .store import ResultStore

__all__ = ("NullProgress", "Progress", "ResultStore", "TqdmProgress")
