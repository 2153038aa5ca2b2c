"""Shared token prefixes: longest common prefixes, the token-trie lower bound, a bounded KV cache.

Masked variants of one conversation share long token prefixes (the system prompt, every turn
before the first masked player). The least work a scorer can do is to run each distinct prefix
once: the number of nodes of the token trie of all scored ``prompt + target`` sequences
(:func:`trie_nodes`). :class:`PrefixCache` holds the key/value states of prefixes already run,
bounded in bytes and evicted least recently used, so a later batch resumes from the longest
cached prefix of its own shared prefix instead of from its first token.

The cache is backend-neutral: an entry is a token tuple and an opaque state with a byte size.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ("PrefixCache", "PrefixCacheStatistics", "common_prefix_length", "trie_nodes")

logger = logging.getLogger(__name__)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def trie_nodes(sequences: Iterable[Sequence[int]]) -> int:
    """The number of nodes (root excluded) of the token trie of ``sequences``.

    This is the fewest token positions any causal scorer must run through the model to score
    every sequence: each distinct prefix once. Method: sort, then sum ``len(s) - lcp(s, previous)``.

    Returns:
        The node count (distinct non-empty prefixes).
    """
    total = 0
    prev: tuple[int, ...] = ()
    for seq in sorted(set(tuple(s) for s in sequences)):
        total += len(seq) - common_prefix_length(prev, seq)
        prev = seq
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheStatistics:
    """A snapshot of a prefix cache's counters.

    Attributes:
        entries: prefixes held now.
        bytes: bytes of state held now.
        hits: lookups that found a cached prefix of at least one token.
        misses: lookups that found none.
        evictions: entries dropped to stay within the byte bound.
    """

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PrefixCache:
    """A least-recently-used map from token prefixes to their model state, bounded in bytes.

    Args:
        max_bytes: the most bytes of state held (0 disables the cache: nothing is stored).

    Raises:
        ConfigError: ``max_bytes`` < 0.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"must be an int >= 0 (bytes), got {max_bytes!r}", field="prefix_cache_bytes")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> PrefixCacheStatistics:
        """A snapshot of the counters (see :class:`PrefixCacheStatistics`)."""
        return PrefixCacheStatistics(
            entries=len(self._entries), bytes=self._bytes, hits=self._hits, misses=self._misses,
            evictions=self._evictions,
        )

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
        self._bytes = 0

    def longest(self, tokens: Sequence[int]) -> tuple[tuple[int, ...], Any, int]:
        """The entry sharing the longest prefix with ``tokens`` (marked most recently used).

        Returns:
            ``(entry_tokens, state, shared)``: the entry's tokens and state and the number of
            leading tokens it shares with ``tokens`` (its state is valid for that many positions
            once cropped); ``((), None, 0)`` when no entry shares a token.
        """
        best: tuple[tuple[int, ...], Any, int] = ((), None, 0)
        for key, (state, _) in self._entries.items():
            if best[2] >= len(key):
                continue
            shared = common_prefix_length(key, tokens)
            if shared > best[2]:
                best = (key, state, shared)
        if best[2] > 0:
            self._hits += 1
            self._entries.move_to_end(best[0])
        else:
            self._misses += 1
        return best

    def peek(self, tokens: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """What :meth:`longest` would find, without counting a hit or a miss or changing the
        eviction order.

        Returns:
            ``(entry_tokens, shared)``: the entry and the leading tokens it shares with
            ``tokens``; ``((), 0)`` when no entry shares a token.
        """
        best: tuple[tuple[int, ...], int] = ((), 0)
        for key in self._entries:
            if len(key) > best[1]:
                shared = common_prefix_length(key, tokens)
                if shared > best[1]:
                    best = (key, shared)
        return best

    def put(self, tokens: Sequence[int], state: Any, nbytes: int) -> bool:
        """Store ``state`` for the prefix ``tokens``, evicting least recently used entries.

        Returns:
            ``False`` when the entry alone exceeds ``max_bytes`` (nothing stored).
        """
        key = tuple(tokens)
        if nbytes > self.max_bytes or not key:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        while self._entries and self._bytes + nbytes > self.max_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self._bytes -= size
            self._evictions += 1
        self._entries[key] = (state, nbytes)
        self._bytes += nbytes
        return True
