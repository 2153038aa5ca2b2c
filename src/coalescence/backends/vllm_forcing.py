"""The forcing processor's former path: a server started with ``--logits-processors
coalescence.backends.vllm_forcing:ForcedAnswer`` still loads it. The processor is
:mod:`coalescence.backends.vllm.forcing` (:data:`~coalescence.backends.vllm.FORCING_PROCESSOR`)."""

from __future__ import annotations

from .vllm.forcing import FORCED_TOKENS, ForcedAnswer

__all__ = ("FORCED_TOKENS", "ForcedAnswer")
