"""Proxy rows per second with a proxy row counted by its tail against counted as a whole prompt (issue 37).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_batching.py \\
        [--games long_design] [--rows 128] [--batch-size 16] [--repeats 2] [--threads 1] [--model smollm2-135m]

The proxy game scores each coalition's row as its tail only, against one cached KV of the whole
conversation (``docs/proxy.md``). The collator's length buckets
(:class:`~coalescence.scheduler.buckets.LengthBuckets`, the engine's defaults for the backend:
128, 512, 2048 and 8192-token buckets, a 16,384-token budget) used to take a proxy row by its
whole length (``n_tokens``), so on a long conversation a call took ``16384 // 8192 = 2`` rows or
``16384 // 2048 = 8``; now the row is bucketed by its own tokens and its shared KV counted once per
call (``admit(..., shared_tokens=request.shared_tokens)``, what the scoring pipeline passes), so
a call takes ``batch_size`` rows.

For each recorded long game (``benchmarks/data/<game>.json``, sentence players; the coalitions: the
first ``--rows`` of its recorded pool), or ``scale:T`` (``benchmarks/long_scale.py``'s joined long
games cut to ``T`` tokens; ``--rows`` keep-half coalitions of ``default_rng(0)``), the same proxy rows (tail rule ``after-last-player``, drop
policy) go through one :class:`~coalescence.scheduler.collator.Collator` per run in front of
``backend.score_proxy``, with at most ``2 x batch_size`` rows in flight as in the engine, under
the old accounting (``whole``: ``shared_tokens=0``) and the new one (``tail``), alternately,
``--repeats`` times each after one warm-up call that puts the shared KV in the prefix cache. It
prints per accounting the calls, rows per call, rows per second (best of the repeats) and the
ratio tail/whole, and checks that both give every row the same value (max |difference|, nats).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
sys.path.insert(0, str(ROOT / "benchmarks"))


def proxy_rows(name: str, rows: int, backend, plan: str = "pool"):
    """The first ``rows`` recorded coalitions of long game ``name`` as proxy requests, or
    (``plan="default"``) the first ``rows`` of the proxy plan the default plan plays on it (seed 0:
    :class:`~coalescence.attribution.estimators.default.DefaultMethod` with the proxy game)."""
    import pyarrow.parquet as pq
    from long_games import load_game

    from coalescence.masking.policies import DropPolicy
    from coalescence.masking.proxy import proxy_layout
    from coalescence.masking.render import ChatRenderer
    from coalescence.snapshot import ConversationSnapshot

    if name.startswith("scale:"):  # long_scale.py's joined long games, cut to this many tokens
        from long_scale import build

        from coalescence.conversation import Conversation

        snapshot = ConversationSnapshot.build(Conversation.from_dict(build(400, int(name[6:]))), unit="sentence")
        n = snapshot.n_players
        masks = np.random.default_rng(0).random((rows, n)) < 0.5  # keep-half coalitions
    else:
        snapshot = ConversationSnapshot.build(load_game(name).conversation, unit="sentence")
        n = snapshot.n_players
        if plan == "default":
            from coalescence import make_estimator

            estimator, _ = make_estimator("default", seed=0).resolve(n, proxy=True)
            masks = np.array(list(estimator.proxy_plan(n)), dtype=bool)[:rows]
        else:
            t = pq.read_table(DATA / f"{name}_pool.parquet")
            packed = np.frombuffer(b"".join(t["mask"].to_pylist()[:rows]), dtype=np.uint8).reshape(min(rows, t.num_rows), -1)
            masks = np.unpackbits(packed, axis=1, count=n, bitorder="little").astype(bool)
    renderer = ChatRenderer(backend.tokenizer)
    policy = DropPolicy()
    layout = proxy_layout(renderer, snapshot, renderer.target_tokens(snapshot, policy), tail="after-last-player", policy=policy)
    return n, [layout.request(row, prefix_group=snapshot.snapshot_id) for row in masks]


def run(backend, requests, batch_size: int, tail: bool) -> tuple[float, list[int], np.ndarray]:
    """Every request through a fresh collator: ``(seconds, rows of each call, [m] utilities)``."""
    import anyio

    from coalescence.engine.lanes import default_buckets
    from coalescence.scheduler.collator import Collator, CollatorBackend

    calls: list[int] = []

    def fn(prompts, call_kwargs, row_kwargs):
        calls.append(len(prompts))
        return backend.score_proxy(prompts)

    collator = Collator(CollatorBackend(fn=fn), max_batch_size=batch_size, buckets=default_buckets(backend, batch_size))
    out = np.empty(len(requests))

    async def main() -> None:
        limit = anyio.CapacityLimiter(2 * batch_size)  # the engine's rows in flight

        async def one(i: int) -> None:
            r = requests[i]
            async with limit:
                result = await collator.submit(
                    r, key_extra=("proxy",), n_tokens=r.n_tokens, shared_tokens=r.shared_tokens if tail else 0
                )
            out[i] = result.utility

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)

    t0 = time.perf_counter()
    anyio.run(main)
    return time.perf_counter() - t0, calls, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--games", default="long_design")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from coalescence import load_backend

    backend = load_backend(args.model, dtype="float32", device="cpu")
    print("| game | n | tokens | shared KV | tail | rows | accounting | calls | rows/call | rows/s | tail/whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in [g for g in args.games.split(",") if g]:
        n, requests = proxy_rows(name, args.rows, backend)
        backend.score_proxy(requests[:1])  # the shared KV into the prefix cache
        best: dict[bool, tuple[float, list[int], np.ndarray]] = {}
        for _ in range(args.repeats):
            for tail in (False, True):
                got = run(backend, requests, args.batch_size, tail)
                if tail not in best or got[0] < best[tail][0]:
                    best[tail] = got
        diff = float(np.abs(best[True][2] - best[False][2]).max())
        r0 = requests[0]
        rate = {tail: len(requests) / best[tail][0] for tail in best}
        for tail in (False, True):
            seconds, calls, _ = best[tail]
            ratio = f"{rate[True] / rate[False]:.2f}x" if tail else ""
            print(
                f"| {name} | {n} | {r0.n_tokens} | {r0.shared_tokens} | {r0.tail_tokens} | {len(requests)} | "
                f"{'tail' if tail else 'whole'} | {len(calls)} | {np.mean(calls):.1f} | {rate[tail]:.1f} | {ratio} |",
                flush=True,
            )
        print(f"<!-- {name}: max |tail - whole| = {diff:.2e} nats -->", flush=True)


if __name__ == "__main__":
    main()
