"""The ``vllm`` and ``vllm-server`` backends' loaders (registered by name in
:mod:`coalescence.backends.kinds`): vLLM's engine in this process, and a running ``vllm serve``
(a backend kind that declares it needs a server URL). vLLM is imported only when an engine starts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailable, ConfigError
from ..base import VLLM_BATCH_SIZE
from ..fingerprint import cache_root
from ..models import ModelSource, Preloaded, load_config, load_tokenizer, loading_error, model_context, model_fingerprint

if TYPE_CHECKING:
    from ..settings import BackendSettings

__all__ = ("float32_directory", "load_vllm", "load_vllm_server")

logger = logging.getLogger(__name__)


def float32_directory(source: ModelSource, *, fingerprint: str, tokenizer: Any = None) -> Path:
    """A local model directory vLLM can load: the model's own directory, or for a GGUF model
    (the ``smollm2-135m`` alias) its weights de-quantised to float32 and saved once with
    ``save_pretrained`` under ``cache_root()/float32/<fingerprint>`` (a changed GGUF file has
    another fingerprint, so another directory; a half-written one is never used: it is written
    beside and renamed into place).

    Raises:
        BackendUnavailable: the model is a hub id (vLLM needs local files here), or cannot be loaded.
    """
    if source.gguf_file is None:
        if not Path(source.location).is_dir():
            raise BackendUnavailable(
                f"the vllm backend loads local model directories; {source.model_id!r} is not one", field="model"
            )
        return Path(source.location)
    target = cache_root() / "float32" / (fingerprint or "unfingerprinted")
    if (target / "config.json").is_file():
        return target
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, gguf_file=source.gguf_file, dtype=torch.float32)
    except (OSError, ValueError, ImportError) as exc:
        raise loading_error(source, exc) from exc
    # save_pretrained refuses a GGUF-loaded (quantizer-tagged) model: the weights are plain float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    model.save_pretrained(tmp)
    (tokenizer if tokenizer is not None else load_tokenizer(source)).save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to float32 in %s", source.model_id, target)
    return target


def load_vllm(source: ModelSource, settings: BackendSettings, preloaded: Preloaded) -> Any:
    """The ``vllm`` backend: vLLM's engine in this process (:class:`~coalescence.backends.vllm.VLLMBackend`)
    in ``settings.dtype``, ``settings.batch_size`` rows per call (``None``:
    :data:`~coalescence.backends.base.VLLM_BATCH_SIZE`).

    ``settings.device`` is vLLM's own choice (the CPU build on a CPU, CUDA with PyPI's ``vllm``)
    and is not read. The tokenizer is the transformers one (the engine tokenizes; vLLM gets ids).

    Raises:
        BackendUnavailable: vLLM is not installed (naming the install command), the model is not
            local, or vLLM cannot start on it.
        ConfigError: bad ``dtype`` or ``batch_size``.
    """
    from . import VLLMBackend, import_vllm

    import_vllm()  # the install hint before any conversion
    fingerprint = preloaded.fingerprint if preloaded.fingerprint is not None else model_fingerprint(source)
    tokenizer = preloaded.tokenizer if preloaded.tokenizer is not None else load_tokenizer(source)
    directory = float32_directory(source, fingerprint=fingerprint, tokenizer=tokenizer)
    max_context = model_context(preloaded.config, tokenizer) if preloaded.config is not None else None
    return VLLMBackend(
        str(directory),
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        fingerprint=fingerprint,
        dtype=settings.dtype,
        max_batch_size=settings.batch_size or VLLM_BATCH_SIZE,
        max_context=max_context,
    )


def load_vllm_server(source: ModelSource, settings: BackendSettings, preloaded: Preloaded) -> Any:
    """The ``vllm-server`` backend: a running ``vllm serve`` at ``settings.server_url`` scores the
    model's coalitions (:class:`~coalescence.backends.vllm.VLLMServerBackend`); the tokenizer and
    the context are the model's own, loaded here. ``device`` and ``dtype`` are the server's and are
    not read.

    Raises:
        ConfigError: no URL (field ``server_url``).
        BackendUnavailable: the server cannot be reached, or serves another model.
    """
    url = settings.server_url
    if not url:
        raise ConfigError("the vllm-server backend scores against a running vllm serve; give its http://HOST:PORT", field="server_url")
    from . import VLLMServerBackend

    tokenizer = preloaded.tokenizer if preloaded.tokenizer is not None else load_tokenizer(source)
    config = preloaded.config if preloaded.config is not None else load_config(source)
    return VLLMServerBackend(
        url,
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        fingerprint=preloaded.fingerprint if preloaded.fingerprint is not None else model_fingerprint(source),
        max_context=model_context(config, tokenizer),
        **({"max_batch_size": settings.batch_size} if settings.batch_size else {}),  # else the server backend's own
    )
