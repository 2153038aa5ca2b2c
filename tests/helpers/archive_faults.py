"""Fault injection at the OS boundary for the archive tests (not a test module).

A full disk and a permission denial cannot be produced for real here: the tests run as root (who
ignores permissions) on one shared file system, with no right to mount a small tmpfs or loop
device. So the OS calls that write (``os.open`` for writing, ``write``, ``pwrite``, ``fsync``,
``ftruncate``, ``replace``, ``rename``, ``mkdir``, ``symlink``, ``link``) are wrapped: on paths under
one root, every call from the ``after``-th on fails with the chosen errno, as a full disk keeps
failing until space is freed. Nothing of coalescence is replaced: its own code runs as written, and
only the OS answers differently.
"""

from __future__ import annotations

import errno as errnos
import os
from pathlib import Path
from typing import Any

WRITE_CALLS = ("open", "write", "pwrite", "fsync", "ftruncate", "replace", "rename", "mkdir", "symlink", "link")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class DiskFault:
    """Counts the write calls on paths under ``root``; from call number ``after`` on (0-based),
    each raises ``OSError(error)`` (only that one call with ``once``: a transient fault).
    ``after=None`` only counts.

    Attributes:
        calls: write calls seen so far (failed ones included).
        failed: names of the calls that were made to fail, in order.
    """

    def __init__(
        self, monkeypatch: Any, root: Path, *, after: int | None, error: int = errnos.ENOSPC, once: bool = False
    ) -> None:
        self.root = os.fspath(root)
        self.after = after
        self.once = once
        self.error = error
        self.calls = 0
        self.failed: list[str] = []
        self._fds: set[int] = set()
        real = {name: getattr(os, name) for name in (*WRITE_CALLS, "close")}
        self.real = real

        def hit(name: str, *paths: Any) -> None:
            self.calls += 1
            if self.after is not None and (self.calls == self.after + 1 if self.once else self.calls > self.after):
                self.failed.append(name)
                raise OSError(self.error, os.strerror(self.error), os.fspath(paths[0]) if paths else None)

        def under(path: Any) -> bool:
            return isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(os.fspath(path)).startswith(self.root)

        def fd_call(name: str):
            def call(fd: int, *args: Any, **kwargs: Any) -> Any:
                if fd in self._fds:
                    hit(name)
                return real[name](fd, *args, **kwargs)

            return call

        def path_call(name: str, where: int):
            def call(*args: Any, **kwargs: Any) -> Any:
                if any(under(a) for a in args[: where + 1]):
                    hit(name, args[where])
                return real[name](*args, **kwargs)

            return call

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            inside = under(path) and kwargs.get("dir_fd") is None
            if inside and flags & _WRITE_FLAGS:
                hit("open", path)
            fd = real["open"](path, flags, *args, **kwargs)
            if inside:
                self._fds.add(fd)
            return fd

        def close(fd: int) -> None:
            self._fds.discard(fd)
            real["close"](fd)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "close", close)
        for name in ("write", "pwrite", "fsync", "ftruncate"):
            monkeypatch.setattr(os, name, fd_call(name))
        for name in ("replace", "rename", "symlink", "link"):
            monkeypatch.setattr(os, name, path_call(name, 1))
        monkeypatch.setattr(os, "mkdir", path_call("mkdir", 0))

    def lift(self) -> None:
        """Space is freed: every later call succeeds."""
        self.after = None
