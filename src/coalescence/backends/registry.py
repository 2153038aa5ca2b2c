"""Loading a model into a backend by name: :func:`load_backend`, the one road from a model name and
its :class:`~coalescence.backends.settings.BackendSettings` to a loaded
:class:`~coalescence.backends.base.ScoringBackend`.

The backend kinds and their capabilities are :mod:`coalescence.backends.kinds` (``hf``, ``vllm``,
``vllm-server``, each loader beside its backend); model names, aliases and what is read of a model
besides its weights are :mod:`coalescence.backends.models`. Their names are re-exported here.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .fingerprint import cache_root
from .kinds import BACKENDS, BackendKind, Capabilities, backend_kind, register_backend
from .models import (
    ALIASES,
    ModelSource,
    Preloaded,
    load_config,
    load_tokenizer,
    model_context,
    model_fingerprint,
    resolve_model,
)
from .settings import FORMER_NAMES, BackendSettings

__all__ = (
    "ALIASES",
    "BACKENDS",
    "BackendKind",
    "BackendSettings",
    "Capabilities",
    "cache_root",
    "float32_directory",
    "load_backend",
    "load_config",
    "load_tokenizer",
    "model_context",
    "model_fingerprint",
    "ModelSource",
    "Preloaded",
    "register_backend",
    "resolve_model",
)

_RENAMED = {"max_batch_size": "batch_size", "url": "server_url"}  # the keywords' earlier names (vllm_url: BackendSettings')


def load_backend(
    spec: str | ModelSource, settings: BackendSettings | None = None, preloaded: Preloaded | None = None, **options: Any
) -> Any:
    """Load a model into a backend kind (default ``hf``: transformers), or connect to a server
    backend (``vllm-server`` with a ``server_url``: a running ``vllm serve``), in this process.

    Args:
        spec: a ``--model`` value or a resolved :class:`~coalescence.backends.models.ModelSource`.
        settings: the backend settings, whole (its Ray fields are not read: this process loads).
        preloaded: the tokenizer, configuration and fingerprint already read (:class:`Preloaded`).
        options: instead of ``settings``, its fields by name (``backend``, ``device``, ``dtype``,
            ``batch_size``, ``server_url``; ``max_batch_size``, and ``url`` and ``vllm_url``, are
            accepted for ``batch_size`` and ``server_url``), and instead of ``preloaded``, its fields
            (``tokenizer``, ``config``, ``fingerprint``).

    Returns:
        A :class:`~coalescence.backends.base.ScoringBackend`.

    Raises:
        ConfigError: an unknown backend name (with a "did you mean"), an unknown option, bad
            ``device`` or ``dtype``, or a server backend without its URL.
        BackendUnavailable: the model cannot be found or loaded (offline hub, missing files,
            missing ``gguf``/``accelerate`` package), with the reason.
    """
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    if options:
        loaded = {k: options.pop(k) for k in ("tokenizer", "config", "fingerprint") if k in options}
        if loaded:
            if preloaded is not None:
                raise ConfigError("give the model's preloaded parts as preloaded or as keywords, not both", field="preloaded")
            preloaded = Preloaded(**loaded)
        if options:
            if settings is not None:
                raise ConfigError(f"give settings or their fields ({', '.join(sorted(options))}), not both", field="settings")
            fields = {_RENAMED.get(k, k): v for k, v in options.items()}
            unknown = sorted(set(fields) - set(BackendSettings.__dataclass_fields__) - set(FORMER_NAMES))
            if unknown:
                raise ConfigError(f"unknown backend option {unknown[0]!r}; use a field of BackendSettings", field=unknown[0])
            settings = BackendSettings(**fields)
    settings = settings if settings is not None else BackendSettings()
    return backend_kind(settings.backend_name).load(source, settings, preloaded or Preloaded())


def __getattr__(name: str) -> Any:
    if name == "float32_directory":  # beside the vLLM backend; imported only when asked for
        from .vllm.loader import float32_directory

        return float32_directory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
