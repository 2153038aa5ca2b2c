"""The sharing path: a batch's common prefix run once (resumed from the prefix cache), then its
rows' suffixes as one tree-attention row over their token trie, as halves, as right-padded
suffixes on the repeated cache, or a single row on its longest cached prefix."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..attention import PrefixSplit
from ..base import ScoreRequest, ScoreResult
from ..prefix import common_prefix_length
from .caches import cache_bytes, fork_cache, resumed_cache

__all__ = ("TreeScoring",)

class TreeScoring:
    """The sharing path of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    def _count_forwards(self, score: Any, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """``score(batch)`` adding its prefix forwards to those already counted for this call."""
        before = self._last_prefix_forwards
        out = score(batch)
        self._last_prefix_forwards += before
        return out

    def _score_shared(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """A batch with prefix sharing: one row alone in one forward (:meth:`_score_row`), more
        rows as their common prefix then their suffixes (:meth:`_score_prefix_then_suffixes`)."""
        self._last_prefix_forwards = 0
        if len(batch) == 1:
            return self._score_row(batch[0])
        return self._score_prefix_then_suffixes(batch)

    def _score_prefix_then_suffixes(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The batch's common prefix once (resumed from the prefix cache), then the suffixes.

        The shared prefix stops before the last prompt token of the shortest prompt, so every
        scored position is in the suffix forward. The suffixes run as one tree-attention row
        (:meth:`_score_tree`) when its mask fits ``tree_mask_limit``; otherwise right-padded on
        the repeated cache, with a 2-D attention mask over prefix + suffix and position ids
        continuing from the prefix length. Either way each real token sees exactly the tokens it
        sees in an unpadded forward of its own row.
        """
        torch = self._torch
        self._last_prefix_forwards = 0
        seqs = [r.prompt_ids + r.target_ids for r in batch]
        limit = min(len(r.prompt_ids) for r in batch) - 1
        shared = limit
        first = seqs[0]
        for seq in seqs[1:]:
            shared = min(shared, common_prefix_length(first, seq[:shared]))
        if shared < 1:
            return self._score_plain(batch)
        prefix = first[:shared]
        rows = len(batch)
        with torch.no_grad():
            # look up with the first row's whole prompt (all but its last token): an entry that
            # covers the batch prefix may go on along some rows (a chain the tree path reuses)
            entry_tokens, state, match = self.prefix_cache.longest(first[: len(batch[0].prompt_ids) - 1])
            resumed = min(match, shared)
            chain: tuple[int, ...] = ()
            if match >= shared and self.tree_mask_limit:
                tail = entry_tokens[shared:]
                depth = max(common_prefix_length(tail, seq[shared : len(r.prompt_ids) - 1]) for r, seq in zip(batch, seqs))
                chain = tail[:depth]
            tree = self._suffix_trie(seqs, shared, chain, [len(r.prompt_ids) for r in batch])
            n_nodes = len(tree[0])
            fits = n_nodes * (shared + len(chain) + n_nodes) <= self.tree_mask_limit
            if self.tree_mask_limit and not fits and rows > 1:
                # too big for one tree row (long rows): halves, each with its own longer common
                # prefix (resumed from the cache) and its own tree, never padded suffixes
                # recomputing everything below the batch prefix
                half = rows // 2
                return self._score_shared(batch[:half]) + self._count_forwards(self._score_shared, batch[half:])
            cache = resumed_cache(self.model.config, entry_tokens, state, resumed + len(chain))
            if shared > resumed:
                ids = torch.tensor([prefix[resumed:]], dtype=torch.long, device=self.device)  # [1, P - C]
                kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keep_logits else {}
                self.model(
                    input_ids=ids,
                    attention_mask=torch.ones((1, shared), dtype=torch.long, device=self.device),
                    position_ids=torch.arange(resumed, shared, device=self.device)[None],
                    cache=cache,
                    use_cache=True,
                    **kwargs,
                    **self._split(resumed, causal=True),
                )
                self._last_prefix_forwards = 1
                if self.prefix_cache.max_bytes:
                    self.prefix_cache.put(prefix, fork_cache(cache), cache_bytes(cache))
            if self.tree_mask_limit and fits:
                return self._score_tree(batch, cache, shared, len(chain), shared - resumed, tree)
            if chain:
                cache.crop(-len(chain))
            if rows > 1:
                cache.batch_repeat_interleave(rows)
            width = max(len(s) for s in seqs) - shared
            input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)  # [B, S]
            attention = torch.zeros((rows, shared + width), dtype=torch.long)  # [B, P + S]
            attention[:, :shared] = 1
            for b, seq in enumerate(seqs):
                own = len(seq) - shared
                input_ids[b, :own] = torch.tensor(seq[shared:], dtype=torch.long)
                attention[b, shared : shared + own] = 1
            positions = torch.arange(shared, shared + width)[None].expand(rows, width)  # [B, S]
            lo = limit  # smallest (prompt_len - 1), absolute
            hi = max(len(s) for s in seqs) - 1
            kwargs = {}
            offset = shared
            if self._keep_logits:
                kwargs["logits_to_keep"] = torch.arange(lo - shared, hi - shared, device=self.device)
                offset = lo
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                position_ids=positions.to(self.device),
                cache=cache,
                use_cache=True,
                **kwargs,
                **self._split(shared, causal=True),  # right padding: a real token never sees a pad
            )
            return self._row_results(batch, out.logits, offset, shared, shared - resumed, width)

    def _score_row(self, r: ScoreRequest) -> list[ScoreResult]:
        """One row alone: the rest of its prompt and its target in one forward on its longest cached prefix.

        A batch of long rows is split in halves down to single rows (their tree would be over
        ``tree_mask_limit``); run as a prefix forward plus a tree of its last prompt token and
        target, such a row took two forwards, the second of 20-odd tokens on 1,000-2,500 cached
        ones at a third of the long-pass rate (benchmarks/RESULTS.md). The row's prompt goes into
        the prefix cache (the states of its own forward, cropped before the target: no copy), for
        the next batch in depth-first order, which most likely continues it.
        """
        torch = self._torch
        seq = r.prompt_ids + r.target_ids
        p, t = len(r.prompt_ids), len(r.target_ids)
        # every scored position is computed here: resume at most before the last prompt token
        entry_tokens, state, resumed = self.prefix_cache.longest(seq[: p - 1])
        cache = resumed_cache(self.model.config, entry_tokens, state, resumed)
        n = len(seq)
        kwargs: dict[str, Any] = {}
        offset = resumed
        if self._keep_logits:
            kwargs["logits_to_keep"] = torch.arange(p - 1 - resumed, n - 1 - resumed, device=self.device)
            offset = p - 1
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([seq[resumed:]], dtype=torch.long, device=self.device),  # [1, L - C]
                attention_mask=torch.ones((1, n), dtype=torch.long, device=self.device),
                position_ids=torch.arange(resumed, n, device=self.device)[None],
                cache=cache,
                use_cache=True,
                **kwargs,
                **self._split(resumed, causal=True),
            )
            self._last_prefix_forwards = int(resumed < p - 1)
            if self.prefix_cache.max_bytes:
                entry = fork_cache(cache)
                entry.crop(-t)
                self.prefix_cache.put(r.prompt_ids, entry, cache_bytes(entry))
            return self._row_results([r], out.logits, offset, resumed, 0, n - resumed)

    def _split(self, prefix_len: int, *, causal: bool) -> dict[str, Any]:
        """The ``prefix_split`` keyword of a forward on ``prefix_len`` cached tokens (:mod:`.attention`),
        or nothing when prefix-split attention is off or nothing is cached."""
        if not self.split_attention or prefix_len < 1:
            return {}
        return {"prefix_split": PrefixSplit(prefix_len, causal)}

    @staticmethod
    def _suffix_trie(
        seqs: Sequence[tuple[int, ...]], shared: int, chain: Sequence[int], prompt_lens: Sequence[int]
    ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """The token trie of the rows' suffixes after ``shared`` tokens, flattened in creation order.

        ``chain`` are tokens after the shared prefix whose states are already in the cache (from
        a cached entry); they are trie nodes with ids ``-2, -3, ...`` that rows may follow, but
        only before their last prompt token (a scored position needs its logits computed).

        Returns:
            ``(tokens, parent, depth, owner, row_nodes)``: per new node its token, parent (-1 the
            root, <= -2 a chain node, else a new node), depth (0 = first suffix position) and the
            row that created it; per row the node of each of its suffix positions.
        """
        chained: dict[tuple[int, int], int] = {}
        prev = -1
        for j, tok in enumerate(chain):
            chained[(prev, tok)] = prev = -2 - j
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parent: list[int] = []
        depth: list[int] = []
        owner: list[int] = []
        row_nodes: list[list[int]] = []
        for b, seq in enumerate(seqs):
            here = -1
            nodes = []
            for k in range(shared, len(seq)):
                node = chained.get((here, seq[k])) if here < 0 and k < prompt_lens[b] - 1 else None
                if node is None:
                    node = index.get((here, seq[k]))
                if node is None:
                    node = index[(here, seq[k])] = len(tokens)
                    tokens.append(seq[k])
                    parent.append(here)
                    depth.append(k - shared)
                    owner.append(b)
                nodes.append(node)
                here = node
            row_nodes.append(nodes)
        return tokens, parent, depth, owner, row_nodes

    def _score_tree(
        self, batch: Sequence[ScoreRequest], cache: Any, shared: int, n_chain: int, computed_prefix: int, tree: tuple
    ) -> list[ScoreResult]:
        """Tree attention on top of the prefix state: the suffix trie as one row, no padding.

        Each node attends to the whole prefix and to its trie ancestors (a float additive 4-D
        mask: a boolean one gave wrong logits under eager attention in a reported test); its
        position id is the prefix length plus its depth, so it sees exactly what the same token
        sees in an unpadded forward of its own row.
        """
        torch = self._torch
        tokens, parent, depth, owner, row_nodes = tree
        n = len(tokens)
        allowed = torch.zeros((n, n), dtype=torch.bool)  # [N, N] node i may attend to node j
        chained = [0] * n  # cached chain positions each node sees (its chain ancestors)
        for i in range(n):
            if parent[i] >= 0:
                allowed[i] = allowed[parent[i]]
                chained[i] = chained[parent[i]]
            elif parent[i] <= -2:
                chained[i] = -parent[i] - 1
            allowed[i, i] = True
        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        mask = torch.zeros((1, 1, n, shared + n_chain + n), dtype=dtype)  # [1, 1, N, P + C + N] additive
        sees_chain = torch.arange(n_chain)[None, :] < torch.tensor(chained)[:, None]  # [N, C]
        mask[0, 0, :, shared : shared + n_chain].masked_fill_(~sees_chain, torch.finfo(dtype).min)
        mask[0, 0, :, shared + n_chain :].masked_fill_(~allowed, torch.finfo(dtype).min)
        keep = sorted(
            {nodes[len(r.prompt_ids) - 1 - shared + j] for r, nodes in zip(batch, row_nodes) for j in range(len(r.target_ids))}
        )
        where = {node: k for k, node in enumerate(keep)}
        kwargs: dict[str, Any] = {}
        if self._keep_logits:
            kwargs["logits_to_keep"] = torch.tensor(keep, device=self.device)
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device),
            attention_mask=mask.to(self.device),
            position_ids=(shared + torch.tensor([depth], dtype=torch.long)).to(self.device),
            cache=cache,
            use_cache=True,
            **kwargs,
            **self._split(shared, causal=False),
        )
        logits = out.logits[0]  # [kept or N, V]
        self._cache_last_row(batch[-1], row_nodes[-1], cache, shared, n_chain)
        created = [0] * len(batch)
        for b in owner:
            created[b] += 1
        results = []
        for b, (r, nodes) in enumerate(zip(batch, row_nodes, strict=True)):
            p, t = len(r.prompt_ids), len(r.target_ids)
            rows_idx = [nodes[p - 1 - shared + j] for j in range(t)]
            if self._keep_logits:
                rows_idx = [where[x] for x in rows_idx]
            logp = torch.log_softmax(logits[rows_idx].float(), dim=-1)  # [t, V]
            tgt = torch.tensor(r.target_ids, dtype=torch.long, device=logp.device)
            token_lp = logp.gather(1, tgt[:, None])[:, 0].cpu().numpy()  # [t] float32
            computed = created[b] + (computed_prefix if b == 0 else 0)
            results.append(
                ScoreResult(
                    token_logprobs=token_lp,
                    utility=float(token_lp.astype(np.float64).sum()),
                    tokens_computed=computed,
                    tokens_reused=r.n_tokens - computed,
                    padded_positions=0,
                )
            )
        return results

    def _cache_last_row(self, last: ScoreRequest, nodes: list[int], cache: Any, shared: int, n_chain: int) -> None:
        """Put the last row's prompt path, gathered from the tree forward's cache, in the prefix cache.

        In depth-first order the next batch most likely continues the last row; its key/value
        states are in ``cache`` already (prefix, chain, then tree nodes, each at its own position
        id), so gathering its path gives exactly the states of a contiguous forward of its prompt.
        """
        torch = self._torch
        p = len(last.prompt_ids)
        path = nodes[: p - shared]
        if not self.prefix_cache.max_bytes or len(path) < 1:
            return
        cols = list(range(shared)) + [shared - x - 2 if x <= -2 else shared + n_chain + x for x in path]
        index = torch.tensor(cols, dtype=torch.long, device=self.device)
        entry = copy.copy(cache)
        entry.layers = [copy.copy(layer) for layer in cache.layers]
        for layer in entry.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.prefix_cache.put(last.prompt_ids, entry, cache_bytes(entry))

