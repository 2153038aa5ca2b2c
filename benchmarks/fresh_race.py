"""The race on long games nobody tuned on: the default plan (no ``--method``, no ``--budget``)
against ContextCite at 64 ablations, both live on one loaded model, judged by one scorer.

Usage::

    .venv/bin/python benchmarks/build_long_games.py --set fresh     # the games' inputs (shipped)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/fresh_race.py --score-only   # held-out pools (untimed)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/fresh_race.py [--games fresh_general,fresh_logging,fresh_classes] \\
        [--cc-budget 64] [--draws 3] [--held-out 48] [--batch-size 16]

Needs the ``contextcite`` extra (``make contextcite``).

The games (``benchmarks/data/fresh_*.json``, 58-72 sentence players of Python documentation
prose: the general FAQ, the logging HOWTO, the classes tutorial) were built after the default
plan and its constants were fixed (issue 47), and no plan or constant was changed on them.

Per game, one process, the model loaded first (SmolLM2-135M-Instruct, ``hf``, fp32, the
machine's threads), the prefix cache emptied before each timed run:

- **ContextCite@64**: ``ContextCiter.get_attributions()`` with 64 ablations, batch 4 (as in its
  examples), timed; one draw (its masks are seeded: a run repeats).
- **coalescence, default plan**: ``Explainer.explain(game, unit="sentence", seed=d)`` with no
  method and no budget, seeds ``d < --draws``, each timed.

Judged alike, with coalescence's utility (log p of the answer, nats, policy ``drop``) scored by
its engine (:class:`long_games.Scorer`), never by the tools' own runs:

- **gold rank**: the rank (1 = highest) of the sentence holding the answer;
- **LDS**: Spearman's correlation of ``sum_{i in S} value_i`` with v(S) over ``--held-out``
  keep-half coalitions drawn from their own generator (``default_rng(FRESH_SEED)``), used by no
  method;
- **drop@3**: ``v(N) - v(N minus each tool's top 3)``, nats.

Every scored coalition goes to ``<game>_pool.parquet`` (``--score-only`` scores the held-out ones
without timing anything, so the timed run can be alone on a quiet machine). The table gives our
median over draws and each measure against ContextCite's.
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

GAMES = ("fresh_general", "fresh_logging", "fresh_classes")
FRESH_SEED = 20261206
"""Seed of the held-out coalitions' generator (no method draws from it)."""


def held_rows(n: int, count: int) -> np.ndarray:
    """``[count, n]`` bool keep-half coalitions, distinct, none empty or full."""
    rng = np.random.default_rng(FRESH_SEED)
    rows: dict[bytes, np.ndarray] = {}
    while len(rows) < count:
        row = rng.random(n) < 0.5
        if 0 < row.sum() < n:
            rows.setdefault(np.packbits(row).tobytes(), row)
    return np.array(list(rows.values()))


def score_missing(game, pool, rows: np.ndarray) -> int:
    from long_games import Scorer

    missing = pool.missing(rows)
    if len(missing):
        scorer = Scorer(game)
        pool.add(*scorer.score(missing))
        scorer.close()
    return len(missing)


def rank_of(values: np.ndarray, i: int) -> int:
    return int(1 + np.sum(values > values[i]))


def race(name: str, cc_budget: int, draws: int, held_out: int, batch_size: int, score_only: bool) -> list[dict]:
    from coalescence import Explainer
    from long_games import Pool, load_game
    from proxy_race import clear_prefix_cache, timed_contextcite, top_removed

    game = load_game(name)
    pool = Pool.open(game)
    held = held_rows(game.n, held_out)
    full = np.ones((1, game.n), dtype=bool)
    scored = score_missing(game, pool, np.concatenate([full, held]))
    print(f"  {name}: {game.n} players, gold {game.gold}; scored {scored} held-out coalitions", file=sys.stderr, flush=True)
    if score_only:
        return []
    ex = Explainer(batch_size=batch_size)
    rows: list[dict] = []
    cc_values, cc_wall = timed_contextcite(ex, game, cc_budget)
    rows.append({"tool": f"contextcite@{cc_budget}", "draw": 0, "wall": cc_wall, "values": cc_values, "note": ""})
    for d in range(draws):
        clear_prefix_cache(ex)
        t0 = time.perf_counter()
        explanation = ex.explain(str(game.path), unit="sentence", seed=d, progress=False)
        wall = time.perf_counter() - t0
        evaluations = getattr(explanation.estimate, "n_evaluations", None)
        rows.append({"tool": f"coalescence default ({explanation.estimate.method})", "draw": d, "wall": wall,
                     "values": np.asarray(explanation.values, dtype=np.float64), "note": str(evaluations or "")})
        print(f"  {name} coalescence default seed {d}: {wall:.1f} s ({explanation.estimate.method})", file=sys.stderr, flush=True)
    ex.close()
    removal = np.array([top_removed(r["values"]) for r in rows])
    score_missing(game, pool, removal)
    held_u = pool.lookup(held)[0]
    v_full = pool.lookup(full)[0][0]
    for r, row in zip(rows, removal, strict=True):
        r["game"], r["n"] = name, game.n
        r["gold_rank"] = rank_of(r["values"], game.gold)
        r["lds"] = float(spearmanr(held.astype(float) @ r["values"], held_u).statistic)
        r["drop3"] = float(v_full - pool.lookup(row[None])[0][0])
        print(f"  {name} {r['tool']} draw {r['draw']}: gold rank {r['gold_rank']}, LDS {r['lds']:.3f}, "
              f"drop@3 {r['drop3']:.2f}, wall {r['wall']:.1f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| game | players | tool | wall s (median) | wall / ContextCite's | gold rank | LDS (median) | LDS - ContextCite's | drop@3 nats (median) | drop@3 / ContextCite's | draws |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for game in dict.fromkeys(r["game"] for r in rows):
        rs = [r for r in rows if r["game"] == game]
        cc = rs[0]
        for tool in dict.fromkeys(r["tool"] for r in rs):
            group = [r for r in rs if r["tool"] == tool]
            wall = float(np.median([r["wall"] for r in group]))
            lds = float(np.median([r["lds"] for r in group]))
            drop = float(np.median([r["drop3"] for r in group]))
            ranks = "/".join(str(r["gold_rank"]) for r in group)
            lines.append(
                f"| {game} | {group[0]['n']} | {tool} | {wall:.1f} | {wall / cc['wall']:.2f} | {ranks} | {lds:.3f} | "
                f"{lds - cc['lds']:+.3f} | {drop:.2f} | {drop / cc['drop3']:.0%} | {len(group)} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default=",".join(GAMES))
    ap.add_argument("--cc-budget", type=int, default=64)
    ap.add_argument("--draws", type=int, default=3, help="seeds of the default plan, each timed")
    ap.add_argument("--held-out", type=int, default=48, help="keep-half coalitions the LDS is computed on")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--score-only", action="store_true", help="score the held-out coalitions into the pools, time nothing")
    args = ap.parse_args()
    rows: list[dict] = []
    for name in [g for g in args.games.split(",") if g]:
        rows += race(name, args.cc_budget, args.draws, args.held_out, args.batch_size, args.score_only)
    if rows:
        print(table(rows))


if __name__ == "__main__":
    main()
