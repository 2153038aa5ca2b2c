"""A run's model and where it executes: :class:`BackendSettings` (the model, its backend, device,
dtype and batch, and whether it runs in this process, in Ray workers or through a running ``vllm
serve``), checked on construction (:func:`check_ray_settings`), and :func:`load_model`, the one
path every caller loads a model by: the CLI's runs (explain, replay, evaluate, sweep), the Python
API's :func:`~coalescence.explain` and :class:`~coalescence.Explainer`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .groups import MAX_WORKERS

if TYPE_CHECKING:
    from ..backends.registry import ModelSource
    from .groups import ModelSettings, RaySettings

__all__ = (
    "MAX_WORKERS",
    "BackendSettings",
    "check_ray_settings",
    "check_server_settings",
    "load_model",
    "local_worker_limit",
    "quiet_loading_bars",
    "ray_backend",
)



@dataclass(frozen=True, slots=True, kw_only=True)
class BackendSettings:
    """How a run's model executes: one settings group, the same for every command and the Python
    API (built from a command's settings by :meth:`of`).

    Args:
        model: alias, local model directory, ``.gguf`` file or hub id (``None``: a replay or an
            evaluation with no model of its own).
        backend: the backend by name (:data:`~coalescence.backends.registry.BACKENDS`: ``hf``,
            ``vllm``, ``vllm-server``); ``None`` (default): ``vllm-server`` with a ``vllm_url``,
            else ``hf`` (the settings hold the name chosen).
        device: torch device (``"cpu"``, ``"cuda"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        batch_size: rows per model call; ``None``: the backend's own default.
        vllm_url: a running ``vllm serve`` (``http://HOST:PORT``) scoring instead of weights loaded here.
        workers: model workers in Ray actors (``None``: in this process, unless ``ray_address``);
            at most :data:`MAX_WORKERS`, and on a local cluster at most this machine's CPUs
            (:func:`local_worker_limit`).
        ray_address: a Ray cluster to join (``auto``, ``HOST:PORT``) instead of starting one.
        gpus_per_worker: accelerators each Ray worker reserves (>= 0; needs ``device="cuda"``
            unless the backend is ``vllm``).
        threads_per_worker: torch threads of each Ray worker (default: its node's CPUs divided
            among the workers there).

    Raises:
        ConfigError: an unknown dtype (``field="dtype"``), or server or Ray settings that cannot
            work (:func:`check_server_settings`, :func:`check_ray_settings`, naming the field),
            before anything loads.
    """

    model: str | None = None
    backend: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int | None = None
    vllm_url: str | None = None
    workers: int | None = None
    ray_address: str | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int | None = None

    def __post_init__(self) -> None:
        from ..backends.base import check_dtype

        check_dtype(self.dtype)  # before anything loads torch
        check_server_settings(self)
        if self.backend is None:  # a URL alone picks the server backend
            object.__setattr__(self, "backend", "vllm-server" if self.vllm_url is not None else "hf")
        check_ray_settings(self)

    @classmethod
    def of(cls, *, model: ModelSettings, ray: RaySettings) -> BackendSettings:
        """The backend settings of a command's settings: its model group and its Ray group (a
        :class:`~coalescence.app.settings.RunSettings`, ``ReplaySettings`` or ``EvaluateSettings``
        is both)."""
        return cls(
            model=model.model,
            backend=model.backend,
            device=model.device,
            dtype=model.dtype,
            batch_size=model.batch_size,
            vllm_url=model.vllm_url,
            workers=ray.workers,
            ray_address=ray.ray_address,
            gpus_per_worker=ray.gpus_per_worker,
            threads_per_worker=ray.threads_per_worker,
        )

    @property
    def distributed(self) -> bool:
        """Whether the model runs in Ray workers (``workers`` or ``ray_address`` given)."""
        return self.workers is not None or self.ray_address is not None

    @property
    def backend_name(self) -> str:
        """The backend that scores, as a run records it: ``vllm-server`` with a ``vllm_url``,
        else ``backend``."""
        return "vllm-server" if self.vllm_url is not None else str(self.backend or "hf")


def check_server_settings(settings: BackendSettings) -> None:
    """Refuse a ``vllm_url`` that cannot work, before anything loads.

    Raises:
        ConfigError: naming ``vllm_url``: given but not a string, empty or not
            ``http(s)://HOST[:PORT]``, missing for the ``vllm-server`` backend, given with another
            backend named (``backend="hf"``: weights loaded here, a contradiction; naming both
            fields), or given with Ray workers (``workers``, ``ray_address``), which would load the
            weights in the workers instead.
    """
    url = settings.vllm_url
    if url is None:
        if settings.backend == "vllm-server":
            raise ConfigError("the vllm-server backend scores against a running vllm serve; give its http://HOST:PORT", field="vllm_url")
        return
    if not isinstance(url, str):
        raise ConfigError(
            f"must be a running vllm serve's URL, a string http://HOST:PORT (or https), got {url!r} ({type(url).__name__})",
            field="vllm_url",
        )
    if not url.strip():
        raise ConfigError("is empty; give a running vllm serve's http://HOST:PORT", field="vllm_url")
    parts = urlsplit(url.strip())
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port that is not a number, or out of range
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"must be http://HOST:PORT (or https), got {url!r}", field="vllm_url")
    if settings.backend is not None and settings.backend != "vllm-server":
        raise ConfigError(
            f"only the vllm-server backend takes a URL, and backend {settings.backend!r} loads the weights here; drop "
            "backend (--backend; a vllm_url alone picks vllm-server) or drop vllm_url (--vllm-url)",
            field="vllm_url",
        )
    if settings.workers is not None or settings.ray_address is not None:
        raise ConfigError(
            "scores on a running vllm serve, while --workers/--ray-address load the model in Ray workers; give one of them",
            field="vllm_url",
        )


def check_ray_settings(settings: BackendSettings) -> None:
    """Refuse Ray settings that cannot work (``workers``, ``ray_address``, ``gpus_per_worker``,
    ``threads_per_worker``).

    Raises:
        ConfigError: naming the field: a count that is not a positive integer, more ``workers``
            than :data:`MAX_WORKERS` or, without ``ray_address``, than this machine can host
            (:func:`local_worker_limit`), an empty address, a negative or non-finite
            ``gpus_per_worker``, a worker setting without workers, or GPUs reserved for workers
            that compute on the CPU.
    """
    s = settings
    for name in ("workers", "threads_per_worker"):
        value = getattr(s, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
    if s.workers is not None:
        if s.workers > MAX_WORKERS:
            raise ConfigError(
                f"asks for {s.workers} Ray workers, each holding a copy of the model; the most a run starts is "
                f"{MAX_WORKERS}; give fewer workers",
                field="workers",
            )
        limit = local_worker_limit() if s.ray_address is None else None
        if limit is not None and s.workers > limit:
            raise ConfigError(
                f"asks for {s.workers} Ray workers on a local cluster, which this machine's {limit} CPUs cannot host "
                f"(one worker per CPU, each holding a copy of the model); give at most {limit} workers, or join a "
                "larger cluster (ray_address, --ray-address)",
                field="workers",
            )
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


def local_worker_limit() -> int | None:
    """The most Ray workers a local cluster started for a run hosts: one per CPU of this machine
    (at least 2, the default count); ``None`` when Ray is already running in this process (a
    cluster the caller joined, whose size the workers' placement decides)."""
    ray = sys.modules.get("ray")  # never imported here: only a Ray already in use counts
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return None
    return max(2, os.cpu_count() or 1)


def ray_backend(settings: BackendSettings, source: ModelSource, **preloaded: Any) -> Any:
    """The model of ``settings`` in Ray workers (:func:`~coalescence.distributed.start_ray_backend`);
    the driver plans and renders, so it keeps the tokenizer (``preloaded``'s, else loaded here)."""
    from ..backends.registry import load_config, load_tokenizer
    from ..distributed import start_ray_backend

    s = settings
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
        tokenizer=preloaded.get("tokenizer") or load_tokenizer(source),
        config=preloaded.get("config") or load_config(source),
        fingerprint=preloaded.get("fingerprint"),
    )


def load_model(settings: BackendSettings, source: ModelSource, *, notify: Callable[[str], None] | None = None, **preloaded: Any) -> Any:
    """The backend of ``settings`` for the resolved model ``source``: in Ray workers when
    ``settings.distributed``, a ``vllm serve`` at ``settings.vllm_url``, else the weights loaded
    in this process, both by :func:`~coalescence.backends.registry.load_backend` (the server
    through the registered ``vllm-server`` backend).

    Args:
        settings: the :class:`BackendSettings` (a command's settings give theirs:
            ``backend_settings()``).
        source: the :class:`~coalescence.backends.registry.ModelSource`
            (:func:`~coalescence.backends.registry.resolve_model`).
        notify: told what is being started, in one line (e.g. printed by the CLI).
        preloaded: the ``tokenizer``, ``config`` and ``fingerprint`` already at hand.

    Returns:
        A :class:`~coalescence.backends.base.ScoringBackend` (a Ray backend shuts down with its
        engine: ``shutdown_with_engine``).

    Raises:
        BackendUnavailable: the backend's package is missing, or the model or the server cannot
            be reached.
        ConfigError: an unknown backend, device or dtype; a server URL that is not ``http://HOST:PORT``.
    """
    from ..backends.registry import load_backend

    s = settings
    if s.distributed:
        if notify is not None:
            where = f"on the Ray cluster at {s.ray_address}" if s.ray_address else "on a local Ray cluster"
            n = f"{s.workers} " if s.workers else ""
            notify(f"starting {n}Ray workers with {s.model or source.model_id} {where} ...")
        return ray_backend(s, source, **preloaded)
    if notify is not None and s.vllm_url is None:  # a server is reached, not loaded
        notify(f"loading {source.model_id} ...")
    with quiet_loading_bars():
        return load_backend(
            source, backend=s.backend_name, url=s.vllm_url, device=s.device, dtype=s.dtype, max_batch_size=s.batch_size, **preloaded
        )


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
