"""Proxy plans with a near-full share, replayed on real runs' plans (issue 37): LDS and drop@3 of the
two-fidelity surrogate at 8 exact coalitions (``--budget``).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_plan_mix.py long_design 0.5:0,0.8:0.25,0.8:0.5,0.9:0.25 10

For each seed d from ``--first-seed`` (0) on, DRAWS of them: ``ControlVariateLasso(budget=B, seed=d,
near_full_share=0)``'s exact plan (B = ``--budget``, 8 by default; utilities from the game's pool,
missing ones scored with the model and added) and its keep-half proxy plan (268-292 rows on the
long games, 4 per player). Each ``p:share`` variant replaces the plan's last ``share``
with coalitions that keep each player with probability p (``default_rng([d, 100 p])``), scores the
proxy game on them (``Scorer.score_proxy``), fits ``phi(c)`` by the LASSO (``LassoSurrogate._fit_surrogate``,
seed d) and the ridge correction on the B exact rows as the estimator does, and judges ``b phi(c) + w``:
the LDS over the game's 32 held-out coalitions and drop@3 (``proxy_race.py``'s definitions; removal
coalitions missing from the pool scored and added). ``0.5:0`` is the keep-half plan (the estimator
before its near-full share: these are the real runs' values to ~1e-3 in LDS). An ``est:p:share``
variant is the estimator itself, ``ControlVariateLasso(budget=B, seed=d, near_full_share=share)``
with ``NEAR_FULL_KEEP = p``: its own plan and ``fit_two_fidelity``, as a real run at seed d
(``est:0.8:0.5`` is the default). ``--contextcite`` adds ContextCite@64's row (``proxy_race.py``'s
draws of its recorded ablations, seeds ``1000 + d``; needs the ``contextcite`` extra). Printed, a
row per variant (``tool``: ``contextcite@64``, ``surrogate`` for ``p:share``, ``surrogate
(estimator's plan)`` for ``est:p:share``; p and share as given): the median (IQR) of the LDS and
drop@3 over the draws, and each draw's drop@3.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from coalescence.attribution.estimators.lasso import LassoSurrogate
    from coalescence.attribution.estimators.proxy import lasso as proxy_lasso
    from coalescence.attribution.estimators.proxy.lasso import ControlVariateLasso, fit_ridge_with_covariate, ridge_penalties
    from long_games import Pool, Scorer, held_out, load_game, pack
    from proxy_race import cc_recorded_values, top_removed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("game")
    ap.add_argument("variants", help="comma-separated p:share (a replaced tail; 0.5:0 the keep-half plan) or est:p:share (the estimator's own plan)")
    ap.add_argument("draws", type=int)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=8, help="exact coalitions (8: the two-fidelity floor)")
    ap.add_argument("--contextcite", action="store_true", help="add ContextCite@64 on the same draws (the contextcite extra)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    name, draws = args.game, args.draws
    variants = [x.split(":") for x in args.variants.split(",")]
    game = load_game(name)
    n = game.n
    pool = Pool.open(game)
    held = held_out(n)
    held_u = pool.lookup(held)[0]
    scorer = Scorer(game)
    cache: dict[bytes, float] = {}

    def proxy(rows: np.ndarray) -> np.ndarray:
        keys = pack(rows)
        todo = [i for i, k in enumerate(keys) if k not in cache]
        if todo:
            for i, v in zip(todo, scorer.score_proxy(rows[todo]), strict=True):
                cache[keys[i]] = v
        return np.array([cache[k] for k in keys])

    results: dict[tuple[str, ...], list[np.ndarray]] = {}
    for d in range(args.first_seed, args.first_seed + draws):
        if args.contextcite:
            results.setdefault(("contextcite@64",), []).append(cc_recorded_values(game, 64, d))
        estimator = ControlVariateLasso(budget=args.budget, seed=d, near_full_share=0.0)
        exact = np.array(list(estimator.plan(n)))
        plan = np.array(list(estimator.proxy_plan(n)))
        missing = pool.missing(exact)
        if len(missing):
            pool.add(*scorer.score(missing))
        u = pool.lookup(exact)[0]
        c_exact = proxy(exact)
        for variant in variants:
            if variant[0] == "est":
                proxy_lasso.NEAR_FULL_KEEP = float(variant[1])
                own = ControlVariateLasso(budget=args.budget, seed=d, near_full_share=float(variant[2]))
                rows = np.array(list(own.proxy_plan(n)))
                estimate = own.fit_two_fidelity(exact, u, np.concatenate([rows, exact]), np.concatenate([proxy(rows), c_exact]))
                results.setdefault(tuple(variant), []).append(np.asarray(estimate.values))
                continue
            p, share = float(variant[0]), float(variant[1])
            near = int(round(len(plan) * share))
            rows = plan.copy()
            if near:
                rows = np.concatenate([plan[: len(plan) - near], np.random.default_rng([d, int(p * 100)]).random((near, n)) < p])
            c = proxy(rows)
            phi_c = LassoSurrogate(budget=len(rows), seed=d, holdout=0.0)._fit_surrogate(rows, c)[0]
            w, _, b = fit_ridge_with_covariate(exact.astype(float), u, c_exact, ridge_penalties(phi_c))
            results.setdefault(tuple(variant), []).append(b * phi_c + w)
        print(f"  {name} draw {d}", file=sys.stderr, flush=True)
    removal = np.array([top_removed(v) for vs in results.values() for v in vs])
    missing = pool.missing(removal)
    if len(missing):
        pool.add(*scorer.score(missing))
    scorer.close()
    v_full = pool.lookup(np.ones((1, n), dtype=bool))[0][0]
    print("| game | tool | near-full keep p | share | LDS median (IQR) | drop@3 nats median (IQR) | each draw's drop@3 |")
    print("|---|---|---|---|---|---|---|")
    for variant, vs in results.items():
        lds = [spearmanr(held.astype(float) @ v, held_u).statistic for v in vs]
        drop = [v_full - pool.lookup(top_removed(v)[None])[0][0] for v in vs]
        q = lambda xs, f: f"{np.median(xs):{f}} ({np.quantile(xs, 0.25):{f}}-{np.quantile(xs, 0.75):{f}})"  # noqa: E731
        p, share = (variant[-2], variant[-1]) if len(variant) > 1 else ("-", "-")
        label = {1: variant[0], 2: "surrogate", 3: "surrogate (estimator's plan)"}[len(variant)]
        print(f"| {name} | {label} | {p} | {share} | {q(lds, '.3f')} | {q(drop, '.2f')} | {' '.join(f'{x:.2f}' for x in drop)} |")


if __name__ == "__main__":
    main()
