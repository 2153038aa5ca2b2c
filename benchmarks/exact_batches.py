"""Issue 47, item 4: do the exact rows of a two-fidelity run go out in batches as full as an
exact-only run's?

One run each on a recorded long game (default ``long_design``: 71 sentence players,
SmolLM2-135M, ``--batch-size 16``): ``auto --budget B`` with the proxy game off and with it played
(named, so it is played whatever it costs). The archive's ``batch_size`` column gives the rows of
each exact row's backend call; the table counts the exact rows by the size of their call.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/exact_batches.py [--game long_design] [--budget 16]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from coalescence import Explainer
    from coalescence.archive import read_rows
    from long_games import load_game

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--game", default="long_design")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    game = load_game(args.game)
    ex = Explainer(batch_size=args.batch_size)
    print("| game | proxy game | exact rows | exact rows by their call's size | exact calls | wall s |")
    print("|---|---|---|---|---|---|")
    for proxy in ("none", "after-last-player"):
        run_dir = Path(tempfile.mkdtemp()) / "run"
        e = ex.explain(str(game.path), unit="sentence", method="auto", budget=args.budget, proxy_game=proxy, seed=0,
                       progress=False, archive=str(run_dir))  # fmt: skip
        rows = read_rows(run_dir)
        sizes = [b for b, g in zip(rows["batch_size"].to_pylist(), rows["game"].to_pylist(), strict=True) if g in (None, "exact")]
        by_size = collections.Counter(sizes)
        calls = sum(count // size for size, count in by_size.items())
        shown = ", ".join(f"{count} in calls of {size}" for size, count in sorted(by_size.items(), reverse=True))
        print(f"| {args.game} | {proxy} | {len(sizes)} | {shown} | {calls} | {e.wall_seconds:.1f} |", flush=True)
    ex.close()


if __name__ == "__main__":
    main()
