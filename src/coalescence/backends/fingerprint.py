"""A model is identified by its content: SHA-256 over its weight, tokenizer and template files.

A run's identity and every coalition key pin the model by this fingerprint, so other weights saved
into the same folder (a fine-tune of the same size) are a different model: a resume refuses them,
naming the difference. Hashing a multi-GB model takes seconds, so each file's digest is cached by
``(real path, size, mtime in ns, inode, device)`` in a small JSON file
(``$COALESCENCE_CACHE_DIR`` or ``$XDG_CACHE_HOME/coalescence`` or ``~/.cache/coalescence``,
``file-digests.json``); a file whose size, modification time or inode changed is hashed again.
(Rewriting a file in place with the same size and restoring its modification time by hand defeats
the cache; nothing else does.) A cache that cannot be read or written is ignored.

What is hashed (:func:`model_files`): a ``.gguf`` file alone (it holds weights, tokenizer and
template); in a ``save_pretrained`` directory, every file whose name marks it as weights
(``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), configuration or tokenizer
(``*.json``, ``*.model``, ``*.txt``, ``*.tiktoken``, ``*.jinja``): everything that can change a
value, not READMEs or hidden files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendUnavailable

__all__ = ("FingerprintStatistics", "cache_root", "file_digest", "fingerprint", "model_files", "statistics")

logger = logging.getLogger(__name__)

_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".tiktoken", ".jinja"})
_CHUNK = 1 << 22
_CACHE_NAME = "file-digests.json"


@dataclass(frozen=True, slots=True)
class FingerprintStatistics:
    """Counters since the process started: files hashed, digests served from the cache, bytes hashed."""

    files_hashed: int = 0
    cache_hits: int = 0
    bytes_hashed: int = 0


_stats = FingerprintStatistics()


def statistics() -> FingerprintStatistics:
    """A snapshot of the hashing counters (see :class:`FingerprintStatistics`)."""
    return _stats


def _cache_path() -> Path:
    root = os.environ.get("COALESCENCE_CACHE_DIR")
    if root:
        return Path(root) / _CACHE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "coalescence" / _CACHE_NAME


def _load_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _save_cache(path: Path, cache: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digests.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(cache, fh, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: hash again next time
        logger.info("cannot write the digest cache %s: %s", path, exc)


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}"


def file_digest(path: str | Path, *, cache: dict[str, str] | None = None) -> str:
    """The SHA-256 (hex) of one file, from ``cache`` when its path, size, mtime and inode match.

    Args:
        path: the file.
        cache: stat key -> digest; updated with a newly computed digest.

    Raises:
        OSError: the file cannot be read.
    """
    global _stats
    p = Path(path)
    key = _stat_key(p)
    if cache is not None and key in cache:
        _stats = FingerprintStatistics(_stats.files_hashed, _stats.cache_hits + 1, _stats.bytes_hashed)
        return cache[key]
    h = hashlib.sha256()
    size = 0
    with open(p, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    digest = h.hexdigest()
    _stats = FingerprintStatistics(_stats.files_hashed + 1, _stats.cache_hits, _stats.bytes_hashed + size)
    if cache is not None:
        stale = key.split("|", 1)[0] + "|"
        for old in [k for k in cache if k.startswith(stale)]:  # one entry per path
            del cache[old]
        cache[key] = digest
    return digest


def model_files(location: str | Path, gguf_file: str | None = None) -> list[Path]:
    """The files whose content identifies a local model (module docs), sorted by name.

    Args:
        location: the model directory.
        gguf_file: a GGUF file name inside ``location``: that file alone.

    Raises:
        BackendUnavailable: no such directory or file, or nothing to hash.
    """
    root = Path(location)
    if gguf_file is not None:
        path = root / gguf_file
        if not path.is_file():
            raise BackendUnavailable(f"no model file {str(path)!r}", field="model")
        return [path]
    if not root.is_dir():
        raise BackendUnavailable(f"no model directory {str(root)!r}", field="model")
    files = sorted(
        f for f in root.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in _SUFFIXES
    )
    if not files:
        raise BackendUnavailable(f"{str(root)!r} holds no weight, config or tokenizer file", field="model")
    return files


def fingerprint(location: str | Path, gguf_file: str | None = None) -> str:
    """SHA-256 (64 hex chars) of a local model's content: of each file's name and digest.

    Args:
        location: the model directory (``save_pretrained`` layout, or the folder of a GGUF file).
        gguf_file: a GGUF file in it: the fingerprint covers that file alone.

    Returns:
        The hex digest over ``name NUL sha256 LF`` lines of :func:`model_files`, in name order.

    Raises:
        BackendUnavailable: the model's files cannot be found or read.
    """
    files = model_files(location, gguf_file)
    path = _cache_path()
    cache = _load_cache(path)
    before = dict(cache)
    h = hashlib.sha256()
    try:
        for f in files:
            h.update(f"{f.name}\0{file_digest(f, cache=cache)}\n".encode())
    except OSError as exc:
        raise BackendUnavailable(f"cannot read the model file {exc.filename!r}: {exc.strerror}", field="model") from exc
    if cache != before:
        _save_cache(path, cache)
    return h.hexdigest()


def cache_root() -> Path:
    """coalescence's cache directory (converted weights, calibrations): ``$COALESCENCE_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/coalescence``, else ``~/.cache/coalescence``."""
    root = os.environ.get("COALESCENCE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "coalescence"
