"""The hot result store: coalition key -> utility, in front of the model."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from ..errors import ConfigError

__all__ = ("ResultStore",)


class ResultStore:
    """A thread-safe LRU map from coalition key to utility (nats).

    Args:
        max_entries: the most keys held (least recently used evicted first); ``None`` for no bound.

    Raises:
        ConfigError: ``max_entries`` < 1.
    """

    def __init__(self, max_entries: int | None = None) -> None:
        if max_entries is not None and max_entries < 1:
            raise ConfigError(f"max_entries must be >= 1, got {max_entries}", field="max_entries")
        self.max_entries = max_entries
        self._data: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> float | None:
        """The stored utility of ``key``, or ``None`` (a hit refreshes the key's recency)."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: str, utility: float) -> None:
        """Store ``utility`` under ``key``, evicting the least recently used key past the bound."""
        with self._lock:
            self._data[key] = float(utility)
            self._data.move_to_end(key)
            if self.max_entries is not None and len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def update(self, items: Iterable[tuple[str, float]]) -> None:
        """Store many ``(key, utility)`` pairs (e.g. from an archive)."""
        for key, utility in items:
            self.put(key, utility)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)
