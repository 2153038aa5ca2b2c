"""A report's input: an ``--out`` JSON document as it is, or a run archive directory fitted here
with no model (:class:`~coalescence.app.fit.ArchiveFit`, as replay), then handed to the report as
a document. The report draws; it never fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import ArchiveError, ConfigError
from ..report.sources import ReportInput, from_document, load_source
from .fit import fit_archive
from .options import names

__all__ = ("report_source",)

_FIELD = "SOURCE"


def report_source(
    source: str | Path,
    *,
    methods: str | Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
    conversation: int | None = None,
) -> ReportInput:
    """Read a report's input: an ``--out`` JSON document, or a run archive directory.

    Args:
        source: a JSON file written by ``explain --out`` or ``replay --out``, or a run directory.
        methods: run archive only: the estimators fitted, names or one comma-separated string
            (default: the run's own method).
        budget: run archive only: the sampling methods' budget (default: the run's, for a run of one
            input with that method; else 32 x players, as ``replay``).
        seed: run archive only: the sampling plans' seed (default: the run's).
        run_id: run archive only: which run (default: the last one).
        conversation: run archive only: fit only this conversation (0-based; default: every one).

    Returns:
        The explanations to show.

    Raises:
        InputError: no such file, not JSON, or not a document of the ``--out`` schema (field
            ``SOURCE``, naming the field at fault).
        ConfigError: archive options given with a JSON document, or an unknown method.
        ArchiveError: a damaged or foreign archive.
        EstimatorError: the archive lacks coalitions a plan needs (the message says how to
            evaluate them with ``coalescence replay RUN_DIR --model``).
    """
    if isinstance(methods, str):
        methods = names(methods)
    path = Path(source)
    if path.is_dir():
        try:
            document = fit_archive(path, methods=methods, budget=budget, seed=seed, run_id=run_id, conversation=conversation)
        except ArchiveError as exc:  # the archive modules name their argument RUN_DIR or archive; here it is SOURCE
            if exc.field not in ("RUN_DIR", "archive"):
                raise
            raise type(exc)(exc.message, field=_FIELD) from exc
        return from_document(document, str(path), kind="archive")
    for option, value in (("method", methods), ("budget", budget), ("seed", seed), ("run", run_id)):
        if value is not None:
            raise ConfigError(f"applies to a run archive directory; {str(source)!r} is a JSON document", field=option)
    return load_source(path)
