"""A run's model: loaded in this process, started in Ray workers
(:func:`~coalescence.distributed.start_ray_backend`), or scored by a running ``vllm serve``
(``vllm_url``); and the Ray settings checked before anything starts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError

__all__ = (
    "load_model",
    "quiet_loading_bars",
    "check_ray_settings",
    "ray_backend",
)


def check_ray_settings(s: Any) -> None:
    """Refuse Ray settings that cannot work (``workers``, ``ray_address``, ``gpus_per_worker``,
    ``threads_per_worker`` of a :class:`RunSettings` or :class:`ReplaySettings`)."""
    for name in ("workers", "threads_per_worker"):
        value = getattr(s, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
    if s.ray_address is not None and (not isinstance(s.ray_address, str) or not s.ray_address.strip()):
        raise ConfigError("is empty; give a Ray cluster address (auto, HOST:PORT)", field="ray_address")
    g = s.gpus_per_worker
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
        raise ConfigError(f"must be a number >= 0, got {g!r}", field="gpus_per_worker")
    if not s.distributed:
        for name in ("gpus_per_worker", "threads_per_worker"):
            if getattr(s, name):
                raise ConfigError("applies to Ray workers; add --workers N or --ray-address ADDR", field=name)
    elif g > 0 and s.device == "cpu" and s.backend != "vllm":
        raise ConfigError(
            "reserves accelerators for workers that would compute on --device cpu; add --device cuda (or --backend vllm, "
            "which uses the GPUs it sees)",
            field="gpus_per_worker",
        )


def ray_backend(s: Any, source: Any, **preloaded: Any) -> Any:
    """The settings' model in Ray workers (:func:`~coalescence.distributed.start_ray_backend`)."""
    from ..distributed import start_ray_backend

    return start_ray_backend(
        source,
        workers=s.workers,
        ray_address=s.ray_address,
        gpus_per_worker=float(s.gpus_per_worker),
        threads_per_worker=s.threads_per_worker,
        backend=s.backend,
        device=s.device,
        dtype=s.dtype,
        max_batch_size=s.batch_size,
        tokenizer=preloaded.get("tokenizer"),
        config=preloaded.get("config"),
        fingerprint=preloaded.get("fingerprint"),
    )


def load_model(s: Any, source: Any, *, notify: Callable[[str], None] | None = None, **preloaded: Any) -> Any:
    """The backend of the settings ``s`` (a :class:`~coalescence.app.settings.RunSettings` or
    :class:`~coalescence.app.settings.ReplaySettings`) for the resolved model ``source``: in Ray
    workers when ``s.distributed``, a ``vllm serve`` at ``s.vllm_url``, else the weights loaded in
    this process by :func:`~coalescence.backends.registry.load_backend`.

    Args:
        s: the settings (backend, device, dtype, batch size, Ray and server settings).
        source: the :class:`~coalescence.backends.registry.ModelSource`.
        notify: told what is being started, in one line (e.g. printed by the CLI).
        preloaded: the ``tokenizer``, ``config`` and ``fingerprint`` already at hand.

    Raises:
        BackendUnavailable: the backend's package is missing, or the server cannot be reached.
        ConfigError: a server URL that is not ``http://HOST:PORT``.
    """
    from ..backends.registry import load_backend, load_config, load_tokenizer, model_context, model_fingerprint

    if s.distributed:
        if notify is not None:
            where = f"on the Ray cluster at {s.ray_address}" if s.ray_address else "on a local Ray cluster"
            n = f"{s.workers} " if s.workers else ""
            notify(f"starting {n}Ray workers with {s.model} {where} ...")
        if preloaded.get("tokenizer") is None:  # the driver plans and renders: it keeps the tokenizer
            preloaded["tokenizer"] = load_tokenizer(source)
        if preloaded.get("config") is None:
            preloaded["config"] = load_config(source)
        return ray_backend(s, source, **preloaded)
    if getattr(s, "vllm_url", None):
        from ..backends.vllm import VLLMServerBackend

        tokenizer = preloaded.get("tokenizer") or load_tokenizer(source)
        config = preloaded.get("config") or load_config(source)
        fingerprint = preloaded.get("fingerprint")
        return VLLMServerBackend(
            s.vllm_url,
            tokenizer,
            model_id=source.model_id,
            revision=source.revision,
            fingerprint=fingerprint if fingerprint is not None else model_fingerprint(source),
            max_context=model_context(config, tokenizer),
            **({"max_batch_size": s.batch_size} if s.batch_size else {}),  # else the server backend's own
        )
    if notify is not None:
        notify(f"loading {source.model_id} ...")
    with quiet_loading_bars():
        return load_backend(source, backend=s.backend, device=s.device, dtype=s.dtype, max_batch_size=s.batch_size, **preloaded)


@contextlib.contextmanager
def quiet_loading_bars() -> Iterator[None]:
    """transformers' and huggingface_hub's own progress bars (weight loading, GGUF conversion,
    downloads) off while a model loads, as they were afterwards: the run's own progress is the
    only bar a user sees."""
    import transformers.utils.logging as tf_logging
    from huggingface_hub import utils as hub_utils

    tf_was, hub_was = tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    tf_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if tf_was:
            tf_logging.enable_progress_bar()
        if not hub_was:
            hub_utils.enable_progress_bars()
