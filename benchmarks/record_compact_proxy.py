"""The compacted proxy game's values on a recorded game's coalitions (issue 37), as a column of
``benchmarks/data/<game>_proxy.parquet``.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/record_compact_proxy.py GAME [--check N] [--batch 16]

The column ``proxy:compact:after-last-player`` holds the proxy game that ``HFBackend.score_proxy``
plays (``kv-proxy-compact``: the tail rule ``after-last-player``, positions compacted) on every
coalition of the file (its ``mask`` column), in nats; the older ``proxy:<rule>`` columns are the
first proxy game, at the full conversation's positions. Without ``--check`` every coalition is
scored through the backend and the column written (the file's metadata ``layouts`` gains the
rule, with ``positions: compact``). With ``--check N`` nothing is written: N coalitions drawn at
random are scored and compared with the column already there (the largest difference in nats), so
a column recorded by another route can be checked against the backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

RULE = "compact:after-last-player"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("game")
    ap.add_argument("--check", type=int, default=0, metavar="N")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    from coalescence import load_backend
    from coalescence.masking.policies import DropPolicy
    from coalescence.masking.proxy import proxy_layout
    from coalescence.masking.render import ChatRenderer
    from proxy_tail import load
    from proxy_game import unpack

    snapshot, _, _, _ = load(args.game)
    path = ROOT / "benchmarks" / "data" / f"{args.game}_proxy.parquet"
    table = pq.read_table(path)
    masks = unpack(table["mask"].to_pylist(), snapshot.n_players)
    backend = load_backend("smollm2-135m", dtype="float32", device="cpu", max_batch_size=args.batch)
    renderer = ChatRenderer(backend.tokenizer)
    policy = DropPolicy()
    layout = proxy_layout(renderer, snapshot, renderer.target_tokens(snapshot, policy), tail="after-last-player", policy=policy)
    rows = np.arange(len(masks))
    if args.check:
        rows = np.sort(np.random.default_rng(0).choice(len(masks), min(args.check, len(masks)), replace=False))
    values = np.full(len(masks), np.nan)
    for lo in range(0, len(rows), args.batch):
        part = rows[lo : lo + args.batch]
        values[part] = [r.utility for r in backend.score_proxy([layout.request(masks[i]) for i in part])]
    if args.check:
        recorded = np.asarray(table[f"proxy:{RULE}"].to_pylist(), dtype=np.float64)[rows]
        print(f"{args.game}: {len(rows)} coalitions, largest |backend - recorded| = {np.max(np.abs(values[rows] - recorded)):.2e} nats")
        return
    if f"proxy:{RULE}" in table.column_names:
        table = table.drop([f"proxy:{RULE}"])
    table = table.append_column(f"proxy:{RULE}", pa.array(values))
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if "layouts" in meta:
        layouts = json.loads(meta["layouts"])
        layouts[RULE] = dict(layouts.get("after-last-player", {}), positions="compact")
        meta["layouts"] = json.dumps(layouts)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table.replace_schema_metadata(meta), tmp, compression="zstd")
    tmp.replace(path)
    print(f"{args.game}: {len(rows)} coalitions written to {path}")


if __name__ == "__main__":
    main()
