"""ContextCite's own ablation masks scored in coalescence's game, refitted by ContextCite's solver.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/long_cc_masks.py long_design 10

Scores ContextCite's 256 recorded ablations of the game (``<game>_contextcite.parquet``) with
coalescence's engine into the game's pool, prints the correlation of ContextCite's own outputs
(logit p in its prompt) with coalescence's logit of p on the same masks, then refits ContextCite's
solver on the same ten draws per budget as ``long_context.py --resamples`` takes from ContextCite's
run: once on ContextCite's outputs (its own run, the table's ContextCite column) and once on
coalescence's utilities of the same masks. Both are judged alike (LDS, drop@3, drop@5: median and
interquartile range). Equal numbers say that what ContextCite's explanations gain comes from its
coalitions, not from its prompt's game.
"""
import os
import sys
import warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
import numpy as np, pyarrow.parquet as pq
from long_games import Pool, held_out, load_game, unpack, DATA, Scorer
import long_context as lc
from context_cite.solver import LassoRegression
gname = sys.argv[1]; draws = int(sys.argv[2])
game = load_game(gname); pool = Pool.open(game)
t = pq.read_table(DATA / f"{gname}_contextcite.parquet")
tokens = int(t.schema.metadata[b"response_tokens"])
theirs = unpack(t["mask"].to_pylist(), game.n); theirs_out = np.asarray(t["logit_prob"].to_pylist(), dtype=np.float32)
missing = pool.missing(theirs)
print('scoring', len(missing), 'of ContextCite masks', flush=True)
if len(missing):
    sc = Scorer(game); pool.add(*sc.score(missing)); sc.close()
ours_u = pool.lookup(theirs)[0]
p = np.exp(np.minimum(ours_u, -1e-12)); ours_logit = (ours_u - np.log1p(-p)).astype(np.float32)
print('correlation of ContextCite outputs and our logit on the same masks', np.corrcoef(theirs_out, ours_logit)[0, 1].round(3))
held = held_out(game.n); held_u = pool.lookup(held)[0]
res = []
for b in (32, 64, 128):
    for d in range(draws):
        rng = np.random.default_rng(1000 + d)
        rng.choice(254, b - 2, replace=False)  # the draw auto's table takes first, so the same ContextCite draws follow
        pick = rng.choice(len(theirs), b, replace=False)
        own = np.asarray(LassoRegression().fit(theirs[pick], theirs_out[pick], tokens)[0], float)
        ours = np.asarray(LassoRegression().fit(theirs[pick], ours_logit[pick], tokens)[0], float)
        res.append((b, d, own, ours))
wanted = np.array([lc.removal(game.n, v, k) for b, d, own, ours in res for v in (own, ours) for k in lc.KS], dtype=bool)
miss = pool.missing(wanted)
print('removals to score', len(miss), flush=True)
if len(miss):
    sc = Scorer(game); pool.add(*sc.score(miss)); sc.close()
for b in (32, 64, 128):
    rows = [(lc.judge(game, pool, own, held, held_u), lc.judge(game, pool, ours, held, held_u)) for bb, d, own, ours in res if bb == b]
    for k in ('lds', 'drop@3', 'drop@5'):
        a = [r[0][k] for r in rows]; c = [r[1][k] for r in rows]
        print(f"| {gname} | {b} | {k} | {np.median(a):.3f} ({np.percentile(a,25):.3f}-{np.percentile(a,75):.3f}) | {np.median(c):.3f} ({np.percentile(c,25):.3f}-{np.percentile(c,75):.3f}) |", flush=True)
