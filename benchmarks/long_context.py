"""Long contexts with many players: every method at budgets 32-256 against ContextCite, judged alike.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/long_context.py \\
        [--games long_unicode,long_design,long_glossary] [--budgets 32,64,128,256] [--seeds 0] \\
        [--methods auto,lasso,banzhaf,kernelshap,regression-msr,loo,contextcite,cc-solver,lasso-logit] [--record]

On each recorded long game (``benchmarks/data/long_*.json``, 67-73 sentence players of real
documentation prose; ``benchmarks/record_long_game.py`` recorded their pools) every method is fitted
at every budget from the game's pool, with no model, and ContextCite 0.0.4 is refitted at the same
number of ablations from its own recorded run (its masks and its per-ablation outputs: its first b
ablations are its run at b). Every explanation is judged by the same rules, computed here:

- **gold rank**: the rank (1 = highest value) of the sentence that holds the answer;
- **drop@k** (k = 1, 3, 5): ``v(N) - v(N minus the top-k players)``, nats (higher: the top-k
  sentences matter more);
- **LDS**: the Spearman rank correlation between ``sum_{i in S} value_i`` and ``v(S)`` over the
  game's 32 held-out coalitions (each player kept with probability 1/2, drawn by a generator no
  method uses). Spearman is unchanged by a monotone map of ``v``, so ContextCite's surrogate of the
  logit of p and ours of log p are judged alike.

``v`` is coalescence's utility (log p of the answer, nats) on coalescence's rendering of each
coalition. The top-k removal coalitions depend on the explanations: ``--record`` scores the
missing ones with the model into the pool (otherwise those cells print ``-``). Times: a method's
``model s`` is the recorded model seconds of the distinct coalitions of its plan (each coalition's
share of its recording chunk) plus its fit; ContextCite's is its recorded wall time scaled to b
ablations plus its fit. The wall-clock race, both tools on one model side by side, is
``--wall BUDGET``.

One sample of coalitions per budget is one draw: ``--resamples R`` judges R draws per budget below
256 instead, for ``auto`` (its sparse surrogate: cross-validated Lasso on every coalition) and
ContextCite alike: each draw is b coalitions taken at random (``numpy`` seed 1000 + draw) from the
256 of the method's own recorded run (coalescence's seed-0 keep-half plan, its empty and full
coalitions always in; ContextCite's 256 recorded ablations), itself a random keep-half design of b
coalitions, fitted by the method's own solver; ``cc-solver`` is ContextCite's solver (its Lasso
and logit-p utility) on auto's draws, so that auto against it is the solver alone. The table gives
each measure's median and interquartile range over the draws and P(auto >= ContextCite), the share
of the R x R pairs of draws in which auto's is at least ContextCite's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_games import DATA, GAMES, Pool, held_out, load_game  # noqa: E402

KS = (1, 3, 5)
METHODS = ("auto", "lasso", "banzhaf", "kernelshap", "regression-msr", "loo", "contextcite")


class ContextCiteSolverOnOurPlan:
    """``cc-solver``: ContextCite's own solver (Lasso, alpha 0.01, on standardised masks and the
    per-token utility) fitted on coalescence's keep-half plan and utilities: the same coalitions
    as ``lasso``/``auto``, so a difference between them is the solver's, not the sample's."""

    def __init__(self, budget: int, seed: int, response_tokens: int) -> None:
        from coalescence.attribution.estimators import LassoSurrogate

        self.inner = LassoSurrogate(budget=budget, seed=seed, holdout=0.0)
        self.tokens = response_tokens

    def plan(self, n: int):
        return self.inner.plan(n)

    def fit(self, masks: np.ndarray, utilities: np.ndarray):
        from types import SimpleNamespace

        from context_cite.solver import LassoRegression

        weight, _ = LassoRegression().fit(masks, np.asarray(utilities, dtype=np.float64), self.tokens)
        return SimpleNamespace(values=np.asarray(weight, dtype=np.float64))


def estimator(method: str, budget: int, seed: int, game=None):
    from coalescence import make_estimator

    if method == "cc-solver":
        meta = pq.read_table(DATA / f"{game.name}_contextcite.parquet").schema.metadata
        return ContextCiteSolverOnOurPlan(budget, seed, int(meta[b"response_tokens"]))
    if method == "lasso-logit":
        from coalescence.attribution.estimators.lasso import LassoSurrogate

        return LassoSurrogate(budget=budget, seed=seed, utility="logit")
    return make_estimator(method, budget=budget, seed=seed)


def contextcite_values(game, budget: int) -> tuple[np.ndarray, float] | None:
    """ContextCite's attributions at ``budget`` ablations, refitted by its own solver from its
    recorded run, and its time (recorded wall scaled to ``budget`` ablations, plus the fit)."""
    path = DATA / f"{game.name}_contextcite.parquet"
    if not path.exists():
        return None
    from context_cite.solver import LassoRegression

    from long_games import unpack

    t = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in t.schema.metadata.items()}
    ablations = int(meta["ablations"])
    if budget > ablations:
        return None
    masks = unpack(t["mask"].to_pylist(), game.n)[:budget]
    outputs = np.asarray(t["logit_prob"].to_pylist(), dtype=np.float32)[:budget]
    t0 = time.perf_counter()
    weight, _ = LassoRegression().fit(masks, outputs, int(meta["response_tokens"]))
    fit = time.perf_counter() - t0
    return np.asarray(weight, dtype=np.float64), float(meta["wall_seconds"]) * budget / ablations + fit


def removal(n: int, values: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(n), -values))  # highest value first, ties by player index
    row = np.ones(n, dtype=bool)
    row[order[:k]] = False
    return row


def judge(game, pool: Pool, values: np.ndarray, held: np.ndarray, held_u: np.ndarray) -> dict:
    order = np.lexsort((np.arange(game.n), -values))
    rank = int(np.where(order == game.gold)[0][0]) + 1
    full = np.ones((1, game.n), dtype=bool)
    v_full = pool.lookup(full)[0][0]
    out = {"gold_rank": rank, "lds": float(spearmanr(held.astype(float) @ values, held_u).statistic)}
    for k in KS:
        row = removal(game.n, values, k)[None]
        try:
            out[f"drop@{k}"] = float(v_full - pool.lookup(row)[0][0])
        except KeyError:
            out[f"drop@{k}"] = None
    return out


def evaluate(game, pool: Pool, methods, budgets, seeds) -> list[dict]:
    held = held_out(game.n)
    held_u = pool.lookup(held)[0]
    rows = []
    for method in methods:
        for budget in [None] if method == "loo" else budgets:
            for seed in [0] if method in ("loo", "contextcite") else seeds:
                if method == "contextcite":
                    got = contextcite_values(game, budget)
                    if got is None:
                        continue
                    values, seconds = got
                    evaluations = budget
                else:
                    est = estimator(method, budget or 0, seed, game)
                    plan = np.array(list(est.plan(game.n)), dtype=bool)
                    try:
                        utilities, model_seconds = pool.lookup(plan)
                    except KeyError as exc:
                        print(f"  {game.name} {method} {budget}: {exc}; record the game's pool", file=sys.stderr)
                        continue
                    t0 = time.perf_counter()
                    values = np.asarray(est.fit(plan, utilities).values, dtype=np.float64)
                    seconds = float(model_seconds.sum()) + time.perf_counter() - t0
                    evaluations = len(plan)
                row = {"game": game.name, "method": method, "budget": budget, "seed": seed, "evaluations": evaluations,
                       "seconds": seconds, "values": values}
                row.update(judge(game, pool, values, held, held_u))
                rows.append(row)
    return rows


def resampled(game, pool: Pool, budgets: list[int], draws: int) -> list[dict]:
    """``auto`` and ContextCite on ``draws`` random sub-designs of their own 256 recorded coalitions at
    each budget below 256 (module docs), judged alike."""
    from context_cite.solver import LassoRegression

    from coalescence.attribution.estimators.auto import AutoMethod
    from coalescence.attribution.estimators.lasso import LassoSurrogate
    from long_games import unpack

    held = held_out(game.n)
    held_u = pool.lookup(held)[0]
    ours = np.array(list(LassoSurrogate(budget=256, seed=0, holdout=0.0).plan(game.n)), dtype=bool)
    ours_u = pool.lookup(ours)[0]
    t = pq.read_table(DATA / f"{game.name}_contextcite.parquet")
    tokens = int(t.schema.metadata[b"response_tokens"])
    theirs = unpack(t["mask"].to_pylist(), game.n)
    theirs_out = np.asarray(t["logit_prob"].to_pylist(), dtype=np.float32)
    rows = []
    for budget in (b for b in budgets if b < 256):
        for draw in range(draws):
            rng = np.random.default_rng(1000 + draw)
            pick = np.concatenate([[0, 1], 2 + rng.choice(len(ours) - 2, budget - 2, replace=False)])
            surrogate, _ = AutoMethod(budget=budget, seed=draw).choose(game.n)  # the sparse surrogate here
            values, _ = surrogate._fit_surrogate(ours[pick], ours_u[pick])
            rows.append({"game": game.name, "method": "auto", "budget": budget, "draw": draw, "values": values})
            # ContextCite's solver on the same coalitions: its logit-p utility, per answer token
            p = np.exp(np.minimum(ours_u[pick], -1e-12))
            weight, _ = LassoRegression().fit(ours[pick], (ours_u[pick] - np.log1p(-p)).astype(np.float32), tokens)
            rows.append({"game": game.name, "method": "cc-solver", "budget": budget, "draw": draw,
                         "values": np.asarray(weight, dtype=np.float64)})
            pick = rng.choice(len(theirs), budget, replace=False)
            weight, _ = LassoRegression().fit(theirs[pick], theirs_out[pick], tokens)
            rows.append({"game": game.name, "method": "contextcite", "budget": budget, "draw": draw,
                         "values": np.asarray(weight, dtype=np.float64)})
    for row in rows:
        row.update(judge(game, pool, row["values"], held, held_u))
    return rows


def resampled_table(rows: list[dict]) -> str:
    lines = [
        "| game | budget | draws | measure | auto median (IQR) | cc-solver on auto's coalitions | ContextCite median (IQR) | P(auto >= ContextCite) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for game, budget in sorted({(r["game"], r["budget"]) for r in rows}, key=lambda k: (k[0], k[1])):
        rs = [r for r in rows if r["game"] == game and r["budget"] == budget]
        for key in ("lds", "drop@3", "drop@5"):
            got = {m: [r[key] for r in rs if r["method"] == m and r[key] is not None] for m in ("auto", "cc-solver", "contextcite")}
            a, c = got["auto"], got["contextcite"]
            if not a or not c:
                continue
            better = np.mean([x >= y for x in a for y in c])

            def q(xs):
                if not xs:
                    return "-"
                lo, med, hi = np.percentile(xs, [25, 50, 75])
                return f"{med:.3f} ({lo:.3f}-{hi:.3f})" if key == "lds" else f"{med:.2f} ({lo:.2f}-{hi:.2f})"

            lines.append(f"| {game} | {budget} | {len(a)} | {key} | {q(a)} | {q(got['cc-solver'])} | {q(c)} | {better:.2f} |")
    gold = [r["gold_rank"] for r in rows]
    lines.append("")
    lines.append(f"gold rank 1 in {sum(g == 1 for g in gold)} of {len(gold)} explanations (every method, draw and budget)")
    return "\n".join(lines)


def record_removals(game, pool: Pool, rows: list[dict], backend: str) -> int:
    wanted = np.array([removal(game.n, r["values"], k) for r in rows for k in KS], dtype=bool)
    missing = pool.missing(wanted)
    if len(missing):
        from long_games import Scorer

        scorer = Scorer(game, backend=backend)
        pool.add(*scorer.score(missing))
        scorer.close()
    return len(missing)


def wall_race(game, budget: int, backends: list[str], repeats: int, batch_size: int) -> list[dict]:
    """Wall seconds of one explanation at ``budget`` evaluations, model loaded beforehand: ContextCite
    (its ablations and its fit, batch 4 as in its examples) and coalescence (``Explainer.explain``
    with ``--method auto``, which takes the sparse surrogate here; planning, scoring and fit) on each
    backend, interleaved over ``repeats``."""
    import torch

    from coalescence import Explainer

    from long_games import contextcite_citer

    tools = {"contextcite": Explainer(batch_size=batch_size)}  # its transformers model serves ContextCite too
    for backend in backends:
        tools[f"coalescence {backend}"] = tools["contextcite"] if backend == "hf" else Explainer(backend=backend, batch_size=batch_size)
    rows = []
    for rep in range(repeats):
        for name, ex in tools.items():
            t0 = time.perf_counter()
            if name == "contextcite":
                citer = contextcite_citer(game, ex.backend.model, ex.backend.tokenizer, budget)
                with torch.inference_mode():
                    citer.get_attributions(verbose=False)
                method = "contextcite"
            else:
                explanation = ex.explain(str(game.path), unit="sentence", budget=budget)
                method = explanation.estimate.method
            wall = time.perf_counter() - t0
            rows.append({"game": game.name, "tool": name, "method": method, "budget": budget, "repeat": rep, "wall": wall})
            print(f"  {game.name} {name} ({method}) at {budget}: {wall:.1f} s", file=sys.stderr, flush=True)
    return rows


def wall_table(rows: list[dict]) -> str:
    lines = ["| game | budget | tool | method | wall s (median) | speed vs ContextCite |", "|---|---|---|---|---|---|"]
    keys = sorted({(r["game"], r["budget"]) for r in rows})
    for game, budget in keys:
        rs = [r for r in rows if r["game"] == game and r["budget"] == budget]
        med = {t: float(np.median([r["wall"] for r in rs if r["tool"] == t])) for t in dict.fromkeys(r["tool"] for r in rs)}
        for tool, wall in med.items():
            method = next(r["method"] for r in rs if r["tool"] == tool)
            lines.append(f"| {game} | {budget} | {tool} | {method} | {wall:.1f} | {med['contextcite'] / wall:.2f}x |")
    return "\n".join(lines)


def fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| game | method | budget | evaluations | gold rank | drop@1 | drop@3 | drop@5 | LDS | model s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["game"], r["method"], r["budget"]), []).append(r)
    for (game, method, budget), rs in groups.items():
        def mean(key):
            xs = [r[key] for r in rs if r[key] is not None]
            return float(np.mean(xs)) if xs else None

        lines.append(
            f"| {game} | {method} | {budget or '-'} | {mean('evaluations'):.0f} | {mean('gold_rank'):.1f} | "
            f"{fmt(mean('drop@1'), 2)} | {fmt(mean('drop@3'), 2)} | {fmt(mean('drop@5'), 2)} | {fmt(mean('lds'))} | "
            f"{fmt(mean('seconds'), 1)} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default=",".join(GAMES))
    ap.add_argument("--budgets", default="32,64,128,256")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--record", action="store_true", help="score missing top-k removal coalitions with the model")
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"), help="backend of --record")
    ap.add_argument("--wall", type=int, default=0, metavar="BUDGET",
                    help="instead: race ContextCite and coalescence at this budget, models loaded beforehand")
    ap.add_argument("--wall-backends", default="hf,vllm", help="coalescence's backends in the race")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the race")
    ap.add_argument("--batch-size", type=int, default=16, help="coalescence's batch size in the race")
    ap.add_argument("--resamples", type=int, default=0, metavar="R",
                    help="instead: auto and ContextCite on R random sub-designs per budget below 256 (module docs)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    if args.wall:
        race = []
        for name in args.games.split(","):
            race += wall_race(load_game(name), args.wall, [b for b in args.wall_backends.split(",") if b], args.repeats, args.batch_size)
        print(wall_table(race))
        return
    if args.resamples:
        rows = []
        for name in args.games.split(","):
            game = load_game(name)
            pool = Pool.open(game)
            got = resampled(game, pool, budgets, args.resamples)
            if args.record:
                scored = record_removals(game, pool, got, args.backend)
                if scored:
                    print(f"{name}: scored {scored} top-k removal coalitions", file=sys.stderr)
                    got = resampled(game, pool, budgets, args.resamples)
            rows += got
        print(resampled_table(rows))
        return
    rows: list[dict] = []
    for name in args.games.split(","):
        game = load_game(name)
        pool = Pool.open(game)
        got = evaluate(game, pool, methods, budgets, seeds)
        if args.record:
            scored = record_removals(game, pool, got, args.backend)
            if scored:
                print(f"{name}: scored {scored} top-k removal coalitions", file=sys.stderr)
                got = evaluate(game, pool, methods, budgets, seeds)
        print(f"{name}: {game.n} players, gold sentence {game.gold}, pool {len(pool)} coalitions", file=sys.stderr)
        rows += got
    print(table(rows))


if __name__ == "__main__":
    main()
