"""Proxy rows of this checkout against the same rows run by an earlier commit's code (issue 47).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/proxy_rows_against.py [--commit 679dc52] \\
        [--games long_design,long_glossary,long_unicode] [--rows 96] [--batch-size 16] \\
        [--repeats 3] [--threads 2] [--plan default]

Issue 47 asks for a proxy row "at least 1.3x faster than at 679dc52, measured side by side in one
run (the same rows, the same values within 1e-4 nats)". ``proxy_rows.py --compare`` approximates
679dc52's method inside this checkout (``rotated_key_rows``, with the later in-place rotation);
this script runs **the commit's own code**: a detached ``git worktree`` of ``--commit`` (made
under ``/tmp`` if missing) serves one model worker process, this checkout's ``src/`` the others,
each loading the model once. The rows are built here (``proxy_batching.proxy_rows``, the same
requests for every worker: :class:`~coalescence.backends.rows.ProxyScoreRequest` is unchanged
since 679dc52) and sent to every worker; the workers then take turns, one at a time (the others
wait idle on their pipes), after one untimed warm-up round each, the order turned each round, each timing all rows through
``backend.score_proxy`` in calls of ``--batch-size`` rows after the shared KV was cached. Workers:
the commit; this checkout's rotated copy (``rotated_key_rows``: how close the in-checkout stand-in
is to the commit); this checkout's default; the same at twice the rows per call. Printed per game: median wall and CPU ms per row, the
median (and range) of the rounds' wall ratios to the commit, the largest |difference| of a row's
utility from the commit's (nats); load averages on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

WORKERS = {
    "commit": {},
    "rotated keys (here)": {"rotated_key_rows": True, "parallel_forwards": False},
    "default (here)": {},
    "default (here), 2x rows per call": {"rows_per_call": 2},
}
"""The workers: the commit's code (its defaults), and this checkout's ``HFBackend`` with these
attributes set (the first ratio's baseline is the commit); ``rows_per_call`` is not an attribute
but a multiple of ``--batch-size`` for that worker's calls (the rows of a larger proxy call)."""


def worker(args: argparse.Namespace) -> None:
    """One model process: load, read the rows, then time them on each ``run`` line of stdin."""
    import torch

    torch.set_num_threads(args.threads)
    from coalescence import load_backend
    from coalescence.backends.rows import ProxyScoreRequest

    backend = load_backend(args.model, dtype="float32", device="cpu")
    attrs = json.loads(args.attrs)
    per_call = attrs.pop("rows_per_call", 1)
    for attr, value in attrs.items():
        setattr(backend, attr, value)
    rows: list[ProxyScoreRequest] = []
    primed = False
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["do"] == "rows":
            rows = [
                ProxyScoreRequest(**{
                    **r, "prompt_ids": tuple(r["prompt_ids"]), "target_ids": tuple(r["target_ids"]),
                    "hidden": tuple(map(tuple, r["hidden"])),
                })
                for r in msg["rows"]
            ]
            backend.score_proxy(rows[:1])  # the shared KV into the prefix cache
            primed = True
            print(json.dumps({"ok": True}), flush=True)
        elif msg["do"] == "run":
            assert primed
            size = msg["batch_size"] * per_call
            t0, c0 = time.perf_counter(), time.process_time()
            got = []
            for at in range(0, len(rows), size):
                got += backend.score_proxy(rows[at : at + size])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(json.dumps({"wall": wall, "cpu": cpu, "utilities": [g.utility for g in got]}), flush=True)
        else:
            return


def _worktree(commit: str) -> Path:
    """A detached worktree of ``commit`` (its ``src/`` is what the commit's worker imports)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], capture_output=True, text=True, check=True).stdout.strip()
    path = Path("/tmp") / f"coalescence-at-{sha}"
    if not (path / "src" / "coalescence").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True, capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", default="679dc52")
    ap.add_argument("--games", default="long_design,long_glossary,long_unicode")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--plan", choices=("pool", "default"), default="default")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attrs", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        worker(args)
        return
    import numpy as np
    from proxy_batching import proxy_rows
    from proxy_rows import table_row

    from coalescence import load_backend

    builder = load_backend(args.model, dtype="float32", device="cpu")  # its tokenizer renders the rows
    then = _worktree(args.commit)
    procs: dict[str, subprocess.Popen] = {}
    for name, attrs in WORKERS.items():
        src = then / "src" if name == "commit" else ROOT / "src"
        env = {**os.environ, "PYTHONPATH": str(src)}
        cmd = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--model", args.model, "--attrs", json.dumps(attrs)]
        procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(src.parent))

    def ask(name: str, msg: dict | None = None) -> dict:
        p = procs[name]
        if msg is not None:
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()
        while True:
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"worker {name!r} ended")
            if line.startswith("{"):
                return json.loads(line)

    for name in procs:
        ask(name)  # loaded
    names = list(WORKERS)
    print(f"load average before: {os.getloadavg()}; commit {args.commit} at {then}", file=sys.stderr)
    print(
        "| game | shared KV | tail | rows | rows per call | "
        + " | ".join(f"{v} ms / row (CPU)" for v in names)
        + " | " + " | ".join(f"{v}: speed-up over the commit (median, range)" for v in names[1:])
        + " | max abs diff from the commit (nats) |"
    )
    print("|---" * (6 + 2 * len(names) - 1) + "|")
    try:
        for game in [g for g in args.games.split(",") if g]:
            _, requests = proxy_rows(game, args.rows, builder, args.plan)
            payload = [
                {"prompt_ids": list(r.prompt_ids), "target_ids": list(r.target_ids), "tail_start": r.tail_start,
                 "hidden": [list(h) for h in r.hidden], "prefix_group": r.prefix_group}
                for r in requests
            ]
            for name in names:
                ask(name, {"do": "rows", "rows": payload})
                ask(name, {"do": "run", "batch_size": args.batch_size})  # warm-up, untimed
            wall: dict[str, list[float]] = {v: [] for v in names}
            cpu: dict[str, list[float]] = {v: [] for v in names}
            values: dict[str, np.ndarray] = {}
            for i in range(args.repeats):
                for v in names[i % len(names) :] + names[: i % len(names)]:
                    out = ask(v, {"do": "run", "batch_size": args.batch_size})
                    wall[v].append(out["wall"])
                    cpu[v].append(out["cpu"])
                    values[v] = np.array(out["utilities"])
            print(table_row(game, requests, args.batch_size, names, wall, cpu, values), flush=True)
    finally:
        for p in procs.values():
            try:
                p.stdin.write(json.dumps({"do": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
            p.wait(timeout=60)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
