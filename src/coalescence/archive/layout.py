"""The run directory on disk: writing files durably, generations of parts, crash recovery.

Every change to a run directory goes through the functions here, and each is one of: write a new
file under a hidden temporary name, fsync it and ``os.replace`` it into place; create a directory;
switch the ``parts`` link with one rename; remove what no reader can see any more. OS errors are
translated into :class:`~coalescence.errors.ArchiveError` (a place that cannot be written: a
permission, a read-only file system; exit 2) or :class:`~coalescence.errors.ArchiveWriteError`
(anything else: disk full, I/O error; exit 3), with one line naming the file.

Generations: ``RUN_DIR/parts`` is a symbolic link to ``.parts-NNNNNN``. A compaction writes the
merged part into a new generation, makes the link ``.parts.next`` to it and renames that link over
``parts``: readers see the old generation or the new one, never both. The old generation is kept
for :data:`RETIRED_SECONDS` after the switch (its mtime records when), so that a read that resolved
the link before the switch can still open the files it listed; the next writer or compaction after
that removes it. A crash at any step leaves debris that :func:`recover` clears (finishing a switch whose
rename happened, undoing one whose rename did not). An archive of schema version 2 or older has a
real ``parts/`` directory: a link cannot replace a directory in one rename, so its one-time switch
renames the directory away and the link into place, two renames in a row, between which
``parts`` is absent (a plain read then fails with "not found"; it never sees a key twice).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import shutil
import time
import uuid
from pathlib import Path

from ..errors import ArchiveError, ArchiveWriteError
from .schema import (
    GENERATION_PATTERN,
    LOCK_NAME,
    NEXT_LINK,
    PARTS_DIR,
    QUARANTINE_DIR,
    generation_name,
    hidden,
    parse_part_name,
    part_name,
)

__all__ = (
    "LEGACY_OLD",
    "RETIRED_SECONDS",
    "PartFile",
    "discard",
    "fsync_dir",
    "is_fresh",
    "is_live",
    "live_dir",
    "live_generation",
    "lock_holder",
    "os_error",
    "one_line",
    "part_files",
    "quarantine",
    "recover",
    "remove_created",
    "remove_tree",
    "start_generation",
    "switch",
    "temporary_name",
    "write_file",
    "write_output",
)

logger = logging.getLogger(__name__)

RETIRED_SECONDS = 600.0
"""How long a generation replaced by a compaction is kept (seconds) for reads still using it."""

LEGACY_OLD = ".parts-legacy"
"""Where a legacy ``parts/`` directory goes during its switch to a link (removed right after)."""

_LINK_FALLBACK = frozenset({errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})
"""Errors of ``os.link`` on file systems without hard links: the part is copied instead."""

_PLACE_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP}
)
"""OS errors that say the place cannot hold an archive (a setting to change), not that a write failed."""


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines from pyarrow's messages too) made one space."""
    return " ".join(str(text).split())


def os_error(exc: OSError, what: str, field: str | None = "archive") -> ArchiveError:
    """Translate an OS error while doing ``what`` (e.g. ``"cannot write /r/manifest.json"``).

    Returns:
        :class:`ArchiveError` for a place that cannot be written (permission, read-only file system,
        a file where a directory should be), :class:`ArchiveWriteError` for the rest (no space,
        I/O error): the CLI exits with 2 and 3 respectively.
    """
    reason = one_line(exc.strerror or exc)
    if exc.errno in _PLACE_ERRNOS:
        return ArchiveError(f"{what}: {reason}; choose a writable place", field=field)
    return ArchiveWriteError(
        f"{what}: {reason}; what was flushed before is intact: free space or fix the device, then rerun "
        "the same command to resume",
        field=field,
    )


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a rename into it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced; mode 0666 less the umask.

    Raises:
        OSError: as the OS reports it; a partly written file is removed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        discard(path)
        raise
    os.close(fd)


def discard(path: Path) -> None:
    """Remove ``path`` if it is there, ignoring failures (cleanup after another error)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_tree(path: Path) -> None:
    """Remove a directory tree (a generation no reader sees); a failure is logged, not raised."""

    def note(function: object, name: str, info: tuple[type, BaseException, object]) -> None:
        logger.warning("could not remove %s (%s); the next writer removes it", name, one_line(info[1]))

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=note)


def _generation_target(link: Path) -> str | None:
    """The generation name a link points to, or ``None`` if it points anywhere else."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return target if GENERATION_PATTERN.match(target) else None


def live_dir(run_dir: Path) -> Path | None:
    """The directory holding the live parts of ``run_dir`` (no change made; no lock needed).

    That is the generation ``parts`` links to, or ``parts`` itself when it is a real directory (an
    archive of version 2 or older), or, while a legacy switch is half done, the generation
    ``.parts.next`` links to. ``None`` when the run has no parts yet.

    Raises:
        ArchiveError: ``parts`` is a file, or a link to anything but a generation of this run.
    """
    parts = run_dir / PARTS_DIR
    if os.path.islink(parts):
        target = _generation_target(parts)
        if target is None or not (run_dir / target).is_dir():
            raise ArchiveError(
                f"{parts} links to {os.readlink(parts)!r}, not to a generation directory of this run "
                "(.parts-NNNNNN); the archive was edited: restore it or choose another archive",
                field="RUN_DIR",
            )
        return run_dir / target
    if parts.is_dir():
        return parts
    if os.path.lexists(parts):
        raise ArchiveError(f"{parts} is not a directory; the archive was edited: restore it", field="RUN_DIR")
    nxt = run_dir / NEXT_LINK
    target = _generation_target(nxt) if os.path.islink(nxt) else None
    if target is not None and (run_dir / target).is_dir():
        return run_dir / target  # a legacy switch stopped between its two renames
    # no parts link: a new run, or one whose link was deleted; a generation holding parts means
    # the latter, and a writer would take the generation for crash debris and delete it
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        names = []
    for name in names:
        generation = run_dir / name
        if GENERATION_PATTERN.match(name) and generation.is_dir() and any(
            n.startswith("part-") for n in os.listdir(generation)
        ):
            raise ArchiveError(
                f"{parts} is missing, but {generation} holds the run's parts; the archive was edited: "
                f"restore the link with `ln -s {name} {parts}` or choose another archive",
                field="RUN_DIR",
            )
    return None


class PartFile:
    """One complete part: its path, index, and the SHA-256 its name records (``None``: legacy)."""

    __slots__ = ("digest", "index", "path")

    def __init__(self, path: Path, index: int, digest: str | None) -> None:
        self.path = path
        self.index = index
        self.digest = digest

    def __repr__(self) -> str:
        return f"PartFile({self.path.name!r})"


def part_files(directory: Path) -> list[PartFile]:
    """The parts in a live directory, by index.

    In a generation directory every part's name carries its digest; a part named without one
    (``part-NNNNNN.parquet``) is accepted only in the real ``parts/`` directory of an archive of
    version 2 or older.

    Raises:
        ArchiveError: an entry that a plain ``pyarrow.dataset`` read would take for data but is not
            a part (a stray file or directory, a link, a part without a digest in a generation),
            or two parts with the same index.
    """
    generation = GENERATION_PATTERN.match(Path(directory).name) is not None
    found: dict[int, PartFile] = {}
    for entry in os.scandir(directory):
        if hidden(entry.name):
            continue  # temporary parts, and what pyarrow skips too
        parsed = parse_part_name(entry.name)
        if parsed is None or entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise ArchiveError(
                f"{Path(directory) / entry.name} is not a part of this archive (a plain dataset read of "
                "parts/ would take it for data); move it out of the archive",
                field="RUN_DIR",
            )
        index, digest = parsed
        if digest is None and generation:
            raise ArchiveError(
                f"{Path(directory) / entry.name} was not written by coalescence (a part's name carries "
                "its SHA-256 since schema version 3); move it out of the archive",
                field="RUN_DIR",
            )
        if index in found:
            raise ArchiveError(
                f"{found[index].path.name} and {entry.name} in {directory} have the same index; the "
                "archive was edited: move the one that does not belong out of it",
                field="RUN_DIR",
            )
        found[index] = PartFile(Path(entry.path), index, digest)
    return [found[i] for i in sorted(found)]


def start_generation(run_dir: Path) -> Path:
    """Create the next generation directory (empty) and return it."""
    numbers = [int(m.group(1)) for m in map(GENERATION_PATTERN.match, os.listdir(run_dir)) if m]
    path = run_dir / generation_name(max(numbers, default=-1) + 1)
    os.mkdir(path)
    return path


def switch(run_dir: Path, generation: Path) -> None:
    """Make ``generation`` the live one (``parts`` links to it) and remove the one it replaces.

    Raises:
        OSError: as the OS reports it; :func:`recover` clears what a failure or a crash leaves.
    """
    parts = run_dir / PARTS_DIR
    nxt = run_dir / NEXT_LINK
    if os.path.lexists(nxt):
        os.unlink(nxt)
    os.symlink(generation.name, nxt)
    old = _generation_target(parts) if os.path.islink(parts) else None
    if not os.path.islink(parts) and os.path.isdir(parts):
        os.rename(parts, run_dir / LEGACY_OLD)  # parts is absent until the next rename (legacy only)
        old = LEGACY_OLD
    try:
        os.replace(nxt, parts)  # the switch: one atomic rename
    except BaseException:
        if os.path.lexists(parts):
            discard(nxt)  # not switched: the old generation stays live
        # else (legacy) the new generation is complete: readers and recover() take it from .parts.next
        raise
    fsync_dir(run_dir)
    if old == LEGACY_OLD:
        remove_tree(run_dir / old)
    elif old is not None and old != generation.name:
        try:
            os.utime(run_dir / old)  # retired now: kept RETIRED_SECONDS for reads listing it
        except OSError:
            pass


def recover(run_dir: Path) -> None:
    """Clear what a crashed writer or compaction left (call with the run's lock held).

    Finishes a switch whose link was made but whose rename did not happen only when ``parts`` is
    absent (the legacy case: the rename away happened); otherwise drops the link. Then removes every
    generation that is not live (a generation a compaction replaced only once it has been retired
    for :data:`RETIRED_SECONDS`), a leftover legacy directory, temporary parts in the live generation
    and temporary manifests.

    Raises:
        OSError: as the OS reports it.
    """
    parts = run_dir / PARTS_DIR
    nxt = run_dir / NEXT_LINK
    if os.path.lexists(nxt):
        if not os.path.lexists(parts) and _generation_target(nxt) is not None:
            os.replace(nxt, parts)
            fsync_dir(run_dir)
        else:
            os.unlink(nxt)
    live = live_dir(run_dir)
    match = GENERATION_PATTERN.match(live.name) if live is not None else None
    live_number = int(match.group(1)) if match else None
    for name in os.listdir(run_dir):
        path = run_dir / name
        generation = GENERATION_PATTERN.match(name)
        if generation and path != live and live_number is not None and int(generation.group(1)) < live_number:
            if _retired_for(path) < RETIRED_SECONDS:
                continue  # replaced by a compaction a moment ago: a read may still be listing it
            remove_tree(path)
        elif (generation or name == LEGACY_OLD) and path != live:
            remove_tree(path)  # never live (a compaction's unfinished generation) or legacy debris
        elif name.startswith(".manifest.json.") and name.endswith(".tmp"):
            discard(path)
    if live is not None:
        for name in sorted(os.listdir(live)):
            if name.startswith(".part-") and name.endswith(".tmp"):
                logger.warning("discarding %s, a part left half-written by a crash; its rows are recomputed", name)
                discard(live / name)


def _retired_for(path: Path) -> float:
    """Seconds since a replaced generation was retired (its mtime; infinite if unreadable)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return float("inf")


def temporary_name(path: Path) -> Path:
    """A unique hidden temporary name next to ``path``."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"


def write_output(path: Path, data: bytes, *, field: str | None) -> None:
    """Write an output file (``--out``, ``--html``) all or nothing, through a symbolic link.

    A regular file (or a new one) is written under a temporary name next to it, fsynced and
    renamed into place. A symbolic link is followed: its target is replaced the same way and the
    link stays a link. A path that is not a regular file (``/dev/stdout``, a pipe, a device) is
    written directly: nothing else can be done with a stream. Missing parent directories are
    created.

    Raises:
        ArchiveError: the place cannot be written (permission, not a directory).
        ArchiveWriteError: the write failed (disk full, I/O error); a regular file is as it was.
    """
    try:
        mode = os.stat(path).st_mode  # follows links
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        try:
            with open(path, "wb") as fh:  # a pipe, a terminal, a device: written as a stream
                fh.write(data)
        except OSError as exc:
            raise os_error(exc, f"cannot write {path}", field) from exc
        return
    target = Path(os.path.realpath(path)) if os.path.islink(path) else path
    tmp = temporary_name(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file(tmp, data)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except OSError as exc:
        discard(tmp)
        raise os_error(exc, f"cannot write {path}", field) from exc


def is_fresh(path: Path) -> bool:
    """Whether ``path`` can become a new run: absent, empty, or left by a creation that crashed
    before its manifest was written (only the lock file, a temporary manifest)."""
    if not os.path.lexists(path):
        return True
    if not path.is_dir() or path.is_symlink():
        return False
    return all(n == LOCK_NAME or (n.startswith(".manifest.json.") and n.endswith(".tmp")) for n in os.listdir(path))


def quarantine(run_dir: Path, parts: list[Path]) -> None:
    """Move parts that failed verification to ``RUN_DIR/quarantine/`` (the caller records them).

    Raises:
        OSError: as the OS reports it.
    """
    if not parts:
        return
    target = run_dir / QUARANTINE_DIR
    target.mkdir(exist_ok=True)
    for part in parts:
        if os.path.lexists(part):
            logger.warning("moving part %s, which failed verification, to %s", part.name, target)
            os.replace(part, target / part.name)
    fsync_dir(target)


def live_generation(run_dir: Path) -> Path:
    """Clear crash debris and return the live generation, creating one (new run) or moving the
    parts of a version-2 archive into one under digest names (hard links; copies where the file
    system has none).

    Raises:
        OSError: as the OS reports it (the caller translates it).
    """
    recover(run_dir)
    live = live_dir(run_dir)
    if live is not None and os.path.islink(run_dir / PARTS_DIR):
        return live
    generation = start_generation(run_dir)
    for part in part_files(live) if live is not None else []:
        data = part.path.read_bytes()
        name = part_name(part.index, hashlib.sha256(data).hexdigest())
        try:
            os.link(part.path, generation / name)
        except OSError as exc:
            if exc.errno not in _LINK_FALLBACK:
                raise
            write_file(generation / name, data)
    fsync_dir(generation)
    switch(run_dir, generation)
    return generation


def is_live(run_dir: Path, generation: Path) -> bool:
    """Whether ``generation`` is what readers of ``run_dir`` see now."""
    try:
        return live_dir(run_dir) == generation
    except ArchiveError:
        return False


def remove_created(created: list[Path], *, lock_file: Path | None) -> None:
    """Undo a run directory's creation that failed before its manifest was written (best effort)."""
    if lock_file is not None:
        discard(lock_file)
    for directory in created:  # deepest first
        try:
            os.rmdir(directory)
        except OSError:
            return


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's write lock (``RUN_DIR/.lock``, the ``flock`` a
    :class:`~coalescence.archive.writer.RunArchive` takes), read without waiting.

    The lock dies with its process, so a run the manifest records as ``running`` while no process
    holds the lock was killed (SIGKILL, a lost machine) before it could record how it ended. The
    lock is tried shared for an instant (``LOCK_SH | LOCK_NB``) and released at once.

    Returns:
        ``None`` when no process holds it (or there is no lock file); else the holder's note
        (``"pid 123 on host since <ISO time>"``), or ``"another process"`` when it wrote none or
        the lock cannot be read (never claimed free without knowing).
    """
    import fcntl

    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError:
        return "another process"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            return holder or "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
