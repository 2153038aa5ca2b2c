"""Prefix-sharing batched scoring vs plain batching, on the real model, side by side in one process.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/prefix_sharing.py [--batch-size 8] [--workloads exact,loo]

Workloads (drop policy, teacher-forced log p of the answer, through the full Engine: scheduler,
collator with length buckets, backend):

- ``exact``: exact Shapley over the user-turn sentence players of ``examples/eiffel.json``
  (``--roles user``: the 8 context sentences and the question, 9 players, 512 coalitions).
- ``loo``: leave-one-out over a conversation with a long fixed system prompt and 20 user
  sentence players (plus the question: 21 players, 22 coalitions).

Variants (``--repeats`` interleaved rounds, best wall time kept), each on a fresh engine (no result-store hits): (a) one coalition per forward, plain;
(b) padded batches of ``--batch-size`` without sharing; (c) the same batches with prefix sharing
(per-batch common prefix + run-level LRU prefix cache). Reports tokens computed (positions run
through the model, padding excluded, padded positions separately), the token-trie lower bound of
all scored sequences, wall time, the ratios, and the largest utility difference between variants.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

from coalescence import Conversation, Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import ExactShapley, LeaveOneOut
from coalescence.backends.prefix import trie_nodes

SYSTEM = (
    "You are a careful research assistant working for a museum's visitor information desk. "
    "Answer every question using only the facts given by the user in the context, and never add "
    "facts from memory. Keep answers short: one sentence, no lists, no headings, no markdown. "
    "If the context does not contain the answer, say that the context does not say. Use plain "
    "dates and numbers exactly as written in the context. Do not speculate about causes, do not "
    "apologise, and do not repeat the question. When several facts could answer the question, pick "
    "the one that answers it most directly. Visitors are often tourists who read on small phone "
    "screens, so brevity matters more than style. Prefer active voice and common words. If a "
    "visitor asks about opening hours, tickets or accessibility, tell them to ask at the desk, "
    "because those change often and are not part of the context you are given. "
) * 2

FACTS = [
    "The Statue of Liberty was dedicated in New York Harbor in 1886.",
    "Big Ben's clock tower in London was finished in 1859.",
    "The Colosseum in Rome was opened in the year 80.",
    "The Sydney Opera House opened in 1973.",
    "The Leaning Tower of Pisa took almost two hundred years to build.",
    "The Empire State Building was finished in 1931.",
    "The Golden Gate Bridge opened to traffic in 1937.",
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "The Louvre became a public museum in 1793.",
    "The Brandenburg Gate in Berlin was completed in 1791.",
    "The Sagrada Familia in Barcelona is still under construction.",
    "The Taj Mahal was completed around 1653.",
    "The CN Tower in Toronto opened in 1976.",
    "The Atomium in Brussels was built for the 1958 World's Fair.",
    "The Space Needle in Seattle was built for the 1962 World's Fair.",
    "The Burj Khalifa in Dubai opened in 2010.",
    "The Tower Bridge in London opened in 1894.",
    "The Chrysler Building was completed in 1930.",
    "The Washington Monument was completed in 1884.",
    "The Sydney Harbour Bridge opened in 1932.",
]


def workloads(which: list[str]) -> list[tuple[str, Conversation, str, object]]:
    out = []
    if "exact" in which:
        out.append(("exact, eiffel.json user sentences", load_conversation("examples/eiffel.json"), "exact", ExactShapley()))
    if "loo" in which:
        conv = Conversation.from_dict(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM.strip()},
                    {"role": "user", "content": "Context: " + " ".join(FACTS) + "\n\nQuestion: When was the Eiffel Tower completed?"},
                    {"role": "assistant", "content": "It was completed in 1889."},
                ]
            }
        )
        out.append(("loo, long system prompt + 20 sentences", conv, "loo", LeaveOneOut()))
    return out


def tree_score(model, batch) -> list[float]:
    """Tree attention: the batch's token trie as one row, a float additive 4-D ancestor mask and
    position ids equal to depth (the alternative to KV reuse, measured here, not in the library)."""
    import torch

    nodes: dict[tuple[int, ...], int] = {}
    parent: list[int] = []
    toks: list[int] = []
    depth: list[int] = []
    row_nodes = []
    for r in batch:
        seq = r.prompt_ids + r.target_ids
        idx: list[int] = []
        for k in range(1, len(seq) + 1):
            i = nodes.get(seq[:k])
            if i is None:
                i = nodes[seq[:k]] = len(toks)
                parent.append(idx[-1] if idx else -1)
                toks.append(seq[k - 1])
                depth.append(k - 1)
            idx.append(i)
        row_nodes.append(idx)
    n = len(toks)
    allowed = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        if parent[i] >= 0:
            allowed[i] = allowed[parent[i]]
        allowed[i, i] = True
    mask = torch.full((n, n), torch.finfo(torch.float32).min)
    mask[allowed] = 0.0
    keep = sorted({idx[len(r.prompt_ids) - 1 + j] for r, idx in zip(batch, row_nodes) for j in range(len(r.target_ids))})
    where = {node: k for k, node in enumerate(keep)}
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([toks]), attention_mask=mask[None, None], position_ids=torch.tensor([depth]),
            use_cache=False, logits_to_keep=torch.tensor(keep),
        )
    logp = torch.log_softmax(out.logits[0].float(), -1)
    return [
        sum(logp[where[idx[len(r.prompt_ids) - 1 + j]], t].item() for j, t in enumerate(r.target_ids))
        for r, idx in zip(batch, row_nodes)
    ]


def tree_vs_kv(backend, requests, batch_size: int, repeats: int) -> None:
    """Side by side on the same batches: whole-batch tree attention (no KV reuse) vs KV reuse of
    the batch prefix (run cache on) with right-padded suffixes vs with a tree-attention suffix row."""
    from coalescence.backends.hf import HFBackend

    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    names = ("tree only", "kv + padded suffixes", "kv + tree suffixes")
    best = dict.fromkeys(names, 1e9)
    values: dict[str, list[float]] = {}
    computed: dict[str, int] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        values["tree only"] = [u for b in batches for u in tree_score(backend.model, b)]
        best["tree only"] = min(best["tree only"], time.perf_counter() - t0)
        computed["tree only"] = sum(trie_nodes(r.prompt_ids + r.target_ids for r in b) for b in batches)
        for name, limit in (("kv + padded suffixes", 0), ("kv + tree suffixes", 2**22)):
            kv = HFBackend(backend.model, backend.tokenizer, model_id="x", max_batch_size=batch_size,
                           tree_mask_limit=limit)
            t0 = time.perf_counter()
            values[name] = [r.utility for r in kv.score(requests)]
            best[name] = min(best[name], time.perf_counter() - t0)
            computed[name] = kv.statistics().tokens_computed + kv.statistics().padded_positions
    ref = np.array(values["kv + tree suffixes"])
    print(f"{len(requests)} rows, {len(batches)} batches of {batch_size} (best of {repeats}), "
          f"trie lower bound {trie_nodes(r.prompt_ids + r.target_ids for r in requests)}:")
    for name in names:
        print(f"  {name:<22} {best[name]:7.1f} s   positions run (padding incl.) {computed[name]:>6}   "
              f"max|du| vs kv+tree {np.abs(np.array(values[name]) - ref).max():.2e}")


def run_variant(backend, snap, policy, masks, batch_size: int):
    before = backend.statistics()
    engine = Engine(backend, batch_size=batch_size)
    t0 = time.perf_counter()
    got_masks, utilities = anyio.run(engine.evaluate, snap, policy, masks)
    wall = time.perf_counter() - t0
    after = backend.statistics()
    assert np.array_equal(got_masks, masks)
    return {
        "wall": wall,
        "utilities": utilities,
        "computed": after.tokens_computed - before.tokens_computed,
        "reused": after.tokens_reused - before.tokens_reused,
        "padded": after.padded_positions - before.padded_positions,
        "tokens": after.tokens - before.tokens,
        "kv_hits": engine.statistics().kv_cache_hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workloads", default="exact,loo")
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the best wall time is kept")
    ap.add_argument("--tree-batches", type=int, default=0,
                    help="instead of (a)/(b)/(c): tree attention vs KV reuse on the first N batches")
    args = ap.parse_args()
    backend = load_backend(args.model)
    backend.prefix_cache.max_bytes = args.cache_mib * 2**20
    policy = get_policy("drop")
    for title, conv, method, estimator in workloads(args.workloads.split(",")):
        engine = Engine(backend)
        snap = engine.prepare(conv, unit="sentence", roles=["user"])
        masks = np.array(list(estimator.plan(snap.n_players)), dtype=bool)
        _, idx = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
        masks = masks[np.sort(idx)]
        target = engine.target_tokens(snap).ids
        seqs = [tuple(engine.renderer.coalition_prompt(snap, policy, m)) + tuple(target) for m in masks]
        bound = trie_nodes(seqs)
        total = sum(len(s) for s in seqs)
        if args.tree_batches:
            from coalescence.backends.base import ScoreRequest
            from coalescence.scheduler.buckets import share_order

            ordered = masks[share_order(masks)][: args.tree_batches * args.batch_size]
            reqs = [ScoreRequest(prompt_ids=tuple(engine.renderer.coalition_prompt(snap, policy, m)), target_ids=target)
                    for m in ordered]
            print(f"\n## {title}")
            tree_vs_kv(backend, reqs, args.batch_size, args.repeats)
            continue
        results: dict[str, dict] = {}
        variants = [("a", 1, False), ("b", args.batch_size, False), ("c", args.batch_size, True)]
        for _ in range(args.repeats):
            for name, bs, share in variants:
                backend.max_batch_size = bs
                backend.prefix_sharing = share
                backend.prefix_cache.clear()
                r = run_variant(backend, snap, policy, masks, bs)
                if name not in results or r["wall"] < results[name]["wall"]:
                    results[name] = r
        print(f"\n## {title}: {snap.n_players} players, {len(masks)} coalitions ({method}), "
              f"{total} tokens in all, trie lower bound {bound} ({total / bound:.2f}x)")
        print(f"{'variant':<34} {'wall s':>7} {'computed':>9} {'vs bound':>8} {'padded':>7} {'reused':>7} "
              f"{'speed vs a':>10} {'speed vs b':>10} {'max|du| vs a':>12}")
        labels = {"a": "(a) one coalition per forward", "b": f"(b) batches of {args.batch_size}, no sharing",
                  "c": f"(c) batches of {args.batch_size}, prefix sharing"}
        for name in "abc":
            r = results[name]
            diff = float(np.abs(r["utilities"] - results["a"]["utilities"]).max())
            print(f"{labels[name]:<34} {r['wall']:>7.1f} {r['computed']:>9} {r['computed'] / bound:>8.2f} "
                  f"{r['padded']:>7} {r['reused']:>7} {results['a']['wall'] / r['wall']:>10.2f} "
                  f"{results['b']['wall'] / r['wall']:>10.2f} {diff:>12.2e}")
        print(f"engine kv_cache_hits in (c): {results['c']['kv_hits']}; prefix cache: "
              f"{backend.prefix_cache.statistics()}")


if __name__ == "__main__":
    main()
