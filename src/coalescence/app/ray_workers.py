"""Ray settings checked, and a run's model started in Ray workers
(:func:`~coalescence.distributed.start_ray_backend`)."""

from __future__ import annotations

import math
from typing import Any


from ..errors import ConfigError

__all__ = (
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
