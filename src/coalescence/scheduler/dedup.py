"""Single-flight deduplication: one evaluation per key in flight, shared by every caller.

The first caller of :meth:`SingleFlight.do` with a key (the *leader*) runs the work; callers that
arrive while it runs (*followers*) wait for the leader's outcome, value or exception, and receive
it too. Nothing is remembered after the flight lands: a failure is not cached, so a later caller
with the same key runs the work again (successes are remembered by the result store, not here).

Cancellation: when the leader is cancelled (or interrupted) before its outcome, the flight is
*abandoned*: its followers wake up and claim the key again, and one of them becomes the new leader.
A cancelled follower just stops waiting; the flight goes on for the others.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import anyio

__all__ = ("Flight", "SingleFlight")

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Flight(Generic[T]):
    """One in-flight evaluation: an event, then a value, an exception or abandonment.

    Created by :class:`SingleFlight`; read through :meth:`SingleFlight.do` or
    :meth:`SingleFlight.attempt`, or by a caller of :meth:`SingleFlight.join` (the scheduler).
    """

    __slots__ = ("_event", "_landed", "abandoned", "error", "followers", "value")

    def __init__(self) -> None:
        # the event is made by the first follower: most flights have none
        self._event: anyio.Event | None = None
        self._landed = False
        self.value: T | None = None
        self.error: Exception | None = None
        self.abandoned = False
        self.followers = 0

    def land(self, value: T | None, error: Exception | None, *, abandoned: bool = False) -> None:
        """Record the outcome and wake every follower."""
        self.value, self.error, self.abandoned = value, error, abandoned
        self._landed = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Wait until the flight lands."""
        if self._event is None:
            self._event = anyio.Event()
            if self._landed:
                self._event.set()
        await self._event.wait()


class SingleFlight(Generic[T]):
    """A registry of in-flight evaluations keyed by coalition key (event-loop only, no threads)."""

    def __init__(self) -> None:
        self._flights: dict[Hashable, Flight[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, key: object) -> bool:
        return key in self._flights

    async def do(self, key: Hashable, work: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Run ``work`` once for every concurrent caller with ``key``.

        Args:
            key: the deduplication key (a coalition key).
            work: the evaluation; called only by the leader.

        Returns:
            ``(value, shared)``: the value, and ``True`` when it came from another caller's
            evaluation (this caller was a follower).

        Raises:
            Exception: whatever ``work`` raised, for the leader and every follower of its flight.
        """
        value, error, shared = await self.attempt(key, work)
        if error is not None:
            raise error
        return value, shared  # type: ignore[return-value]

    async def attempt(
        self, key: Hashable, work: Callable[[], Awaitable[T]]
    ) -> tuple[T | None, Exception | None, bool]:
        """Like :meth:`do`, but returns the exception instead of raising it.

        Returns:
            ``(value, error, shared)``: ``value`` is ``None`` when ``error`` (an ``Exception``
            raised by ``work``) is set; ``shared`` is ``True`` for a follower.

        Raises:
            BaseException: cancellation or an interrupt (never recorded as the flight's outcome).
        """
        while True:
            flight, leading = self.join(key)
            if leading:
                break
            await flight.wait()
            if flight.abandoned:
                continue  # the leader was cancelled: claim the key again
            return flight.value, flight.error, True  # type: ignore[return-value]
        # the leader (inline rather than in a coroutine of its own: one frame less per evaluation)
        try:
            value = await work()
        except Exception as exc:
            self.land(key, flight, None, exc)
            return None, exc, False
        except BaseException:
            # cancellation or interrupt: hand the key to a follower
            self.land(key, flight, None, None, abandoned=True)
            raise
        self.land(key, flight, value, None)
        return value, None, False

    def join(self, key: Hashable) -> tuple[Flight[T], bool]:
        """The flight of ``key`` and whether the caller leads it (the step :meth:`attempt` takes
        before its work, for a caller that runs the leader's work inline itself).

        Returns:
            ``(flight, leading)``: with ``leading`` ``True``, a new flight the caller must end with
            :meth:`land` whatever happens (value, exception or abandonment); otherwise the flight
            in progress, now counting the caller as a follower (wait on it with ``flight.wait()``;
            when it lands ``abandoned``, join again).
        """
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Flight()
            return flight, True
        flight.followers += 1
        return flight, False

    def land(
        self, key: Hashable, flight: Flight[T], value: T | None, error: Exception | None, *, abandoned: bool = False
    ) -> None:
        """End a flight that :meth:`join` made the caller lead: free ``key`` (a later caller leads a
        new flight), record the outcome and wake every follower."""
        self._release(key, flight)
        flight.land(value, error, abandoned=abandoned)
        if abandoned and flight.followers:
            logger.debug("flight %s abandoned by its leader; a follower retries", key)

    def _release(self, key: Hashable, flight: Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
