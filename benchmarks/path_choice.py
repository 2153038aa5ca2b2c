"""The transformers backend's path per batch: prefix sharing vs a plain batched forward vs ``auto``
(the cost model of ``coalescence.backends.cost`` choosing per prefix group), side by side.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/path_choice.py [--unit document] [--coalitions 32]
        [--batch-size 8] [--plans half,loo] [--repeats 1]

Game: ``benchmarks/data/rag12_stdlib.json`` (12 Python standard-library docstrings, about 2,500
tokens), drop policy, teacher-forced log p of the answer, through the full Engine (scheduler,
collator with length buckets, backend), SmolLM2-135M on the CPU. Plans:

- ``half``: ContextCite's design: ``--coalitions`` random coalitions, each player present with
  probability 1/2 (seeded), so the rows of a batch share little beyond the template header;
- ``loo``: leave-one-out (the full context and each player left out): rows share long prefixes.

Variants, each on a fresh engine with an empty prefix cache (interleaved over ``--repeats``, the
best wall time kept): ``plain`` (``path="plain"``), ``shared`` (``path="shared"``, what the
backend did before the cost model), ``auto`` (the default). The calibration ``auto`` needs runs
once before them (its time printed), so it is not in ``auto``'s wall time. Columns: wall seconds,
positions run through the model (``tokens_computed`` plus padded positions), padded positions,
speed vs plain (plain's wall / the variant's), the largest |utility difference| vs plain (nats),
and for ``auto`` the prefix groups it scored on each path.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio
import numpy as np
import torch

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import LeaveOneOut

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("plain", "shared", "auto")


def run(backend, snap, policy, masks, batch_size: int) -> dict:
    before = backend.statistics()
    backend.prefix_cache.clear()
    engine = Engine(backend, batch_size=batch_size)
    t0 = time.perf_counter()
    got, utilities = anyio.run(engine.evaluate, snap, policy, masks)
    wall = time.perf_counter() - t0
    after = backend.statistics()
    assert np.array_equal(got, masks)
    return {
        "wall": wall,
        "utilities": np.asarray(utilities, dtype=np.float64),
        "run": (after.tokens_computed - before.tokens_computed) + (after.padded_positions - before.padded_positions),
        "padded": after.padded_positions - before.padded_positions,
        "shared": after.groups_shared - before.groups_shared,
        "plain": after.groups_plain - before.groups_plain,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="benchmarks/data/rag12_stdlib.json", help="the conversation (relative to the repository)")
    ap.add_argument("--unit", default="document", help="document or sentence")
    ap.add_argument("--coalitions", type=int, default=32, help="random keep-half coalitions")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--plans", default="half,loo")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    backend = load_backend(args.model, max_batch_size=args.batch_size)
    policy = get_policy("drop")
    engine = Engine(backend)
    snap = engine.prepare(load_conversation(ROOT / args.data), unit=args.unit)
    t0 = time.perf_counter()
    rates = backend.calibrate(force=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; calibration {time.perf_counter() - t0:.2f} s: "
          f"causal {[f'{r / 1e9:.1f}' for _, r in rates.causal]} GFLOP/s, tree {[f'{r / 1e9:.1f}' for _, r in rates.tree]} GFLOP/s")
    rng = np.random.default_rng(0)
    plans = {
        "half": ("random keep-half (p = 1/2)", rng.random((args.coalitions, snap.n_players)) < 0.5),
        "loo": ("leave-one-out", np.array(list(LeaveOneOut().plan(snap.n_players)), dtype=bool)),
    }
    for name in args.plans.split(","):
        title, masks = plans[name]
        _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
        masks = masks[np.sort(first)]
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                backend.path = variant
                r = run(backend, snap, policy, masks, args.batch_size)
                if variant not in best or r["wall"] < best[variant]["wall"]:
                    best[variant] = r
        print(f"\n## {Path(args.data).stem} by {args.unit}: {snap.n_players} players, {title}, {len(masks)} coalitions, "
              f"batches of {args.batch_size}")
        print(f"{'path':<8} {'wall s':>7} {'positions run':>13} {'padded':>7} {'speed vs plain':>14} "
              f"{'max|du| vs plain':>16} {'groups shared/plain':>19}")
        ref = best["plain"]
        for variant in VARIANTS:
            r = best[variant]
            du = float(np.abs(r["utilities"] - ref["utilities"]).max())
            print(f"{variant:<8} {r['wall']:>7.2f} {r['run']:>13} {r['padded']:>7} {ref['wall'] / r['wall']:>14.2f} "
                  f"{du:>16.2e} {r['shared']:>9}/{r['plain']}")


if __name__ == "__main__":
    main()
