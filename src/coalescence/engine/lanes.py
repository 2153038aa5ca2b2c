"""The scoring pipelines of a backend's lanes, shared by every evaluation in flight on a lane."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends.base import ScoringBackend
from ..pipeline import ScoringPipeline
from ..scheduler.buckets import LengthBuckets

__all__ = ("LanePipelines", "default_buckets")


def default_buckets(backend: ScoringBackend, batch_size: int) -> LengthBuckets:
    """The collator's length buckets when none were given: for a backend that pads its rows, the
    default buckets capped at the model's context; for one that does not (vLLM), one bucket of
    the model's context taking ``batch_size`` rows."""
    context = int(backend.max_context)
    if backend.pads_rows:
        return LengthBuckets(max_tokens=context)
    return LengthBuckets(ceilings=(context,), padded_token_budget=context * batch_size, max_tokens=context)


class LanePipelines:
    """The collator and scoring pipeline shared by every evaluation in flight on a lane (made
    inside the event loop by the first; closed when the last one ends), so concurrent
    conversations fill the same batches.

    The backend names the lane of a conversation
    (:meth:`~coalescence.backends.base.ScoringBackend.acquire_lane`;
    :class:`~coalescence.distributed.RayBackend`: one per model worker); each lane has its own
    collator, so one call per lane is in flight at a time. A backend with one lane answers ``None``.

    Args:
        backend: the scoring backend whose lanes these are.
        make: ``lane -> pipeline``, called for a lane with no evaluation in flight.
    """

    def __init__(self, backend: ScoringBackend, make: Callable[[Any], ScoringPipeline]) -> None:
        self._backend = backend
        self._make = make
        self._shared: dict[Any, ScoringPipeline] = {}
        self._users: dict[Any, int] = {}

    def acquire(self, snapshot_id: str | None = None) -> tuple[Any, ScoringPipeline]:
        """The lane of the conversation ``snapshot_id`` and its pipeline; :meth:`release` it after."""
        lane = self._backend.acquire_lane(snapshot_id) if snapshot_id is not None else None
        shared = self._shared.get(lane)
        if shared is None:
            shared = self._shared[lane] = self._make(lane)
        self._users[lane] = self._users.get(lane, 0) + 1
        return lane, shared

    def release(self, lane: Any = None) -> None:
        """End one evaluation on ``lane``; the last one closes the lane's collator."""
        if lane is not None:
            self._backend.release_lane(lane)
        self._users[lane] -= 1
        if self._users[lane] == 0:
            del self._users[lane]
            shared = self._shared.pop(lane, None)
            if shared is not None:
                shared.collator.close()
