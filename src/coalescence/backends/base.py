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

from ..errors import ConfigError

__all__ = ("ScoreRequest", "ScoreResult", "ScoringBackend")


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
        tokens_computed: number of tokens the model ran for this row (prompt + target).
    """

    token_logprobs: np.ndarray
    utility: float
    tokens_computed: int


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
