"""The shared-KV proxy game's forwards (:meth:`HFBackend.score_proxy
<coalescence.backends.hf.HFBackend.score_proxy>`): rows grouped by their shared KV, resumed from the
prefix cache, and their tails laid side by side in one row under an additive 4-D block mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..attention import PrefixSplit
from ..base import ProxyScoreRequest, ScoreResult
from .caches import cache_bytes, fork_cache, resumed_cache

__all__ = ("ProxyScoring",)

class ProxyScoring:
    """The proxy game's forwards of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    def _proxy_group(self, prefix: tuple[int, ...], rows: Sequence[ProxyScoreRequest]) -> tuple[list[ScoreResult], int]:
        """Proxy rows sharing the KV of ``prefix`` (see :meth:`score_proxy`); returns the results
        and the number of prefix forwards run (0 or 1)."""
        torch = self._torch
        shared = len(prefix)
        ran = 0
        with torch.no_grad():
            if shared:
                entry_tokens, state, match = self.prefix_cache.longest(prefix)
                resumed = min(match, shared)
                cache = resumed_cache(self.model.config, entry_tokens, state, resumed)
                if shared > resumed:
                    kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keep_logits else {}
                    self.model(
                        input_ids=torch.tensor([prefix[resumed:]], dtype=torch.long, device=self.device),  # [1, P - C]
                        attention_mask=torch.ones((1, shared), dtype=torch.long, device=self.device),
                        position_ids=torch.arange(resumed, shared, device=self.device)[None],
                        cache=cache,
                        use_cache=True,
                        **kwargs,
                        **self._split(resumed, causal=True),
                    )
                    ran = 1
                    if self.prefix_cache.max_bytes:
                        self.prefix_cache.put(prefix, fork_cache(cache), cache_bytes(cache))
            else:
                resumed = 0
                cache = resumed_cache(self.model.config, (), None, 0)
            limit = self.tree_mask_limit or 2**22
            results: list[ScoreResult] = []
            at = 0
            while at < len(rows):
                n_tokens = 0
                end = at
                while end < len(rows):
                    grown = n_tokens + rows[end].n_tokens - 1 - shared
                    if end > at and grown * (shared + grown) > limit:
                        break
                    n_tokens = grown
                    end += 1
                chunk = rows[at:end]
                computed_prefix = shared - resumed if at == 0 else 0
                fork = fork_cache(cache) if shared else resumed_cache(self.model.config, (), None, 0)  # the forward extends its own
                results += self._proxy_forward(chunk, fork, shared, computed_prefix)
                at = end
        return results, ran

    def _proxy_forward(
        self, rows: Sequence[ProxyScoreRequest], cache: Any, shared: int, computed_prefix: int
    ) -> list[ScoreResult]:
        """One forward of proxy rows side by side on ``cache`` (``shared`` positions; a fork: the
        forward extends it), with the block mask of :meth:`score_proxy`."""
        torch = self._torch
        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        lows = torch.finfo(dtype).min
        lengths = [r.n_tokens - 1 - shared for r in rows]  # [R] tail positions per row
        n = sum(lengths)
        tokens: list[int] = []
        positions: list[int] = []
        mask = torch.full((n, shared + n), lows, dtype=dtype)  # [N, P + N] additive
        keep: list[int] = []
        at = 0
        for r, t in zip(rows, lengths, strict=True):
            seq = r.prompt_ids + r.target_ids
            tokens += seq[shared : shared + t]
            positions += range(shared, shared + t)
            visible = torch.ones(shared + t, dtype=torch.bool)  # [P + T] key positions not hidden
            for a, b in r.hidden:
                visible[a:b] = False
            masked = (torch.arange(shared, shared + t) >= r.tail_start)[:, None]  # [T, 1] queries in the tail
            sees = ~masked | visible[None, :]  # [T, P + T]
            causal = torch.ones((t, t), dtype=torch.bool).tril_()
            mask[at : at + t, :shared].masked_fill_(sees[:, :shared], 0.0)
            mask[at : at + t, shared + at : shared + at + t].masked_fill_(sees[:, shared:] & causal, 0.0)
            p = len(r.prompt_ids)
            keep += range(at + p - 1 - shared, at + p - 1 - shared + len(r.target_ids))
            at += t
        kwargs: dict[str, Any] = {}
        if self._keep_logits:
            kwargs["logits_to_keep"] = torch.tensor(keep, device=self.device)
        split: dict[str, Any] = {}
        if self.split_attention and shared:
            block = lengths[0] if len(set(lengths)) == 1 else 0
            split = {"prefix_split": PrefixSplit(shared, False, prefix_masked=True, block=block)}
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),  # [1, N]
            attention_mask=mask[None, None].to(self.device),  # [1, 1, N, P + N]
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),  # [1, N]
            cache=cache,
            use_cache=True,
            **kwargs,
            **split,
        )
        logits = out.logits[0]  # [kept or N, V]
        results = []
        k = 0
        for b, (r, t) in enumerate(zip(rows, lengths, strict=True)):
            m = len(r.target_ids)
            rows_idx = list(range(k, k + m)) if self._keep_logits else keep[k : k + m]
            k += m
            logp = torch.log_softmax(logits[rows_idx].float(), dim=-1)  # [m, V]
            tgt = torch.tensor(r.target_ids, dtype=torch.long, device=logp.device)
            token_lp = logp.gather(1, tgt[:, None])[:, 0].cpu().numpy()  # [m] float32
            extra = computed_prefix if b == 0 else 0
            results.append(
                ScoreResult(
                    token_logprobs=token_lp,
                    utility=float(token_lp.astype(np.float64).sum()),
                    tokens_computed=t + extra,
                    tokens_reused=shared - extra,
                    padded_positions=0,
                )
            )
        return results

