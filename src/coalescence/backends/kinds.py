"""Backend kinds: what ``--backend`` names. A kind is a loader and the capabilities it declares.

A loader is ``loader(source, settings, preloaded) -> ScoringBackend``: the resolved model
(:class:`~coalescence.backends.models.ModelSource`), the run's
:class:`~coalescence.backends.settings.BackendSettings` whole, and what the caller already read of
the model (:class:`~coalescence.backends.models.Preloaded`). The built-in loaders live beside
their backends (``backends/hf/loader.py``, ``backends/vllm/loader.py``) and are imported only
when a model loads, so naming a kind imports no model library.

What a kind can do is declared (:class:`Capabilities`) and asked before anything loads: the
settings check asks whether it needs a server URL, the run's checks whether it generates answers
and may play the proxy game. Ray workers (:mod:`coalescence.distributed`) run any kind: they are
an executor, not a kind, and whatever the kind can do its workers can.

Adding a backend is one module (its loader) and one :func:`register_backend` call
(docs/extending.md has a worked example).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..registry import Registry

__all__ = ("BACKENDS", "BackendKind", "Capabilities", "backend_kind", "register_backend")


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a backend kind can do, declared before it loads (preflight asks these, not a field).

    Attributes:
        generate: it generates answers (a conversation without one, a utility that compares
            generated answers); ``False``: it scores given answers only (teacher forcing).
        proxy_game: it may score the shared-KV proxy game (``score_proxy``); the loaded backend
            still says whether its model does (``supports_proxy``, ``proxy_refusal_reason``).
        prefix_cache: it reuses a shared prompt prefix's KV across rows (a conversation's rows
            stay on one Ray worker to keep it warm).
        needs_url: it scores on a running server at ``BackendSettings.server_url`` instead of
            loading weights here (it runs where the server is: not in Ray workers).
        remote_dtype: the dtype it computes in is the server's own, recorded as ``"server"``.
    """

    generate: bool = True
    proxy_game: bool = False
    prefix_cache: bool = False
    needs_url: bool = False
    remote_dtype: bool = False


@dataclass(frozen=True, slots=True)
class BackendKind:
    """A backend kind: its loader (a callable, or ``"module:function"`` imported when first used)
    and its :class:`Capabilities`.

    Args:
        loader: ``loader(source, settings, preloaded) -> ScoringBackend``, or its import path.
        capabilities: what the kind can do (default: generates, no proxy game, no server).
    """

    loader: Callable[..., Any] | str
    capabilities: Capabilities = Capabilities()

    def load(self, source: Any, settings: Any, preloaded: Any) -> Any:
        """The loaded backend: ``loader(source, settings, preloaded)``.

        Raises:
            BackendUnavailable, ConfigError: what the loader raises (the model, its package,
                a device or dtype it refuses).
        """
        loader = self.loader
        if isinstance(loader, str):
            module, _, name = loader.partition(":")
            loader = getattr(importlib.import_module(module), name)
        return loader(source, settings, preloaded)


def _check_kind(name: str, kind: object) -> None:
    if not isinstance(kind, BackendKind) or not (callable(kind.loader) or isinstance(kind.loader, str)):
        raise ConfigError(f"the backend {name!r} must be a callable loader, got {type(kind).__name__}", field="backend")


BACKENDS: Registry[BackendKind] = Registry("backend", field="backend", check=_check_kind)
"""Backend kinds by name (``--backend``); :func:`register_backend` adds one."""


def register_backend(
    name: str, loader: Callable[..., Any] | str | BackendKind, *, capabilities: Capabilities | None = None, replace: bool = False
) -> None:
    """Register a backend kind under ``name``: a loader ``loader(source, settings, preloaded) ->
    ScoringBackend`` (or its ``"module:function"`` path) with the capabilities it declares.

    Args:
        name: the ``--backend`` name.
        loader: the loader, its import path, or a whole :class:`BackendKind`.
        capabilities: what it can do (default :class:`Capabilities`: generates answers, no proxy
            game, no server URL); not with a :class:`BackendKind`, which has its own.
        replace: replace a kind already registered under ``name``.

    Raises:
        ConfigError: an empty name, a loader that is not callable, or a name already registered to
            another kind while ``replace`` is false (field ``backend``).
    """
    if isinstance(loader, BackendKind):
        if capabilities is not None:
            raise ConfigError("a BackendKind has its own capabilities; give the loader alone with them", field="backend")
        kind = loader
    elif callable(loader) or isinstance(loader, str):
        kind = BackendKind(loader, capabilities or Capabilities())
    else:
        raise ConfigError(f"the backend {name!r} must be a callable loader, got {type(loader).__name__}", field="backend")
    BACKENDS.register(name, kind, replace=replace)


def backend_kind(name: str) -> BackendKind:
    """The kind registered under ``name``.

    Raises:
        ConfigError: an unknown name, with the nearest one ("did you mean") and the choices.
    """
    return BACKENDS.lookup(name)


register_backend(
    "hf",
    "coalescence.backends.hf.loader:load_hf",
    capabilities=Capabilities(generate=True, proxy_game=True, prefix_cache=True),
)
register_backend("vllm", "coalescence.backends.vllm.loader:load_vllm", capabilities=Capabilities(generate=True, prefix_cache=True))
register_backend(
    "vllm-server",
    "coalescence.backends.vllm.loader:load_vllm_server",
    capabilities=Capabilities(generate=False, prefix_cache=True, needs_url=True, remote_dtype=True),
)
