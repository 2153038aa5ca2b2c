"""How close a run comes to the compute limit of one machine (issue 16, part 1), and the batch-size
sweep behind the default ``--batch-size``.

For each game: the wall time of a fixed plan through the full Engine (scheduler, collator with
length buckets, prefix-sharing backend; a fresh engine and an empty prefix cache per run), the
token positions the model ran, the token-trie lower bound of every scored sequence (each distinct
prefix once: no scorer can run fewer), the forward rate of one long pass (tokens/s of a single
causal forward over one sequence of the game's own text: its full coalition's rendering, repeated
to at least ``--long-pass`` tokens), and the ratio

    limit ratio = wall / (trie nodes / long-pass rate)

which is 1.0 for a scorer that runs exactly the trie's nodes as fast as one long forward. The
ratio is paired: the long pass runs just before and just after each run and the run's ratio uses
the mean of those two rates (on a shared host one long pass moves by +-17% between minutes, more
than the effects measured); the table gives the median over ``--repeats`` of the walls, of the
rates and of the paired ratios (and the ratios' range). The FLOP-aware ratio divides that by the
FLOPs of the trie's nodes over those of as many long-pass positions (a node attends to every key
before it, which the token count does not charge). Where the time went: model forward (the ``model(...)`` calls, masks excluded), the backend outside the
forward (trie building, additive masks, cache bookkeeping, log-softmax), and everything else
(planning, rendering, tokenisation, scheduler, collator, store).

Games:
- ``demo``: ``examples/eiffel.json``, ``--unit sentence``, exact Shapley (1,024 coalitions).
- ``rag12``: ``benchmarks/data/rag12_stdlib.json``, 12 real documents (Python standard-library
  module docstrings, PSF licence; about 2,500 tokens), ``--unit document``, KernelSHAP with a
  fixed budget (``--rag-budget``, default 32).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/compute_limit.py [--games demo,rag12] [--batch-sizes 4,8,16,32]
        [--tree-mask-limits 4194304,1048576]

``--tree-mask-limits``: the backend's ``tree_mask_limit`` (the largest dense tree-attention mask,
in elements, before a batch is split in halves), swept with the batch sizes; ``--prefix-cache-mib``:
the run-level prefix cache's bound (``prefix_cache_bytes``, MiB); ``--split-attention on,off``:
prefix-split attention (``coalescence.backends.attention``) on or off; ``--single-row one,two``: a
batch of one row (long rows' batches are split in halves down to single rows) runs in one forward
on its cached prefix (the backend's path) or, as before, as a prefix forward plus a tree of its
last prompt token and target. Every combination runs in the same process, interleaved over
``--repeats``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import torch

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import make_estimator
from coalescence.backends.hf import HFBackend
from coalescence.backends.prefix import trie_nodes

ROOT = Path(__file__).resolve().parent.parent


def games(names: list[str], rag_budget: int) -> list[tuple[str, str, str, str, int | None]]:
    table = {
        "demo": ("demo", "examples/eiffel.json", "sentence", "exact", None),
        "rag12": ("rag12", "benchmarks/data/rag12_stdlib.json", "document", "kernelshap", rag_budget),
    }
    return [table[n] for n in names]


class ForwardClock:
    """Accumulates the wall time of the model's forward calls (wraps ``model.forward``)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        self.calls = 0
        inner = model.forward

        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        model.forward = forward


class BackendClock:
    """Accumulates the wall time of the backend's ``score`` calls."""

    def __init__(self, backend) -> None:
        self.seconds = 0.0
        inner = backend.score

        def score(requests):
            t0 = time.perf_counter()
            try:
                return inner(requests)
            finally:
                self.seconds += time.perf_counter() - t0

        backend.score = score


def forward_flops(model, key_counts: Sequence[int]) -> float:
    """Floating-point operations of computing one position per entry of ``key_counts`` (the keys it
    attends to, itself included): 2 per weight outside the embeddings, plus 4 per query-key pair
    per layer and attention channel (the scores and the weighted sum of values); the LM head of
    the scored positions is left out (benchmarks/RESULTS.md: +0.6% of the trie's FLOPs on rag12,
    +9.6% on the demo)."""
    c = model.config
    channels = c.num_attention_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    linear = 2 * model.num_parameters(exclude_embeddings=True)
    return float(linear * len(key_counts) + 4 * c.num_hidden_layers * channels * sum(key_counts))


def trie_key_counts(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Per node of the token trie of ``seqs`` the keys its position attends to (its depth + 1)."""
    root: dict = {}
    counts = []
    for seq in seqs:
        node = root
        for depth, tok in enumerate(seq):
            if tok not in node:
                node[tok] = {}
                counts.append(depth + 1)
            node = node[tok]
    return counts


def long_pass_rate(backend, ids: list[int], at_least: int, repeats: int = 3) -> tuple[int, float]:
    seq = list(ids)
    while len(seq) < at_least:
        seq += ids
    x = torch.tensor([seq])
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            backend.model(input_ids=x, use_cache=False, logits_to_keep=1)
            best = min(best, time.perf_counter() - t0)
    return len(seq), len(seq) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", default="demo,rag12")
    ap.add_argument("--batch-sizes", default="4,8,16,32")
    ap.add_argument("--rag-budget", type=int, default=32)
    ap.add_argument("--long-pass", type=int, default=1024, help="tokens of the long pass, at least")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats; medians are reported")
    ap.add_argument("--tree-mask-limits", default="", help="tree_mask_limit values to sweep (default: the backend's)")
    ap.add_argument("--prefix-cache-mib", default="", help="prefix_cache_bytes values to sweep, MiB (default: the backend's)")
    ap.add_argument("--split-attention", default="", help="on, off or on,off (default: the backend's)")
    ap.add_argument("--single-row", default="one", help="one, two or one,two: forwards for a batch of one row")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    backend = load_backend("smollm2-135m", max_batch_size=max(sizes))
    can_split = backend.split_attention
    limits = [int(x) for x in args.tree_mask_limits.split(",") if x] or [backend.tree_mask_limit]
    caches = [int(x) * 2**20 for x in args.prefix_cache_mib.split(",") if x] or [backend.prefix_cache.max_bytes]
    splits = [{"on": True, "off": False}[x] for x in args.split_attention.split(",") if x] or [can_split]
    singles = args.single_row.split(",")
    configs = [(bs, tml, pcb, sa, one) for bs in sizes for tml in limits for pcb in caches for sa in splits for one in singles]
    one_forward = backend._score_row

    def two_forwards(request):  # the path before: the row's prompt as a prefix, then a tree of its tail
        return HFBackend._score_prefix_then_suffixes(backend, [request])

    forward = ForwardClock(backend.model)
    scoring = BackendClock(backend)
    policy = get_policy("drop")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, path, unit, method, budget in games(args.games.split(","), args.rag_budget):
        engine = Engine(backend)
        snap = engine.prepare(load_conversation(ROOT / path), unit=unit)
        estimator = make_estimator(method, budget=budget, seed=0)
        masks = np.array(list(estimator.plan(snap.n_players)), dtype=bool)
        _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
        masks = masks[np.sort(first)]
        target = engine.target_tokens(snap, policy)
        renderer = engine.renderer
        seqs = [  # each coalition's scored sequence, as the scoring pipeline builds it
            tuple(renderer.encode(renderer.scoring_prompt(policy.render(snap, m), target))) + tuple(target.ids) for m in masks
        ]
        bound = trie_nodes(seqs)
        full = max(seqs, key=len)
        long_len, _ = long_pass_rate(backend, list(full), args.long_pass)  # warm-up
        nodes = trie_key_counts(seqs)
        assert len(nodes) == bound
        # FLOPs of the trie's nodes against as many positions of the long pass: a node deep in a
        # long prompt attends to more keys than the long pass's average position
        depth_cost = forward_flops(backend.model, nodes) / (
            forward_flops(backend.model, range(1, long_len + 1)) * bound / long_len
        )
        rows: dict[tuple, list[dict]] = {config: [] for config in configs}
        for _ in range(args.repeats):
            for config in configs:
                bs, tml, pcb, sa, one = config
                backend._score_row = one_forward if one == "one" else two_forwards
                backend.max_batch_size = bs
                backend.tree_mask_limit = tml
                backend.prefix_cache.clear()
                backend.prefix_cache.max_bytes = pcb
                backend.split_attention = sa and can_split
                rate = long_pass_rate(backend, list(full), args.long_pass, repeats=1)[1]
                before = backend.statistics()
                f0, s0 = forward.seconds, scoring.seconds
                t0 = time.perf_counter()
                got, utilities = anyio.run(Engine(backend, batch_size=bs).evaluate, snap, policy, masks)
                wall = time.perf_counter() - t0
                after = backend.statistics()
                r = {
                    "wall": wall,
                    "computed": after.tokens_computed - before.tokens_computed + after.padded_positions - before.padded_positions,
                    "forward": forward.seconds - f0,
                    "backend": scoring.seconds - s0,
                    "utilities": utilities,
                }
                r["rate"] = (rate + long_pass_rate(backend, list(full), args.long_pass, repeats=1)[1]) / 2
                r["ratio"] = wall / (bound / r["rate"])
                rows[config].append(r)
        rates = [r["rate"] for config in configs for r in rows[config]]
        rate = float(np.median(rates))
        ideal = bound / rate
        print(
            f"\n## {name}: {snap.n_players} players, {len(masks)} coalitions ({method}"
            f"{'' if budget is None else f', budget {budget}'}), {sum(map(len, seqs)):,} tokens in all, "
            f"longest {len(full)}, trie bound {bound:,}; long pass {long_len} tokens at {rate:,.0f} tokens/s "
            f"(median of {len(rates)} pairs next to the runs, {min(rates):,.0f}-{max(rates):,.0f}), so the limit is {ideal:.1f} s; "
            f"the trie's nodes cost {depth_cost:.3f}x the FLOPs of as many long-pass positions (FLOP-aware limit {ideal * depth_cost:.1f} s)"
        )
        print("| batch | tree mask limit | prefix cache MiB | split attention | one row | wall s | computed | vs bound | tokens/s | long pass tokens/s | limit ratio (range) | FLOP-aware ratio | forward s | backend outside forward s | outside backend s | max \\|du\\| vs first |")
        print("|---:|---:|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ref = rows[configs[0]][0]["utilities"]
        for config in configs:
            bs, tml, pcb, sa, one = config
            runs = rows[config]
            med = {k: float(np.median([r[k] for r in runs])) for k in ("wall", "rate", "ratio", "forward", "backend")}
            computed = runs[0]["computed"]
            ratios = [r["ratio"] for r in runs]
            du = max(float(np.abs(r["utilities"] - ref).max()) for r in runs)
            print(
                f"| {bs} | {tml:,} | {pcb // 2**20:,} | {'on' if sa and can_split else 'off'} | {one} forward{'s' if one == 'two' else ''} | {med['wall']:.1f} | {computed:,} | {computed / bound:.2f} | {computed / med['wall']:,.0f} | "
                f"{med['rate']:,.0f} | {med['ratio']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {med['ratio'] / depth_cost:.2f} | {med['forward']:.1f} | {med['backend'] - med['forward']:.1f} | {med['wall'] - med['backend']:.1f} | "
                f"{du:.1e} |"
            )


if __name__ == "__main__":
    main()
