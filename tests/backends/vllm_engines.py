"""One vLLM engine per template family for the whole test session (a vLLM engine takes 25-45 s to
start and 2-4 GiB of memory), shared by the contract suite and tests/backends/test_vllm.py.

Only :data:`VLLM_FAMILIES` get an engine: each family is one more engine start in CI.
"""

from __future__ import annotations

import atexit
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


@atexit.register
def _shutdown() -> None:
    import logging

    logging.disable(logging.CRITICAL)  # vLLM logs its shutdown; the streams may be closed by now
    for backend in _ENGINES.values():
        backend.shutdown()
