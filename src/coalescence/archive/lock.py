"""The one writer of a run directory: an exclusive OS lock (``flock``) on ``RUN_DIR/.lock``.

The lock file holds the holder's pid, host and start time, so a second writer is refused with a
message naming who holds the run.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from ..errors import ArchiveError
from .layout import os_error
from .schema import LOCK_NAME

__all__ = ("RunLock",)


class RunLock:
    """An exclusive OS lock (``flock``) on ``RUN_DIR/.lock``, holding the holder's pid/host/time.

    Args:
        run_dir: the run directory (it exists).
        field: the option an error names (``"archive"``, ``"RUN_DIR"``).

    Raises:
        ArchiveError: another process holds the lock (naming it), or the lock file cannot be
            opened or locked.
    """

    def __init__(self, run_dir: Path, field: str = "archive") -> None:
        path = run_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise os_error(exc, f"cannot open the lock file {path}", field) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ArchiveError(
                    f"{str(run_dir)!r} is being written by {holder or 'another process'}; wait for it to "
                    "finish or use another archive",
                    field=field,
                ) from None
            raise os_error(exc, f"cannot lock {path}", field) from exc
        self._fd: int | None = fd
        note = f"pid {os.getpid()} on {socket.gethostname()} since {datetime.now(UTC).isoformat()}\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        except OSError:  # the holder's name only helps the next writer's message; the lock holds without it
            pass

    def release(self) -> None:
        """Unlock and close (the holder's note erased first); a second call does nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
