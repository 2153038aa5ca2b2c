"""The proxy game near the full coalition (issue 37): does it order the players whose removal
matters there as the exact game does?

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_near_full.py --game long_design --removed 39,34

For a recorded long game and the players ``--removed`` (e.g. the two that every tool ranks first),
every other player X: the exact v(N minus removed minus {X}) and the proxy game's c(same), and the
single removals N minus {X}. Printed: the range of the top-(k+1) removal drops over X in both games,
their Spearman and Pearson correlations, the exact drop of the proxy's five best X and of the exact
game's five best, and the same correlations for the single removals. Exact coalitions missing from
the game's pool (``<game>_pool.parquet``) are scored through the engine first and added to it;
the proxy rows (``kv-proxy-compact``, the engine's default tail rule) are scored each run (~0.07 s a row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from long_games import Pool, Scorer, load_game

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--game", default="long_design")
    ap.add_argument("--removed", default="39,34", help="players removed in every row besides X (comma-separated)")
    args = ap.parse_args()
    game = load_game(args.game)
    n = game.n
    removed = [int(x) for x in args.removed.split(",") if x]
    others = [x for x in range(n) if x not in removed]
    with_x = np.ones((len(others), n), dtype=bool)
    for r, x in enumerate(others):
        with_x[r, removed + [x]] = False
    single = ~np.eye(n, dtype=bool)
    rows = np.concatenate([np.ones((1, n), dtype=bool), with_x, single])
    pool = Pool.open(game)
    scorer = Scorer(game)
    missing = pool.missing(rows)
    if len(missing):
        pool.add(*scorer.score(missing))
        print(f"{game.name}: scored {len(missing)} exact coalitions", file=sys.stderr, flush=True)
    v = pool.lookup(rows)[0]
    c = scorer.score_proxy(rows)
    scorer.close()
    k = len(others)
    dv, dc = v[0] - v[1 : 1 + k], c[0] - c[1 : 1 + k]
    lv, lc = v[0] - v[1 + k :], c[0] - c[1 + k :]
    label = f"N minus {{{', '.join(map(str, removed))}, X}}"

    def best(d: np.ndarray) -> str:
        return ", ".join(f"{others[i]} ({dv[i]:.2f})" for i in np.argsort(-d)[:5])

    print(f"| {game.name}, {label} | exact | proxy game |")
    print("|---|---|---|")
    print(f"| drop over the {k} choices of X (nats) | {dv.min():.2f}-{dv.max():.2f} | {dc.min():.2f}-{dc.max():.2f} |")
    print(f"| Spearman / Pearson with the exact drops | - | {spearmanr(dv, dc).statistic:.3f} / {np.corrcoef(dv, dc)[0, 1]:.3f} |")
    print(f"| five best X (their exact drop) | {best(dv)} | {best(dc)} |")
    worst = int(np.argmin(dv))
    print(f"| worst X (exact) | {others[worst]} ({dv[worst]:.2f}) | ranked {int(np.flatnonzero(np.argsort(-dc) == worst)[0]) + 1} of {k} |")
    print(f"| single removals N minus {{X}}: Spearman / Pearson | - | {spearmanr(lv, lc).statistic:.3f} / {np.corrcoef(lv, lc)[0, 1]:.3f} |")


if __name__ == "__main__":
    main()
