"""How close a run comes to the compute limit of one machine (issue 16, part 1), and the batch-size
sweep behind the default ``--batch-size``.

For each game: the wall time of a fixed plan through the full Engine (scheduler, collator with
length buckets, prefix-sharing backend; a fresh engine and an empty prefix cache per run), the
token positions the model ran, the token-trie lower bound of every scored sequence (each distinct
prefix once: no scorer can run fewer), the forward rate of one long pass (tokens/s of a single
causal forward over one sequence of the game's own text: its full coalition's rendering, repeated
to at least ``--long-pass`` tokens), and the ratio

    limit ratio = wall / (trie nodes / long-pass rate)

which is 1.0 for a scorer that runs exactly the trie's nodes as fast as one long forward. Where
the time went: model forward (the ``model(...)`` calls, masks excluded), the backend outside the
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
prefix-split attention (``coalescence.backends.attention``) on or off. Every combination runs in
the same process, interleaved over ``--repeats``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio
import numpy as np
import torch

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import make_estimator
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
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the best wall time is kept")
    ap.add_argument("--tree-mask-limits", default="", help="tree_mask_limit values to sweep (default: the backend's)")
    ap.add_argument("--prefix-cache-mib", default="", help="prefix_cache_bytes values to sweep, MiB (default: the backend's)")
    ap.add_argument("--split-attention", default="", help="on, off or on,off (default: the backend's)")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    backend = load_backend("smollm2-135m", max_batch_size=max(sizes))
    can_split = backend.split_attention
    limits = [int(x) for x in args.tree_mask_limits.split(",") if x] or [backend.tree_mask_limit]
    caches = [int(x) * 2**20 for x in args.prefix_cache_mib.split(",") if x] or [backend.prefix_cache.max_bytes]
    splits = [{"on": True, "off": False}[x] for x in args.split_attention.split(",") if x] or [can_split]
    configs = [(bs, tml, pcb, sa) for bs in sizes for tml in limits for pcb in caches for sa in splits]
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
        long_len, rate = long_pass_rate(backend, list(full), args.long_pass)
        rows: dict[tuple[int, int], dict] = {}
        for _ in range(args.repeats):
            for config in configs:
                bs, tml, pcb, sa = config
                backend.max_batch_size = bs
                backend.tree_mask_limit = tml
                backend.prefix_cache.clear()
                backend.prefix_cache.max_bytes = pcb
                backend.split_attention = sa and can_split
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
                if config not in rows or wall < rows[config]["wall"]:
                    rows[config] = r
        ideal = bound / rate
        print(
            f"\n## {name}: {snap.n_players} players, {len(masks)} coalitions ({method}"
            f"{'' if budget is None else f', budget {budget}'}), {sum(map(len, seqs)):,} tokens in all, "
            f"longest {len(full)}, trie bound {bound:,}; long pass {long_len} tokens at {rate:,.0f} tokens/s, "
            f"so the limit is {ideal:.1f} s"
        )
        print("| batch | tree mask limit | prefix cache MiB | split attention | wall s | computed | vs bound | tokens/s | limit ratio | forward s | backend outside forward s | outside backend s | max \\|du\\| vs first |")
        print("|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ref = rows[configs[0]]["utilities"]
        for config in configs:
            bs, tml, pcb, sa = config
            r = rows[config]
            print(
                f"| {bs} | {tml:,} | {pcb // 2**20:,} | {'on' if sa and can_split else 'off'} | {r['wall']:.1f} | {r['computed']:,} | {r['computed'] / bound:.2f} | {r['computed'] / r['wall']:,.0f} | "
                f"{r['wall'] / ideal:.2f} | {r['forward']:.1f} | {r['backend'] - r['forward']:.1f} | {r['wall'] - r['backend']:.1f} | "
                f"{float(np.abs(r['utilities'] - ref).max()):.1e} |"
            )


if __name__ == "__main__":
    main()
