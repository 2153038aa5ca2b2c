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

from .backend import HFBackend
from .caches import fork_cache as _fork  # the name tests/backends/test_prefix.py imports

__all__ = ("HFBackend",)
