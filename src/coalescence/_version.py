"""The installed distribution's version, in a module of its own so that any module can read it
without importing the package root (which imports nearly everything)."""

from __future__ import annotations

from importlib import metadata as _metadata

__all__ = ("__version__",)

try:
    __version__: str = _metadata.version("coalescence")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
