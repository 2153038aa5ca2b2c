"""Length buckets and the padded-token budget of scoring batches.

A batch is padded to its longest row, so mixing a 60-token row with a 2,000-token row wastes
almost the whole batch on padding, and a batch of many long rows can exhaust memory. Requests
carry their token length (prompt + target); the collator puts the ceiling of the smallest bucket
that holds it into the batch key, so only rows of one bucket share a call, and a call takes at most
``padded_token_budget // ceiling`` rows (and at most the collator's ``max_batch_size``): the padded
positions of every dispatched batch stay within the budget. A request longer than the largest
bucket or the model's context is rejected at admission, before any model call.

Rows that share leading tokens computed once for the whole batch (the proxy game's rows: one
cached KV of the full conversation, then each row's tail, laid side by side unpadded) are counted
by their own tokens: such a row of ``n`` tokens sharing ``s`` is bucketed by ``n - s``, the count
``s`` enters the batch key too, and a call takes at most ``(padded_token_budget - s) // ceiling``
rows, so ``s`` plus the rows' ceilings stay within the budget. Counted as whole prompts, a
conversation of 5,000 tokens would put 2 proxy rows in a call of the default 16,384-token budget;
counted by tails of 100 tokens, 63 (both capped by ``max_batch_size``).

:func:`share_order` orders coalitions so that those sharing leading players (hence long token
prefixes) are submitted next to each other and land in the same or consecutive batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, InputError

__all__ = ("DEFAULT_CEILINGS", "LengthBuckets", "share_order")

DEFAULT_CEILINGS: tuple[int, ...] = (128, 512, 2048, 8192)
"""Bucket ceilings in tokens (prompt + target)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthBuckets:
    """Bucket ceilings and the padded-token budget of one batch.

    Args:
        ceilings: strictly increasing bucket ceilings in tokens (prompt + target), each >= 1.
        padded_token_budget: the most padded positions (rows x bucket ceiling) of one batch; must
            hold at least one row of the largest bucket.
        max_tokens: the model's context in tokens, or ``None``; longer requests are rejected too.

    Raises:
        ConfigError: empty, unsorted or non-positive ceilings, a budget smaller than a ceiling, or
            ``max_tokens`` < 1 (the message quotes the bad value).
    """

    ceilings: tuple[int, ...] = DEFAULT_CEILINGS
    padded_token_budget: int = 16384
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        ceilings = tuple(self.ceilings) if isinstance(self.ceilings, (list, tuple)) else None
        if not ceilings or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in ceilings):
            raise ConfigError(f"must be positive token counts, got {self.ceilings!r}", field="length_buckets")
        if any(a >= b for a, b in zip(ceilings, ceilings[1:])):
            raise ConfigError(f"must be strictly increasing, got {ceilings!r}", field="length_buckets")
        object.__setattr__(self, "ceilings", ceilings)
        budget = self.padded_token_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < ceilings[-1]:
            raise ConfigError(
                f"must hold one row of every bucket (>= {ceilings[-1]} tokens), got {budget!r}",
                field="padded_token_budget",
            )
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ConfigError(f"must be a positive token count, got {self.max_tokens!r}", field="max_tokens")

    @property
    def limit(self) -> int:
        """The longest admissible request in tokens (largest bucket, capped by the context)."""
        top = self.ceilings[-1]
        return top if self.max_tokens is None else min(top, self.max_tokens)

    def bucket(self, n_tokens: int) -> int:
        """The ceiling of the smallest bucket holding ``n_tokens``.

        Raises:
            InputError: ``n_tokens`` exceeds the largest bucket or the model's context (field
                ``messages``; the message gives the length and the limit).
        """
        if self.max_tokens is not None and n_tokens > self.max_tokens:
            raise InputError(
                f"a request of {n_tokens} tokens exceeds the model's context of {self.max_tokens} tokens; "
                "shorten the conversation",
                field="messages",
            )
        for ceiling in self.ceilings:
            if n_tokens <= ceiling:
                return ceiling
        raise InputError(
            f"a request of {n_tokens} tokens exceeds the largest length bucket of {self.ceilings[-1]} "
            "tokens; configure a larger bucket or shorten the conversation",
            field="messages",
        )

    def max_rows(self, ceiling: int, max_batch_size: int, *, shared_tokens: int = 0) -> int:
        """Rows one batch of bucket ``ceiling`` may take.

        Args:
            ceiling: the bucket of the rows' own tokens (see :meth:`bucket`).
            max_batch_size: the most rows of any call.
            shared_tokens: tokens every row of the batch shares, computed once for the batch (a
                proxy batch's cached KV; 0 for rows that share nothing), counted once.

        Returns:
            ``min(max_batch_size, (padded_token_budget - shared_tokens) // ceiling)``, at least 1
            (one row always goes).
        """
        return max(1, min(max_batch_size, (self.padded_token_budget - shared_tokens) // ceiling))


def share_order(masks: np.ndarray) -> np.ndarray:
    """The order that puts coalitions with shared leading players next to each other.

    Depth-first over the player trie: sort by player 0 (present first), then player 1, and so on,
    so coalitions agreeing on their first k players (hence sharing the rendered prompt up to the
    (k+1)-th player) are contiguous.

    Args:
        masks: ``[m, n_players]`` bool coalitions (True = present).

    Returns:
        ``[m]`` int64 permutation (stable: ties keep their input order).
    """
    if masks.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    if masks.shape[1] == 0:
        return np.arange(masks.shape[0], dtype=np.int64)
    # np.lexsort sorts by the last key first; ~mask puts present (False) before absent (True)
    return np.lexsort(tuple((~masks[:, j]) for j in range(masks.shape[1] - 1, -1, -1))).astype(np.int64)
