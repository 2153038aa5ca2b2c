"""How a run's model executes: :class:`BackendSettings` (the model, its backend kind, device,
dtype, batch and server URL, and the Ray workers it may run in), checked on construction before
anything loads. A keyword's earlier name (``vllm_url`` for ``server_url``: :data:`FORMER_NAMES`)
is still taken, by :func:`current_names` before construction. The settings travel whole: a backend's loader
(:mod:`coalescence.backends.kinds`), a Ray worker (:class:`~coalescence.distributed.ModelWorker`)
and the Python API's :class:`~coalescence.Explainer` each take this one object, so an option that
reaches the model is one field here, one command-line option and the loader that reads it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError, InputError
from ..normalised import NormalisedSettings
from .kinds import BackendKind, Capabilities, backend_kind

__all__ = (
    "FORMER_NAMES",
    "MAX_WORKERS",
    "BackendSettings",
    "check_ray_settings",
    "check_server_settings",
    "current_names",
    "local_worker_limit",
    "without_password",
)

MAX_WORKERS = 1024
"""The most Ray workers a run starts (each holds a copy of the model): a larger count is refused
as a slip, on a joined cluster too. A local cluster takes at most this machine's CPUs (at least 2,
the default count), :func:`local_worker_limit`."""

FORMER_NAMES = {"vllm_url": "server_url"}
"""The backend settings' keywords under an earlier name, still taken (by :func:`current_names`):
``vllm_url`` is ``server_url``, the URL of any server backend kind, ``vllm serve``'s or another's."""


def current_names(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (a settings class's keywords, changed in place) with each earlier name
    (:data:`FORMER_NAMES`) under its current one: ``vllm_url=URL`` is ``server_url=URL``.

    Raises:
        ConfigError: both names given, neither ``None``, with different values (naming both;
            ``field`` the current name).
    """
    for old, new in FORMER_NAMES.items():
        if old not in given:
            continue
        value = given.pop(old)
        if value is None:
            continue
        if given.get(new) is not None and given[new] != value:
            raise ConfigError(
                f"is given twice, as {new}={given[new]!r} and as {old}={value!r} (its earlier name); give one, {new}",
                field=new,
            )
        given[new] = value
    return given


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendSettings(NormalisedSettings):
    """How a run's model executes: one settings group, the same for every command and the Python
    API (built from a command's settings by :meth:`of`).

    Args:
        model: alias, local model directory, ``.gguf`` file or hub id (``None``: a replay or an
            evaluation with no model of its own).
        backend: the backend kind by name (:data:`~coalescence.backends.kinds.BACKENDS`: ``hf``,
            ``vllm``, ``vllm-server``, or one registered); ``None`` (default): ``vllm-server``
            with a ``server_url``, else ``hf`` (the settings hold the name chosen).
        device: torch device (``"cpu"``, ``"cuda"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        batch_size: rows per model call; ``None``: the backend's own default.
        server_url: a running server (``http://HOST:PORT``) scoring instead of weights loaded here,
            for a backend kind that needs one (:attr:`~coalescence.backends.kinds.Capabilities.needs_url`:
            ``vllm-server``'s ``vllm serve``, or a registered server kind); ``vllm_url``, its
            earlier name, is taken too (:func:`current_names`).
        workers: model workers in Ray actors (``None``: in this process, unless ``ray_address``);
            at most :data:`MAX_WORKERS`, and on a local cluster at most this machine's CPUs
            (:func:`local_worker_limit`).
        ray_address: a Ray cluster to join (``auto``, ``HOST:PORT``) instead of starting one.
        gpus_per_worker: accelerators each Ray worker reserves (>= 0; needs ``device="cuda"``
            unless the backend is ``vllm``).
        threads_per_worker: torch threads of each Ray worker (default: its node's CPUs divided
            among the workers there).

    Raises:
        ConfigError: a model that is not a str or path (``field="model"``), a batch size that is
            not a positive integer (``field="batch_size"``), an unknown dtype (``field="dtype"``), ``server_url`` and ``vllm_url`` both
            given and different, or server or Ray settings that cannot work (:func:`check_server_settings`, :func:`check_ray_settings`, naming the field),
            before anything loads.
    """

    model: str | None = None
    backend: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int | None = None
    server_url: str | None = None
    workers: int | None = None
    ray_address: str | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int | None = None

    def __post_init__(self) -> None:
        from .base import check_dtype

        check_dtype(self.dtype)  # before anything loads torch
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(
                f"must be a model alias, directory, .gguf file or hub id (a str or a path), got a {type(self.model).__name__}",
                field="model",
            )
        b = self.batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError(f"must be a positive integer (rows per model call), or None for the backend's own; got {b!r}", field="batch_size")
        check_server_settings(self)
        check_ray_settings(self)

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``vllm_url`` taken as ``server_url`` (:func:`current_names`); ``backend`` named: a URL
        alone picks the server backend, else ``hf`` (:attr:`backend_name`).

        Raises:
            ConfigError: ``server_url`` and ``vllm_url`` both given and different.
        """
        given = current_names(given)
        if given.get("backend") is None:
            given["backend"] = "vllm-server" if given.get("server_url") is not None else "hf"
        return given

    @classmethod
    def of(cls, *groups: Any) -> BackendSettings:
        """The backend settings of a command's settings groups (a
        :class:`~coalescence.app.settings.RunSettings`, ``ReplaySettings`` or ``EvaluateSettings``
        is its model group and its Ray group in one): each field from the first group that has an
        attribute of its name, so a new field reaches every command with no list to keep."""
        given = {}
        for f in fields(cls):
            for group in groups:
                if hasattr(group, f.name):
                    given[f.name] = getattr(group, f.name)
                    break
        return cls(**given)

    @property
    def kind(self) -> BackendKind:
        """The backend kind that scores (:func:`~coalescence.backends.kinds.backend_kind`).

        Raises:
            ConfigError: an unknown backend name (with a "did you mean")."""
        return backend_kind(self.backend_name)

    @property
    def capabilities(self) -> Capabilities:
        """What the backend kind can do (:class:`~coalescence.backends.kinds.Capabilities`)."""
        return self.kind.capabilities

    def check_can(self, conversations: Sequence[Any], utility: Any, *, is_batch: bool) -> None:
        """Refuse what the backend kind cannot do, as it declares (:attr:`capabilities`), before
        anything is loaded or written: a kind that does not ``generate`` (a server such as ``vllm
        serve`` scores teacher-forced answers only: :class:`~coalescence.backends.vllm.VLLMServerBackend`)
        gets no utility that compares generated answers and no conversation without an answer.

        Args:
            conversations: the run's :class:`~coalescence.conversation.Conversation` inputs.
            utility: the run's :class:`~coalescence.utility.UtilitySpec` (its ``teacher_forced``, ``kind``).
            is_batch: the inputs are a JSONL batch's lines (an error names the line).

        Raises:
            ConfigError: a utility that generates answers (field ``utility``).
            InputError: a conversation without an answer (it would be generated; field ``target``).
        """
        if self.capabilities.generate:
            return
        name = self.backend_name
        where = f"through --server-url (backend {name})" if self.server_url else f"on backend {name}"
        if not utility.teacher_forced:
            raise ConfigError(
                f"{utility.kind} compares generated answers, and a run {where} only scores given ones; use "
                "a log-probability utility (logprob, mean_logprob, logit_prob, prob) or --backend vllm/hf to generate",
                field="utility",
            )
        for k, conversation in enumerate(conversations):
            if conversation.target is None:
                raise InputError(
                    f"the conversation has no answer to explain, and a run {where} does not generate one; give the "
                    "answer (a final assistant message or target), or use --backend vllm or hf to generate it",
                    field=f"line {k + 1}: target" if is_batch else "target",  # as inputs.on_line labels a line
                )

    @property
    def distributed(self) -> bool:
        """Whether the model runs in Ray workers (``workers`` or ``ray_address`` given)."""
        return self.workers is not None or self.ray_address is not None

    @property
    def backend_name(self) -> str:
        """The backend kind that scores, as a run records it: ``backend``, whose default is
        ``vllm-server`` with a ``server_url``, else ``hf``."""
        return str(self.backend or ("vllm-server" if self.server_url is not None else "hf"))


def check_server_settings(settings: BackendSettings) -> None:
    """Refuse a server URL (``server_url``) that cannot work, before anything loads: a backend
    kind that declares it needs one (:attr:`~coalescence.backends.kinds.Capabilities.needs_url`:
    ``vllm-server``, or a registered server kind) gets a well-formed one, and no other kind gets one.

    Raises:
        ConfigError: naming ``server_url``: given but not a string, empty or not
            ``http(s)://HOST[:PORT]``, missing for a kind that needs one, given with a kind that
            loads the weights here (``backend="hf"``: a contradiction; naming both fields), or
            given with Ray workers (``workers``, ``ray_address``), which would load the weights in
            the workers instead; naming ``backend``: an unknown backend name.
    """
    url = settings.server_url
    name = settings.backend_name
    needs_url = backend_kind(name).capabilities.needs_url
    if url is None:
        if needs_url:
            raise ConfigError(f"the {name} backend scores against a running server; give its http://HOST:PORT", field="server_url")
        return
    if not isinstance(url, str):
        raise ConfigError(
            f"must be a running server's URL, a string http://HOST:PORT (or https), got {url!r} ({type(url).__name__})",
            field="server_url",
        )
    if not url.strip():
        raise ConfigError("is empty; give a running server's http://HOST:PORT", field="server_url")
    parts = urlsplit(url.strip())
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port that is not a number, or out of range
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"must be http://HOST:PORT (or https), got {url!r}", field="server_url")
    if not needs_url:
        raise ConfigError(
            f"only a server backend (vllm-server, or one registered) takes a URL, and backend {name!r} loads the "
            "weights here; drop backend (--backend; a server_url alone picks vllm-server) or drop server_url "
            "(--server-url)",
            field="server_url",
        )
    if settings.workers is not None or settings.ray_address is not None:
        raise ConfigError(
            f"scores on a running server (backend {name}), while --workers/--ray-address load the model in Ray "
            "workers; give one of them",
            field="server_url",
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


def without_password(url: str) -> str:
    """``url`` with the password of its user information replaced by ``***``
    (``http://user:secret@host:8000`` -> ``http://user:***@host:8000``): an archive is shared, a
    credential is not; any other URL as given."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
