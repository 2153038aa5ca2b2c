"""Estimator leaderboard: accuracy against exact Shapley values per budget, every native method and
every shapiq approximator through coalescence's estimator interface, next to shap and captum, on
analytic and recorded real games; time to an error of 0.10; interaction approximators against the
exact pairwise Shapley interaction index.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/estimator_accuracy.py [--seeds 20]
        [--budgets 64,128,256,512,1024] [--players 12,16] [--real A.parquet,B.parquet]
        [--slow-seeds 5] [--interactions] [--methods kernelshap,shapiq:RegressionMSR,shap]

(needs the benchmark extras: pip install -c constraints.txt shap==0.51.0 captum==0.9.0; the
shapiq extra is installed by `make install`.)

Games: analytic n = 12 and n = 16 (additive + glove + weighted majority + a pairwise interaction)
and real games: the utilities of every coalition of a conversation scored by SmolLM2-135M-Instruct,
recorded once by benchmarks/record_real_game.py (see benchmarks/data/SOURCES.md). Truth: exact
Shapley values from all 2^n coalitions.

Methods at equal budgets (budget = the most distinct coalitions evaluated): every sampling method
of coalescence (kernelshap, permutation, lasso; banzhaf, which estimates another value, is shown
for reference), every shapiq approximator run through coalescence's adapter
(``make_estimator("shapiq:<Name>")``: plan, pool, fit, exactly as a CLI run fits), shap's
KernelExplainer (its defaults, and l1_reg=False) and captum's ShapleyValueSampling and KernelShap.
Each peer gets the same value function as a black box over 0/1 masks; its distinct evaluations are
counted and its sample count is set so that it asks for at most the budget. ProxySPEX and SPEX fit
a proxy model per call (seconds each): they get --slow-seeds seeds.

Error: relative L2 (||phi_hat - phi|| / ||phi||), median and 90th percentile over seeds.

Time to an error of 0.10 (real games): the smallest budget of the grid whose median error is at
most 0.10; the model seconds of the coalitions each seed used, from the recorded per-coalition model
time when the game file has it (column ``model_seconds``: the run's batch time shared among the
batch's rows), plus the median fit time.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from coalescence.attribution.estimators import ExactShapley, make_estimator
from coalescence.attribution.games import AdditiveGame, GloveGame, PairwiseInteractionGame, WeightedMajorityGame

NATIVE = ("kernelshap", "regression-msr", "permutation", "lasso", "banzhaf")
SLOW = ("ProxySPEX", "SPEX")
VARIANTS = ("shapiq:RegressionMSR:proxy_model=linear",)
"""Approximators with a constructor option: RegressionMSR with a linear proxy (its closed-form
Leverage-SHAP sampling weights, Witter, Liu & Musco 2025) besides its default XGBoost proxy."""


class MixedGame:
    """Additive + glove (first 6 players) + weighted majority + a pairwise interaction."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.n_players = n
        self.parts = [
            AdditiveGame(weights=rng.normal(0, 1, n)),
            PairwiseInteractionGame(weights=np.zeros(n), i=1, j=n - 1, bonus=2.0),
        ]
        self.glove = GloveGame(n_left=3, n_right=3)
        w = rng.integers(1, 5, n).astype(float)
        self.majority = WeightedMajorityGame(weights=w, quota=float(w.sum() / 2))
        self.seconds = None

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        masks = np.atleast_2d(np.asarray(masks, dtype=bool))
        out = sum(p(masks) for p in self.parts)
        out = out + 1.5 * self.glove(masks[:, :6]) + 3.0 * self.majority(masks)
        return np.asarray(out, dtype=np.float64)


class TableGame:
    """A game given by the utility of every coalition (a recorded real run), with each coalition's
    model seconds when recorded."""

    def __init__(self, masks: np.ndarray, utilities: np.ndarray, seconds: np.ndarray | None = None) -> None:
        self.n_players = masks.shape[1]
        idx = masks.astype(np.int64) @ (1 << np.arange(self.n_players))
        self.table = np.empty(2**self.n_players)
        self.table[idx] = utilities
        self.seconds = None
        if seconds is not None:
            self.seconds = np.empty(2**self.n_players)
            self.seconds[idx] = seconds

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        idx = np.atleast_2d(np.asarray(masks, dtype=np.int64)) @ (1 << np.arange(self.n_players))
        return self.table[idx]


def load_real(path: str) -> tuple[str, TableGame]:
    import pyarrow.parquet as pq

    from coalescence.masking.codec import PackedMask

    t = pq.read_table(path)
    masks = np.stack([PackedMask(w, n).to_bools() for w, n in zip(t["mask"].to_pylist(), t["n_bits"].to_pylist(), strict=True)])
    seconds = t["model_seconds"].to_numpy() if "model_seconds" in t.column_names else None
    name = path.rsplit("/", 1)[-1].removesuffix(".parquet").removesuffix("_exact")
    return f"SmolLM2 {name} n={masks.shape[1]}", TableGame(masks, t["utility"].to_numpy(), seconds)


def exact_values(game) -> np.ndarray:
    est = ExactShapley()
    masks = np.array(list(est.plan(game.n_players)))
    return est.fit(masks, game(masks)).values


def index_of(masks: np.ndarray) -> np.ndarray:
    return np.atleast_2d(np.asarray(masks, dtype=np.int64)) @ (1 << np.arange(masks.shape[-1]))


class Counted:
    """Wraps a game as a black box over 0/1 rows, recording the distinct coalitions asked for."""

    def __init__(self, game) -> None:
        self.game = game
        self.seen: set[int] = set()

    def __call__(self, rows) -> np.ndarray:
        masks = np.atleast_2d(np.asarray(rows) > 0.5)
        self.seen.update(index_of(masks).tolist())
        return self.game(masks)


Result = tuple[np.ndarray, np.ndarray]  # values [n], coalition indices used


def ours(method: str, game, budget: int, seed: int, **extra) -> tuple[np.ndarray, np.ndarray, object] | None:
    est = make_estimator(method, budget=budget, seed=seed, **extra)
    try:
        est.validate(game.n_players)
    except Exception:
        return None
    masks = np.array(list(est.plan(game.n_players)))
    fit = est.fit(masks, game(masks))
    return fit.values, np.unique(index_of(masks)), fit


def shap_kernel(game, budget: int, seed: int, **options) -> Result | None:
    import shap

    n = game.n_players
    f = Counted(game)
    np.random.seed(seed)  # shap samples with the global numpy generator
    explainer = shap.KernelExplainer(f, np.zeros((1, n)))
    values = explainer.shap_values(np.ones((1, n)), nsamples=max(budget - 2, 1), silent=True, **options)
    return np.asarray(values).reshape(-1)[:n], np.array(sorted(f.seen))


def captum_method(kind: str, game, budget: int, seed: int) -> Result | None:
    import torch
    from captum.attr import KernelShap, ShapleyValueSampling

    n = game.n_players
    f = Counted(game)
    torch.manual_seed(seed)
    forward = lambda x: torch.as_tensor(f(x.detach().numpy()), dtype=torch.float64)  # noqa: E731
    inputs, baselines = torch.ones((1, n), dtype=torch.float64), torch.zeros((1, n), dtype=torch.float64)
    if kind == "svs":  # one permutation costs n evaluations plus the baseline
        samples = max((budget - 1) // n, 1)
        attr = ShapleyValueSampling(forward).attribute(inputs, baselines=baselines, n_samples=samples, perturbations_per_eval=64)
    else:
        attr = KernelShap(forward).attribute(inputs, baselines=baselines, n_samples=budget, perturbations_per_eval=64)
    return attr.detach().numpy().reshape(-1), np.array(sorted(f.seen))


def methods() -> dict[str, object]:
    from coalescence.attribution.estimators.shapiq import approximator_names

    out: dict[str, object] = {}
    for m in NATIVE:
        out[m] = lambda g, b, s, m=m: (r := ours(m, g, b, s)) and r[:2]
    names = approximator_names()
    for name in names:
        out[f"shapiq:{name}"] = lambda g, b, s, name=name: (r := ours(f"shapiq:{name}", g, b, s)) and r[:2]
    for variant in VARIANTS:  # an approximator with a constructor option (shapiq:NAME:KEY=VALUE)
        if variant.split(":")[1] in names:
            out[variant] = lambda g, b, s, v=variant: (r := ours(v, g, b, s)) and r[:2]
    out["shap KernelExplainer (defaults)"] = shap_kernel
    out["shap KernelExplainer (l1_reg=False)"] = lambda g, b, s: shap_kernel(g, b, s, l1_reg=False)
    out["captum ShapleyValueSampling"] = lambda g, b, s: captum_method("svs", g, b, s)
    out["captum KernelShap"] = lambda g, b, s: captum_method("kernel", g, b, s)
    return out


def is_ours(method: str) -> bool:
    return method in NATIVE or method.startswith("shapiq:")


def selected(only: list[str]) -> dict[str, object]:
    """The methods named in ``only`` (a peer's family by its first word: shap, captum), or all."""
    every = methods()
    if not only:
        return every
    return {m: run for m, run in every.items() if m in only or m.split(" ")[0] in only}


def leaderboard(name: str, game, budgets: list[int], seeds: int, slow_seeds: int, only: list[str] = ()) -> dict[str, object]:
    truth = exact_values(game)
    norm = np.linalg.norm(truth)
    print(f"\n### {name}: relative L2 error, median (90th percentile) over seeds; [most distinct coalitions used]")
    print("| method | " + " | ".join(str(b) for b in budgets) + " | seeds | fit s |")
    print("|---|" + "---:|" * (len(budgets) + 2))
    medians: dict[str, list[float]] = {}
    to_target: dict[str, str] = {}
    for method, run in selected(list(only)).items():
        k = slow_seeds if any(method.endswith(s) for s in SLOW) else seeds
        cells, med = [], []
        fit_times: list[float] = []
        target = None
        for b in budgets:
            rel, used, model_s, times = [], 0, [], []
            for seed in range(k):
                t0 = time.perf_counter()
                try:
                    out = run(game, b, seed)
                except Exception:  # a peer that cannot run at this budget
                    out = None
                times.append(time.perf_counter() - t0)
                if not out:
                    break
                values, idx = out
                rel.append(np.linalg.norm(values - truth) / norm)
                used = max(used, len(idx))
                if game.seconds is not None:
                    model_s.append(float(game.seconds[idx].sum()))
            if not rel:
                cells.append("-")
                med.append(np.inf)
                continue
            fit_times += times
            m, p90 = float(np.median(rel)), float(np.percentile(rel, 90))
            med.append(m)
            cells.append(f"{m:.3f} ({p90:.3f}) [{used}]")
            if target is None and m <= 0.10:
                fit = float(np.median(times))
                target = f"{b}: {np.median(model_s):.0f} s model + {fit:.2f} s fit" if model_s else f"{b}: {fit:.2f} s fit"
        medians[method] = med
        to_target[method] = target or f"> {budgets[-1]}"
        fit_s = f"{np.median(fit_times):.2f}" if fit_times else "-"
        print(f"| {method} | " + " | ".join(cells) + f" | {k} | {fit_s} |", flush=True)
    ours_best = np.min([medians[m] for m in medians if is_ours(m)], axis=0)
    shap_best = np.min([medians[m] for m in medians if m.startswith("shap ")], axis=0)
    winner = [min((m for m in medians if is_ours(m)), key=lambda m, j=j: medians[m][j]) for j in range(len(budgets))]
    print("| best coalescence / best shap KernelExplainer | " + " | ".join(f"{r:.2f}" for r in ours_best / shap_best) + " | | |")
    print("| best coalescence method | " + " | ".join(winner) + " | | |")
    if game.seconds is not None:
        print(f"\nTime to a median relative error of 0.10 on {name} (budget: model seconds of the coalitions used + fit):")
        for method, what in to_target.items():
            print(f"- {method}: {what}")
    return {"medians": medians, "winners": winner}


def interaction_board(name: str, game, budgets: list[int], seeds: int) -> None:
    n = game.n_players
    _, _, exact = ours("exact", game, 0, 0, interactions=2, index="SII")  # budget ignored by exact
    truth = np.array([v for _, v in exact.interactions])
    norm = np.linalg.norm(truth)
    print(f"\n### {name}: pairwise Shapley interaction index (SII), relative L2 error over the {n * (n - 1) // 2} pairs, median (90th percentile) over {seeds} seeds")
    print("| approximator | " + " | ".join(str(b) for b in budgets) + " |")
    print("|---|" + "---:|" * len(budgets))
    for approx in ("KernelSHAPIQ", "InconsistentKernelSHAPIQ", "SVARMIQ", "SHAPIQ", "PermutationSamplingSII"):
        cells = []
        for b in budgets:
            rel = []
            for seed in range(seeds):
                r = ours(f"shapiq:{approx}", game, b, seed, interactions=2, index="SII")
                if r is None:
                    break
                est = np.array([v for _, v in r[2].interactions])
                rel.append(np.linalg.norm(est - truth) / norm)
            cells.append(f"{np.median(rel):.3f} ({np.percentile(rel, 90):.3f})" if rel else "-")
        print(f"| shapiq:{approx} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--slow-seeds", type=int, default=5, help="seeds of ProxySPEX and SPEX (seconds per fit)")
    ap.add_argument("--budgets", default="64,128,256,512,1024")
    ap.add_argument("--players", default="12,16", help="analytic games (empty: none)")
    ap.add_argument("--real", default="", help="comma-separated Parquet files of every coalition (record_real_game.py)")
    ap.add_argument("--interactions", action="store_true", help="also the SII leaderboard on the real games")
    ap.add_argument("--methods", default="", help="comma-separated methods to run (shap, captum: both of each); default every one")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    budgets = [int(b) for b in args.budgets.split(",")]
    games = [(f"analytic n={n}", MixedGame(int(n), seed=0)) for n in args.players.split(",") if n]
    reals = [load_real(p) for p in args.real.split(",") if p]
    from coalescence.attribution.estimators.shapiq.external import external_shapiq
    from coalescence.attribution.estimators.shapiq.inprocess import _InProcess

    external = external_shapiq()
    print(f"shapiq here: {_InProcess().version()}; external: {external.version() if external else 'none'}")
    only = [m for m in args.methods.split(",") if m]
    wins: dict[str, int] = {}
    cells = 0
    for name, game in games + reals:
        board = leaderboard(name, game, budgets, args.seeds, args.slow_seeds, only)
        if any(g is game for _, g in reals):
            for b, w in zip(budgets, board["winners"], strict=True):
                if b >= 128:
                    wins[w] = wins.get(w, 0) + 1
                    cells += 1
    if wins:
        print(f"\nCells won on the real games at budgets >= 128 (of {cells}): " + ", ".join(f"{m} {k}" for m, k in sorted(wins.items(), key=lambda kv: -kv[1])))
    if args.interactions:
        for name, game in reals:
            interaction_board(name, game, budgets, args.seeds)


if __name__ == "__main__":
    main()
