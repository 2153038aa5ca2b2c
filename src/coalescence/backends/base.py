"""The backend protocol: score (prompt, target) token sequences with teacher forcing.

A backend is synchronous and is called from one worker thread at a time (the engine, and later
the collator, are its only callers). Each backend translates its library's exceptions into
:class:`~coalescence.errors.BackendError` subclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import BatchFailed, ConfigError

__all__ = ("ScoreRequest", "ScoreResult", "ScoringBackend", "ScoringStatistics", "validate_results")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreRequest:
    """One teacher-forced scoring row.

    Args:
        prompt_ids: prompt token ids (at least one; the first target token is predicted from the
            last prompt token).
        target_ids: the token ids whose log-probabilities are summed (at least one).

    Raises:
        ConfigError: an empty prompt or target.
    """

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("a score request needs at least one prompt token", field="prompt_ids")
        if not self.target_ids:
            raise ConfigError("a score request needs at least one target token", field="target_ids")

    @property
    def n_tokens(self) -> int:
        """Total sequence length, prompt + target."""
        return len(self.prompt_ids) + len(self.target_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreResult:
    """The teacher-forced score of one row.

    Attributes:
        token_logprobs: ``[n_target]`` float32, log p(target_j | prompt, target_<j) in nats.
        utility: float64 sum of ``token_logprobs`` (nats): log p(target | prompt).
        tokens_computed: token positions the model ran for this row. With prefix sharing, a shared
            prefix run for a batch is counted in the batch's first row, so the rows of a batch sum
            to the positions the batch ran (padding excluded).
        tokens_reused: positions of this row served from a shared or cached prefix
            (``tokens_computed + tokens_reused == n_tokens``).
        padded_positions: pad positions run in this row's slot of the batch (computed, discarded).
    """

    token_logprobs: np.ndarray
    utility: float
    tokens_computed: int
    tokens_reused: int = 0
    padded_positions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoringStatistics:
    """A backend's scoring counters, as a frozen snapshot (all calls together).

    Attributes:
        batches: forward batches run (prefix forwards not counted).
        rows: rows scored.
        tokens: ``sum(n_tokens)`` of the rows scored (the work with no sharing and no padding).
        tokens_computed: real token positions run through the model (prefixes included).
        tokens_reused: positions served from a shared or cached prefix.
        padded_positions: pad positions run (computed and discarded).
        prefix_forwards: forwards that extended a prefix state (per batch or from the cache).
    """

    batches: int = 0
    rows: int = 0
    tokens: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    padded_positions: int = 0
    prefix_forwards: int = 0


def validate_results(requests: Sequence[ScoreRequest], results: Sequence[Any]) -> list[ScoreResult]:
    """Check a whole batch's outputs before any of them is used.

    Args:
        requests: the batch's rows.
        results: what the backend returned for them.

    Returns:
        ``results`` as a list.

    Raises:
        BatchFailed: not exactly one :class:`ScoreResult` per request, a row without exactly
            ``len(target_ids)`` log-probabilities, or a non-finite one.
    """
    if isinstance(results, (str, bytes)) or not isinstance(results, Sequence):
        raise BatchFailed(f"the backend returned {type(results).__name__}, not a sequence of results")
    if len(results) != len(requests):
        raise BatchFailed(f"the backend returned {len(results)} results for {len(requests)} rows")
    for i, (req, res) in enumerate(zip(requests, results, strict=True)):
        if not isinstance(res, ScoreResult):
            raise BatchFailed(f"row {i}: the backend returned {type(res).__name__}, not a ScoreResult")
        lp = np.asarray(res.token_logprobs)
        if lp.shape != (len(req.target_ids),):
            raise BatchFailed(
                f"row {i}: {lp.shape} log-probabilities for {len(req.target_ids)} target tokens"
            )
        if not (np.isfinite(lp).all() and np.isfinite(res.utility)):
            raise BatchFailed(f"row {i}: non-finite log-probabilities in a batch of {len(requests)} rows")
    return list(results)


class ScoringBackend(Protocol):
    """What the engine needs from a model.

    Attributes:
        model_id: the model's name (alias, directory or hub id), part of the coalition key.
        revision: a string that changes when the weights change, part of the coalition key.
        dtype: the compute dtype name (e.g. ``"float32"``), part of the coalition key.
        tokenizer: a transformers tokenizer with a chat template.
        max_context: the longest sequence (tokens) the model accepts.
    """

    model_id: str
    revision: str
    dtype: str
    tokenizer: Any
    max_context: int

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score each request; one result per request, in order.

        Raises:
            BatchFailed: the model call failed or returned non-finite values.
        """
        ...

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """Greedy continuation token ids of ``prompt_ids`` (at most ``max_new_tokens``)."""
        ...
