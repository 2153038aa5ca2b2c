"""Hugging Face transformers backend: teacher-forced log-probabilities of a causal LM.

Rows of a batch are right-padded to the longest row with a true attention mask, so pad positions
are never attended to by real tokens and never scored; position ids run 0..len-1 on every row.
Logits are computed only for the positions that predict target tokens (``logits_to_keep``), and
log-softmax runs in float32 whatever the model dtype.

Prefix sharing (default): masked variants of one conversation share long token prefixes. Each
batch runs the longest prefix common to all its rows once into a ``DynamicCache``, resuming from
the longest matching entry of a run-level LRU :class:`~coalescence.backends.prefix.PrefixCache`
(cropped to the shared length; a fork sharing its tensors, which transformers' dynamic cache layers
never write into, so cached entries are never touched). On top of
that state the rows' suffixes run either

- as one tree-attention row (default): the token trie of the suffixes, flattened, each distinct
  suffix token once, a float additive 4-D mask letting each node see the prefix and its trie
  ancestors, position ids = prefix length + depth, no padding; a batch whose N x (P + N) mask would
  be over ``tree_mask_limit`` is split in halves, each with its own longer common prefix; or
- right-padded on the cache repeated across the batch (``batch_repeat_interleave``), with a 2-D
  mask over prefix + suffix and position ids continuing from the prefix length
  (``tree_mask_limit=0``).

A batch of one row (what the halving of long rows ends in) runs the rest of its prompt and its
target in one forward on its longest cached prefix.

Path choice (``path="auto"``, default): sharing runs fewer positions but not always faster (a
tree over rows that share little has a dense mask over all of them), so each prefix group of a
batch of several rows takes the sharing path or the plain path, whichever the cost model of
:mod:`coalescence.backends.cost` estimates faster: the forwards each path would run (tokens,
padding included, and attention pairs), in FLOPs, over forward rates measured once per backend
by :meth:`HFBackend.calibrate` (about 110 GFLOP on SmolLM2-135M; or given as ``path_rates``).
``path="shared"`` always shares, ``path="plain"`` (or ``prefix_sharing=False``) never does.

On the CPU under ``sdpa`` these suffix forwards split their attention into the cached prefix (no
mask, no copies of its keys) and their own keys (causal, or the tree's mask), merged by
log-sum-exp (:mod:`coalescence.backends.attention`).

All are exact up to float rounding (fp32: within 1e-4 nats of the plain path); with the run cache
and the engine's depth-first order the positions run come within a few percent of the token-trie
lower bound (see benchmarks/RESULTS.md, "Prefix sharing").

The shared-KV proxy game (:meth:`HFBackend.score_proxy`, issue 37) reuses the same parts: the
shared KV resumed from the prefix cache, rows' tails laid side by side in one row with an additive
4-D mask (as the tree rows are), and prefix-split attention that also reads the mask's prefix
columns (per-row hidden players) and runs equal-length rows' local parts as a batch of blocks.

Generation (:meth:`HFBackend.generate_batch`) decodes the rows of a batch together: prompts
left-padded, one ``model.generate`` call per ``max_batch_size`` rows (one row per greedy request,
one per sample of a sampled request). Sampling draws each row's tokens by inverse CDF from a
``torch.Generator`` of its own, seeded by the sample's seed (:class:`_SeededSampler`, a logits
processor; the global RNG is never used), so a sample does not depend on its batch-mates' draws.
Batched kernels are not batch-invariant in floating point, so a row whose decision was close (a
top-2 logit margin below ``greedy_tie_margin``, or a uniform draw within ``sample_tie_gap`` of a
CDF boundary) is decoded again alone: every text is exactly what its row gives alone.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendError, BatchFailed, ConfigError
from .base import (
    DEFAULT_BATCH_SIZE,
    BackendBase,
    GenerateRequest,
    GenerateResult,
    ProxyScoreRequest,
    ScoreRequest,
    ScoreResult,
    ScoringStatistics,
    validate_generations,
    validate_results,
)
from .attention import PrefixSplit, install
from .cost import PATHS, Forward, PathRates, calibration_key, forward_flops, load_rates, model_shape, save_rates
from .prefix import PrefixCache, common_prefix_length

__all__ = ("HFBackend",)

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")

class HFBackend(BackendBase):
    """Scores teacher-forced targets with a transformers causal LM (synchronous); a
    :class:`~coalescence.backends.base.ScoringBackend` with one lane that owns no processes.

    Args:
        model: a ``PreTrainedModel`` for causal LM (e.g. ``LlamaForCausalLM``).
        tokenizer: its tokenizer (with a chat template for the engine's renderer).
        model_id: name recorded in coalition keys and the archive.
        revision: weights revision recorded in coalition keys.
        fingerprint: SHA-256 of the model's weight, tokenizer and template files
            (:func:`~coalescence.backends.registry.model_fingerprint`), part of the coalition key;
            ``""`` when unknown (a model built in memory).
        max_batch_size: rows per forward pass (>= 1).
        prefix_sharing: run the token prefix common to a batch's rows once and reuse its
            key/value states for every row (exact up to float rounding); ``False`` runs every row
            from its first token (the plain path), whatever ``path`` says.
        path: with prefix sharing, how each prefix group of a batch of several rows is scored:
            ``"auto"`` (default) takes the sharing path or the plain path (one right-padded
            forward of the whole rows), whichever :mod:`coalescence.backends.cost` estimates
            faster; ``"shared"`` always shares; ``"plain"`` never does. A single row always
            resumes from its longest cached prefix (never slower than plain). The attribute
            ``path`` may be changed between calls.
        path_rates: the forward rates ``path="auto"`` compares the paths with
            (:class:`~coalescence.backends.cost.PathRates`); ``None`` (default) measures them
            with :meth:`calibrate` the first time a choice needs them.
        calibration_dir: a directory where measured rates are kept as JSON, keyed by the
            model's fingerprint, dtype, device, torch threads and machine
            (:func:`~coalescence.backends.cost.calibration_key`), so another process on the same
            machine reuses them; ``None`` (default) keeps them in memory only, as does a model
            without a fingerprint. The registry passes ``cache_root()/calibration``.
        prefix_cache_bytes: bound (bytes) of the run-level LRU cache of prefix key/value states
            that later batches resume from (0: no run-level cache; only per-batch sharing).
            Default 1 GiB: a RAG game of 12 documents (about 2,600 tokens, 46 KiB of key/value
            states a token on SmolLM2-135M) computed 1.10x its token-trie bound at 256 MiB, whose
            entries were evicted before reuse, and 1.01x at 1 GiB (benchmarks/RESULTS.md).
        tree_mask_limit: with prefix sharing, a batch's suffixes run as one tree-attention row
            (each distinct suffix token once, no padding) when its mask has at most this many
            elements (nodes x (prefix + nodes)); a larger batch is split in halves (down to single
            rows, each one forward); 0 runs right-padded suffixes on a repeated cache instead.
        split_attention: with prefix sharing, run each suffix forward's attention as a prefix part
            and a local part merged by log-sum-exp (:mod:`coalescence.backends.attention`; exact
            up to float rounding) where the model can (on the CPU under ``sdpa``: the model's
            attention implementation is then switched to ``coalescence_prefix_split``, which is
            ``sdpa`` for every other call); the attribute ``split_attention`` says whether it is on.
        greedy_tie_margin: greedy requests of a batch decode together (left-padded, up to
            ``max_batch_size`` rows per ``generate`` call); a row whose top-2 logit margin fell
            below this at any of its steps is decoded again alone, so a near-tie that padding's
            float rounding could flip never changes its text (default: 1e-3 for float32, 0.1 for
            16-bit dtypes; ``None`` for that default, ``float("inf")`` decodes every row alone).
        sample_tie_gap: the same guard for sampled rows: a row whose uniform draw fell within
            this probability of a boundary of its cumulative distribution at any step is decoded
            again alone (default: 1e-5 for float32, 1e-2 for 16-bit dtypes).

    Attributes:
        supports_proxy: True (the proxy game, :meth:`score_proxy`) unless the model has
            sliding-window attention, which the proxy's block mask does not model.
        eos_token_ids: the token ids every decode (:meth:`generate`, :meth:`generate_batch`)
            stops at: the model's generation-config ``eos_token_id`` (an int or a list), then the
            tokenizer's EOS (the chat template's end-of-turn) when it is not among them.

    Raises:
        ConfigError: ``max_batch_size`` < 1, ``prefix_cache_bytes`` < 0, or ``path`` not one
            of ``"auto"``, ``"shared"``, ``"plain"``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str = "",
        fingerprint: str = "",
        max_batch_size: int = DEFAULT_BATCH_SIZE,
        prefix_sharing: bool = True,
        prefix_cache_bytes: int = 2**30,
        tree_mask_limit: int = 2**22,
        split_attention: bool = True,
        greedy_tie_margin: float | None = None,
        sample_tie_gap: float | None = None,
        path: str = "auto",
        path_rates: PathRates | None = None,
        calibration_dir: str | Path | None = None,
    ) -> None:
        import torch

        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="batch_size")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.fingerprint = fingerprint
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
        self.prefix_sharing = bool(prefix_sharing)
        if path not in PATHS:
            raise ConfigError(f"unknown path {path!r}; use one of {', '.join(PATHS)}", field="path")
        if path_rates is not None and not isinstance(path_rates, PathRates):
            raise ConfigError(f"must be a PathRates or None, got {path_rates!r}", field="path_rates")
        self.path = path
        self.path_rates = path_rates
        self.calibration_dir = Path(calibration_dir) if calibration_dir is not None else None
        self._model_shape = model_shape(model)
        self._last_paths = (0, 0)  # (groups shared, groups plain) of the last batch
        if isinstance(tree_mask_limit, bool) or not isinstance(tree_mask_limit, int) or tree_mask_limit < 0:
            raise ConfigError(f"must be an int >= 0, got {tree_mask_limit!r}", field="tree_mask_limit")
        self.tree_mask_limit = tree_mask_limit
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # sliding-window attention (Mistral v0.1, Gemma 2 and 3, ...): its cache layers keep only
        # the window, which the shared prefix, tree masks and cache entries do not model; a batch
        # with a row reaching the window is scored on the plain path (transformers' own masks)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        sliding = window is not None and (layer_types is None or any("sliding" in str(t) for t in layer_types))
        self.sliding_window: int | None = int(window) if sliding else None
        # prefix-split attention for the suffix forwards (CPU + sdpa only; see .attention)
        self.split_attention = bool(split_attention) and self.prefix_sharing and install(model)
        # the proxy game's block mask models full causal attention, not a sliding window
        self.supports_proxy = self.sliding_window is None
        self._stats = ScoringStatistics()
        self._last_prefix_forwards = 0
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        if greedy_tie_margin is None:
            greedy_tie_margin = 1e-3 if self.dtype == "float32" else 0.1
        if isinstance(greedy_tie_margin, bool) or not isinstance(greedy_tie_margin, int | float) or not greedy_tie_margin >= 0:
            raise ConfigError(f"must be a number >= 0, got {greedy_tie_margin!r}", field="greedy_tie_margin")
        self.greedy_tie_margin = float(greedy_tie_margin)
        if sample_tie_gap is None:
            sample_tie_gap = 1e-5 if self.dtype == "float32" else 1e-2
        if isinstance(sample_tie_gap, bool) or not isinstance(sample_tie_gap, int | float) or not sample_tie_gap >= 0:
            raise ConfigError(f"must be a number >= 0, got {sample_tie_gap!r}", field="sample_tie_gap")
        self.sample_tie_gap = float(sample_tie_gap)

    @staticmethod
    def dtype_from_name(name: str) -> Any:
        """The torch dtype for ``"float32"``, ``"bfloat16"`` or ``"float16"``.

        Raises:
            ConfigError: another name (field ``--dtype``).
        """
        import torch

        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}", field="dtype")
        return getattr(torch, name)

    def identity(self) -> dict[str, str]:
        """``{"backend": "hf"}``."""
        return {"backend": "hf"}

    def statistics(self) -> ScoringStatistics:
        """A snapshot of the counters over every :meth:`score` and generation call (see :class:`ScoringStatistics`)."""
        return self._stats

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each request's target, in nats.

        Runs ``ceil(len(requests) / max_batch_size)`` batches, each prefix group of a batch on
        the sharing path or the plain path (``path``; ``"auto"`` chooses by estimated time, see
        :meth:`_choose` and :mod:`coalescence.backends.cost`, the first choice calibrating the
        rates). The sharing path first runs (or resumes from the prefix cache) the longest token
        prefix common to all the group's rows, then their suffixes on top of that state; on a
        model with sliding-window attention only while every row of the batch is shorter than
        the window (else plain). The plain path runs the rows right-padded in one forward.
        :meth:`statistics` counts the groups of each path (``groups_shared``, ``groups_plain``).

        Returns:
            One :class:`ScoreResult` per request, in order (validated as a whole batch).

        Raises:
            BatchFailed: a row is longer than ``max_context``, the model raised, or it produced
                non-finite log-probabilities.
        """
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(
                    f"a sequence of {r.n_tokens} tokens exceeds the model's context of {self.max_context}"
                )
        results: list[ScoreResult] = []
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start : start + self.max_batch_size]
            if not batch:
                continue
            try:
                mode = self.path if self.prefix_sharing else "plain"
                if self.sliding_window is not None and max(r.n_tokens for r in batch) >= self.sliding_window:
                    mode = "plain"
                if mode == "plain":
                    out = self._score_plain(batch)
                    self._last_paths = (0, len({r.prefix_group for r in batch}))
                else:
                    out = self._score_groups(batch, mode)
            except BatchFailed:
                raise
            except Exception as exc:  # translate the library's errors at the boundary
                raise BatchFailed(f"model call failed on a batch of {len(batch)} rows: {exc}") from exc
            results.extend(validate_results(batch, out))
            s = self._stats
            self._stats = dataclasses.replace(
                s,
                batches=s.batches + 1,
                rows=s.rows + len(batch),
                tokens=s.tokens + sum(r.n_tokens for r in batch),
                tokens_computed=s.tokens_computed + sum(x.tokens_computed for x in out),
                tokens_reused=s.tokens_reused + sum(x.tokens_reused for x in out),
                padded_positions=s.padded_positions + sum(x.padded_positions for x in out),
                prefix_forwards=s.prefix_forwards + self._last_prefix_forwards,
                groups_shared=s.groups_shared + self._last_paths[0],
                groups_plain=s.groups_plain + self._last_paths[1],
            )
        return results

    def score_proxy(self, requests: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """Rows of the shared-KV proxy game (issue 37; semantics in
        :class:`~coalescence.backends.base.ProxyScoreRequest`), in nats.

        Rows are grouped by their shared KV, ``prompt_ids[:s]`` with ``s = min(tail_start,
        len(prompt_ids) - 1)`` (every scored position is run in the row). Per group the shared KV
        is resumed from the prefix cache (:class:`~coalescence.backends.prefix.PrefixCache`, keyed
        by its tokens; the part not cached is run once and put there), and the rows' tails
        (``prompt_ids[s:] + target_ids[:-1]``, at their original positions) are laid side by side
        in one row of ``N`` tokens per forward, on a fork of that cache that shares its tensors
        (never a copy per row), with one additive 4-D mask ``[1, 1, N, s + N]``: per row, the prefix
        columns of its hidden ranges masked for its queries at positions ``>= tail_start``, and its
        own block causal with its hidden positions masked likewise (other rows' blocks masked).
        A forward takes as many rows as keep ``N x (s + N)`` within ``tree_mask_limit`` (2**22
        when 0), at least one. On the CPU under prefix-split attention the prefix part reads the
        mask's prefix columns and rows of equal length run their local part as a batch of blocks
        (:class:`~coalescence.backends.attention.PrefixSplit`); elsewhere the dense mask goes to
        the model's attention (``sdpa``). Exact up to float rounding (fp32: 1e-4 nats).

        Returns:
            One :class:`ScoreResult` per request, in order: ``tokens_computed`` the row's tail
            (``n_tokens - 1 - s``: the last target token is never run), plus, on the first row of
            a group, the shared KV positions run for it; ``tokens_reused`` the shared KV positions
            read from the cache (so ``tokens_computed + tokens_reused == n_tokens - 1``).

        Raises:
            BackendError: a model with sliding-window attention (``supports_proxy`` False).
            BatchFailed: a row longer than ``max_context`` (before any model call), the model
                raised, or non-finite log-probabilities.
        """
        if not self.supports_proxy:
            raise BackendError(
                f"the proxy game is not available for {self.model_id}: its sliding-window attention is not "
                "modelled by the shared-KV mask; run the exact game only (--proxy-game none)"
            )
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(f"a sequence of {r.n_tokens} tokens exceeds the model's context of {self.max_context}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.prompt_ids[: min(r.tail_start, len(r.prompt_ids) - 1)], []).append(i)
        out: list[Any] = [None] * len(requests)
        forwards = 0
        for prefix, rows in groups.items():
            try:
                results, ran = self._proxy_group(prefix, [requests[i] for i in rows])
            except BatchFailed:
                raise
            except Exception as exc:  # translate the library's errors at the boundary
                raise BatchFailed(f"model call failed on {len(rows)} proxy rows: {exc}") from exc
            forwards += ran
            for i, result in zip(rows, results, strict=True):
                out[i] = result
        results = validate_results(requests, out)  # type: ignore[arg-type]
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            proxy_rows=s.proxy_rows + len(results),
            proxy_tokens_computed=s.proxy_tokens_computed + sum(x.tokens_computed for x in results),
            proxy_tokens_reused=s.proxy_tokens_reused + sum(x.tokens_reused for x in results),
            prefix_forwards=s.prefix_forwards + forwards,
        )
        return results

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
                cache = self._resumed_cache(entry_tokens, state, resumed)
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
                        self.prefix_cache.put(prefix, _fork(cache), _cache_bytes(cache))
            else:
                resumed = 0
                cache = self._resumed_cache((), None, 0)
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
                fork = _fork(cache) if shared else self._resumed_cache((), None, 0)  # the forward extends its own
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

    def _count_forwards(self, score: Any, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """``score(batch)`` adding its prefix forwards to those already counted for this call."""
        before = self._last_prefix_forwards
        out = score(batch)
        self._last_prefix_forwards += before
        return out

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
            cache = self._resumed_cache(entry_tokens, state, resumed + len(chain))
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
                    self.prefix_cache.put(prefix, _fork(cache), _cache_bytes(cache))
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
        cache = self._resumed_cache(entry_tokens, state, resumed)
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
                entry = _fork(cache)
                entry.crop(-t)
                self.prefix_cache.put(r.prompt_ids, entry, _cache_bytes(entry))
            return self._row_results([r], out.logits, offset, resumed, 0, n - resumed)

    def _resumed_cache(self, entry_tokens: tuple[int, ...], state: Any, length: int) -> Any:
        """A cache holding the first ``length`` positions of a prefix cache entry (``entry_tokens``,
        ``state``): a fork of it, cropped; an empty ``DynamicCache`` when ``length`` is 0."""
        if length < 1:
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        cache = _fork(state)
        if len(entry_tokens) > length:
            cache.crop(-(len(entry_tokens) - length))
        return cache

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
        self.prefix_cache.put(last.prompt_ids, entry, _cache_bytes(entry))

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens`` tokens, stops at EOS).

        Stops at :attr:`eos_token_ids`, like :meth:`generate_batch`.

        Returns:
            The new token ids, end-of-turn token included when the model produced one.

        Raises:
            ConfigError: ``max_new_tokens`` < 1 (``--max-new-tokens``) or an empty prompt (``prompt_ids``).
            BatchFailed: generation failed.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"must be an int >= 1, got {max_new_tokens!r}", field="max_new_tokens")
        if len(prompt_ids) == 0:
            raise ConfigError("generation needs at least one prompt token", field="prompt_ids")
        try:
            ids = self._decode((tuple(prompt_ids), max_new_tokens, 0.0, 1.0, 0))
        except BatchFailed:
            raise
        except Exception as exc:  # translate the library's errors at the boundary
            raise BatchFailed(f"generation failed: {exc}") from exc
        self._count_decodes([(len(prompt_ids), len(ids))])
        return list(ids)

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples, the rows of the batch decoded together.

        A greedy request is one row (its text repeated for every seed); a sampled request is one
        row per seed. Rows with equal ``max_new_tokens``, temperature and top-p are decoded
        together, ``max_batch_size`` per left-padded ``model.generate`` call (greedy decoding,
        ``do_sample=False``); a sampled row's token at each step is drawn by :class:`_SeededSampler`
        from ``softmax(scores / temperature)`` restricted to the top-p nucleus, with the row's own
        ``torch.Generator`` seeded by its seed. Transformers' own sampling warpers (e.g. a
        ``top_k=50`` generation default) never apply; its other logits processors (e.g. a
        ``repetition_penalty``) apply to greedy and sampled rows alike, so a sampled row whose
        nucleus is a single token is the greedy one. A row that came close to another decision
        (see the module docs) is decoded again alone, so each result equals, row for row, what
        its request gives alone, whatever the batch:

        - greedy: the token ids of ``model.generate(input_ids, attention_mask=ones,
          do_sample=False, max_new_tokens=..., pad_token_id=...)`` on that prompt;
        - sampled: a function of (prompt, temperature, top-p, seed) only. The global torch RNG is
          never used or changed.

        Every decode stops at :attr:`eos_token_ids` (kept in the output) or after
        ``max_new_tokens``.

        Args:
            requests: the requests, in order.

        Returns:
            One :class:`GenerateResult` per request, in order (validated as a whole batch);
            ``tokens_computed`` counts per decode the prompt plus the new tokens fed back
            (``len(prompt) + n_new - 1``: the last new token is never run; padding excluded).

        Raises:
            BatchFailed: a request's ``n_tokens`` exceeds ``max_context``, or the model raised.
        """
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(
                    f"a prompt of {len(r.prompt_ids)} tokens plus {r.max_new_tokens} new tokens exceeds "
                    f"the model's context of {self.max_context}"
                )
        rows = {_row_key(r, seed): None for r in requests for seed in (r.seeds[:1] if r.greedy else r.seeds)}
        try:
            together = self._decode_together(list(rows))
        except Exception as exc:  # translate the library's errors at the boundary
            together = {}
            logger.debug("batched decode failed (%s); decoding each row alone to find the failing request", exc)
        results: list[GenerateResult] = []
        decodes: list[tuple[int, int]] = []  # (prompt length, new tokens) per decode run
        for i, r in enumerate(requests):
            try:
                runs = []
                for seed in r.seeds[:1] if r.greedy else r.seeds:
                    key = _row_key(r, seed)
                    done = together.get(key)
                    runs.append(done if done is not None else self._decode(key))
            except BatchFailed:
                raise
            except Exception as exc:  # translate the library's errors at the boundary
                raise BatchFailed(f"generation failed on request {i} of a batch of {len(requests)}: {exc}") from exc
            samples = tuple(runs) * r.n_samples if r.greedy else tuple(runs)
            mine = [(len(r.prompt_ids), len(ids)) for ids in runs]
            decodes.extend(mine)
            results.append(GenerateResult(token_ids=samples, tokens_computed=sum(_decode_positions(*d) for d in mine)))
        results = validate_generations(requests, results)
        self._count_decodes(decodes)
        return results

    def _decode_together(self, rows: Sequence[_Row]) -> dict[_Row, tuple[int, ...]]:
        """Decode ``rows`` in left-padded batches; the rows whose every decision was clear.

        Rows are grouped by ``(max_new_tokens, temperature, top_p)`` and sorted by prompt length
        (less padding), ``max_batch_size`` per ``model.generate`` call; the attention mask hides
        the padding and transformers derives position ids from it. After the model's own logits
        processors, :class:`_MarginRecorder` (greedy) or :class:`_SeededSampler` (sampling)
        records how close each row's decision was at each step; a row below the guard
        (:attr:`greedy_tie_margin`, :attr:`sample_tie_gap`) at any step before its EOS is left
        out, so the caller decodes it alone. Padding moves a row's scores only by float rounding
        (fp32: about 1e-5 of a logit), so every returned row is the token sequence the row gives
        alone. A group of one row is left to the caller. Errors propagate.
        """
        out: dict[_Row, tuple[int, ...]] = {}
        groups: dict[tuple[int, float, float], list[_Row]] = {}
        for row in rows:
            groups.setdefault(row[1:4], []).append(row)
        eos = set(self.eos_token_ids)
        redone = 0
        for (n_new, temperature, top_p), members in groups.items():
            greedy = temperature == 0
            guard = self.greedy_tie_margin if greedy else self.sample_tie_gap
            if not math.isfinite(guard):
                continue
            members.sort(key=lambda row: len(row[0]))
            for start in range(0, len(members), self.max_batch_size):
                chunk = members[start : start + self.max_batch_size]
                if len(chunk) == 1:
                    continue
                processor = _MarginRecorder() if greedy else _SeededSampler(
                    temperature, top_p, [row[4] for row in chunk], device=self.device
                )
                new = self._generate([row[0] for row in chunk], n_new, processor)
                closeness = _stack_steps(processor.closeness)  # [B, T]
                for b, row in enumerate(chunk):
                    tokens = new[b]
                    n = next((k + 1 for k, x in enumerate(tokens) if x in eos), len(tokens))
                    if n and float(closeness[b, :n].min()) < guard:
                        redone += 1
                        continue
                    out[row] = tuple(tokens[:n])
        if redone:
            logger.debug("%d rows close to another decision decoded again alone", redone)
        self._stats = dataclasses.replace(self._stats, redone_alone=self._stats.redone_alone + redone)
        return out

    def _generate(self, prompts: Sequence[tuple[int, ...]], max_new_tokens: int, processor: Any) -> list[list[int]]:
        """One ``model.generate`` call, greedy over ``processor``'s scores, on left-padded ``prompts``.

        Returns:
            Per row the new token ids (padding after a row's EOS included).
        """
        torch = self._torch
        from transformers import LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [B, P] left-padded
        attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P] 1 = real token
        for b, prompt in enumerate(prompts):
            ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[b, width - len(prompt) :] = 1
        with torch.inference_mode():
            seqs = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention.to(self.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=list(self.eos_token_ids) or None,
                logits_processor=LogitsProcessorList([processor]),
            )
        return [[int(x) for x in row] for row in seqs[:, width:].tolist()]

    def _decode(self, row: _Row) -> tuple[int, ...]:
        """One row decoded alone: the reference every batched row equals (see :meth:`generate_batch`).

        Returns:
            The new token ids (EOS / end-of-turn included when produced).
        """
        prompt, n_new, temperature, top_p, seed = row
        processor = _MarginRecorder() if temperature == 0 else _SeededSampler(temperature, top_p, [seed], device=self.device)
        tokens = self._generate([prompt], n_new, processor)[0]
        eos = set(self.eos_token_ids)
        n = next((k + 1 for k, x in enumerate(tokens) if x in eos), len(tokens))
        return tuple(tokens[:n])

    def _count_decodes(self, decodes: Sequence[tuple[int, int]]) -> None:
        """Add ``(prompt length, new tokens)`` decodes to the statistics."""
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            decodes=s.decodes + len(decodes),
            generated_tokens=s.generated_tokens + sum(n for _, n in decodes),
            generation_tokens_computed=s.generation_tokens_computed + sum(_decode_positions(*d) for d in decodes),
        )


_Row = tuple[tuple[int, ...], int, float, float, int]
"""One decode: ``(prompt_ids, max_new_tokens, temperature, top_p, seed)`` (greedy: temperature 0, seed 0)."""


def _row_key(request: GenerateRequest, seed: int) -> _Row:
    if request.greedy:
        return (request.prompt_ids, request.max_new_tokens, 0.0, 1.0, 0)
    return (request.prompt_ids, request.max_new_tokens, float(request.temperature), float(request.top_p), int(seed))


def _stack_steps(steps: Sequence[Any]) -> Any:
    """Per-step ``[B]`` tensors as one ``[B, T]`` float32 CPU tensor."""
    import torch

    return torch.stack(list(steps), dim=1).float().cpu()


class _MarginRecorder:
    """A logits processor that records each row's top-2 margin of the final scores, unchanged.

    transformers appends user processors after the generation config's own, so the recorded
    margins are those of the scores greedy decoding takes its argmax over.
    """

    def __init__(self) -> None:
        self.closeness: list[Any] = []  # per step: [B] float32 top-2 margins (logits)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        top2 = scores.float().topk(2, dim=-1).values  # [B, 2]
        self.closeness.append(top2[:, 0] - top2[:, 1])
        return scores


class _SeededSampler:
    """A logits processor that samples each row's next token with the row's own generator.

    Per step and row: ``p = softmax(top_p_filter(scores / temperature))`` (transformers'
    ``TopPLogitsWarper``, float32), ``u`` uniform in [0, 1) from the row's ``torch.Generator``
    (seeded by the row's seed; one draw per step), and the token is the first whose cumulative
    probability exceeds ``u`` (inverse-CDF sampling). It returns scores that are 0 at that token
    and -inf elsewhere, so ``generate``'s greedy argmax takes it. It records each draw's distance
    to the nearest CDF boundary (``closeness``): a draw that close could pick another token under
    a float-rounding change of the scores.
    """

    def __init__(self, temperature: float, top_p: float, seeds: Sequence[int], *, device: Any) -> None:
        import torch
        from transformers import TopPLogitsWarper

        self.temperature = float(temperature)
        self.top_p = TopPLogitsWarper(top_p=float(top_p)) if top_p < 1 else None
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
        self.device = device
        self.closeness: list[Any] = []  # per step: [B] float32 distance of u to a CDF boundary

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        warped = scores.float() / self.temperature  # [B, V]
        if self.top_p is not None:
            warped = self.top_p(input_ids, warped)
        cdf = torch.softmax(warped, dim=-1).cumsum(dim=-1)  # [B, V]
        cdf = cdf / cdf[:, -1:]  # exactly 1 at the end
        u = torch.cat([torch.rand(1, generator=g, device=self.device) for g in self.generators])  # [B]
        token = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)  # [B, 1]
        upper = cdf.gather(1, token)[:, 0]
        lower = torch.where(token[:, 0] > 0, cdf.gather(1, (token - 1).clamp_(min=0))[:, 0], torch.zeros_like(u))
        self.closeness.append(torch.minimum(u - lower, upper - u))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, token, 0.0)


def _decode_positions(prompt_len: int, n_new: int) -> int:
    """Token positions one KV-cached decode runs: the prompt, then each new token but the last
    (which is only sampled, never fed back)."""
    return prompt_len + max(n_new - 1, 0)


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids every decode stops at: the model's generation-config ``eos_token_id`` (an int or a
    list), then the tokenizer's EOS (the chat template's end-of-turn) when it is not among them."""
    out: list[int] = []
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    for x in [eos] if isinstance(eos, int) else list(eos or ()):
        if int(x) not in out:
            out.append(int(x))
    tok = getattr(tokenizer, "eos_token_id", None)
    if tok is not None and int(tok) not in out:
        out.append(int(tok))
    return tuple(out)


def _fork(cache: Any) -> Any:
    """A ``DynamicCache`` that shares ``cache``'s key/value tensors but not its layer objects.

    transformers' dynamic layers never write into their tensors: ``update``, ``crop`` and
    ``batch_repeat_interleave`` assign new ones (``torch.cat``, a slice, a repeat), so a fork can be
    extended, cropped or repeated without touching the cached entry, and costs no copy (a deep copy
    of a 2,500-token entry is 115 MB on SmolLM2-135M). Any other layer kind is deep-copied.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers):
        return copy.deepcopy(cache)
    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in layers]
    return fork


def _cache_bytes(cache: Any) -> int:
    """Bytes of the key/value tensors held by a ``DynamicCache``."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
