"""The hot result store: coalition key -> utility, in front of the model.

The scheduler looks every job up here before any model call; a replay fills it with the pairs the
archive package reads (:func:`~coalescence.archive.read_utilities`, :meth:`ResultStore.fill`), so
every coalition the archive holds is served without a model call; the store never reads a file.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable

from ..errors import ConfigError

__all__ = ("ResultStore", "entry_bytes")

_FLOAT_BYTES = sys.getsizeof(0.0)
_SLOT_BYTES = 3 * 8 + 2 * 8  # hash table slot (hash, key, value) + LRU links (prev, next)


def entry_bytes(key: str) -> int:
    """The bytes one entry is charged against ``max_bytes``.

    The estimate is ``sys.getsizeof(key)`` plus a float object plus the map's per-entry slot and
    LRU links (40 bytes on 64-bit CPython): about 185 bytes for a 64-hex-digit SHA-256 key.

    Args:
        key: a coalition key.

    Returns:
        The charged size in bytes.
    """
    return sys.getsizeof(key) + _FLOAT_BYTES + _SLOT_BYTES


class ResultStore:
    """A thread-safe LRU map from coalition key to utility (nats).

    Bounded by entries, by (estimated, see :func:`entry_bytes`) bytes, by both or not at all; when a
    ``put`` exceeds a bound, least recently used keys are evicted until every bound holds. A ``get``
    hit and a ``put`` both make the key most recently used. Every method takes one lock, so threads
    (e.g. backend worker threads) and the event loop can share a store.

    Args:
        max_entries: the most keys held; ``None`` for no bound.
        max_bytes: the most bytes held (sum of :func:`entry_bytes`); ``None`` for no bound.

    Raises:
        ConfigError: ``max_entries`` < 1, or ``max_bytes`` smaller than one entry (200 bytes).
    """

    def __init__(self, max_entries: int | None = None, *, max_bytes: int | None = None) -> None:
        if max_entries is not None and (not isinstance(max_entries, int) or max_entries < 1):
            raise ConfigError(f"max_entries must be >= 1, got {max_entries!r}", field="max_entries")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 200):
            raise ConfigError(
                f"max_bytes must be >= 200 (one entry), got {max_bytes!r}", field="max_bytes"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, float] = OrderedDict()
        self._nbytes = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of :func:`entry_bytes` over the keys held)."""
        with self._lock:
            return self._nbytes

    @property
    def evictions(self) -> int:
        """Keys evicted so far to keep the bounds."""
        with self._lock:
            return self._evictions

    def get(self, key: str) -> float | None:
        """The stored utility of ``key`` in nats, or ``None`` (a hit refreshes the key's recency)."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: str, utility: float) -> None:
        """Store ``utility`` (nats) under ``key``, evicting least recently used keys past the bounds."""
        value = float(utility)
        with self._lock:
            if key in self._data:
                self._data[key] = value
                self._data.move_to_end(key)
                return
            self._data[key] = value
            self._nbytes += entry_bytes(key)
            if self.max_entries is not None or self.max_bytes is not None:  # unbounded: none to evict
                self._evict()

    def _evict(self) -> None:
        # called with the lock held; the newest key is never evicted (max_bytes >= one entry)
        while (self.max_entries is not None and len(self._data) > self.max_entries) or (
            self.max_bytes is not None and self._nbytes > self.max_bytes and len(self._data) > 1
        ):
            old, _ = self._data.popitem(last=False)
            self._nbytes -= entry_bytes(old)
            self._evictions += 1

    def update(self, items: Iterable[tuple[str, float]]) -> None:
        """Store many ``(key, utility)`` pairs in order (later pairs are more recent).

        Equivalent to :meth:`put` for each pair, under one lock acquisition, evicting once at the end.
        """
        with self._lock:
            data = self._data
            added = 0
            for key, utility in items:
                if key in data:
                    data.move_to_end(key)
                else:
                    added += entry_bytes(key)
                data[key] = float(utility)
            self._nbytes += added
            self._evict()

    def clear(self) -> None:
        """Drop every key."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0

    def fill(self, items: Iterable[tuple[str, float]]) -> int:
        """Store ``(key, utility)`` pairs in order, as the archive reads them
        (:func:`~coalescence.archive.read_utilities`), so with a bound the last pairs stay.

        Returns:
            The number of pairs given.
        """
        pairs = items if isinstance(items, list) else list(items)
        self.update(pairs)
        return len(pairs)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
