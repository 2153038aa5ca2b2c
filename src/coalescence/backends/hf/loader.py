"""The ``hf`` backend's loader: a transformers model and tokenizer in an :class:`~coalescence.backends.hf.HFBackend`
(registered by name in :mod:`coalescence.backends.kinds`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ..base import DEFAULT_BATCH_SIZE
from ..fingerprint import cache_root
from ..models import ModelSource, Preloaded, load_tokenizer, loading_error, model_fingerprint
from .backend import HFBackend

if TYPE_CHECKING:
    from ..settings import BackendSettings

__all__ = ("load_hf",)

logger = logging.getLogger(__name__)


def load_hf(source: ModelSource, settings: BackendSettings, preloaded: Preloaded) -> HFBackend:
    """The ``hf`` backend: ``source``'s weights loaded by transformers on ``settings.device`` in
    ``settings.dtype``, ``settings.batch_size`` rows per forward pass (``None``:
    :data:`~coalescence.backends.base.DEFAULT_BATCH_SIZE`).

    Args:
        source: the resolved model.
        settings: the run's backend settings (device, dtype, batch size read here).
        preloaded: the tokenizer, configuration and fingerprint already read (else read here).

    Raises:
        BackendUnavailable: the model cannot be found or loaded (offline hub, missing files,
            missing ``gguf``/``accelerate`` package), with the reason.
        ConfigError: bad ``dtype``, or a ``device`` that torch does not know, that is not
            available here, or ``meta``.
    """
    device, dtype = settings.device, settings.dtype
    torch_dtype = HFBackend.dtype_from_name(dtype)
    import torch
    from transformers import AutoModelForCausalLM

    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}: {exc}", field="device") from exc
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use --device cpu", field="device")
    if torch_device.type == "meta":
        raise ConfigError("the meta device holds no weights and computes nothing; use --device cpu or cuda", field="device")
    backend_module = getattr(torch, torch_device.type, None)  # torch.mps, torch.xpu, ...
    if torch_device.type != "cpu" and not getattr(backend_module, "is_available", lambda: False)():
        raise ConfigError(f"device {device!r} is not available on this machine; use --device cpu", field="device")
    fingerprint = preloaded.fingerprint if preloaded.fingerprint is not None else model_fingerprint(source)
    tokenizer = preloaded.tokenizer if preloaded.tokenizer is not None else load_tokenizer(source)
    extra: dict[str, Any] = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if preloaded.config is not None:
        extra["config"] = preloaded.config
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch_dtype, **extra)
    except (OSError, ValueError, ImportError) as exc:
        raise loading_error(source, exc) from exc
    model.to(torch_device)
    logger.info("loaded %s (%s, sha256 %s) on %s as %s", source.model_id, source.revision, fingerprint[:12], torch_device, dtype)
    return HFBackend(
        model,
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        max_batch_size=settings.batch_size or DEFAULT_BATCH_SIZE,
        fingerprint=fingerprint,
        calibration_dir=cache_root() / "calibration",
    )
