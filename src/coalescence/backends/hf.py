"""Hugging Face transformers backend: teacher-forced log-probabilities of a causal LM.

Rows of a batch are right-padded to the longest row with a true attention mask, so pad positions
are never attended to by real tokens and never scored; position ids run 0..len-1 on every row.
Logits are computed only for the positions that predict target tokens (``logits_to_keep``), and
log-softmax runs in float32 whatever the model dtype.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BatchFailed, ConfigError
from .base import ScoreRequest, ScoreResult

__all__ = ("HFBackend",)

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


class HFBackend:
    """Scores teacher-forced targets with a transformers causal LM (synchronous).

    Args:
        model: a ``PreTrainedModel`` for causal LM (e.g. ``LlamaForCausalLM``).
        tokenizer: its tokenizer (with a chat template for the engine's renderer).
        model_id: name recorded in coalition keys and the archive.
        revision: weights revision recorded in coalition keys.
        max_batch_size: rows per forward pass (>= 1).

    Raises:
        ConfigError: ``max_batch_size`` < 1.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str = "",
        max_batch_size: int = 4,
    ) -> None:
        import torch

        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="--batch-size")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.max_batch_size = max_batch_size
        param = next(model.parameters())
        self.device = param.device
        self.dtype = str(param.dtype).removeprefix("torch.")
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_token_id = int(pad)
        config = model.config
        self.max_context = int(
            getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
        )
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._torch = torch

    @staticmethod
    def dtype_from_name(name: str) -> Any:
        """The torch dtype for ``"float32"``, ``"bfloat16"`` or ``"float16"``.

        Raises:
            ConfigError: another name (field ``--dtype``).
        """
        import torch

        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}", field="--dtype")
        return getattr(torch, name)

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each request's target, in nats.

        Runs ``ceil(len(requests) / max_batch_size)`` forward passes.

        Returns:
            One :class:`ScoreResult` per request, in order.

        Raises:
            BatchFailed: a row is longer than ``max_context``, the model raised, or it produced
                non-finite log-probabilities.
        """
        results: list[ScoreResult] = []
        for start in range(0, len(requests), self.max_batch_size):
            results.extend(self._score_batch(requests[start : start + self.max_batch_size]))
        return results

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        torch = self._torch
        if not batch:
            return []
        lengths = [r.n_tokens for r in batch]
        width = max(lengths)
        if width > self.max_context:
            raise BatchFailed(
                f"a sequence of {width} tokens exceeds the model's context of {self.max_context}"
            )
        rows = len(batch)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)  # [B, L]
        attention = torch.zeros((rows, width), dtype=torch.long)  # [B, L] 1 = real token
        for b, r in enumerate(batch):
            seq = r.prompt_ids + r.target_ids
            input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[b, : len(seq)] = 1
        # positions whose logits predict target tokens: prompt_len - 1 .. n_tokens - 2 per row
        lo = min(len(r.prompt_ids) for r in batch) - 1
        hi = max(lengths) - 1
        kwargs: dict[str, Any] = {}
        if self._keep_logits:
            kwargs["logits_to_keep"] = torch.arange(lo, hi, device=self.device)
            offset = lo
        else:
            offset = 0
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    use_cache=False,
                    **kwargs,
                )
                logits = out.logits  # [B, kept positions, V]
                results = []
                for b, r in enumerate(batch):
                    p, t = len(r.prompt_ids), len(r.target_ids)
                    scored = logits[b, p - 1 - offset : p - 1 - offset + t].float()  # [t, V]
                    logp = torch.log_softmax(scored, dim=-1)
                    tgt = torch.tensor(r.target_ids, dtype=torch.long, device=logp.device)
                    token_lp = logp.gather(1, tgt[:, None])[:, 0].cpu().numpy()  # [t] float32
                    results.append(
                        ScoreResult(
                            token_logprobs=token_lp,
                            utility=float(token_lp.astype(np.float64).sum()),
                            tokens_computed=r.n_tokens,
                        )
                    )
        except BatchFailed:
            raise
        except Exception as exc:  # translate the library's errors at the boundary
            raise BatchFailed(f"model call failed on a batch of {rows} rows: {exc}") from exc
        if len(results) != rows or not all(np.isfinite(x.token_logprobs).all() for x in results):
            raise BatchFailed(f"the model returned non-finite log-probabilities in a batch of {rows} rows")
        return results

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens`` tokens, stops at EOS).

        Returns:
            The new token ids, end-of-turn token included when the model produced one.

        Raises:
            ConfigError: ``max_new_tokens`` < 1.
            BatchFailed: generation failed.
        """
        torch = self._torch
        if max_new_tokens < 1:
            raise ConfigError(f"must be >= 1, got {max_new_tokens}", field="--max-new-tokens")
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.pad_token_id,
                )
        except Exception as exc:
            raise BatchFailed(f"generation failed: {exc}") from exc
        return [int(x) for x in out[0, ids.shape[1] :].tolist()]
