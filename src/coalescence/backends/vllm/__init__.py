"""The vLLM backends: ``vllm`` (:class:`VLLMBackend`, vLLM's engine in this process, :mod:`.engine`)
and ``vllm-server`` (:class:`VLLMServerBackend`, a running ``vllm serve``, :mod:`.server`), both
around the envelope of :class:`~coalescence.backends.base.BackendBase`; what they share (vLLM's
import, the forced answer's key, reading log-probabilities) in :mod:`.common`; the logits processor
that forces an answer's tokens, which a server loads by :data:`FORCING_PROCESSOR`, in
:mod:`.forcing` (the only module here that imports vLLM at its top: this package imports it
only when an engine starts)."""

from __future__ import annotations

from .common import FORCING_PROCESSOR, INSTALL_HINT, import_vllm
from .engine import CPU_BLOCK_SIZE, CPU_KV_CACHE_GIB, VLLMBackend
from .server import VLLMServerBackend

__all__ = ("CPU_BLOCK_SIZE", "CPU_KV_CACHE_GIB", "FORCING_PROCESSOR", "INSTALL_HINT", "VLLMBackend", "VLLMServerBackend", "import_vllm")
