"""Issue 37's race on the long games: two-fidelity ``auto`` (few exact coalitions and the compacted
proxy game) against ContextCite at 64 ablations, quality and wall time in one run.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_race.py [--games long_design,long_glossary,long_unicode] \\
        [--cc-budget 64] [--ours default,8:0] [--draws 10] [--wall-draws 3] [--batch-size 16]

Needs the ``contextcite`` extra (``make contextcite``).

**Wall time** (models loaded beforehand, one process, the prefix cache emptied before each run):
ContextCite's ``get_attributions`` at ``--cc-budget`` ablations (batch 4, as in its examples), and
``Explainer.explain(game, unit="sentence", budget=m, proxy_budget=K, seed=d)`` (``--method auto``:
the control-variate surrogate with the shared-KV proxy game, positions compacted) for each ``m:K``
of ``--ours`` (``K = 0``: the default proxy budget, :func:`~coalescence.attribution.estimators.proxy.default_proxy_budget`)
and seeds ``d < --wall-draws``; ``--ours default`` (the default) runs ``Explainer.explain(game,
unit="sentence", seed=d)`` with no method and no budget: the default plan
(:mod:`coalescence.attribution.estimators.default`). With the proxy game played the surrogate takes 8 exact coalitions
(``TWO_FIDELITY_MIN_BUDGET``; 16 on exact rows alone).

**Quality over independent draws** (``--draws``): the LDS, the Spearman correlation of ``sum_{i in
S} phi_i`` with the exact v(S) over the game's 32 held-out keep-half coalitions (``long_games.held_out``),
and drop@3, ``v(N) - v(N minus the top 3 players)`` in nats, for each tool's attributions. Ours:
``explain`` with seeds ``0 .. draws - 1`` (the wall runs are the first of them). ContextCite: its
solver on ``--cc-budget`` ablations drawn at random (seed ``1000 + draw``) from its 256 recorded ones
(``<game>_contextcite.parquet``; its own masks are seeded, so its runs repeat). The exact utilities of
the held-out and removal coalitions come from the game's pool (``<game>_pool.parquet``); removal
coalitions not in it are scored with the model first and added to it. Each draw's LDS, drop@3 and
removed players are printed on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

GAMES = ("long_design", "long_glossary", "long_unicode")


def top_removed(values: np.ndarray, k: int = 3) -> np.ndarray:
    n = len(values)
    order = np.lexsort((np.arange(n), -values))  # highest first, ties by index
    row = np.ones(n, dtype=bool)
    row[order[:k]] = False
    return row


def cc_recorded_values(game, budget: int, draw: int) -> np.ndarray:
    import pyarrow.parquet as pq
    from context_cite.solver import LassoRegression

    from long_games import DATA, unpack

    t = pq.read_table(DATA / f"{game.name}_contextcite.parquet")
    tokens = int(t.schema.metadata[b"response_tokens"])
    masks = unpack(t["mask"].to_pylist(), game.n)
    outs = np.asarray(t["logit_prob"].to_pylist(), dtype=np.float32)
    pick = np.random.default_rng(1000 + draw).choice(len(masks), budget, replace=False)
    weight, _ = LassoRegression().fit(masks[pick], outs[pick], tokens)
    return np.asarray(weight, dtype=np.float64)


def clear_prefix_cache(ex) -> None:
    """Empty the explainer's backend's prefix cache (before each timed run)."""
    cache = getattr(ex.backend, "prefix_cache", None)
    if cache is not None:
        cache.clear()


def timed_contextcite(ex, game, budget: int) -> tuple[np.ndarray, float]:
    """ContextCite's attributions at ``budget`` ablations on ``ex``'s loaded model, the prefix cache
    emptied first, and its wall time (s)."""
    import torch

    from long_games import contextcite_citer

    clear_prefix_cache(ex)
    t0 = time.perf_counter()
    citer = contextcite_citer(game, ex.backend.model, ex.backend.tokenizer, budget)
    with torch.inference_mode():
        values = np.asarray(citer.get_attributions(verbose=False), dtype=np.float64)
    wall = time.perf_counter() - t0
    print(f"  {game.name} contextcite@{budget}: {wall:.1f} s", file=sys.stderr, flush=True)
    return values, wall


def race(name: str, cc_budget: int, ours: list[tuple[int, int]], draws: int, wall_draws: int, batch_size: int) -> list[dict]:
    from coalescence import Explainer
    from long_games import Pool, Scorer, held_out, load_game

    game = load_game(name)
    pool = Pool.open(game)
    held = held_out(game.n)
    held_u = pool.lookup(held)[0]
    ex = Explainer(batch_size=batch_size)
    rows: list[dict] = []
    cc_values, cc_wall = timed_contextcite(ex, game, cc_budget)
    rows.append({"tool": f"contextcite@{cc_budget}", "m": cc_budget, "k": 0, "draw": -1, "wall": cc_wall, "values": cc_values})
    for d in range(draws):
        rows.append({"tool": f"contextcite@{cc_budget}", "m": cc_budget, "k": 0, "draw": d, "wall": None,
                     "values": cc_recorded_values(game, cc_budget, d)})
    for m, k in ours:
        for d in range(draws):
            clear_prefix_cache(ex)
            t0 = time.perf_counter()
            if m == 0:  # the default plan: no method, no budget
                explanation = ex.explain(str(game.path), unit="sentence", seed=d, progress=False)
            else:
                explanation = ex.explain(str(game.path), unit="sentence", budget=m, proxy_budget=k or None, seed=d, progress=False)
            wall = time.perf_counter() - t0
            values = np.asarray(explanation.values, dtype=np.float64)
            method = explanation.estimate.method
            rows.append({"tool": f"coalescence {method}", "m": m, "k": k, "draw": d, "wall": wall if d < wall_draws else None,
                         "values": values})
            print(f"  {name} coalescence m={m} K={k} seed {d}: {wall:.1f} s ({method})", file=sys.stderr, flush=True)
    ex.close()
    removal = np.array([top_removed(r["values"]) for r in rows])
    missing = pool.missing(removal)
    if len(missing):
        scorer = Scorer(game)
        pool.add(*scorer.score(missing))
        scorer.close()
        print(f"  {name}: scored {len(missing)} removal coalitions", file=sys.stderr, flush=True)
    v_full = pool.lookup(np.ones((1, game.n), dtype=bool))[0][0]
    for r, row in zip(rows, removal, strict=True):
        r["game"] = name
        r["lds"] = float(spearmanr(held.astype(float) @ r["values"], held_u).statistic)
        r["drop3"] = float(v_full - pool.lookup(row[None])[0][0])
        if r["draw"] >= 0:
            top = ",".join(str(int(i)) for i in np.flatnonzero(~row))
            print(f"  {name} {r['tool']} m={r['m']} K={r['k']} draw {r['draw']}: LDS {r['lds']:.3f}, drop@3 {r['drop3']:.2f} "
                  f"(players {top} removed)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| game | tool | exact m | proxy K | wall s (median) | wall / ContextCite's | LDS median (IQR) | drop@3 nats median (IQR) | draws |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for game in dict.fromkeys(r["game"] for r in rows):
        rs = [r for r in rows if r["game"] == game]
        cc_wall = next(r["wall"] for r in rs if r["tool"].startswith("contextcite") and r["wall"] is not None)
        for key in dict.fromkeys((r["tool"], r["m"], r["k"]) for r in rs):
            group = [r for r in rs if (r["tool"], r["m"], r["k"]) == key]
            judged = [r for r in group if r["draw"] >= 0]
            walls = [r["wall"] for r in group if r["wall"] is not None]
            wall = float(np.median(walls))

            def q(xs: list[float], fmt: str) -> str:
                lo, med, hi = np.percentile(xs, [25, 50, 75])
                return f"{med:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"

            lines.append(
                f"| {game} | {key[0]}{' (default plan)' if key[1] == 0 else ''} | {key[1] or 'default'} | {key[2] or ('-' if key[0].startswith('contextcite') else 'default')} | {wall:.1f} | {wall / cc_wall:.2f} | "
                f"{q([r['lds'] for r in judged], '.3f')} | {q([r['drop3'] for r in judged], '.2f')} | {len(judged)} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default=",".join(GAMES))
    ap.add_argument("--cc-budget", type=int, default=64)
    ap.add_argument(
        "--ours", default="default",
        help="coalescence's runs: 'default' (no method, no budget: the default plan) or exact budget:proxy budget pairs "
        "(proxy 0: the default proxy budget)",
    )
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--wall-draws", type=int, default=3, help="how many of our draws count in the wall-time median")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    ours = [(0, 0) if pair == "default" else tuple(int(x) for x in pair.split(":")) for pair in args.ours.split(",") if pair]
    rows: list[dict] = []
    for name in [g for g in args.games.split(",") if g]:
        rows += race(name, args.cc_budget, ours, args.draws, args.wall_draws, args.batch_size)
    print(table(rows))


if __name__ == "__main__":
    main()
