"""What the collator works on: the backend it calls, the records of admitted rows, and what a
collated call came to (:class:`CollatorStatistics` counters, one :class:`CallReport` per batch).

A :class:`CollatorRecord` is one validated request (its prompt, effective kwargs, candidates,
batch key and the most rows of a call it may lead), compared by identity; its private slot holds
the state the lock-leader :class:`~coalescence.scheduler.collator.Collator` moves it through
(queued, taken, done or cancelled) and, once delivered, its output or exception.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import anyio

from ..backends.base import ScoreRequest, ScoringBackend, validate_results
from ..errors import BatchFailed, ConfigError

__all__ = (
    "BatchFn",
    "CallReport",
    "CollatorBackend",
    "CollatorRecord",
    "CollatorStatistics",
    "frozen_mapping",
    "scoring_backend",
)

BatchFn = Callable[[list[Any], dict[str, Any], list[dict[str, Any]]], Sequence[Any]]
"""``fn(prompts, call_kwargs, row_kwargs) -> outputs``: one synchronous backend call.

``prompts`` and ``row_kwargs`` have one entry per row; ``outputs`` must have exactly one per row,
in order. ``call_kwargs`` carries ``n_candidates`` when a request asks for more than one.
"""

Scope = Literal["row", "call"]

SCOPES = ("row", "call")
RESERVED = "n_candidates"
"""The call kwarg the collator sets itself (candidates of a multi-candidate request)."""

EMPTY: Mapping[str, Any] = MappingProxyType({})
"""The one empty read-only mapping that records without kwargs share."""


def frozen_mapping(value: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    """A read-only copy of a string-keyed mapping (:data:`EMPTY` for ``None``).

    Raises:
        ConfigError: not a mapping, or a key that is not a string (field ``name``).
    """
    if value is None:
        return EMPTY
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be a mapping, got {value!r}", field=name)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}", field=name)
    return MappingProxyType(dict(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class CollatorBackend:
    """A synchronous batch function and the runtime kwargs it consumes.

    Args:
        fn: the :data:`BatchFn`; called from one worker thread at a time.
        runtime_kwargs: name -> ``"row"`` (one value per row) or ``"call"`` (one value per call).

    Raises:
        ConfigError: ``fn`` not callable, a scope other than ``"row"``/``"call"``, a non-string
            name, or the reserved name ``"n_candidates"``.
    """

    fn: BatchFn
    runtime_kwargs: Mapping[str, Scope] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"must be callable, got {self.fn!r}", field="fn")
        scopes = frozen_mapping(self.runtime_kwargs, "runtime_kwargs")
        for name, scope in scopes.items():
            if scope not in SCOPES:
                raise ConfigError(f"scope of {name!r} must be 'row' or 'call', got {scope!r}", field="runtime_kwargs")
            if name == RESERVED:
                raise ConfigError(f"{RESERVED!r} is reserved for the collator", field="runtime_kwargs")
        object.__setattr__(self, "runtime_kwargs", scopes)


def scoring_backend(backend: ScoringBackend) -> CollatorBackend:
    """Adapt a :class:`~coalescence.backends.base.ScoringBackend` for the collator.

    Prompts are :class:`~coalescence.backends.base.ScoreRequest` rows; outputs are their
    :class:`~coalescence.backends.base.ScoreResult`. The backend consumes no runtime kwargs.

    Args:
        backend: the scoring backend (e.g. :class:`~coalescence.backends.hf.HFBackend`).

    Returns:
        A :class:`CollatorBackend` whose ``fn`` calls ``backend.score(prompts)``.
    """

    def fn(prompts: list[Any], call_kwargs: dict[str, Any], row_kwargs: list[dict[str, Any]]) -> list[Any]:
        for p in prompts:
            if not isinstance(p, ScoreRequest):
                raise BatchFailed(f"a scoring backend takes ScoreRequest rows, got {type(p).__name__}")
        return validate_results(prompts, backend.score(prompts))

    return CollatorBackend(fn=fn, runtime_kwargs={})


class _Slot:
    """Mutable per-record state, touched only on the event-loop thread."""

    __slots__ = ("event", "ok", "owner", "state", "value")

    def __init__(self) -> None:
        self.owner: Collator | None = None
        self.state: str | None = None
        self.ok = False
        self.value: Any = None
        self.event: anyio.Event | None = None  # set to wake the record's task while it sleeps


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CollatorRecord:
    """One admitted request, validated, not yet queued (compared by identity).

    Args:
        prompt: the row's prompt as the backend takes it (e.g. a ``ScoreRequest``).
        call_kwargs: effective call-scoped kwargs (static call-scoped + per-request generation kwargs).
        row_kwargs: effective per-row runtime kwargs (static row-scoped broadcast + per request).
        n_candidates: candidates asked for (>= 1); above 1 the request dispatches alone.
        batch_key: 64-hex SHA-256 (see :func:`~coalescence.scheduler.batch_keys.batch_key`).
        max_rows: the most rows of a call this record leads (0: the collator's ``max_batch_size``);
            set from its length bucket and the padded-token budget.

    Raises:
        ConfigError: ``n_candidates`` < 1 or a malformed ``batch_key``.
    """

    prompt: Any
    call_kwargs: Mapping[str, Any]
    row_kwargs: Mapping[str, Any]
    n_candidates: int
    batch_key: str
    max_rows: int = 0
    _slot: _Slot = field(init=False, default_factory=_Slot, repr=False)

    def __post_init__(self) -> None:
        if (  # a request without kwargs (the scoring path), in one expression of exact types
            self.call_kwargs is EMPTY and self.row_kwargs is EMPTY and type(self.n_candidates) is int
            and self.n_candidates >= 1 and type(self.batch_key) is str and len(self.batch_key) == 64
        ):
            return
        if isinstance(self.n_candidates, bool) or not isinstance(self.n_candidates, int) or self.n_candidates < 1:
            raise ConfigError(f"must be a positive integer, got {self.n_candidates!r}", field="n_candidates")
        if not (isinstance(self.batch_key, str) and len(self.batch_key) == 64):
            raise ConfigError(f"must be 64 hex digits, got {self.batch_key!r}", field="batch_key")
        # most records carry no kwargs: they share one empty read-only mapping
        object.__setattr__(self, "call_kwargs", MappingProxyType(dict(self.call_kwargs)) if self.call_kwargs else EMPTY)
        object.__setattr__(self, "row_kwargs", MappingProxyType(dict(self.row_kwargs)) if self.row_kwargs else EMPTY)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollatorStatistics:
    """A snapshot of a collator's counters.

    Attributes:
        calls: backend calls made (poison-isolation re-runs included).
        rows: records delivered (a result or an exception), each counted once.
        largest_batch: most rows in one backend call (0 before the first call).
        poison_reruns: failed multi-row calls whose members were re-run one by one.
        failed_rows: records delivered an exception.
    """

    calls: int = 0
    rows: int = 0
    largest_batch: int = 0
    poison_reruns: int = 0
    failed_rows: int = 0


@dataclass(slots=True)
class CallReport:
    """What one led batch came to, filled in the worker thread and delivered on the event loop.

    Attributes:
        outcomes: one ``(ok, value)`` per member in batch order: its output, or its exception.
        calls: backend calls made for the batch (1, or 1 + members after poison isolation; 0
            when the worker call could not run).
        poisoned: whether the multi-row call failed and its members were re-run one by one.
        batch_message: set when a multi-row call failed and every member then succeeded alone.
    """

    outcomes: list[tuple[bool, Any]]
    calls: int
    poisoned: bool
    batch_message: str | None

