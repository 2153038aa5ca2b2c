"""Interleaved A/B of the engine overhead benchmark: two source trees in one process.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/scheduler_overhead_ab.py BASE_ROOT NEW_ROOT [--pairs 10]

Each root is a checkout (``ROOT/src`` its sources, ``ROOT/benchmarks/scheduler_overhead.py`` its
benchmark). Both trees are imported into this process (the ``coalescence`` modules are swapped in
``sys.modules`` between the imports; each benchmark keeps its own), then their ``one_run`` (batch
64, 2**players coalitions) alternate run by run, the order flipping every pair, so both see the same
machine load. Prints each tree's median and best coalitions/s and CPU microseconds per coalition,
and the median ratio new/base of coalitions/s (and base/new of CPU time) over the pairs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import anyio


def load(root: Path, tag: str) -> ModuleType:
    """``root``'s benchmark module, importing ``root/src``'s ``coalescence`` afresh."""
    for name in [n for n in sys.modules if n == "coalescence" or n.startswith("coalescence.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root / "src"))
    try:
        spec = importlib.util.spec_from_file_location(f"scheduler_overhead_{tag}", root / "benchmarks" / "scheduler_overhead.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(root / "src"))
    where = Path(sys.modules["coalescence"].__file__ or "").resolve()
    if not where.is_relative_to((root / "src").resolve()):
        raise SystemExit(f"{root}: imported coalescence from {where}")
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--players", type=int, default=14)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    modules = {"base": load(args.base, "base"), "new": load(args.new, "new")}
    m = 2**args.players
    wall: dict[str, list[float]] = {k: [] for k in modules}
    cpu: dict[str, list[float]] = {k: [] for k in modules}
    with tempfile.TemporaryDirectory() as tmp:
        for k, module in modules.items():  # warm-up: imports, memos
            anyio.run(module.one_run, args.players, args.batch, Path(tmp) / f"warm-{k}")
        for i in range(args.pairs):
            for k in ("base", "new") if i % 2 == 0 else ("new", "base"):
                c0 = time.process_time()
                wall[k].append(anyio.run(modules[k].one_run, args.players, args.batch, Path(tmp) / f"{k}-{i}"))
                cpu[k].append((time.process_time() - c0) / m * 1e6)
    print(f"{m} coalitions, batch {args.batch}, {args.pairs} interleaved pairs")
    for k in modules:
        print(
            f"{k:>4} {getattr(args, k)}: coalitions/s median {m / statistics.median(wall[k]):,.0f}, best "
            f"{m / min(wall[k]):,.0f}; CPU us/coalition median {statistics.median(cpu[k]):.1f}, best {min(cpu[k]):.1f}"
        )
    speed = [b / n for b, n in zip(wall["base"], wall["new"], strict=True)]
    work = [b / n for b, n in zip(cpu["base"], cpu["new"], strict=True)]
    print(
        f"new/base coalitions/s: median {statistics.median(speed):.2f} (pairs {min(speed):.2f}-{max(speed):.2f}); "
        f"base/new CPU time: median {statistics.median(work):.2f} (pairs {min(work):.2f}-{max(work):.2f})"
    )


if __name__ == "__main__":
    main()
