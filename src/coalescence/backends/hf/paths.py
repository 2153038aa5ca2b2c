"""Path choice: each prefix group of a batch on the sharing path or the plain path, whichever the
cost model (:mod:`coalescence.backends.cost`) estimates faster over rates measured once
(:meth:`PathChoice.calibrate`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import ScoreRequest, ScoreResult
from ..cost import Forward, PathRates, calibration_key, forward_flops, load_rates, save_rates
from ..prefix import PrefixCache, common_prefix_length

__all__ = ("PathChoice",)

logger = logging.getLogger(__name__)

class PathChoice:
    """Path choice and calibration of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    def _score_groups(self, batch: Sequence[ScoreRequest], mode: str) -> list[ScoreResult]:
        """A batch scored prefix group by prefix group (:attr:`ScoreRequest.prefix_group`), each
        group on the path ``mode`` says (``"auto"``: :meth:`_choose`), results in the batch's order.

        Rows of different conversations share at most the chat template's header: one tree over
        them all would have a dense attention mask over every row's tokens and a prefix cache
        entry for none of them (measured: a 64-conversation dataset three times slower).
        """
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(batch):
            groups.setdefault(r.prefix_group, []).append(i)
        out: list[Any] = [None] * len(batch)
        forwards = 0
        paths = [0, 0]
        for rows in groups.values():
            group = [batch[i] for i in rows]
            path = mode if mode != "auto" else self._choose(group)
            paths[path == "plain"] += 1
            results = self._score_plain(group) if path == "plain" else self._score_shared(group)
            for i, result in zip(rows, results, strict=True):
                out[i] = result
            forwards += self._last_prefix_forwards
        self._last_prefix_forwards = forwards
        self._last_paths = (paths[0], paths[1])
        return out

    def _choose(self, group: Sequence[ScoreRequest]) -> str:
        """``"shared"`` or ``"plain"`` for one prefix group: the path whose forwards
        (:meth:`_shared_forwards`, :meth:`_plain_forwards`) the rates of :meth:`calibrate`
        estimate faster (:meth:`~coalescence.backends.cost.PathRates.seconds`; a tie shares).
        A single row shares (its forward on its cached prefix runs at most the plain one's
        positions); a group with no common prefix is plain (sharing would run it plainly)."""
        if len(group) == 1:
            return "shared"
        plain = self._plain_forwards(group)
        shared = self._shared_forwards(group, [])
        if shared == plain:
            return "plain"
        rates = self.calibrate()
        t_shared = rates.seconds(self._model_shape, shared)
        t_plain = rates.seconds(self._model_shape, plain)
        logger.debug(
            "%d rows: sharing %d positions in %d forwards (est. %.3f s) vs plain %d (est. %.3f s)",
            len(group), sum(f[1] for f in shared), len(shared), t_shared, plain[0][1], t_plain,
        )
        return "shared" if t_shared <= t_plain else "plain"

    @staticmethod
    def _plain_forwards(batch: Sequence[ScoreRequest]) -> list[Forward]:
        """The forward :meth:`_score_plain` runs: ``("causal", rows x width, rows x width^2)``."""
        width = max(r.n_tokens for r in batch)
        return [("causal", len(batch) * width, len(batch) * width * width)]

    def _shared_forwards(self, batch: Sequence[ScoreRequest], virtual: list[tuple[int, ...]]) -> list[Forward]:
        """The forwards :meth:`_score_shared` would run on ``batch`` (``(kind, tokens, pairs)``,
        see :mod:`coalescence.backends.cost`), without running them.

        It follows :meth:`_score_prefix_then_suffixes`: the common prefix (capped before the
        shortest prompt's last token), of which the part not in the prefix cache runs as a
        causal forward (``P - C`` tokens, ``(P - C) x P`` pairs); then the suffix trie as one
        tree row (``N`` new nodes on ``P`` prefix and ``K`` chain positions followed from a
        cached entry: ``N x (P + K + N)`` pairs) or, over ``tree_mask_limit``, the halves in
        turn (single rows: ``n - C`` tokens, ``(n - C) x n`` pairs); or with
        ``tree_mask_limit=0`` right-padded suffixes (``rows x S`` tokens, ``rows x S x (P + S)``
        pairs). ``virtual`` collects the prefixes the earlier forwards of the same batch would
        put in the prefix cache (an entry those forwards evict, or an equally long match the
        cache's recency order picks otherwise, can make the estimate differ from the run).
        """
        cached = self.prefix_cache.max_bytes > 0

        def resumable(tokens: Sequence[int]) -> tuple[tuple[int, ...], int]:
            best = self.prefix_cache.peek(tokens)
            for v in virtual:
                if len(v) > best[1]:
                    match = common_prefix_length(v, tokens)
                    if match > best[1]:
                        best = (v, match)
            return best

        if len(batch) == 1:
            r = batch[0]
            seq = r.prompt_ids + r.target_ids
            c = resumable(seq[: len(r.prompt_ids) - 1])[1]
            n = len(seq)
            if cached:
                virtual.append(r.prompt_ids)
            return [("causal", n - c, (n - c) * n)]
        seqs = [r.prompt_ids + r.target_ids for r in batch]
        shared = min(len(r.prompt_ids) for r in batch) - 1
        first = seqs[0]
        for seq in seqs[1:]:
            shared = min(shared, common_prefix_length(first, seq[:shared]))
        if shared < 1:
            return self._plain_forwards(batch)
        entry, match = resumable(first[: len(batch[0].prompt_ids) - 1])
        resumed = min(match, shared)
        rows = len(batch)
        chain: tuple[int, ...] = ()
        if self.tree_mask_limit:
            if match >= shared:
                tail = entry[shared:]
                depth = max(common_prefix_length(tail, seq[shared : len(r.prompt_ids) - 1]) for r, seq in zip(batch, seqs))
                chain = tail[:depth]
            n = len(self._suffix_trie(seqs, shared, chain, [len(r.prompt_ids) for r in batch])[0])
            if n * (shared + len(chain) + n) > self.tree_mask_limit:
                half = rows // 2
                return self._shared_forwards(batch[:half], virtual) + self._shared_forwards(batch[half:], virtual)
        out: list[Forward] = []
        if shared > resumed:
            out.append(("causal", shared - resumed, (shared - resumed) * shared))
            if cached:
                virtual.append(first[:shared])
        if self.tree_mask_limit:
            out.append(("tree", n, n * (shared + len(chain) + n)))
            if cached:
                virtual.append(batch[-1].prompt_ids)
        else:
            width = max(len(s) for s in seqs) - shared
            out.append(("tree", rows * width, rows * width * (shared + width)))
        return out

    def calibrate(self, *, force: bool = False) -> PathRates:
        """The forward rates ``path="auto"`` compares the two paths with, measured once.

        Returns :attr:`path_rates` when set (given, or measured earlier), else the rates stored
        under :attr:`calibration_dir` for this model and machine, else measures them: on
        synthetic token ids (seeded), after warm-up forwards of 2 rows of 8 tokens (plain, then
        shared), the wall time of a plain padded batch (4 rows of 24-32 tokens), a single row of
        138 tokens, and two suffix batches on that row's cached prefix of 128 tokens (4 rows x 16
        and 8 rows x 20 suffix tokens, as tree rows, or padded suffixes with
        ``tree_mask_limit=0``); each gives ``(flops, flops / seconds)``
        (:func:`~coalescence.backends.cost.forward_flops`). Lengths shrink to fit a context or
        sliding window under 160 tokens; where the suffix batches do not fit (a context under
        about 32 tokens, or a sliding window under 290, which a tree's prefix and nodes must fit
        in) only the plain batch is measured and its rate serves both kinds. The run's prefix cache and statistics are left untouched. About
        520 token positions, about 110 GFLOP on SmolLM2-135M.

        Args:
            force: measure again even when rates are known (and store them).

        Returns:
            The :class:`~coalescence.backends.cost.PathRates`, also kept as :attr:`path_rates`.

        Raises:
            Whatever the model raises (:meth:`score` translates it into ``BatchFailed``).
        """
        if self.path_rates is not None and not force:
            return self.path_rates
        key = None
        if self.calibration_dir is not None and self.fingerprint:
            key = calibration_key(
                fingerprint=self.fingerprint, model_id=self.model_id, dtype=self.dtype, device=str(self.device),
                threads=self._torch.get_num_threads(),
            )
            stored = None if force else load_rates(self.calibration_dir, key)
            if stored is not None:
                self.path_rates = stored
                return stored
        t0 = time.perf_counter()
        rates = self._measure_rates()
        logger.info("calibrated the scoring paths in %.2f s: %s", time.perf_counter() - t0, rates)
        self.path_rates = rates
        if key is not None:
            save_rates(self.calibration_dir, key, rates)
        return rates

    def _measure_rates(self) -> PathRates:
        """The measurements of :meth:`calibrate` (see there), on a scratch prefix cache."""
        torch = self._torch
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 1000)
        low, high = min(5, vocab - 1), max(min(vocab, 4000), min(5, vocab - 1) + 1)
        rng = np.random.default_rng(0)
        cap = self.max_context - 1
        if self.sliding_window is not None:
            cap = min(cap, self.sliding_window - 1)
        scale = min(1.0, cap / 160)

        def size(n: int, least: int = 1) -> int:
            return max(least, int(n * scale))

        def ids(n: int, first: int | None = None) -> tuple[int, ...]:
            out = tuple(int(x) for x in rng.integers(low, high, n))
            return out if first is None else (low + first % (high - low),) + out[1:]

        def sync() -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def timed(fn: Any, batch: Sequence[ScoreRequest]) -> float:
            sync()
            t0 = time.perf_counter()
            fn(batch)
            sync()
            return max(time.perf_counter() - t0, 1e-9)

        shape = self._model_shape
        plain = [ScoreRequest(prompt_ids=ids(size(n)), target_ids=ids(size(4))) for n in (28, 24, 20, 26)]
        prefix = ids(size(128))
        row = ScoreRequest(prompt_ids=prefix, target_ids=ids(size(10)))
        trees = [
            [ScoreRequest(prompt_ids=prefix + ids(size(s, 2), first=k * 16 + b), target_ids=ids(size(4))) for b in range(rows)]
            for k, (rows, s) in enumerate(((4, 12), (8, 16)))
        ]
        longest = max(r.n_tokens for batch in trees for r in batch)
        if self.sliding_window is not None:  # a tree's prefix and nodes within the window, too
            longest = max(longest, len(prefix) + max(sum(r.n_tokens - len(prefix) for r in b) for b in trees))
        warm = ids(4)
        warm_up = [ScoreRequest(prompt_ids=warm + ids(2, first=b), target_ids=ids(2)) for b in range(2)]  # 8 tokens each
        saved = (self.prefix_cache, self.tree_mask_limit, self._last_prefix_forwards)
        self.prefix_cache = PrefixCache(2**30)
        if self.tree_mask_limit:
            self.tree_mask_limit = max(self.tree_mask_limit, 2**22)  # one tree row, not halves
        causal: list[tuple[float, float]] = []
        tree: list[tuple[float, float]] = []
        try:
            self._score_plain(warm_up if cap >= 12 else plain)  # warm-up: a plain batch, a prefix forward, a tree row
            if cap >= 12:
                self._score_shared(warm_up)
            for batch in (plain, [row]) if longest <= cap else (plain,):
                forwards = self._plain_forwards(batch) if len(batch) > 1 else self._shared_forwards(batch, [])
                seconds = timed(self._score_plain if len(batch) > 1 else self._score_shared, batch)
                flops = sum(forward_flops(shape, t, p) for _, t, p in forwards)
                causal.append((flops, flops / seconds))
            for batch in trees if longest <= cap else ():
                forwards = self._shared_forwards(batch, [])
                seconds = timed(self._score_shared, batch)
                flops = sum(forward_flops(shape, t, p) for _, t, p in forwards)
                tree.append((flops, flops / seconds))
        finally:
            self.prefix_cache, self.tree_mask_limit, self._last_prefix_forwards = saved
        if not tree:  # a context or window too short for the prefix batches: one rate for both
            tree = causal
        return PathRates(causal=causal, tree=tree)

