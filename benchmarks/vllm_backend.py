"""The transformers backend against vLLM in-process and a vLLM server, side by side in one run.

For each game (``demo``: examples/eiffel.json by sentence, exact Shapley; ``rag12``:
benchmarks/data/rag12_stdlib.json by document, KernelSHAP's plan at ``--rag-budget``), the same
coalitions (the plan's distinct masks) go through ``Engine.evaluate`` on each backend: wall time,
token positions computed, positions served from a cache, and the largest |difference| of a
coalition's utility from the transformers backend's (nats).

    PYTHONPATH=src python benchmarks/vllm_backend.py --games demo,rag12 [--vllm-url http://127.0.0.1:8000]

The server (optional) must serve SmolLM2-135M-Instruct in float32, e.g. the directory the vllm
backend converted (``~/.cache/coalescence/float32/<fingerprint>``):
``python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio
import numpy as np

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import make_estimator

ROOT = Path(__file__).resolve().parent.parent
GAMES = {
    "demo": ("examples/eiffel.json", "sentence", "exact", None),
    "rag12": ("benchmarks/data/rag12_stdlib.json", "document", "kernelshap", 32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", default="demo,rag12")
    ap.add_argument("--rag-budget", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="rows per backend call (the engine's collator)")
    ap.add_argument("--vllm-url", default=None, help="also a running vLLM server of the same model")
    args = ap.parse_args()
    backends = {"hf": load_backend("smollm2-135m", max_batch_size=args.batch_size)}
    t0 = time.perf_counter()
    backends["vllm"] = load_backend("smollm2-135m", backend="vllm", max_batch_size=args.batch_size)
    print(f"vllm engine start (and float32 conversion on a first run): {time.perf_counter() - t0:.1f} s")
    if args.vllm_url:
        from coalescence.backends.vllm import VLLMServerBackend

        hf = backends["hf"]
        backends["server"] = VLLMServerBackend(
            args.vllm_url, hf.tokenizer, model_id=hf.model_id, revision=hf.revision, max_context=hf.max_context,
            max_batch_size=args.batch_size,
        )
    policy = get_policy("drop")
    for game in args.games.split(","):
        path, unit, method, budget = GAMES[game]
        budget = args.rag_budget if budget else None
        engine = Engine(backends["hf"])
        snap = engine.prepare(load_conversation(ROOT / path), unit=unit)
        masks = np.array(list(make_estimator(method, budget=budget, seed=0).plan(snap.n_players)), dtype=bool)
        _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
        masks = masks[np.sort(first)]
        print(f"\n## {game}: {snap.n_players} players, {len(masks)} coalitions ({method})\n")
        print("| backend | wall s | tokens computed | cached tokens | max abs diff vs hf (nats) |")
        print("|---|---:|---:|---:|---:|")
        reference = None
        for name, backend in backends.items():
            before = backend.statistics()
            t0 = time.perf_counter()
            _, utilities = anyio.run(Engine(backend, batch_size=args.batch_size).evaluate, snap, policy, masks)
            wall = time.perf_counter() - t0
            after = backend.statistics()
            reference = utilities if reference is None else reference
            diff = float(np.max(np.abs(np.asarray(utilities) - np.asarray(reference))))
            print(
                f"| {name} | {wall:.1f} | {after.tokens_computed - before.tokens_computed:,} | "
                f"{after.tokens_reused - before.tokens_reused:,} | {diff:.2e} |"
            )
    for backend in backends.values():
        backend.shutdown()


if __name__ == "__main__":
    main()
