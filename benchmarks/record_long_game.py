"""Record a long-context game once: a pool of coalitions scored by SmolLM2-135M-Instruct, and ContextCite's own run.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/record_long_game.py \\
        --game long_unicode [--budgets 32,64,128,256] [--seeds 0] [--backend hf|vllm] [--contextcite 256]

For a game ``benchmarks/data/<game>.json`` (sentence players of one context span, built by
``benchmarks/build_long_games.py``) it scores, through coalescence's engine, every coalition the
long-context benchmark (``benchmarks/long_context.py``) asks for:

- the plans of ``lasso``/``banzhaf`` (one uniform plan serves both), ``kernelshap``/``regression-msr``
  (one plan serves both) at each budget and seed, and ``loo``;
- the held-out coalitions of the benchmark's linear datamodeling score (LDS): :data:`HELD_OUT`
  coalitions keeping each player with probability 1/2, drawn by ``default_rng(HELD_OUT_SEED)``,
  independent of every method's sampler;

into ``benchmarks/data/<game>_pool.parquet`` (packed mask, n_bits, utility in nats, model seconds
per coalition: the wall time of its chunk over its coalitions), appending chunk by chunk: the same
command again scores only what is missing (a killed recording resumes). With ``--contextcite B``
it also runs ContextCite 0.0.4 itself (the ``contextcite`` extra: ``make contextcite``) with B
ablations on the same model, prompt and answer and its default solver, and keeps its masks, its
per-ablation outputs (logit-probability of the answer, its utility) and its wall time in
``benchmarks/data/<game>_contextcite.parquet``: its first b rows are its run at b ablations (its
ablation i is drawn by ``RandomState(i)``), so the benchmark fits it at every budget up to B
without the model.

The top-k removal coalitions the benchmark judges explanations by depend on the explanations; the
benchmark scores them (``long_context.py --record``) into the same pool.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_games import HELD_OUT, held_out, load_game, method_plans, Pool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--game", required=True, help="a game of benchmarks/data (long_unicode, long_design, long_glossary)")
    ap.add_argument("--budgets", default="32,64,128,256")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="coalitions scored between two appends to the pool")
    ap.add_argument("--contextcite", type=int, default=0, help="also run ContextCite with this many ablations")
    ap.add_argument("--skip-pool", action="store_true", help="only the ContextCite run")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    game = load_game(args.game)
    pool = Pool.open(game)
    if not args.skip_pool:
        wanted = method_plans(game.n, budgets, seeds) + [held_out(game.n)]
        masks = np.concatenate(wanted)
        missing = pool.missing(masks)
        print(f"{game.name}: {game.n} players, {len(pool)} coalitions in the pool, {len(missing)} to score ({args.backend})")
        if len(missing):
            from long_games import Scorer

            scorer = Scorer(game, backend=args.backend, batch_size=args.batch_size)
            t0 = time.perf_counter()
            for start in range(0, len(missing), args.chunk):
                chunk = missing[start : start + args.chunk]
                pool.add(*scorer.score(chunk))
                done = start + len(chunk)
                rate = done / (time.perf_counter() - t0)
                print(f"  {done}/{len(missing)} scored, {rate:.2f} coalitions/s, pool {len(pool)}", flush=True)
            scorer.close()
    if args.contextcite:
        from long_games import run_contextcite

        table = run_contextcite(game, args.contextcite)
        print(f"{game.name}: ContextCite, {args.contextcite} ablations, {table.schema.metadata[b'wall_seconds'].decode()} s")


if __name__ == "__main__":
    main()
