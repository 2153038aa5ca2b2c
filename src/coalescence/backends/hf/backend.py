"""The transformers backend's face: construction and its checks, and the dispatch of each call
(the long-row refusal, the error mapping and the statistics) to the scoring paths and generation
of :mod:`coalescence.backends.hf` (the package's docs describe them)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ..attention import install
from ..base import DEFAULT_BATCH_SIZE, BackendBase, ProxyScoreRequest, ScoreRequest, ScoreResult, check_dtype
from ..cost import PATHS, PathRates, model_shape
from ..prefix import PrefixCache
from .generation import Generation, _eos_token_ids
from .paths import PathChoice
from .plain import PlainScoring
from .proxy import ProxyScoring, proxy_capability
from .tree import TreeScoring

__all__ = ("HFBackend",)


class HFBackend(ProxyScoring, PathChoice, TreeScoring, PlainScoring, Generation, BackendBase):
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
        supports_proxy: whether the model plays the compacted proxy game (:meth:`score_proxy`):
            True only for the architectures whose compacted proxy rows are tested against the
            exact game (:data:`.proxy.PROXY_ARCHITECTURES`: gemma, granite, llama, mistral, olmo,
            olmo2, phi3, qwen2, qwen3) with a full-width RoPE of fixed frequencies in every layer
            and no sliding window. Refused, before any model call: a partial rotary factor
            (StableLM, Phi, GPT-NeoX), layers without RoPE (SmolLM3's NoPE layers), interleaved
            RoPE (Cohere, GLM), a RoPE type whose frequencies change with the length (dynamic,
            longrope), sliding-window attention (Mistral v0.1, Gemma 2 and 3), and every other
            architecture (:func:`.proxy.proxy_capability`): on those a compacted row would be
            silently wrong or fail mid-run.
        proxy_refusal_reason: why ``supports_proxy`` is False, as a sentence fragment (e.g.
            ``"stablelm has a partial rotary embedding (partial_rotary_factor 0.25: ...)"``), the
            engine's note quotes it; None when the proxy game is played.
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
        # the proxy game: a tested architecture's full-width RoPE, full causal attention (its block
        # mask does not model a sliding window); refused before any model call, with the reason
        self._rope, self.proxy_refusal_reason = proxy_capability(model, self.sliding_window)
        self.supports_proxy = self.proxy_refusal_reason is None
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
        """The torch dtype for a name of :data:`~coalescence.backends.base.DTYPES`.

        Raises:
            ConfigError: another name (field ``--dtype``).
        """
        import torch

        return getattr(torch, check_dtype(name))

    def identity(self) -> dict[str, str]:
        """``{"backend": "hf"}``."""
        return {"backend": "hf"}

    def _score_calls(self, requests: Sequence[ScoreRequest]) -> list[Sequence[ScoreRequest]]:
        """``ceil(len(requests) / max_batch_size)`` batches, each one model call of the envelope."""
        return [requests[start : start + self.max_batch_size] for start in range(0, len(requests), self.max_batch_size)]

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of one batch's targets, in nats (:meth:`score`, the
        envelope of :class:`~coalescence.backends.base.BackendBase`, refuses, maps errors and counts).

        Each prefix group of the batch goes on the sharing path or the plain path (``path``;
        ``"auto"`` chooses by estimated time, see :meth:`_choose` and
        :mod:`coalescence.backends.cost`, the first choice calibrating the rates). The sharing
        path first runs (or resumes from the prefix cache) the longest token prefix common to all
        the group's rows, then their suffixes on top of that state; on a model with sliding-window
        attention only while every row of the batch is shorter than the window (else plain). The
        plain path runs the rows right-padded in one forward. :meth:`statistics` counts the
        groups of each path (``groups_shared``, ``groups_plain``) and the prefix forwards.
        """
        mode = self.path if self.prefix_sharing else "plain"
        if self.sliding_window is not None and max(r.n_tokens for r in batch) >= self.sliding_window:
            mode = "plain"
        if mode == "plain":
            out = self._score_plain(batch)
            self._last_paths = (0, len({r.prefix_group for r in batch}))
        else:
            out = self._score_groups(batch, mode)
        self._note(
            prefix_forwards=self._last_prefix_forwards, groups_shared=self._last_paths[0], groups_plain=self._last_paths[1]
        )
        return out

    def _no_proxy_game(self) -> str:
        return (
            f"the proxy game is not available for {self.model_id}: {self.proxy_refusal_reason}; run the exact "
            "game only (--proxy-game none)"
        )

    def _proxy_calls(self, requests: Sequence[ProxyScoreRequest]) -> list[list[int]]:
        """The requests grouped by their shared KV, ``prompt_ids[:s]`` with ``s = min(tail_start,
        len(prompt_ids) - 1)`` (every scored position is run in the row), by index."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(_shared_kv(r), []).append(i)
        return list(groups.values())

    def _score_proxy_batch(self, rows: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """Rows of the shared-KV proxy game that share their KV (issue 37; semantics in
        :class:`~coalescence.backends.base.ProxyScoreRequest`; one group of :meth:`_proxy_calls`), in nats.

        The shared KV is resumed from the prefix cache (:class:`~coalescence.backends.prefix.PrefixCache`,
        keyed by its tokens; the part not cached is run once and put there; ``s`` positions), and
        the rows' tails (``prompt_ids[s:] + target_ids[:-1]``) run on it as a batch, positions
        compacted (:mod:`.proxy`): per row, the cached keys rotated to their compacted positions
        (RoPE, by minus the hidden tokens before them: a row's own copy of the keys, the values
        shared), the tail at its compacted positions, one additive 4-D mask ``[R, 1, T, s + T]``
        with the hidden ranges masked for the queries at positions ``>= tail_start``. A forward
        takes rows of one length, as many as keep their keys and values within 1 GiB and the mask's
        ``R x T x (s + T)`` within ``tree_mask_limit`` (2**22 when 0), at least one; the model's
        attention (``sdpa``) runs it. Exact up to float rounding (fp32: 1e-4 nats). Only a model
        with ``supports_proxy`` True gets here (the others are refused by the envelope, with
        ``proxy_refusal_reason``).

        Returns:
            One :class:`ScoreResult` per row, in order: ``tokens_computed`` the row's tail
            (``n_tokens - 1 - s``: the last target token is never run), plus, on the first row of
            a group, the shared KV positions run for it; ``tokens_reused`` the shared KV positions
            read from the cache (so ``tokens_computed + tokens_reused == n_tokens - 1``).
        """
        results, ran = self._proxy_group(_shared_kv(rows[0]), rows)
        self._note(prefix_forwards=ran)
        return results


def _shared_kv(r: ProxyScoreRequest) -> tuple[int, ...]:
    """The prompt tokens of a proxy row's shared KV (before its tail, and before its last prompt token)."""
    return r.prompt_ids[: r.shared_tokens]
