"""Output paths checked before any work: ``--out``, ``--html`` and ``--archive`` (a writable place,
a report's optional packages present, an archive that reads), and per-line errors of a batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


from ..errors import ConfigError

__all__ = (
    "check_run_dir",
    "refuse_overwrite",
    "check_writable_parent",
    "html_path",
    "output_path",
)


def check_writable_parent(path: Path, name: str) -> None:
    """Refuse a path whose nearest existing ancestor is not a directory a file can be created in:
    asked of the file system itself, with a temporary file made and removed there at once
    (:func:`tempfile.TemporaryFile`), as permission bits do not tell (root may "write" to
    ``/proc``, which makes no files; a read-only mount).

    Raises:
        ConfigError: a file in the way, or a directory where no file can be created (field ``name``).
    """
    import os
    import tempfile

    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{str(parent)!r} is a file, not a directory; give another path", field=name)
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"{str(parent)!r} is not writable; give another path", field=name)
            try:
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as exc:
                raise ConfigError(f"no file can be created in {str(parent)!r} ({exc.strerror or exc}); give another path", field=name) from None
            return


def output_path(value: str | Path | None, name: str) -> Path | None:
    """An output file's path, checked before any work: not a directory, in a writable place.

    Raises:
        ConfigError: a directory, or a place that cannot be written (field ``name``).
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{str(value)!r} is a directory; give a file path", field=name)
    check_writable_parent(path, name)
    return path


def refuse_overwrite(
    outputs: dict[str, Path | None], *, sources: dict[str, Any] | None = None, run_dirs: dict[str, Any] | None = None
) -> None:
    """Refuse outputs that would destroy what the command reads or writes: an output that is one of
    the sources (the input, a document compared or reported), another output, or a file inside a
    run archive (its manifest, its parts), one of the sources or any other (a directory holding a
    ``manifest.json``).

    Args:
        outputs: output files by their option's field (``out``, ``html``); ``None`` entries skipped.
        sources: files read, by field (``input``, ``SOURCE``); paths that are not files are skipped.
        run_dirs: run archive directories, by field.

    Raises:
        ConfigError: the first clash (naming the output's field, what it would overwrite, the fix).
    """
    import os

    def same(a: Path, b: Path) -> bool:
        try:
            return os.path.realpath(a) == os.path.realpath(b)
        except OSError:
            return False

    seen: dict[str, Path] = {}
    for field, path in outputs.items():
        if path is None:
            continue
        for other_field, other in seen.items():
            if same(path, other):
                raise ConfigError(f"{str(path)!r} is also the {other_field} file; give each output its own path", field=field)
        for source_field, source in (sources or {}).items():
            if isinstance(source, (str, Path)) and Path(source).is_file() and same(path, Path(source)):
                raise ConfigError(f"{str(path)!r} is the {source_field} itself; writing it would destroy it: give another path", field=field)
        for dir_field, run_dir in (run_dirs or {}).items():
            if isinstance(run_dir, (str, Path)) and run_dir is not True:
                real = os.path.realpath(run_dir)
                if os.path.realpath(path).startswith(real.rstrip(os.sep) + os.sep):
                    raise ConfigError(f"{str(path)!r} lies inside the run archive {str(run_dir)!r}; give a path outside it", field=field)
        for parent in Path(os.path.realpath(path)).parents:  # any run archive, read by this command or not
            if (parent / "manifest.json").is_file():
                raise ConfigError(f"{str(path)!r} lies inside the run archive {str(parent)!r}; give a path outside it", field=field)
        seen[field] = path


def html_path(value: str | Path | None, name: str = "html") -> Path | None:
    """The HTML report's path (see :func:`output_path`), its optional dependency checked too.

    Raises:
        ConfigError: as :func:`output_path`.
        BackendUnavailable: the report's optional packages are missing (with the install command).
    """
    path = output_path(value, name)
    if path is not None:
        from ..report import check_available

        check_available()
    return path


def check_run_dir(archive: str | Path, *, skip_corrupt: bool = False) -> Path:
    """Check an ``archive`` setting before the model loads: a new path whose parent is writable
    (or a directory a killed creation left with its lock file alone, as the archive takes it), or
    a run directory whose manifest and parts read (a damaged manifest, a newer schema or a part
    failing its digest is refused here, not after the weights load).

    Returns:
        The run directory's path.

    Raises:
        ConfigError: the path exists and is not a run directory, or cannot be written.
        ArchiveError: a damaged manifest or part (without ``skip_corrupt``).
    """
    from ..archive.layout import is_fresh
    from ..archive.reader import check_parts, read_manifest

    run_dir = Path(archive)
    # a creation killed before its manifest was written (its lock file alone) becomes the new run
    if not is_fresh(run_dir) and not (run_dir.is_dir() and (run_dir / "manifest.json").is_file()):
        raise ConfigError(
            f"{str(archive)!r} exists and is not a run directory; choose a new path or delete it",
            field="archive",
        )
    if (run_dir / "manifest.json").is_file():
        read_manifest(run_dir)
        check_parts(run_dir, skip_corrupt=skip_corrupt)
    check_writable_parent(run_dir, "archive")
    return run_dir
