"""Prefix-split attention: a suffix forward's attention over ``[cached prefix | its own keys]`` in two
parts, merged by their log-sum-exp.

Every suffix forward of the prefix-sharing backend has the same structure: each query token sees
*every* key of the cached prefix, and a causal or tree-shaped subset of the keys computed in this
forward (a continuation of the prefix, right-padded suffix rows, or a suffix trie). One attention
call with a dense ``N x (P + L)`` mask does ``N x (P + L)`` work with the mask added everywhere and,
for a key/value-head count below the query-head count (grouped-query attention), ``repeat_kv``
copies of the whole prefix. Split in two:

- prefix part: ``N x P``, no mask; with grouped-query attention the query heads that share a
  key/value head are stacked along the query axis (``[B, H_kv, n_rep * N, d]``), so the prefix's
  keys are never copied;
- local part: ``N x L``, causal (``is_causal``: ``N == L`` and top-left alignment is the right one)
  or with the local columns of the additive mask;

and merged exactly (a tree with more nodes than prefix keys is left to one call, where the split
measured slower): with ``(o1, lse1)`` and ``(o2, lse2)`` the parts' outputs and per-query
log-sum-exps, ``lse = logaddexp(lse1, lse2)`` and ``o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``
(the online-softmax merge: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
the split-KV step of FlashAttention-2 / Flash-Decoding). The result equals the one-call attention up
to float rounding (fp32: within 1e-4 nats on the utility; ``tests/backends/test_attention.py``);
``benchmarks/RESULTS.md`` ("Close to the compute limit") has the speed.

The parts run in PyTorch's CPU flash-attention kernel, the only public-dtype path that returns the
log-sum-exp (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``). It is installed only
on a CPU model whose attention implementation is ``sdpa`` and that follows transformers'
``AttentionInterface`` (:func:`install`); every other call, and every call without a
:class:`PrefixSplit`, is transformers' own ``sdpa_attention_forward`` unchanged, so generation, the
plain path and models with sliding windows, soft-capping or position biases behave exactly as
under ``sdpa``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ("NAME", "PrefixSplit", "install", "prefix_split_attention")

NAME = "coalescence_prefix_split"

# Where it runs (benchmarks/split_attention.py, SmolLM2-135M, 2 CPU threads, one forward each):
# continuations 1.02x (300 prefix keys, 600 new), 1.09x (1,400 / 900), 1.18x (2,000 / 600); trees
# 1.22x (2,000 / 600), 1.09x (2,500 / 120), 1.13x (2,450 / 24), but 0.94x for a tree longer than
# its prefix (700 / 1,400), whose local part is as dense as before and whose merge is extra: such a
# tree runs as one sdpa call.

#: Attention calls (one per layer and forward) that ran split, since import: for tests and
#: benchmarks to see that the split path ran.
split_calls = 0


@dataclasses.dataclass(frozen=True)
class PrefixSplit:
    """How a forward's keys split: the first ``prefix_len`` (the cached prefix) are seen by every
    query; the rest (this forward's own keys) causally (``causal=True``: query i sees local keys
    0..i, so the forward's query length must equal its local key length) or through the local
    columns ``[..., prefix_len:]`` of the forward's additive 4-D ``attention_mask`` (``causal=False``).

    ``prefix_masked=True`` reads the prefix columns ``[..., :prefix_len]`` of the additive mask too
    (queries that see only part of the prefix: the proxy game's rows, which hide absent players'
    cached tokens); the merge stays exact. ``block=T`` (with ``causal=False``) says the local
    columns are block-diagonal in blocks of ``T`` queries and ``T`` keys (rows of equal length laid
    side by side): the local part then runs as a batch of ``N / T`` blocks, ``T x T`` each, instead of
    one ``N x N`` call.

    Passed to the model as the keyword ``prefix_split``; transformers hands model keywords on to the
    attention function.
    """

    prefix_len: int
    causal: bool
    prefix_masked: bool = False
    block: int = 0
    rotation: Any = None
    """``(cos, sin)``, each ``[R, prefix_len, d]`` float32, or None: with ``block=T`` (``R`` blocks),
    block r's queries see the prefix keys rotated by RoPE's ``(cos_r, sin_r)`` (the compacted proxy
    game: each row's cached keys moved to its own positions), computed per layer for its blocks and
    never kept; ``block`` and ``prefix_masked`` are then required."""
    rows: Any = None
    """A sequence of :class:`~coalescence.backends.row_prefix.RowPrefix`, one per block of ``block``
    queries, or None: the same compacted prefix as ``rotation`` computed without a rotated copy of
    the keys (each row's queries turned per span of one offset, or its visible keys gathered;
    :func:`~coalescence.backends.row_prefix.row_prefix_attention`), the prefix columns of the mask
    not read (every query of a row sees the same keys); ``block`` and ``prefix_masked`` required.
    Takes precedence over ``rotation``."""
    prefix: Any = None
    """With ``rows``: the cached prefix held apart from the forward, or None (the prefix is then
    the first ``prefix_len`` keys of the forward's cache, as in every other split). A sequence, per
    layer (the attention module's ``layer_idx``), of :class:`~coalescence.backends.row_prefix.PrefixKV`.
    The forward then runs with no cache at all: its keys and values are its own ``N`` only (no
    per-layer concatenation of the ``P`` cached positions in front of them), and its
    ``attention_mask`` is the local ``[1, 1, N, N]`` block-diagonal one."""


def _sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> tuple[Any, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def prefix_split_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    prefix_split: PrefixSplit | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """An ``AttentionInterface`` function: :class:`PrefixSplit` attention when asked, else ``sdpa``.

    Args:
        query: ``[B, H, N, d]``; key, value: ``[B, H_kv, P + L, d]`` (the cache's keys then this
            forward's), ``H`` a multiple of ``H_kv``.
        attention_mask: with a split that is not causal, an additive float mask ``[1 or B, 1, N, P + L]``
            whose prefix columns are all 0 (only its local columns are read).

    Returns:
        ``(output [B, N, H, d], None)``, as ``sdpa_attention_forward``.
    """
    if prefix_split is not None and prefix_split.prefix is not None:
        return _rows_apart(module, query, key, value, attention_mask, scaling, prefix_split)
    P = 0 if prefix_split is None else prefix_split.prefix_len
    kv_len = key.shape[-2]
    n = query.shape[-2]
    plain = (
        prefix_split is None
        or not 0 < P < kv_len
        or query.device.type != "cpu"
        or dropout
        or any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "position_bias"))
        or (prefix_split.causal and kv_len - P != n)
        or (not prefix_split.causal and not prefix_split.block and P < kv_len - P)  # a tree longer than its prefix: slower split
        or (not prefix_split.causal and (attention_mask is None or not attention_mask.dtype.is_floating_point))
        or (prefix_split.prefix_masked and (attention_mask is None or not attention_mask.dtype.is_floating_point))
        or (prefix_split.block and (prefix_split.causal or n != kv_len - P or n % prefix_split.block))
        or (prefix_split.rotation is not None and not (prefix_split.block and prefix_split.prefix_masked))
        or (prefix_split.rows is not None and not (prefix_split.block and prefix_split.prefix_masked and len(prefix_split.rows) * prefix_split.block == n))
    )
    if plain:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    import torch

    global split_calls
    split_calls += 1
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, h, _, d = query.shape
    h_kv = key.shape[1]
    n_rep = h // h_kv
    # prefix part: every query sees every prefix key; heads sharing a key/value head stacked
    if prefix_split.rows is not None:  # per row, on the shared keys: queries turned per span, or visible keys gathered
        if b != 1:
            raise ValueError("a row-wise prefix split needs the rows side by side in one batch row")
        from .row_prefix import row_prefix_attention

        t = prefix_split.block
        r = n // t
        q = query.reshape(h_kv, n_rep, r, t, d).permute(2, 0, 1, 3, 4).reshape(r, h_kv, n_rep * t, d)
        o1, lse1 = row_prefix_attention(q, key[:, :, :P], value[:, :, :P], prefix_split.rows, scaling)  # [R, H_kv, n_rep * T(, d)]
        o1 = o1.reshape(r, h_kv, n_rep, t, d).permute(1, 2, 0, 3, 4).reshape(1, h, n, d)
        lse1 = lse1.reshape(r, h_kv, n_rep, t).permute(1, 2, 0, 3).reshape(1, h, n)
    elif prefix_split.rotation is not None:  # per block: the prefix keys rotated to that row's positions
        if b != 1:
            raise ValueError("a rotated prefix split needs the rows side by side in one batch row")
        cos, sin = prefix_split.rotation  # [R, P, d]
        t = prefix_split.block
        r = n // t
        keys = key[:, :, :P].float()  # [1, H_kv, P, d]
        half = d // 2
        turned = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
        rk = (keys * cos[:, None]).addcmul_(turned, sin[:, None]).to(key.dtype)  # [R, H_kv, P, d], in place
        rv = value[:, :, :P].expand(r, -1, -1, -1)  # [R, H_kv, P, d], a view
        q = query.reshape(h_kv, n_rep, r, t, d).permute(2, 0, 1, 3, 4).reshape(r, h_kv, n_rep * t, d)
        pm = attention_mask[0, 0, :, :P].reshape(r, 1, t, P).repeat(1, 1, n_rep, 1)  # [R, 1, n_rep * T, P]
        o1, lse1 = flash(q, rk, rv, 0.0, False, attn_mask=pm, scale=scaling)  # [R, H_kv, n_rep * T, d]
        o1 = o1.reshape(r, h_kv, n_rep, t, d).permute(1, 2, 0, 3, 4).reshape(1, h, n, d)
        lse1 = lse1.reshape(r, h_kv, n_rep, t).permute(1, 2, 0, 3).reshape(1, h, n)
    else:
        stacked = query.reshape(b, h_kv, n_rep * n, d)  # [B, H_kv, n_rep * N, d]
        prefix_mask = None
        if prefix_split.prefix_masked:  # per-query prefix columns, tiled for the stacked heads
            prefix_mask = attention_mask[..., :P].repeat(1, 1, n_rep, 1)  # [1 or B, 1, n_rep * N, P]
        o1, lse1 = flash(stacked, key[:, :, :P], value[:, :, :P], 0.0, False, attn_mask=prefix_mask, scale=scaling)
        o1 = o1.reshape(b, h, n, d)
        lse1 = lse1.reshape(b, h, n)
    # local part: this forward's keys, causal or through the mask's local columns
    return _local_merged(query, key[:, :, P:], value[:, :, P:], attention_mask[..., P:] if attention_mask is not None else None, scaling, prefix_split, o1, lse1)


def _local_merged(query: Any, key: Any, value: Any, local_mask: Any, scaling: float | None, split: PrefixSplit, o1: Any, lse1: Any) -> tuple[Any, None]:
    """The local part (``query`` ``[B, H, N, d]`` on the forward's own ``key``, ``value``
    ``[B, H_kv, L, d]``: causal, or through ``local_mask`` ``[1 or B, 1, N, L]``, block-diagonal with
    ``split.block``) merged with the prefix part ``(o1 [B, H, N, d], lse1 [B, H, N])``; returns
    ``(output [B, N, H, d], None)``."""
    import torch

    from transformers.integrations.sdpa_attention import repeat_kv

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, h, n, d = query.shape
    n_rep = h // key.shape[1]
    local_k = repeat_kv(key, n_rep)  # [B, H, L, d]
    local_v = repeat_kv(value, n_rep)
    if split.causal:
        o2, lse2 = flash(query, local_k, local_v, 0.0, True, scale=scaling)
    elif split.block:  # block-diagonal: R blocks of T as a batch (B == 1 for side-by-side rows)
        t = split.block
        r = n // t

        def blocks(x: Any) -> Any:  # [B, H, R * T, d] -> [B * R, H, T, d]
            return x.reshape(b, h, r, t, d).transpose(1, 2).reshape(b * r, h, t, d)

        local = local_mask.expand(b, 1, n, n).reshape(b, r, t, r, t)
        local = local.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b * r, 1, t, t)  # [B * R, 1, T, T]
        o2, lse2 = flash(blocks(query), blocks(local_k), blocks(local_v), 0.0, False, attn_mask=local.contiguous(), scale=scaling)
        o2 = o2.reshape(b, r, h, t, d).transpose(1, 2).reshape(b, h, n, d)
        lse2 = lse2.reshape(b, r, h, t).transpose(1, 2).reshape(b, h, n)
    else:
        o2, lse2 = flash(query, local_k, local_v, 0.0, False, attn_mask=local_mask, scale=scaling)
    lse = torch.logaddexp(lse1, lse2)  # [B, H, N] float32
    out = o1.float() * torch.exp(lse1 - lse)[..., None] + o2.float() * torch.exp(lse2 - lse)[..., None]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _rows_apart(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None, split: PrefixSplit) -> tuple[Any, None]:
    """:class:`PrefixSplit` ``rows`` with the prefix held apart (``split.prefix``): ``key``, ``value``
    ``[1, H_kv, N, d]`` are the forward's own, ``attention_mask`` its local ``[1, 1, N, N]``; the
    prefix is ``split.prefix[module.layer_idx]``."""
    from .row_prefix import row_prefix_attention

    global split_calls
    split_calls += 1
    _, h, n, d = query.shape
    h_kv = key.shape[1]
    n_rep = h // h_kv
    t = split.block
    r = n // t
    if query.shape[0] != 1 or attention_mask is None or n % t or len(split.rows) != r or key.shape[-2] != n:
        raise ValueError(f"a row-wise prefix held apart needs {len(split.rows)} rows of {t} side by side in one batch row, got {tuple(query.shape)}")
    prefix = split.prefix[module.layer_idx]
    q = query.reshape(h_kv, n_rep, r, t, d).permute(2, 0, 1, 3, 4).reshape(r, h_kv, n_rep * t, d)
    o1, lse1 = row_prefix_attention(q, prefix.keys, prefix.values, split.rows, scaling, prefix.by_position)  # [R, H_kv, n_rep * T(, d)]
    o1 = o1.reshape(r, h_kv, n_rep, t, d).permute(1, 2, 0, 3, 4).reshape(1, h, n, d)
    lse1 = lse1.reshape(r, h_kv, n_rep, t).permute(1, 2, 0, 3).reshape(1, h, n)
    return _local_merged(query, key, value, attention_mask, scaling, split, o1, lse1)


def install(model: Any) -> bool:
    """Switch ``model`` to :func:`prefix_split_attention` when it can run it; report whether it did.

    It can when the model is on the CPU, its attention implementation is ``sdpa``, it dispatches
    attention through transformers' ``AttentionInterface`` (``model._can_set_attn_implementation()``)
    and this PyTorch has the CPU flash-attention operator. The function is registered with
    transformers once (``AttentionInterface`` and, for the masks transformers builds itself,
    ``AttentionMaskInterface`` with ``sdpa``'s mask), under :data:`NAME`.
    """
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = getattr(model, "config", None)
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError, TypeError):
        return False
    can = getattr(model, "_can_set_attn_implementation", None)
    if (
        config is None
        or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME)
        or param.device.type != "cpu"
        or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        or can is None
        or not can()
    ):
        return False
    AttentionInterface.register(NAME, prefix_split_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME
