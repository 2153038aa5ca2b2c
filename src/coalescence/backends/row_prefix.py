"""The compacted proxy game's prefix attention, row by row, on the one shared key cache.

A proxy row (``backends/hf/proxy.py``) runs its tail's ``T`` queries against the ``P`` cached
prefix keys with its absent players' keys hidden and every visible key moved to its compacted
position: the cached key at j, rotated by RoPE at j, turned by ``-h(j)``, ``h(j)`` the row's hidden
tokens before j. ``h`` is constant on each *span* of the row's visible keys between two hidden
ranges, and RoPE's rotation is orthogonal, so on a span of offset h

    ``<q, R(-h) k_j> = <R(h) q, k_j>``:

the row's queries turned once by ``+h`` score the span's cached keys as they are. Two ways to run
a row (:class:`RowPrefix`), both one flash-attention call per part on views or per-row buffers
small enough to stay in cache, never a ``[R, H_kv, P, d]`` copy of the rotated keys:

- ``spans`` (few spans, e.g. a leave-one-out row: two): per span, the queries turned by its
  offset (``[1, H_kv, n_rep * T, d]``, small) attend the span's slice of the cached keys and
  values (views, no copy, no mask); the parts merged by their log-sum-exp;
- ``gather`` (many spans, e.g. a keep-half row): the row's visible keys and values gathered
  (``[1, H_kv, V, d]``, V the visible count: one ``index_select`` each, by the row's visible
  positions, from the prefix laid out position-major once per layer, ``[P, H_kv, d]``, so each
  visible position is one contiguous copy; flash attention reads the result as a strided view),
  the keys after the
  first hidden token turned by ``-h`` in place, one call with no mask (hidden keys are not there
  to mask).

Both equal the rotated-keys attention up to float rounding (``tests/backends/test_proxy.py``,
``test_row_prefix_modes_equal_the_reference``; ``benchmarks/proxy_rows.py --compare`` times them).
The rows run in as many Python threads as PyTorch has intra-op threads (:data:`PARALLEL_ROWS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ("PARALLEL_ROWS", "SPAN_LIMIT", "PrefixKV", "RowPrefix", "position_major", "row_prefix_attention")

SPAN_LIMIT = 4
"""Most spans a row runs as ``spans`` (one call each); a row with more is gathered. Leave-one-out
rows have two; keep-half rows of 70 players ~20 (``benchmarks/RESULTS.md``, "Proxy rows without
a rotated copy of the keys")."""


@dataclasses.dataclass(frozen=True)
class RowPrefix:
    """One proxy row's view of the cached prefix (built once per forward, read by every layer).

    Attributes:
        spans: ``((a, z), ...)`` the row's visible prefix keys as spans of one offset each, in
            order, ``0 <= a < z <= P``.
        turns: ``spans`` mode: per span, ``(cos, sin)`` ``[d]`` float32 turning the queries by the
            span's offset ``+h`` (RoPE's table, its attention scaling divided out), or None where
            ``h == 0``; empty in ``gather`` mode.
        gather: the mode: True, ``gather``; False, ``spans``.
        index: ``gather`` mode: ``[V]`` int64, the visible positions in order (the spans' positions).
        still: ``gather`` mode: how many leading visible positions have ``h == 0`` (not turned).
        cos, sin: ``gather`` mode: ``[V - still, H_kv, d / 2]`` float32, contiguous, turning the
            rest by ``-h``: RoPE's tables on one half of the head dimension (they repeat their
            frequencies over the two halves), expanded over the key/value heads, since an op
            broadcasting a ``[V, 1, d / 2]`` table over the heads ran at half the speed; or None
            where nothing is turned.
    """

    spans: tuple[tuple[int, int], ...] = ()
    turns: tuple[Any, ...] = ()
    gather: bool = False
    index: Any = None
    still: int = 0
    cos: Any = None
    sin: Any = None


@dataclasses.dataclass(frozen=True)
class PrefixKV:
    """One layer's cached prefix, held apart from a proxy forward
    (:attr:`~coalescence.backends.attention.PrefixSplit.prefix`).

    Attributes:
        keys, values: ``[1, H_kv, P, d]``, the layer's cached prefix (views are fine).
        by_position: ``(keys, values)`` position-major, ``[P, H_kv, d]`` each and contiguous, or
            None: what ``gather`` rows copy their visible positions from (:func:`position_major`).
    """

    keys: Any
    values: Any
    by_position: Any = None


def position_major(keys: Any, values: Any) -> tuple[Any, Any]:
    """``(keys, values)`` ``[1, H_kv, P, d]`` laid out position-major, ``[P, H_kv, d]`` each and
    contiguous: a row's gather (``index_select`` on dim 0) is then one contiguous copy per visible
    position, where on ``[1, H_kv, P, d]`` it is a strided one per head."""
    return keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous()


def _turn_in_place(x: Any, cos: Any, sin: Any) -> None:
    """``x <- x * cos + rotate_half(x) * sin`` in place on the halves of ``x`` (``[..., d]`` float32),
    ``cos, sin`` the tables of one half (``[..., d / 2]``, matching ``x``'s leading shape; RoPE's
    tables repeat their frequencies: ``cat(freqs, freqs)``): ``x1 <- x1 c - x2 s`` and
    ``x2 <- x2 c + x1 s``, with no ``rotate_half`` copy of ``x``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).addcmul_(first, sin)


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def row_prefix_attention(
    query: Any, key: Any, value: Any, rows: Sequence[RowPrefix], scaling: float | None, by_position: Any = None
) -> tuple[Any, Any]:
    """The prefix part of a proxy forward, row by row.

    Args:
        query: ``[R, H_kv, n_rep * T, d]``, row r's ``T`` queries with the query heads sharing a
            key/value head stacked (as the rotated path lays them out).
        key, value: ``[1, H_kv, P, d]``, the cached prefix (views are fine).
        rows: one :class:`RowPrefix` per row.
        scaling: the attention's softmax scale.
        by_position: ``key`` and ``value`` position-major (:func:`position_major`), or None: laid
            out here, once, where a row gathers.

    Returns:
        ``(out [R, H_kv, n_rep * T, d]`` in the query's dtype, ``lse [R, H_kv, n_rep * T]``
        float32``)``: each row's attention over its visible prefix keys and its log-sum-exp.
    """
    import torch

    # the gather rows read the prefix position-major, [P, H_kv, d], laid out once per call: each
    # row's gather is then one contiguous copy per visible position (index_select on dim 0)
    if by_position is None and any(r.gather for r in rows):
        by_position = position_major(key, value)
    threads = torch.get_num_threads()
    if threads < 2 or len(rows) < 2 or not PARALLEL_ROWS:
        return _rows(query, key, value, by_position, rows, scaling, 0)
    groups = [range(len(rows) * g // threads, len(rows) * (g + 1) // threads) for g in range(threads)]
    torch.set_num_threads(1)
    try:
        parts = list(_pool(threads).map(lambda g: _rows(query, key, value, by_position, [rows[i] for i in g], scaling, g.start), groups))
    finally:
        torch.set_num_threads(threads)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


PARALLEL_ROWS = True
"""Run the rows in as many Python threads as PyTorch has intra-op threads, each op on one thread
(rows' calls are small: one op's threads meeting at a barrier cost more than they share, most of
all on a busy machine); PyTorch's thread count is set to 1 for the while and restored (process-wide:
torch work in another thread of the process meanwhile runs on one thread too)."""

_POOLS: dict[int, Any] = {}


def _pool(n: int) -> Any:
    from concurrent.futures import ThreadPoolExecutor

    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(n, thread_name_prefix="row-prefix")
    return _POOLS[n]


def _rows(
    query: Any, key: Any, value: Any, by_position: Any, rows: Sequence[RowPrefix], scaling: float | None, first: int
) -> tuple[Any, Any]:
    """:func:`row_prefix_attention` of ``rows``, row ``first`` of ``query`` the first; ``by_position``
    the prefix keys and values position-major (``[P, H_kv, d]`` each) where a row gathers."""
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs: list[Any] = []
    lses: list[Any] = []
    for j, row in enumerate(rows):
        i = first + j
        q = query[i : i + 1]  # [1, H_kv, M, d]
        if not row.gather:
            parts = []
            for (a, z), turn in zip(row.spans, row.turns, strict=True):
                qi = q
                if turn is not None:
                    qf = q.float()
                    qi = (qf * turn[0]).addcmul_(_rotate_half(qf), turn[1]).to(q.dtype)
                parts.append(flash(qi, key[:, :, a:z], value[:, :, a:z], 0.0, False, scale=scaling))
            if len(parts) == 1:
                o, lse = parts[0]
            else:
                stacked = torch.stack([p[1] for p in parts])  # [U, 1, H_kv, M]
                lse = torch.logsumexp(stacked, dim=0)
                w = torch.exp(stacked - lse)[..., None]
                o = sum(p[0].float() * w[u] for u, p in enumerate(parts)).to(q.dtype)
        else:
            k = by_position[0].index_select(0, row.index)  # [V, H_kv, d]
            v = by_position[1].index_select(0, row.index)
            moved = k[row.still :]
            if row.cos is not None:  # [V - still, H_kv, d / 2]
                if moved.dtype == torch.float32:
                    _turn_in_place(moved, row.cos, row.sin)
                else:
                    mf = moved.float()
                    _turn_in_place(mf, row.cos, row.sin)
                    moved.copy_(mf)
            o, lse = flash(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False, scale=scaling)  # [1, H_kv, V, d] views
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
