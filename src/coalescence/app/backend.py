"""A run's model and where it executes: :func:`load_model`, the one path every caller loads a
model by (the CLI's runs: explain, replay, evaluate, sweep; the Python API's
:func:`~coalescence.explain` and :class:`~coalescence.Explainer`): the backend of a
:class:`~coalescence.backends.settings.BackendSettings` (re-exported here) in this process, or in
Ray workers (:mod:`coalescence.distributed`, an executor that runs any backend kind).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..backends.settings import MAX_WORKERS, BackendSettings, check_ray_settings, check_server_settings, local_worker_limit

if TYPE_CHECKING:
    from ..backends.models import ModelSource

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


def ray_backend(settings: BackendSettings, source: ModelSource, **preloaded: Any) -> Any:
    """The model of ``settings`` in Ray workers (:func:`~coalescence.distributed.start_ray_backend`);
    the driver plans and renders, so it keeps the tokenizer (``preloaded``'s, else loaded here)."""
    from ..backends.models import Preloaded
    from ..backends.registry import load_config, load_tokenizer
    from ..distributed import start_ray_backend

    given = Preloaded(**preloaded)
    return start_ray_backend(
        source,
        settings,
        Preloaded(
            tokenizer=given.tokenizer or load_tokenizer(source),
            config=given.config or load_config(source),
            fingerprint=given.fingerprint,
        ),
    )


def load_model(settings: BackendSettings, source: ModelSource, *, notify: Callable[[str], None] | None = None, **preloaded: Any) -> Any:
    """The backend of ``settings`` for the resolved model ``source``: in Ray workers when
    ``settings.distributed`` (each worker loads the backend kind the settings name), else in this
    process by :func:`~coalescence.backends.registry.load_backend` (a server kind, ``vllm-server``,
    connects to ``settings.server_url`` instead of loading weights).

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
    from ..backends.models import Preloaded
    from ..backends.registry import load_backend

    s = settings
    if s.distributed:
        if notify is not None:
            where = f"on the Ray cluster at {s.ray_address}" if s.ray_address else "on a local Ray cluster"
            n = f"{s.workers} " if s.workers else ""
            notify(f"starting {n}Ray workers with {s.model or source.model_id} {where} ...")
        return ray_backend(s, source, **preloaded)
    if notify is not None and not s.capabilities.needs_url:  # a server is reached, not loaded
        notify(f"loading {source.model_id} ...")
    with quiet_loading_bars():
        return load_backend(source, s, Preloaded(**preloaded))


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
