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
  (V of them, V the visible count), the keys after the first hidden token turned by ``-h``, one
  call (hidden keys are not there to mask). The gather rows of a forward run together
  (:class:`RowPlan`, :class:`GatherBatch`): one ``index_select`` of every row's visible keys and
  values (``[G, H_kv, V_max, d]``, rows shorter than the longest padded and their pads masked),
  one turn and one flash call for all of them per layer, instead of a handful of small calls per
  row (the per-row calls' overhead was about half of the prefix attention's time).

Both equal the rotated-keys attention up to float rounding (``tests/backends/test_proxy.py``,
``test_row_prefix_modes_equal_the_reference``; ``benchmarks/proxy_rows.py --compare`` times them).
The rows run in as many Python threads as PyTorch has intra-op threads (:data:`PARALLEL_ROWS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ("PARALLEL_ROWS", "SPAN_LIMIT", "GatherBatch", "RowPlan", "RowPrefix", "row_prefix_attention")

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
        still: ``gather`` mode: how many leading visible positions have ``h == 0`` (not turned).
        cos, sin: ``gather`` mode: ``[V - still, d]`` float32, turning the rest by ``-h``, or None
            where nothing is turned.
    """

    spans: tuple[tuple[int, int], ...] = ()
    turns: tuple[Any, ...] = ()
    gather: bool = False
    still: int = 0
    cos: Any = None
    sin: Any = None


@dataclasses.dataclass(frozen=True)
class GatherBatch:
    """The ``gather`` rows of one forward as one batch (built once per forward by :class:`RowPlan`).

    Attributes:
        rows: ``[G]`` int64, the gather rows' indexes among the forward's rows, ascending.
        index: ``[G * V_max]`` int64, row g's visible prefix positions then padding (position 0),
            ``V_max`` the most visible positions of a row.
        mask: ``[G, 1, 1, V_max]`` float32 additive mask (0 on visible keys, the dtype's lowest on a
            row's padding), or None where every row has ``V_max`` visible keys.
        cos, sin: ``[G, 1, V_max, d]`` float32, turning each gathered key by ``-h`` (1 and 0 where
            ``h == 0`` and on padding), or None where no row turns a key.
        width: ``V_max``.
    """

    rows: Any
    index: Any
    mask: Any
    cos: Any
    sin: Any
    width: int

    @classmethod
    def of(cls, rows: Sequence[RowPrefix], head_dim: int) -> GatherBatch | None:
        """The batch of the ``gather`` rows among ``rows`` (None where fewer than two)."""
        import torch

        picked = [i for i, r in enumerate(rows) if r.gather]
        if len(picked) < 2:
            return None
        positions = [torch.cat([torch.arange(a, z) for a, z in rows[i].spans]) for i in picked]
        width = max(len(p) for p in positions)
        g = len(picked)
        index = torch.zeros((g, width), dtype=torch.long)
        mask = torch.zeros((g, 1, 1, width), dtype=torch.float32)
        turned = any(rows[i].cos is not None for i in picked)
        cos = torch.ones((g, 1, width, head_dim), dtype=torch.float32) if turned else None
        sin = torch.zeros((g, 1, width, head_dim), dtype=torch.float32) if turned else None
        for j, (i, p) in enumerate(zip(picked, positions, strict=True)):
            index[j, : len(p)] = p
            mask[j, ..., len(p) :] = torch.finfo(torch.float32).min
            row = rows[i]
            if row.cos is not None:
                cos[j, 0, row.still : len(p)] = row.cos
                sin[j, 0, row.still : len(p)] = row.sin
        full = all(len(p) == width for p in positions)
        return cls(
            rows=torch.tensor(picked, dtype=torch.long), index=index.reshape(-1), mask=None if full else mask,
            cos=cos, sin=sin, width=width,
        )


class RowPlan(Sequence[RowPrefix]):
    """A forward's :class:`RowPrefix` rows (a sequence of them, in order) with their ``gather``
    rows' :class:`GatherBatch`, built once per forward and read by every layer.

    Args:
        rows: one :class:`RowPrefix` per row.
        head_dim: the attention heads' dimension ``d``.
    """

    def __init__(self, rows: Sequence[RowPrefix], head_dim: int) -> None:
        self.rows = tuple(rows)
        self.batch = GatherBatch.of(self.rows, head_dim)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i]


def _gathered(query: Any, key: Any, value: Any, batch: GatherBatch, scaling: float | None) -> tuple[Any, Any]:
    """The prefix attention of ``batch``'s rows in one call: ``(out [G, H_kv, M, d], lse [G, H_kv, M])``."""
    import torch

    g = len(batch.rows)
    h_kv, d = key.shape[1], key.shape[-1]

    def take(x: Any) -> Any:  # [1, H_kv, P, d] -> [G, H_kv, V_max, d] (a strided view of one copy)
        return x[0].transpose(0, 1).index_select(0, batch.index).view(g, batch.width, h_kv, d).transpose(1, 2)

    k, v = take(key), take(value)
    if batch.cos is not None:
        kf = k.float()
        k = (kf * batch.cos).addcmul_(_rotate_half(kf), batch.sin).to(key.dtype)
    q = query.index_select(0, batch.rows)  # [G, H_kv, M, d]
    mask = None if batch.mask is None else batch.mask.to(q.dtype).expand(g, 1, q.shape[2], batch.width)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(q, k, v, 0.0, False, attn_mask=mask, scale=scaling)[:2]


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def row_prefix_attention(query: Any, key: Any, value: Any, rows: Sequence[RowPrefix], scaling: float | None) -> tuple[Any, Any]:
    """The prefix part of a proxy forward, row by row.

    Args:
        query: ``[R, H_kv, n_rep * T, d]``, row r's ``T`` queries with the query heads sharing a
            key/value head stacked (as the rotated path lays them out).
        key, value: ``[1, H_kv, P, d]``, the cached prefix (views are fine).
        rows: one :class:`RowPrefix` per row, or a :class:`RowPlan` (its ``gather`` rows then run
            as one batch: :class:`GatherBatch`).
        scaling: the attention's softmax scale.

    Returns:
        ``(out [R, H_kv, n_rep * T, d]`` in the query's dtype, ``lse [R, H_kv, n_rep * T]``
        float32``)``: each row's attention over its visible prefix keys and its log-sum-exp.
    """
    import torch

    batch = rows.batch if isinstance(rows, RowPlan) else None
    if batch is None:
        return _each(query, key, value, list(range(len(rows))), rows, scaling)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
    o, l = _gathered(query, key, value, batch, scaling)
    out.index_copy_(0, batch.rows, o)
    lse.index_copy_(0, batch.rows, l.float())
    rest = sorted(set(range(len(rows))) - set(batch.rows.tolist()))
    if rest:
        o, l = _each(query, key, value, rest, rows, scaling)
        at = torch.tensor(rest, dtype=torch.long)
        out.index_copy_(0, at, o)
        lse.index_copy_(0, at, l.float())
    return out, lse


def _each(query: Any, key: Any, value: Any, which: Sequence[int], rows: Sequence[RowPrefix], scaling: float | None) -> tuple[Any, Any]:
    """Rows ``which`` one by one (in :data:`PARALLEL_ROWS` threads): ``(out, lse)`` stacked in that order."""
    import torch

    threads = torch.get_num_threads()
    if threads < 2 or len(which) < 2 or not PARALLEL_ROWS:
        return _rows(query, key, value, which, rows, scaling)
    groups = [which[len(which) * g // threads : len(which) * (g + 1) // threads] for g in range(threads)]
    torch.set_num_threads(1)
    try:
        parts = list(_pool(threads).map(lambda g: _rows(query, key, value, g, rows, scaling), [g for g in groups if g]))
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


def _rows(query: Any, key: Any, value: Any, which: Sequence[int], rows: Sequence[RowPrefix], scaling: float | None) -> tuple[Any, Any]:
    """:func:`row_prefix_attention` of rows ``which`` (indexes into ``rows`` and ``query``), in order."""
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs: list[Any] = []
    lses: list[Any] = []
    for i in which:
        row = rows[i]
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
            k = torch.cat([key[:, :, a:z] for a, z in row.spans], dim=2)  # [1, H_kv, V, d]
            v = torch.cat([value[:, :, a:z] for a, z in row.spans], dim=2)
            moved = k[:, :, row.still :]
            if row.cos is not None:
                if moved.dtype == torch.float32:
                    turned = _rotate_half(moved)
                    moved.mul_(row.cos).addcmul_(turned, row.sin)
                else:
                    mf = moved.float()
                    moved.copy_((mf * row.cos).addcmul_(_rotate_half(mf), row.sin))
            o, lse = flash(q, k, v, 0.0, False, scale=scaling)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
