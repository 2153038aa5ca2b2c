"""Accuracy of Shapley estimators against exact values, per budget, ours next to shap and captum.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/estimator_accuracy.py [--seeds 20] [--budgets 64,...,4096]
        [--real benchmarks/data/eiffel12_exact.parquet]

(needs the benchmark extras: pip install -c constraints.txt shap captum)

Games: n = 12 and n = 16 analytic games (additive + glove + weighted majority + a pairwise
interaction, so every estimator has something to get wrong), and, when --real is given, a real
game: the utilities of every coalition of an exact run of SmolLM2-135M-Instruct over 12 sentence
players (recorded once by benchmarks/record_real_game.py). Truth: exact Shapley values from all 2^n
coalitions.

Estimators at equal budgets (budget = distinct coalitions evaluated): ours (KernelSHAP with paired
sampling and exact efficiency; antithetic permutation sampling); shap's KernelExplainer; captum's
ShapleyValueSampling and KernelShap. Every peer gets the same value function as a black box over
0/1 masks (baseline 0 = absent, input 1 = present); its distinct evaluations are counted, and its
sample count is set so that it uses at most the budget. Error: relative L2 (||phi_hat - phi|| /
||phi||) and mean absolute error, median over seeds.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from coalescence.attribution.estimators import ExactShapley, make_estimator
from coalescence.attribution.games import AdditiveGame, GloveGame, PairwiseInteractionGame, WeightedMajorityGame


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

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        masks = np.asarray(masks, dtype=bool)
        out = sum(p(masks) for p in self.parts)
        out = out + 1.5 * self.glove(masks[:, :6]) + 3.0 * self.majority(masks)
        return np.asarray(out, dtype=np.float64)


class TableGame:
    """A game given by the utility of every coalition (a recorded real run)."""

    def __init__(self, masks: np.ndarray, utilities: np.ndarray) -> None:
        self.n_players = masks.shape[1]
        weights = 1 << np.arange(self.n_players)
        self.table = np.empty(2**self.n_players)
        self.table[masks.astype(np.int64) @ weights] = utilities

    def __call__(self, masks: np.ndarray) -> np.ndarray:
        idx = np.asarray(masks, dtype=np.int64) @ (1 << np.arange(self.n_players))
        return self.table[idx]


def exact_values(game) -> np.ndarray:
    est = ExactShapley()
    masks = np.array(list(est.plan(game.n_players)))
    return est.fit(masks, game(masks)).values


class Counted:
    """Wraps a game as a black box over 0/1 rows, counting distinct coalitions asked for."""

    def __init__(self, game) -> None:
        self.game = game
        self.seen: set[bytes] = set()

    def __call__(self, rows) -> np.ndarray:
        masks = np.asarray(rows) > 0.5
        for r in masks:
            self.seen.add(np.packbits(r).tobytes())
        return self.game(masks)


def ours(method: str, game, budget: int, seed: int) -> tuple[np.ndarray, int] | None:
    est = make_estimator(method, budget=budget, seed=seed)
    try:
        est.validate(game.n_players)
    except Exception:
        return None
    masks = np.array(list(est.plan(game.n_players)))
    fit = est.fit(masks, game(masks))
    return fit.values, fit.n_evaluations


def shap_kernel(game, budget: int, seed: int, **options) -> tuple[np.ndarray, int] | None:
    import shap

    n = game.n_players
    f = Counted(game)
    np.random.seed(seed)  # shap samples with the global numpy generator
    explainer = shap.KernelExplainer(f, np.zeros((1, n)))
    values = explainer.shap_values(np.ones((1, n)), nsamples=max(budget - 2, 1), silent=True, **options)
    return np.asarray(values).reshape(-1)[:n], len(f.seen)


def captum_method(kind: str, game, budget: int, seed: int) -> tuple[np.ndarray, int] | None:
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
    return attr.detach().numpy().reshape(-1), len(f.seen)


METHODS = {
    "ours: kernelshap": lambda g, b, s: ours("kernelshap", g, b, s),
    "ours: permutation": lambda g, b, s: ours("permutation", g, b, s),
    "shap KernelExplainer (its defaults)": shap_kernel,
    "shap KernelExplainer (l1_reg=False)": lambda g, b, s: shap_kernel(g, b, s, l1_reg=False),
    "captum ShapleyValueSampling": lambda g, b, s: captum_method("svs", g, b, s),
    "captum KernelShap": lambda g, b, s: captum_method("kernel", g, b, s),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--budgets", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--players", default="12,16")
    ap.add_argument("--real", default=None, help="parquet of masks+utilities of every coalition (record_real_game.py)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    budgets = [int(b) for b in args.budgets.split(",")]
    games = [(f"analytic n={n}", MixedGame(int(n), seed=0)) for n in args.players.split(",")]
    if args.real:
        import pyarrow.parquet as pq

        from coalescence.masking.codec import PackedMask

        t = pq.read_table(args.real)
        masks = np.stack([PackedMask(w, n).to_bools() for w, n in zip(t["mask"].to_pylist(), t["n_bits"].to_pylist(), strict=True)])
        games.append((f"SmolLM2 eiffel n={masks.shape[1]}", TableGame(masks, t["utility"].to_numpy())))
    for name, game in games:
        truth = exact_values(game)
        norm = np.linalg.norm(truth)
        print(f"\n### {name}: median over {args.seeds} seeds, relative L2 error (mean abs error); [max distinct evaluations used]")
        print("| method | " + " | ".join(str(b) for b in budgets) + " |")
        print("|---|" + "---:|" * len(budgets))
        medians: dict[str, list[float]] = {}
        for method, run in METHODS.items():
            cells, med_rel = [], []
            t0 = time.perf_counter()
            for b in budgets:
                rel, mae, used = [], [], 0
                for seed in range(args.seeds):
                    out = run(game, b, seed)
                    if out is None:
                        break
                    values, n_used = out
                    rel.append(np.linalg.norm(values - truth) / norm)
                    mae.append(np.abs(values - truth).mean())
                    used = max(used, n_used)
                if not rel:
                    cells.append("-")
                    med_rel.append(np.inf)
                    continue
                med_rel.append(float(np.median(rel)))
                cells.append(f"{np.median(rel):.3f} ({np.median(mae):.3f}) [{used}]")
            medians[method] = med_rel
            print(f"| {method} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.0f} s -->")
        peers = [m for m in METHODS if not m.startswith("ours")]
        best_peer = np.min([medians[m] for m in peers], axis=0)
        ratio = np.array(medians["ours: kernelshap"]) / best_peer
        print("| ours kernelshap / best peer | " + " | ".join(f"{r:.2f}" for r in ratio) + " |")


if __name__ == "__main__":
    main()
