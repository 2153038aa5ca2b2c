"""Counting the model evaluations of one task's :meth:`~coalescence.engine.Engine.evaluate` calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ("counted", "counting_evaluations")

_EXECUTED: ContextVar[list[int] | None] = ContextVar("coalescence_executed", default=None)


@contextmanager
def counting_evaluations() -> Iterator[list[int]]:
    """Count the model evaluations of the :meth:`~coalescence.engine.Engine.evaluate` calls made in
    this task (and not those of other conversations evaluated concurrently): ``box[0]`` after the
    block. Blocks nest: an inner block counts its own calls, which the outer one does not see."""
    box = [0]
    token = _EXECUTED.set(box)
    try:
        yield box
    finally:
        _EXECUTED.reset(token)


def counted(executed: int) -> None:
    """Add ``executed`` model evaluations to the innermost :func:`counting_evaluations` block of
    this task, if any (the engine's ``evaluate`` calls it)."""
    box = _EXECUTED.get()
    if box is not None:
        box[0] += executed
