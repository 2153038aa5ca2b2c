"""The shared-KV proxy game's forwards (:meth:`HFBackend.score_proxy
<coalescence.backends.hf.HFBackend.score_proxy>`): rows grouped by their shared KV, resumed from the
prefix cache, and their tails run against it with the absent players' keys masked and every
position compacted as the exact game lays it out: the cached keys re-rotated (RoPE) per row to
their position once the hidden tokens are gone, the tail placed right after the visible context
(:func:`rope_rotation`). On the CPU the rows run side by side and each row's prefix attention reads
the one shared key cache (:mod:`coalescence.backends.row_prefix`: its queries turned per span of
one offset, or its visible keys gathered and turned); elsewhere each row's re-rotated keys are its
own, so rows run as a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import ProxyScoreRequest, ScoreResult
from ..attention import PrefixSplit
from ..row_prefix import SPAN_LIMIT, PrefixKV, RowPrefix, position_major
from .caches import cache_bytes, fork_cache, resumed_cache

__all__ = ("COMPACT_ROPE_TYPES", "PROXY_ARCHITECTURES", "ProxyScoring", "proxy_capability", "rope_rotation")

COMPACT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose rotation by a position offset is a fixed per-frequency rotation (the
compacted proxy game re-rotates cached keys by it); ``dynamic`` and ``longrope`` change their
frequencies with the sequence length and are not re-rotated."""

PROXY_ARCHITECTURES = ("gemma", "granite", "llama", "mistral", "olmo", "olmo2", "phi3", "qwen2", "qwen3")
"""The architectures (``config.model_type``) with a proxy game: those whose compacted proxy rows
``tests/backends/test_proxy_architectures.py`` checks against the exact game's rows, on a tiny
model whose attention carries nothing between positions but in its last layer (there a correct
compacted row is its exact row). Each is a full-width RoPE in transformers' half-split layout
applied in every layer; a model of one of them is still refused where its configuration is not
(a partial rotary factor, layers without RoPE, a RoPE type outside :data:`COMPACT_ROPE_TYPES`)."""

INTERLEAVED_ROPE = ("cohere", "cohere2", "glm", "glm4", "chatglm", "deepseek_v2", "deepseek_v3")
"""Architectures that rotate adjacent dimension pairs (interleaved RoPE), not the two halves of
the head dimension that the compacted proxy game's re-rotation turns."""


def _rope_dicts(config: Any) -> list[dict[str, Any]]:
    """Every RoPE parameter dict of ``config``: ``rope_parameters`` (flat, or nested per layer type)
    and ``rope_scaling`` (transformers 4.x's name)."""
    out: list[dict[str, Any]] = []
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            out += nested or [value]
    return out


def proxy_capability(model: Any, sliding_window: int | None = None) -> tuple[Any | None, str | None]:
    """Whether the compacted proxy game can run on ``model``: ``(rotary, None)`` with its rotary
    embedding module (the base model's ``rotary_emb``, which the game re-rotates cached keys with), or
    ``(None, reason)``, the reason a sentence fragment naming what is not modelled.

    Refused, in this order: no single rotary module with fixed frequencies (absolute positions,
    ALiBi, one rotary per layer type); a partial rotary factor below 1, read from
    ``config.partial_rotary_factor``, ``config.rope_parameters`` and ``config.rope_scaling``, or a
    rotary module narrower than the head (the re-rotation would turn the unrotated dimensions too);
    layers without RoPE (``no_rope_layers``, as SmolLM3's NoPE layers: their cached keys carry no
    position to move); interleaved RoPE (:data:`INTERLEAVED_ROPE` or ``rope_interleave``); a RoPE
    type outside :data:`COMPACT_ROPE_TYPES`; a ``sliding_window`` (tokens, the backend's: the proxy's
    block mask models full causal attention); and any architecture outside
    :data:`PROXY_ARCHITECTURES` (not checked against the exact game).
    """
    config = getattr(model, "config", None)
    rotary = getattr(getattr(model, "base_model", None), "rotary_emb", None)
    kind = getattr(config, "model_type", None) or type(model).__name__
    if config is None or rotary is None or not hasattr(rotary, "inv_freq"):
        return None, f"{kind} has no single rotary position embedding (rotary_emb) to move its cached keys with"
    factors = [getattr(config, "partial_rotary_factor", None)] + [d.get("partial_rotary_factor") for d in _rope_dicts(config)]
    partial = next((f for f in factors if f is not None and float(f) != 1.0), None)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(getattr(config, "num_attention_heads", 1) or 1, 1)
    if partial is None and 2 * rotary.inv_freq.numel() != head_dim:
        partial = 2 * rotary.inv_freq.numel() / head_dim
    if partial is not None:
        return None, (
            f"{kind} has a partial rotary embedding (partial_rotary_factor {float(partial):g}: part of each head "
            "unrotated), which the re-rotation of the cached keys does not model"
        )
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        nope = [i for i, use in enumerate(no_rope) if not use]
        return None, (
            f"{kind} has layers without a position encoding (NoPE layers {nope[:8]}{' ...' if len(nope) > 8 else ''}), "
            "whose cached keys the re-rotation would move"
        )
    if kind in INTERLEAVED_ROPE or getattr(config, "rope_interleave", False):
        return None, f"{kind} has an interleaved rotary embedding (adjacent dimensions paired), which the re-rotation does not model"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in COMPACT_ROPE_TYPES:
        return None, (
            f"{kind}'s RoPE type {rope_type!r} is not a fixed rotation per position offset (the re-rotation "
            f"models {', '.join(COMPACT_ROPE_TYPES)})"
        )
    if sliding_window is not None:
        return None, f"{kind}'s sliding-window attention ({sliding_window} tokens) is not modelled by the proxy's block mask"
    if kind not in PROXY_ARCHITECTURES:
        return None, (
            f"architecture {kind!r} is not among those whose compacted proxy rows are tested against the exact "
            f"game ({', '.join(PROXY_ARCHITECTURES)})"
        )
    return rotary, None


def rope_rotation(model: Any) -> Any | None:
    """The model's rotary embedding module when the compacted proxy game can re-rotate its cached
    keys, else None (the backend then has no proxy game: ``supports_proxy`` False; the reason is
    :func:`proxy_capability`'s)."""
    return proxy_capability(model)[0]


def _rotate_half(x: Any) -> Any:
    """RoPE's half rotation in transformers' layout (the head dimension's two halves are the pairs)."""
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

_FORWARD_POOLS: dict[int, Any] = {}


def _forward_pool(n: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    if n not in _FORWARD_POOLS:
        _FORWARD_POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="proxy-forward")
    return _FORWARD_POOLS[n]


_ROW_BYTES = 1 << 30
"""Most bytes of per-row re-rotated keys and values one proxy forward holds."""


class ProxyScoring:
    """The proxy game's forwards of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    rotated_key_rows: bool = False
    """Run every side-by-side proxy forward with each row's own rotated copy of the prefix keys
    (``PrefixSplit.rotation``, the method until 2026-12-06) instead of the row-wise prefix on the
    shared keys (``PrefixSplit.rows``); the latter is the default and equal up to float rounding.
    For the benchmark that compares them (``benchmarks/proxy_rows.py --compare``). The rotated copy
    also runs, whatever this says, where a row's queries before its tail see hidden prefix keys."""

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
            # a row's re-rotated keys and the values beside them: 2 x layers x kv heads x positions x head dim
            config = self.model.config
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(getattr(config, "num_attention_heads", 1) or 1, 1)
            itemsize = torch.finfo(self.model.dtype).bits // 8 if self.model.dtype.is_floating_point else 4
            per_position = 2 * config.num_hidden_layers * heads * head_dim * itemsize
            limit = self.tree_mask_limit or 2**22
            results: list[ScoreResult] = []
            at = 0
            side_by_side = self.split_attention and shared > 0  # the rotated prefix split (CPU)
            while at < len(rows):
                end = at + 1
                total = rows[at].n_tokens - 1
                if side_by_side:  # rows of one length side by side, the mask's N x (s + N) within the limit
                    t = total - shared
                    while end < len(rows) and rows[end].n_tokens == rows[at].n_tokens and (end + 1 - at) * t * (shared + (end + 1 - at) * t) <= limit:
                        end += 1
                    computed_prefix = shared - resumed if at == 0 else 0
                    apart = None if self.rotated_key_rows else self._prefix_apart(prefix, cache, rows)
                    results += self._proxy_forwards_side_by_side(rows[at:end], cache, shared, computed_prefix, apart)
                    at = end
                    continue
                # rows of one length as a batch, within 1 GiB of per-row keys and values
                while (
                    end < len(rows) and rows[end].n_tokens == rows[at].n_tokens
                    and (end + 1 - at) * total * per_position <= _ROW_BYTES  # the rows' own keys and values
                    and (end + 1 - at) * (total - shared) * total <= limit  # the 4-D mask's entries
                ):
                    end += 1
                chunk = rows[at:end]
                computed_prefix = shared - resumed if at == 0 else 0
                results += self._proxy_forward_compact(chunk, cache, shared, computed_prefix)
                at = end
        return results, ran

    parallel_forwards: bool = True
    """On the CPU, split a call's side-by-side proxy rows into as many forwards as PyTorch has
    intra-op threads and run them at once in Python threads, each op on one thread (PyTorch's thread
    count is set to 1 for the while and restored: process-wide). A row-wise proxy forward is many
    small ops (per row and layer a handful of flash calls, gathers and turns on its visible prefix):
    each on one thread of its own forward, no op's threads meet at a barrier, and each forward's
    projections are still large enough to run near peak on one thread. Not for the rotated copy
    (:attr:`rotated_key_rows`, whose large ops use the threads themselves).
    ``benchmarks/proxy_rows.py --compare`` times it."""

    def _prefix_apart(self, prefix: tuple[int, ...], cache: Any, rows: Sequence[ProxyScoreRequest]) -> list[PrefixKV]:
        """The cached ``prefix`` (``cache``'s layers) held apart from the row-wise forwards, one
        :class:`~coalescence.backends.row_prefix.PrefixKV` a layer; laid out position-major too
        where a row of ``rows`` may gather (more visible spans than
        :data:`~coalescence.backends.row_prefix.SPAN_LIMIT`), kept for the next call on the same
        prefix (one prefix at a time)."""
        gathers = any(len(r.hidden) + 1 > SPAN_LIMIT for r in rows)
        known = getattr(self, "_apart", None)
        if known is not None and known[0] == prefix and (known[1] or not gathers):
            return known[2]
        apart = [
            PrefixKV(layer.keys, layer.values, position_major(layer.keys, layer.values) if gathers else None)
            for layer in cache.layers
        ]
        self._apart = (prefix, gathers, apart)
        return apart

    def _proxy_forwards_side_by_side(
        self, rows: Sequence[ProxyScoreRequest], cache: Any, shared: int, computed_prefix: int, apart: Sequence[PrefixKV] | None = None
    ) -> list[ScoreResult]:
        """:meth:`_proxy_forward_split` of ``rows``, in as many forwards side by side as PyTorch has
        intra-op threads, each on one thread (:attr:`parallel_forwards`), each on its own fork of
        ``cache`` (or ``apart``, the prefix held apart); one forward where the rows are the rotated
        copy's (:attr:`rotated_key_rows`) or a forward would hold no row."""
        torch = self._torch
        threads = torch.get_num_threads()
        parts = min(threads, len(rows)) if self.parallel_forwards and not self.rotated_key_rows else 1
        if parts < 2:
            return self._proxy_forward_split(rows, fork_cache(cache), shared, computed_prefix, apart)
        bounds = [len(rows) * i // parts for i in range(parts + 1)]

        def run(i: int) -> list[ScoreResult]:
            with torch.no_grad():  # grad mode is per thread
                part = rows[bounds[i] : bounds[i + 1]]
                return self._proxy_forward_split(part, fork_cache(cache), shared, computed_prefix if i == 0 else 0, apart)

        torch.set_num_threads(1)
        try:
            outs = list(_forward_pool(parts).map(run, range(parts)))
        finally:
            torch.set_num_threads(threads)
        return [r for out in outs for r in out]

    def _compact_rotation(self, before: Any) -> tuple[Any, Any]:
        """``(cos, sin)``, each ``[b, P, d]`` float32 on the model's device: RoPE's rotation of each
        cached key by minus ``before`` (``[b, P]`` int64, the hidden tokens before it), the model's
        attention scaling divided out (the cached keys carry it once already)."""
        torch = self._torch
        probe = torch.zeros((1, before.shape[1], 1), dtype=torch.float32, device=self.device)
        cos, sin = self._rope(probe, (-before).to(self.device))
        scale = float(getattr(self._rope, "attention_scaling", 1.0) or 1.0)
        return cos.float() / scale, sin.float() / scale

    def _rope_halves_repeat(self) -> bool:
        """Whether the model's RoPE tables repeat their frequencies over the head dimension's two
        halves (``cat(freqs, freqs)``), which the gather rows' in-place turn relies on; checked once
        per backend on the offsets 1-64."""
        known = getattr(self, "_halves_repeat", None)
        if known is None:
            torch = self._torch
            cos, sin = self._compact_rotation(torch.arange(1, 65)[None])  # [1, 64, d]
            half = cos.shape[-1] // 2
            known = bool(torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:]))
            self._halves_repeat = known
        return known

    def _row_prefixes(self, rows: Sequence[ProxyScoreRequest], hidden: Any, before: Any) -> list[RowPrefix] | None:
        """Each row's view of the shared prefix for :func:`~coalescence.backends.row_prefix.row_prefix_attention`
        (``hidden`` ``[R, P]`` bool, ``before`` ``[R, P]`` int64: the hidden tokens before each
        position), or None where a row's queries before its tail see hidden prefix keys (every
        query of a row must see the same prefix keys; the rotated copy runs those)."""
        torch = self._torch
        shared = hidden.shape[1]
        if any(r.tail_start > shared and bool(hidden[i].any()) for i, r in enumerate(rows)):
            return None
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        plans: list[RowPrefix] = []
        for i in range(len(rows)):
            visible = ~hidden[i]
            edges = torch.nonzero(visible[1:] != visible[:-1])[:, 0] + 1  # where visibility flips
            bounds = [0, *edges.tolist(), shared]
            spans = [(a, z) for a, z in zip(bounds[:-1], bounds[1:]) if bool(visible[a])]
            if len(spans) <= SPAN_LIMIT:
                offsets = torch.tensor([int(before[i, a]) for a, _ in spans], dtype=torch.long)
                cos, sin = self._compact_rotation(-offsets[None])  # [1, U, d]: turning by +h
                turns = tuple(None if int(h) == 0 else (cos[0, u], sin[0, u]) for u, h in enumerate(offsets))
                plans.append(RowPrefix(spans=tuple(spans), turns=turns))
                continue
            offsets = before[i, visible]  # [V]
            index = torch.nonzero(visible)[:, 0].to(self.device)  # [V] the visible positions
            still = int((offsets == 0).sum())  # h is non-decreasing: the unturned keys lead
            if still == offsets.numel():
                plans.append(RowPrefix(spans=tuple(spans), gather=True, index=index, still=still))
                continue
            if not self._rope_halves_repeat():
                return None  # the in-place turn needs RoPE's repeated halves (cat(freqs, freqs))
            cos, sin = self._compact_rotation(offsets[None, still:])  # [1, V - still, d]: turning by -h
            half = cos.shape[-1] // 2

            def per_head(table: Any) -> Any:  # [V - still, H_kv, d / 2], contiguous
                return table[0, :, None, :half].expand(-1, heads, -1).contiguous()

            plans.append(RowPrefix(spans=tuple(spans), gather=True, index=index, still=still, cos=per_head(cos), sin=per_head(sin)))
        return plans

    def _proxy_forward_compact(
        self, rows: Sequence[ProxyScoreRequest], cache: Any, shared: int, computed_prefix: int
    ) -> list[ScoreResult]:
        """One forward of proxy rows of one length as a batch on ``cache`` (``shared`` positions,
        batch 1, never written), positions compacted (module docs): per row r, a position p is
        placed at ``p - h_r(p)``, ``h_r(p)`` its hidden tokens before p; the cached key at j is
        rotated by ``-h_r(j)`` (RoPE: a rotation by the position offset), so every visible key sits
        where the exact game puts it; the forward's own tokens get their compacted positions; a query
        at ``p >= tail_start`` sees the keys in no hidden range, one before it every earlier key."""
        torch = self._torch
        from transformers import DynamicCache

        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        lows = torch.finfo(dtype).min
        b = len(rows)
        total = rows[0].n_tokens - 1  # positions of each row: prompt + target[:-1]
        t = total - shared  # the positions each row computes
        hidden = torch.zeros((b, total), dtype=torch.bool)
        for i, r in enumerate(rows):
            for lo, hi in r.hidden:
                hidden[i, lo:hi] = True
        before = torch.cumsum(hidden.long(), dim=1) - hidden.long()  # [b, total] hidden tokens before p
        positions = torch.arange(total)[None] - before  # [b, total] compacted
        causal = torch.ones((t, total), dtype=torch.bool).tril_(diagonal=shared)  # [t, total]: key q <= p
        in_tail = torch.tensor([[shared + k >= r.tail_start for k in range(t)] for r in rows])  # [b, t]
        sees = causal[None] & (~in_tail[:, :, None] | ~hidden[:, None, :])  # [b, t, total]
        mask = torch.zeros((b, 1, t, total), dtype=dtype).masked_fill_(~sees[:, None], lows)
        rotated = DynamicCache()
        if shared:
            cos, sin = self._compact_rotation(before[:, :shared])
            cos, sin = cos[:, None], sin[:, None]  # [b, 1, shared, d]
            for li, layer in enumerate(cache.layers):
                keys = layer.keys.float()  # [1, H_kv, shared, d]
                turned = (keys * cos + _rotate_half(keys) * sin).to(layer.keys.dtype)  # [b, H_kv, shared, d]
                rotated.update(turned, layer.values.expand(b, -1, -1, -1), li)
        tokens = [list(r.prompt_ids + r.target_ids)[shared:total] for r in rows]
        keep = list(range(len(rows[0].prompt_ids) - 1 - shared, t))  # logits of the target tokens
        kwargs: dict[str, Any] = {"logits_to_keep": torch.tensor(keep, device=self.device)} if self._keep_logits else {}
        out = self.model(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),  # [b, t]
            attention_mask=mask.to(self.device),  # [b, 1, t, shared + t]
            position_ids=positions[:, shared:].to(self.device),  # [b, t]
            cache=rotated,
            use_cache=True,
            **kwargs,
        )
        logits = out.logits  # [b, kept or t, V]
        picked = [logits[i] if self._keep_logits else logits[i, keep] for i in range(b)]  # [m, V] each
        return _row_results(rows, picked, t, shared, computed_prefix)

    def _proxy_forward_split(
        self, rows: Sequence[ProxyScoreRequest], cache: Any, shared: int, computed_prefix: int, apart: Sequence[PrefixKV] | None = None
    ) -> list[ScoreResult]:
        """One forward of proxy rows of one length laid side by side in one row on ``cache`` (a fork:
        the forward extends it), positions compacted (:meth:`_proxy_forward_compact`'s semantics):
        the tails at their compacted positions, and each row's queries reading the shared prefix keys
        at its own positions inside the prefix-split attention, one layer at a time: row by row on
        the shared keys (:class:`~coalescence.backends.attention.PrefixSplit` ``rows``,
        :meth:`_row_prefixes`), or, where a row's queries before its tail see hidden keys or
        :attr:`rotated_key_rows` says so, with the keys rotated per row for the layer (``rotation``);
        no row keeps a copy of the cache. Row by row with ``apart`` (the prefix held apart,
        :meth:`_prefix_apart`), the forward runs with no cache: its keys are its own, never
        concatenated behind the prefix's, and its mask is the local ``N x N`` one."""
        torch = self._torch
        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        lows = torch.finfo(dtype).min
        b = len(rows)
        total = rows[0].n_tokens - 1
        t = total - shared
        n = b * t
        hidden = torch.zeros((b, total), dtype=torch.bool)
        for i, r in enumerate(rows):
            for lo, hi in r.hidden:
                hidden[i, lo:hi] = True
        before = torch.cumsum(hidden.long(), dim=1) - hidden.long()  # [b, total] hidden tokens before p
        positions = (torch.arange(total)[None] - before)[:, shared:].reshape(-1)  # [N] compacted
        plan = None if self.rotated_key_rows else self._row_prefixes(rows, hidden[:, :shared], before[:, :shared])
        held_apart = plan is not None and apart is not None
        cols = 0 if held_apart else shared  # the mask's prefix columns (none where the prefix is apart)
        mask = torch.full((n, cols + n), lows, dtype=dtype)  # [N, P + N] additive (or [N, N])
        tokens: list[int] = []
        keep: list[int] = []
        causal = torch.ones((t, t), dtype=torch.bool).tril_()
        for i, r in enumerate(rows):
            at = i * t
            tokens += list(r.prompt_ids + r.target_ids)[shared:total]
            in_tail = (torch.arange(shared, total) >= r.tail_start)[:, None]  # [T, 1]
            sees = ~in_tail | ~hidden[i][None, :]  # [T, P + T]
            if cols:
                mask[at : at + t, :shared].masked_fill_(sees[:, :shared], 0.0)
            mask[at : at + t, cols + at : cols + at + t].masked_fill_(sees[:, shared:] & causal, 0.0)
            p = len(r.prompt_ids)
            keep += range(at + p - 1 - shared, at + p - 1 - shared + len(r.target_ids))
        if plan is None:
            split = PrefixSplit(shared, False, prefix_masked=True, block=t, rotation=self._compact_rotation(before[:, :shared]))
        else:
            split = PrefixSplit(shared, False, prefix_masked=True, block=t, rows=plan, prefix=apart if held_apart else None)
        kwargs: dict[str, Any] = {"logits_to_keep": torch.tensor(keep, device=self.device)} if self._keep_logits else {}
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),  # [1, N]
            attention_mask=mask[None, None].to(self.device),  # [1, 1, N, P + N] (or [1, 1, N, N])
            position_ids=positions[None].to(self.device),  # [1, N]
            cache=None if held_apart else cache,
            use_cache=not held_apart,
            prefix_split=split,
            **kwargs,
        )
        logits = out.logits[0]  # [kept or N, V]
        spans = np.cumsum([0] + [len(r.target_ids) for r in rows])
        picked = [logits[a:z] if self._keep_logits else logits[keep[a:z]] for a, z in zip(spans[:-1], spans[1:])]
        return _row_results(rows, picked, t, shared, computed_prefix)


def _row_results(
    rows: Sequence[ProxyScoreRequest], logits: Sequence[Any], t: int, shared: int, computed_prefix: int
) -> list[ScoreResult]:
    """One :class:`ScoreResult` per row from its target positions' logits (``[m, V]`` each): the
    target's log-probabilities in nats; ``t`` positions computed per row, plus ``computed_prefix``
    shared KV positions on the first row (read from the cache on the others)."""
    import torch

    results = []
    for i, (r, picked) in enumerate(zip(rows, logits, strict=True)):
        logp = torch.log_softmax(picked.float(), dim=-1)  # [m, V]
        tgt = torch.tensor(r.target_ids, dtype=torch.long, device=logp.device)
        token_lp = logp.gather(1, tgt[:, None])[:, 0].cpu().numpy()  # [m] float32
        extra = computed_prefix if i == 0 else 0
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
