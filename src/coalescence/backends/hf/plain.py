"""The plain path: whole rows right-padded in one forward, and the per-row log-probabilities read
from a forward's logits (every path's last step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import ScoreRequest, ScoreResult

__all__ = ("PlainScoring",)

class PlainScoring:
    """The plain path of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    def _row_results(
        self, batch: Sequence[ScoreRequest], logits: Any, offset: int, shared: int, computed_prefix: int, width: int
    ) -> list[ScoreResult]:
        """Per-row log-probabilities from ``logits`` ``[B, kept, V]`` whose index 0 is absolute
        position ``offset``; ``shared`` leading positions came from a prefix state, of which
        ``computed_prefix`` were run for this batch; ``width`` is the padded run length per row."""
        torch = self._torch
        results = []
        for b, r in enumerate(batch):
            p, t = len(r.prompt_ids), len(r.target_ids)
            scored = logits[b, p - 1 - offset : p - 1 - offset + t].float()  # [t, V]
            logp = torch.log_softmax(scored, dim=-1)
            tgt = torch.tensor(r.target_ids, dtype=torch.long, device=logp.device)
            token_lp = logp.gather(1, tgt[:, None])[:, 0].cpu().numpy()  # [t] float32
            own = r.n_tokens - shared
            computed = own + (computed_prefix if b == 0 else 0)
            results.append(
                ScoreResult(
                    token_logprobs=token_lp,
                    utility=float(token_lp.astype(np.float64).sum()),
                    tokens_computed=computed,
                    tokens_reused=r.n_tokens - computed,
                    padded_positions=width - own,
                )
            )
        return results

    def _score_plain(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """One right-padded forward over the whole rows (no sharing)."""
        torch = self._torch
        self._last_prefix_forwards = 0
        lengths = [r.n_tokens for r in batch]
        width = max(lengths)
        rows = len(batch)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)  # [B, L]
        attention = torch.zeros((rows, width), dtype=torch.long)  # [B, L] 1 = real token
        for b, r in enumerate(batch):
            seq = r.prompt_ids + r.target_ids
            input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[b, : len(seq)] = 1
        # positions whose logits predict target tokens: prompt_len - 1 .. n_tokens - 2 per row
        lo = min(len(r.prompt_ids) for r in batch) - 1
        hi = width - 1
        kwargs: dict[str, Any] = {}
        offset = 0
        if self._keep_logits:
            kwargs["logits_to_keep"] = torch.arange(lo, hi, device=self.device)
            offset = lo
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                use_cache=False,
                **kwargs,
            )
            return self._row_results(batch, out.logits, offset, 0, 0, width)

