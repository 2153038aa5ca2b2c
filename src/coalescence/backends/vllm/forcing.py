"""A vLLM logits processor that forces a request's answer tokens: teacher forcing through decoding.

``vllm serve`` skips its prefix cache for every request that asks for prompt log-probabilities (the
entries of cached positions are not computed), so scoring a coalition's answer as part of its
prompt recomputes the whole prompt each time. Decoding the answer instead keeps the prompt on the
prefix cache: the request is the coalition's prompt alone, with ``max_tokens`` the answer's length,
and this processor sets every logit but the answer's next token to ``-inf`` at each step, so the
tokens sampled are the answer's. With vLLM's default ``--logprobs-mode raw_logprobs`` the
log-probability returned for a sampled token (``logprobs=0``) is computed from the model's raw
logits *before* any logits processor: log p(answer_j | prompt, answer_<j), the teacher-forced
value.

The server loads it with::

    vllm serve MODEL --logits-processors coalescence.backends.vllm.forcing:ForcedAnswer ...

(coalescence installed in the server's environment), and a request names its answer in
``vllm_xargs``: ``{"coalescence_forced_tokens": [id, ...]}``. Requests without it are untouched.
:class:`~coalescence.backends.vllm.server.VLLMServerBackend` checks, before scoring, that a server forces
answers and returns raw log-probabilities (a probe scored both ways), else it scores through
prompt log-probabilities as before.

The module imports vLLM and torch at its top; the rest of coalescence imports it only where a
vLLM engine starts (:class:`~coalescence.backends.vllm.engine.VLLMBackend`), so coalescence, and
the server client, run without vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from .common import FORCED_TOKENS

__all__ = ("FORCED_TOKENS", "ForcedAnswer")


class ForcedAnswer(LogitsProcessor):
    """Forces each request's ``extra_args["coalescence_forced_tokens"]`` as its output, one token per step.

    At decoding step ``n`` of a request with answer ``a`` (``n < len(a)``), every logit of its row
    except ``a[n]`` becomes ``-inf`` (``a[n]``'s logit is kept); rows of other requests, and a
    request past its answer, are left as they are. Not argmax-invariant: it changes what is sampled.

    Raises:
        ValueError: (vLLM's ``validate_params``, an HTTP 400 on a server) a forced answer that is
            not a non-empty list of non-negative token ids, or ``max_tokens`` shorter than it.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (answer ids, the request's output ids: a live reference vLLM appends to)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}
        self.device = device

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        forced = (sampling_params.extra_args or {}).get(FORCED_TOKENS)
        if forced is None:
            return
        if not isinstance(forced, list) or not forced or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in forced):
            raise ValueError(f"{FORCED_TOKENS} must be a non-empty list of token ids, got {forced!r}")
        if sampling_params.max_tokens is not None and sampling_params.max_tokens < len(forced):
            raise ValueError(f"max_tokens {sampling_params.max_tokens} is shorter than the {len(forced)} forced tokens")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> tuple[list[int], list[int]] | None:
            forced = (params.extra_args or {}).get(FORCED_TOKENS) if params is not None else None
            return (list(forced), output_ids) if forced else None

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index, token = [], []
        for row, (forced, output_ids) in self.rows.items():
            step = len(output_ids)
            if step < len(forced) and row < logits.shape[0]:
                index.append(row)
                token.append(forced[step])
        if not index:
            return logits
        rows = torch.tensor(index, dtype=torch.long, device=logits.device)
        tokens = torch.tensor(token, dtype=torch.long, device=logits.device)
        kept = logits[rows, tokens].clone()
        logits[rows] = float("-inf")
        logits[rows, tokens] = kept
        return logits
