"""Two-fidelity estimators on recorded proxy pools (issue 37): the exact game on few coalitions, the
shared-KV proxy game on many. No model: it reads the recorded pools.

Usage::

    .venv/bin/python benchmarks/proxy_game.py [--data benchmarks/data] [--rule RULE] \\
        [--games demo,eiffel12,long_design,long_glossary,long_unicode] [--seeds 20] [--draws 10] \\
        [--budgets 16,32,64] [--lasso-budgets 8,16,32,64] [--multiples 4,8,16,32] [--guided 0.5,0.7]

The proxy values are ``<data>/<game>_proxy.parquet`` (``benchmarks/proxy_tail.py --write``: one
column ``proxy:<rule>`` per tail rule, the proxy's log p of the answer in nats on the recorded
coalitions; ``--rule`` picks one, by default the first with values), the exact values the recorded
pools (the demo's archive ``docs/demo/eiffel-run``, ``<game>_exact.parquet``, the long games'
``<game>_pool.parquet``).

**Shapley** (games whose every coalition is recorded exactly and by the proxy: exact Shapley
known). For each exact budget m and seed: ``regression-msr`` at m; ``proxy-shapley`` at m with a
proxy budget of ``multiple * m`` (capped at 2^n); the proxy alone (RegressionMSR of the proxy game
at ``multiple * m``, its values taken as the exact game's). Printed: the median over seeds of the
relative L2 error ``||phi_hat - phi|| / ||phi||`` against the exact Shapley values of the exact
game, the ratio to regression-msr's, the share of (seed, player) cells whose 95% interval covers
the exact value, and the largest |mean - phi| / (sd / sqrt(seeds)) over the players (a bias check:
about 2-3 for an unbiased estimator at 10-14 players).

``--games analytic`` runs the same on the Harsanyi-dividend game of the tests (n = 8, its proxy
in-script): the bias check at 200 seeds. Every game shows ``proxy-shapley-shrunk`` (the cross-fitted
estimate blended toward its control with jackknife weights, ``proxy/blend.py``) and
``proxy-shapley`` three ways: the default
(cross-fitted, its least squares weighted by each coalition's weight in the importance-sampled
term's variance, the linear terms ridged), ``ridge=0, weighting="draws"`` (the estimator before
that: least squares, each coalition weighted by its draws) and ``cross_fit=False`` (b fitted on
the exact coalitions, then ``b phi(c) + regression-msr(v - b c)``). ``--guided 0.5,0.7`` adds
rows of the proxy-guided plan (``benchmarks/guided.py``: the exact pairs drawn from a mixture of
KernelSHAP's distribution, share ``mix``, and one guided by the proxy's residual; the proxy on all
2^n coalitions).

**LASSO / LDS** (the long games, 67-73 sentence players). As ``benchmarks/long_context.py
--resamples``: each draw takes m exact coalitions at random (seed 1000 + draw) from the game's
recorded seed-0 keep-half plan of 256 (its empty and full coalitions always in), and K = multiple *
m proxy coalitions at random (seed 2000 + draw) from the proxy's recorded keep-half rows (``lasso``'s
seed-0 plan of ``proxy_tail.py --proxy-budget``). Fitted: ``auto``'s exact-only surrogate (LASSO,
``cv_rule="dense-1se"``) on the m exact rows; the control-variate LASSO (:class:`ControlVariateLasso`'s
fit on plain arrays: ``fit_lasso_with_covariate`` on the m exact rows with c, ``phi(c)`` the LASSO
surrogate of the K proxy rows) with both CV rules; the default two-fidelity surrogate (``cv-ridge``:
``phi(c)`` by least squares on the K proxy rows from 8 (n + 1) of them, the LASSO below; the
correction w by :func:`fit_ridge_with_covariate` with :func:`ridge_penalties`); the proxy alone
(its LASSO, and its least squares); ContextCite (its solver on m of
its 256 recorded ablations). Judged by the LDS: the Spearman correlation of ``sum_{i in S} phi_i``
with the exact v(S) over the game's 32 held-out coalitions; median and interquartile range over
the draws. (ContextCite's rows need the ``context-cite`` package; without it they are left out.) Cost in exact-row equivalents: ``m + K * r``, with r the proxy's tokens computed per row
over an exact row's (the file's metadata).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

EXACT_GAMES = ("demo", "eiffel12", "pythonlabs_multihop14", "faq_chat14")
LONG_GAMES = ("long_design", "long_glossary", "long_unicode")


def unpack(keys: list[bytes], n: int) -> np.ndarray:
    packed = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
    return np.unpackbits(packed, axis=1, count=n, bitorder="little").astype(bool)


def pack(rows: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in np.packbits(np.asarray(rows, dtype=bool), axis=1, bitorder="little")]


def exact_pool(name: str, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(masks [m, n] bool, utilities [m] float64)``: the game's recorded exact values."""
    if name == "demo":
        run = ROOT / "docs" / "demo" / "eiffel-run"
        n = len(json.loads((run / "manifest.json").read_text())["snapshots"][0]["players"])
        t = pa.concat_tables([pq.read_table(p, columns=["mask", "utility"]) for p in sorted((run / "parts").glob("*.parquet"))])
    else:
        t = pq.read_table(data / (f"{name}_pool.parquet" if name in LONG_GAMES else f"{name}_exact.parquet"))
        n = int(t["n_bits"][0].as_py())
    return unpack(t["mask"].to_pylist(), n), np.asarray(t["utility"].to_pylist(), dtype=np.float64)


def proxy_pool(name: str, data: Path, rule: str | None) -> tuple[dict[bytes, float], str, float] | None:
    """``(proxy values by packed mask, rule, tokens per proxy row / tokens per exact row)``, or None."""
    path = data / f"{name}_proxy.parquet"
    if not path.exists():
        return None
    t = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items()}
    columns = [c for c in t.column_names if c.startswith("proxy:")]
    if rule is None:
        rule = next((c[6:] for c in columns if np.isfinite(np.asarray(t[c].to_pylist(), dtype=float)).any()), None)
    if rule is None or f"proxy:{rule}" not in columns:
        return None
    values = np.asarray(t[f"proxy:{rule}"].to_pylist(), dtype=np.float64)
    keep = np.isfinite(values)
    keys = [k for k, ok in zip(t["mask"].to_pylist(), keep) if ok]
    ratio = float("nan")
    if "layouts" in meta and "exact_row_tokens" in meta:
        layout = json.loads(meta["layouts"]).get(rule, {})
        if "tail_tokens" in layout:
            ratio = float(layout["tail_tokens"]) / float(meta["exact_row_tokens"])
    return dict(zip(keys, values[keep].tolist())), rule, ratio


def shapley_rows(name: str, masks, u, proxy: dict, budgets, multiples, seeds, guided=()) -> list[dict]:
    from coalescence.attribution.estimators import ExactShapley, RegressionMSR
    from coalescence.attribution.estimators.proxy import ShrunkTwoFidelityShapley, TwoFidelityShapley
    from guided import guided_plan, guided_shapley

    n = masks.shape[1]
    c = np.array([proxy.get(k, np.nan) for k in pack(masks)])
    if np.isnan(c).any():
        print(f"{name}: the proxy covers {int(np.isfinite(c).sum())} of the {len(c)} coalitions; no Shapley rows", file=sys.stderr)
        return []
    phi = ExactShapley().fit(masks, u).values
    phi_c = ExactShapley().fit(masks, c).values
    index = {key: i for i, key in enumerate(pack(masks))}
    scale = float(np.linalg.norm(phi))
    pearson = float(np.corrcoef(u, c)[0, 1])
    rows = []
    for m in budgets:
        base = np.array([RegressionMSR(budget=m, seed=s).fit(masks, u).values for s in seeds])
        rows.append(summary(name, n, pearson, "regression-msr", m, 0, base, None, phi, scale))
        for k in multiples:
            forms = (("proxy-shapley", TwoFidelityShapley, {}), ("proxy-shapley-shrunk", ShrunkTwoFidelityShapley, {}),
                     ("proxy-shapley, unweighted, no ridge", TwoFidelityShapley, {"ridge": 0.0, "weighting": "draws"}),
                     ("proxy-shapley, in-sample b", TwoFidelityShapley, {"cross_fit": False}))
            for label, cls, options in forms:
                ests = [cls(budget=m, seed=s, proxy_budget=k * m, **options).fit_two_fidelity(masks, u, masks, c) for s in seeds]
                vals = np.array([e.values for e in ests])
                se = np.array([e.stderr for e in ests])
                row = summary(name, n, pearson, label, m, min(k * m, 1 << n), vals, se, phi, scale)
                kinds = {("a" + " + b c" * bool(e.diagnostics["control_proxy"]) + " + linear" * bool(e.diagnostics["control_linear"])
                          + " (ridge)" * bool(e.diagnostics.get("control_ridge", 0.0) > 0)) for e in ests}
                row["controls"] = "; ".join(sorted(kinds)) if options.get("cross_fit", True) else "regression-msr of v - b c"
                rows.append(row)
            if guided and k == multiples[0]:  # the exact coalitions drawn from the proxy-guided distribution (the proxy on all 2^n first)
                for mix in guided:
                    ests = []
                    for s in seeds:
                        plan = guided_plan(masks, c, m, s, mix)
                        where = [index[r.tobytes()] for r in np.packbits(plan.rows, axis=1, bitorder="little")]
                        ests.append(guided_shapley(plan, u[where], c[where], phi_c))
                    vals = np.array([e.values for e in ests])
                    se = np.array([e.stderr for e in ests])
                    row = summary(name, n, pearson, f"proxy-shapley, proxy-guided plan (mix {mix:g})", m, 1 << n, vals, se, phi, scale)
                    row["controls"] = "a + b c + linear (ridge)"
                    rows.append(row)
            alone = np.array([RegressionMSR(budget=min(k * m, 1 << n), seed=s).fit(masks, c).values for s in seeds])
            rows.append(summary(name, n, pearson, "proxy alone", 0, min(k * m, 1 << n), alone, None, phi, scale))
    return rows


def analytic_game(n: int = 8):
    """``(masks, v, c)``: the Harsanyi-dividend game of ``tests/attribution/estimators/test_two_fidelity.py``
    (singletons, 6 pairs, 3 triples; seed 7) and its proxy (dividends moved and scaled, plus a
    smooth nonlinear term; seed 11), over all 2^n coalitions."""
    import itertools

    masks = np.array([[(k >> i) & 1 for i in range(n)] for k in range(1 << n)], dtype=bool)
    rng = np.random.default_rng(7)
    terms = {(i,): float(rng.normal()) for i in range(n)}
    pairs = list(itertools.combinations(range(n), 2))
    for k in rng.choice(len(pairs), size=6, replace=False):
        terms[pairs[k]] = float(rng.normal(0.0, 1.5))
    triples = list(itertools.combinations(range(n), 3))
    for k in rng.choice(len(triples), size=3, replace=False):
        terms[triples[k]] = float(rng.normal(0.0, 2.0))
    v0 = float(rng.normal())

    def play(ts, base):
        out = np.full(masks.shape[0], base)
        for players, d in ts.items():
            out += d * masks[:, list(players)].all(axis=1)
        return out

    other_rng = np.random.default_rng(11)
    other = {t: 0.8 * d + float(other_rng.normal(0.0, 0.25)) for t, d in terms.items()}
    theta = other_rng.normal(0.0, 0.4, size=n)
    return masks, play(terms, v0), play(other, 0.3) + 0.6 * np.sin(masks @ theta)


def summary(name, n, pearson, method, m, k, vals, se, phi, scale) -> dict:
    err = np.linalg.norm(vals - phi, axis=1) / scale
    sd = vals.std(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs(vals.mean(axis=0) - phi) / (sd / np.sqrt(vals.shape[0]))
    known = None if se is None else np.isfinite(se)
    cover = float(np.mean((np.abs(vals - phi) <= 1.959963984540054 * se)[known])) if known is not None and known.any() else None
    return {"game": name, "n": n, "pearson": pearson, "method": method, "exact": m, "proxy": k, "median": float(np.median(err)),
            "p90": float(np.quantile(err, 0.9)), "cover": cover, "bias_z": float(np.nanmax(z)) if np.isfinite(z).any() else float("nan")}


def shapley_table(rows: list[dict]) -> str:
    lines = ["| game | n | Pearson | method | exact | proxy | rel. error median (p90) | vs regression-msr | 95% coverage | max bias z | controls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base: dict = {}
    for r in rows:
        if r["method"] == "regression-msr":
            base[(r["game"], r["exact"])] = r["median"]
        ref = base.get((r["game"], r["exact"])) if r["exact"] else None
        ratio = f"{r['median'] / ref:.2f}x" if ref else "-"
        cover = "-" if r["cover"] is None else f"{r['cover']:.3f}"
        bias = f"{r['bias_z']:.1f}" if r["bias_z"] < 1e6 else "(no spread)"
        lines.append(f"| {r['game']} | {r['n']} | {r['pearson']:.3f} | {r['method']} | {r['exact'] or '-'} | {r['proxy'] or '-'} | "
                     f"{r['median']:.3f} ({r['p90']:.3f}) | {ratio} | {cover} | {bias} | {r.get('controls') or '-'} |")
    return "\n".join(lines)


def lasso_rows(name: str, data: Path, masks, u, proxy: dict, ratio: float, budgets, multiples, draws, fixed=()) -> list[dict]:
    try:
        from context_cite.solver import LassoRegression
    except ImportError:  # the benchmark extra; ContextCite's rows are then left out
        LassoRegression = None

    from coalescence.attribution.estimators.lasso import LassoSurrogate
    from coalescence.attribution.estimators.proxy.lasso import (
        LEAST_SQUARES_ROWS_PER_TERM,
        fit_lasso_with_covariate,
        fit_ridge_with_covariate,
        ridge_penalties,
    )
    from long_games import held_out

    n = masks.shape[1]
    exact = dict(zip(pack(masks), u))
    held = held_out(n)
    held_u = np.array([exact[k] for k in pack(held)])
    ours = np.array(list(LassoSurrogate(budget=256, seed=0, holdout=0.0).plan(n)), dtype=bool)
    ours_u = np.array([exact[k] for k in pack(ours)])
    ours_c = np.array([proxy.get(k, np.nan) for k in pack(ours)])
    if np.isnan(ours_c).any():
        print(f"{name}: the proxy misses {int(np.isnan(ours_c).sum())} of the 256 exact keep-half coalitions", file=sys.stderr)
        return []
    held_keys = set(pack(held))
    proxy_rows = [k for k in proxy if k not in held_keys and k not in set(pack(ours))]
    pr_masks = unpack(proxy_rows, n)
    keep_half = (pr_masks.sum(axis=1) > 0) & (pr_masks.sum(axis=1) < n)
    pr_masks = pr_masks[keep_half]
    pr_c = np.array([proxy[k] for k in pack(pr_masks)])
    t = pq.read_table(data / f"{name}_contextcite.parquet")
    tokens = int(t.schema.metadata[b"response_tokens"])
    theirs = unpack(t["mask"].to_pylist(), n)
    theirs_out = np.asarray(t["logit_prob"].to_pylist(), dtype=np.float32)
    pearson = float(np.corrcoef(ours_u, ours_c)[0, 1])

    def lds(values: np.ndarray) -> float:
        pred = held.astype(float) @ values
        return 0.0 if np.ptp(pred) == 0 else float(spearmanr(pred, held_u).statistic)

    rows = []
    for m in budgets:
        for draw in range(draws):
            rng = np.random.default_rng(1000 + draw)
            pick = np.concatenate([[0, 1], 2 + rng.choice(len(ours) - 2, m - 2, replace=False)])
            x, y, c = ours[pick].astype(float), ours_u[pick], ours_c[pick]
            surrogate = LassoSurrogate(budget=max(m, 16), seed=draw, holdout=0.0, cv_rule="dense-1se")
            values, _ = surrogate._fit_surrogate(ours[pick], y)
            rows.append({"game": name, "method": "auto (exact only)", "exact": m, "proxy": 0, "cost": m, "lds": lds(values)})
            if LassoRegression is not None:
                p = np.random.default_rng(1000 + draw).choice(len(theirs), m, replace=False)
                weight, _ = LassoRegression().fit(theirs[p], theirs_out[p], tokens)
                rows.append({"game": name, "method": "contextcite", "exact": m, "proxy": 0, "cost": m, "lds": lds(np.asarray(weight, dtype=float))})
            for kk in sorted({min(k * m, len(pr_masks)) for k in multiples} | {min(k, len(pr_masks)) for k in fixed}):
                sel = np.random.default_rng(2000 + draw).choice(len(pr_masks), kk, replace=False)
                phi_c, _ = LassoSurrogate(budget=kk, seed=draw, holdout=0.0)._fit_surrogate(pr_masks[sel], pr_c[sel])
                rows.append({"game": name, "method": "proxy alone", "exact": 0, "proxy": kk, "cost": kk * ratio, "lds": lds(phi_c)})
                for rule in ("dense-1se", "min"):
                    w, _, b, _ = fit_lasso_with_covariate(x, y, c, cv_rule=rule, seed=draw)
                    rows.append({"game": name, "method": f"cv-lasso ({rule})", "exact": m, "proxy": kk, "cost": m + kk * ratio,
                                 "lds": lds(b * phi_c + w), "b": b})
                # the default two-fidelity surrogate: phi(c) by least squares (from 8 (n + 1) proxy rows), the ridge correction
                if kk >= LEAST_SQUARES_ROWS_PER_TERM * (n + 1):
                    phi_ls = np.linalg.lstsq(np.column_stack([np.ones(kk), pr_masks[sel]]).astype(float), pr_c[sel], rcond=None)[0][1:]
                    rows.append({"game": name, "method": "proxy alone (least squares)", "exact": 0, "proxy": kk, "cost": kk * ratio, "lds": lds(phi_ls)})
                else:
                    phi_ls = phi_c
                w, _, b = fit_ridge_with_covariate(x, y, c, ridge_penalties(phi_ls))
                rows.append({"game": name, "method": "cv-ridge (default)", "exact": m, "proxy": kk, "cost": m + kk * ratio,
                             "lds": lds(b * phi_ls + w), "b": b})
    for r in rows:
        r["pearson"] = pearson
    return rows


def lasso_table(rows: list[dict]) -> str:
    lines = ["| game | Pearson (256 exact rows) | method | exact m | proxy K | cost (exact rows) | LDS median (IQR) | draws |", "|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["game"], r["method"], r["exact"], r["proxy"]), []).append(r)
    for (game, method, m, k), rs in groups.items():
        x = np.array([r["lds"] for r in rs])
        cost = np.mean([r["cost"] for r in rs])
        lines.append(f"| {game} | {rs[0]['pearson']:.3f} | {method} | {m or '-'} | {k or '-'} | {cost:.1f} | "
                     f"{np.median(x):.3f} ({np.quantile(x, 0.25):.3f}-{np.quantile(x, 0.75):.3f}) | {len(rs)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    ap.add_argument("--rule", default=None)
    ap.add_argument("--games", default=",".join(EXACT_GAMES + LONG_GAMES))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--lasso-budgets", default="8,16,32,64")
    ap.add_argument("--multiples", default="4,8,16,32")
    ap.add_argument("--guided", default="", help="mixes (0-1] of the proxy-guided plan to add to the Shapley rows (proxy on all 2^n)")
    ap.add_argument("--proxy-fixed", default="", help="proxy coalition counts tried besides the multiples (LASSO part)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # regression-msr's "raise the budget" at 16 exact coalitions
    multiples = [int(x) for x in args.multiples.split(",")]
    guided = [float(x) for x in args.guided.split(",") if x]
    shapley, lasso = [], []
    for name in args.games.split(","):
        if name == "analytic":  # the tests' game and proxy, every coalition: the bias check
            masks, u, c = analytic_game()
            proxy = dict(zip(pack(masks), c.tolist()))
            seeds = range(args.seeds)
            budgets = [int(x) for x in args.budgets.split(",")]
            shapley += shapley_rows(name, masks, u, proxy, budgets, multiples, seeds, guided)
            continue
        got = proxy_pool(name, args.data, args.rule)
        if got is None:
            print(f"{name}: no proxy values ({args.data / (name + '_proxy.parquet')}); skipped", file=sys.stderr)
            continue
        proxy, rule, ratio = got
        masks, u = exact_pool(name, args.data)
        print(f"{name}: rule {rule}, {len(proxy)} proxy coalitions, proxy/exact tokens per row {ratio:.4f}", file=sys.stderr)
        if name in LONG_GAMES:
            fixed = [int(x) for x in args.proxy_fixed.split(",") if x]
            lasso += lasso_rows(name, args.data, masks, u, proxy, ratio, [int(x) for x in args.lasso_budgets.split(",")], multiples, args.draws, fixed)
        else:
            shapley += shapley_rows(name, masks, u, proxy, [int(x) for x in args.budgets.split(",")], multiples, range(args.seeds), guided)
    if shapley:
        print(shapley_table(shapley))
        print()
    if lasso:
        print(lasso_table(lasso))


if __name__ == "__main__":
    main()
