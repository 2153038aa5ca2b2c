"""A report's input: an ``--out`` JSON document as it is, or a run archive directory fitted here
with no model (:class:`~coalescence.app.fit.ArchiveFit`, as replay), then handed to the report as
a document. The report draws; it never fits. ``coalescence report`` (:class:`ReportSettings`,
:func:`write_report_files`) writes its page and its chart image.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ArchiveError, CoalescenceError, ConfigError, ReportError
from ..report.sources import ReportInput, from_document, load_source
from .fit import fit_archive
from .options import SettingsGroup, names, option, positive_int
from .options import seed as seed_type

__all__ = ("ReportSettings", "drawn", "image_path", "report_source", "write_report_files")

_FIELD = "SOURCE"


def report_source(
    source: str | Path,
    *,
    methods: str | Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
    conversation: int | None = None,
    skip_corrupt: bool = False,
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
        skip_corrupt: run archive only: leave out a part that fails verification (with a warning)
            instead of refusing.

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
            document = fit_archive(
                path, methods=methods, budget=budget, seed=seed, run_id=run_id, conversation=conversation, skip_corrupt=skip_corrupt
            )
        except ArchiveError as exc:  # the archive modules name their argument RUN_DIR or archive; here it is SOURCE
            if exc.field not in ("RUN_DIR", "archive"):
                raise
            raise type(exc)(exc.message, field=_FIELD) from exc
        return from_document(document, str(path), kind="archive")
    for option, value in (("method", methods), ("budget", budget), ("seed", seed), ("run", run_id)):
        if value is not None:
            raise ConfigError(f"applies to a run archive directory; {str(source)!r} is a JSON document", field=option)
    return load_source(path)


def image_path(text: str) -> str:
    """``report --image``: a path ending in ``.png`` or ``.svg`` (the image's format)."""
    from ..report.chart import IMAGE_FORMATS

    if Path(text).suffix.lower().lstrip(".") not in IMAGE_FORMATS:
        accepted = ", ".join(f".{s}" for s in IMAGE_FORMATS)
        raise argparse.ArgumentTypeError(f"{text!r} has no image suffix; accepted suffixes: {accepted}")
    return text


def _methods_help() -> str:
    from ..attribution.estimators import METHODS

    return f"run archive: comma-separated methods fitted ({','.join(METHODS)}) (default: the run's method)"


_SCALE_HELP = (
    "colour scale: robust (when one value dwarfs the rest, the values below the 90th percentile of |value| take 80%% "
    "of the shades, so they stay apart; the largest is still the darkest) or linear (default: %(default)s)"
)


@dataclass(frozen=True, kw_only=True)
class ReportSettings(SettingsGroup):
    """The settings of ``coalescence report`` (its options; ``method``, ``budget``, ``seed`` and
    ``run`` apply to a run archive, as :func:`report_source`).

    Args:
        output: the HTML page written, or ``None``.
        image: the ranked bar chart written as an image (``.png`` or ``.svg``), or ``None``.
        method: comma-separated methods fitted (default: the run's).
        budget, seed, run: the sampling budget, the plans' seed and the run id (default: the run's).
        scale: the colour scale, ``robust`` or ``linear``.

    Raises:
        ConfigError: neither ``output`` nor ``image``.
    """

    title: ClassVar[str] = "report"

    output: str | Path | None = option(None, short="-o", flag="--output", metavar="HTML", help="the HTML file written (give -o, --image or both)")
    image: str | Path | None = option(
        None,
        metavar="PATH",
        type=image_path,
        help="write the ranked bar chart as an image: PNG or SVG by the suffix (.png, .svg), the page's chart "
        "(same labels, colours, error bars), one panel per explanation",
    )
    method: str | None = option(None, help=_methods_help)
    budget: int | None = option(
        None, type=positive_int, help="run archive: sampling budget (default: the run's for a one-input run, else 32 x players)"
    )
    seed: int | None = option(None, type=seed_type, help="run archive: seed of the sampling plans (default: the run's)")
    run: str | None = option(None, help="run archive: run id (default: the last run)")
    scale: str = option("robust", choices=("robust", "linear"), help=_SCALE_HELP)

    def __post_init__(self) -> None:
        if self.output is None and self.image is None:
            raise ConfigError("give the HTML file written (-o report.html), --image chart.png, or both", field="output")


def drawn(draw: Callable[[], Any], field: str) -> Any:
    """``draw()``; a drawing library's failure is a :class:`~coalescence.errors.ReportError` naming
    ``field`` (exit 4 at the command line, one line), not a model failure."""
    try:
        return draw()
    except CoalescenceError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ReportError(f"the report could not be drawn ({type(exc).__name__}: {first})", field=field) from exc


def write_report_files(source: str | Path, settings: ReportSettings, *, written: Callable[[str, Path], Any] | None = None) -> ReportInput:
    """``coalescence report``: the report of ``source`` (:func:`report_source`) written as the HTML
    page ``settings.output`` and/or the chart image ``settings.image``, every path checked first.

    Args:
        source: an ``--out`` JSON document or a run archive directory.
        settings: what to write, and the run archive's fit.
        written: called with ``("report", path)`` once the page is written, ``("image", path)`` once
            the image is.

    Returns:
        The report drawn.

    Raises:
        ConfigError: an output that is a directory, unwritable, or would overwrite the source or a
            run archive; no method in ``settings.method``; as :func:`report_source`.
        BackendUnavailable: the report's optional packages are missing.
        ReportError: the page or the image could not be drawn.
        ArchiveError, ArchiveWriteError: a file could not be written.
    """
    from ..report import render_report, write_chart_image, write_report
    from .outputs import html_path, refuse_overwrite

    s = settings
    out = html_path(s.output, "output")
    image = html_path(s.image, "image")  # matplotlib draws the image too
    is_dir = Path(source).is_dir()  # a directory that is no run archive is refused by report_source
    archive = is_dir and (Path(source) / "manifest.json").is_file()
    refuse_overwrite({"output": out, "image": image}, sources={} if is_dir else {"SOURCE": source}, run_dirs={"SOURCE": source} if archive else None)
    methods = names(s.method) if s.method is not None else None
    if methods is not None and not methods:
        raise ConfigError("give at least one method, e.g. --method exact", field="method")
    report = report_source(source, methods=methods, budget=s.budget, seed=s.seed, run_id=s.run)
    if out is not None:
        write_report(out, drawn(lambda: render_report(report, scale=s.scale), "output"), field="output")
        if written is not None:
            written("report", out)
    if image is not None:
        drawn(lambda: write_chart_image(image, report, scale=s.scale, field="image"), "image")
        if written is not None:
            written("image", image)
    return report
