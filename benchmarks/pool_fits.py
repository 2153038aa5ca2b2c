"""The exact game's own least-squares surrogate on the recorded long games' pools, by how many
players the coalitions keep (issue 37): which third player each fit ranks, and the top-3 removal drop.

Usage::

    .venv/bin/python benchmarks/pool_fits.py [--games long_design,long_glossary,long_unicode]

No model is loaded: for each game, ordinary least squares ``v(S) ~ a + sum_{i in S} w_i`` over the
pool's (``<game>_pool.parquet``) exact coalitions that keep more than 30% and less than 70% of the
players (keep-half), more than 70% and less than 95% (near-full), and all of them; printed: the rows fitted, the five largest ``w`` (player indices) and
``v(N) - v(N minus the top 3)`` in nats where that coalition is in the pool (``proxy_race.py``'s
drop@3; n/a otherwise). The pools grow as other benchmarks score coalitions, so the row counts are
part of the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

BANDS = (("keep-half (30-70% kept)", 0.3, 0.7), ("near-full (70-95% kept)", 0.7, 0.95), ("all", -1.0, 2.0))


def main() -> None:
    from long_games import GAMES, Pool, load_game, unpack
    from proxy_race import top_removed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default=",".join(sorted(GAMES)))
    args = ap.parse_args()
    print("| game | coalitions | rows | five largest w (players) | drop@3 nats |")
    print("|---|---|---|---|---|")
    for name in args.games.split(","):
        game = load_game(name)
        pool = Pool.open(game)
        keys = list(pool.utility)
        x = unpack(keys, game.n)
        v = np.array([pool.utility[k] for k in keys])
        kept = x.mean(axis=1)
        v_full = pool.lookup(np.ones((1, game.n), dtype=bool))[0][0]
        for label, lo, hi in BANDS:
            rows = (kept > lo) & (kept < hi)
            design = np.column_stack([np.ones(rows.sum()), x[rows]])
            w = np.linalg.lstsq(design, v[rows], rcond=None)[0][1:]
            removal = top_removed(w)[None]
            drop = f"{v_full - pool.lookup(removal)[0][0]:.2f}" if not len(pool.missing(removal)) else "n/a"
            top = ", ".join(str(int(i)) for i in np.argsort(-w, kind="stable")[:5])
            print(f"| {name} | {label} | {int(rows.sum())} | {top} | {drop} |")


if __name__ == "__main__":
    main()
