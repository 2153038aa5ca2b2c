"""The HTML report: explanations as one self-contained page that opens from disk offline.

Typical use::

    from coalescence.report import load_source, render_report, write_report

    write_report("report.html", render_report(load_source("runs/eiffel.json")))

SOURCE is an ``--out`` JSON document (single, JSONL batch, hierarchy or replay) or a run archive
directory, fitted from its coalitions with no model (:func:`load_source`). The page is laid out by
Jinja2 templates and its bar charts are drawn by matplotlib as inline SVG: no script, no network
request of any kind (see :mod:`.page` for what it shows). The same bar charts are written as an
image file (PNG or SVG) by :func:`write_chart_image` (``coalescence report SOURCE --image PATH``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .chart import IMAGE_FORMATS
from .colors import DivergingScale, contrast_ratio, relative_luminance, text_color
from .page import chart_images, explanation_fragment, render_page
from .sources import Entry, ReportInput, load_source

__all__ = (
    "IMAGE_FORMATS",
    "DivergingScale",
    "Entry",
    "ReportView",
    "ReportInput",
    "chart_images",
    "check_available",
    "image_format",
    "contrast_ratio",
    "explanation_fragment",
    "load_source",
    "relative_luminance",
    "render_report",
    "text_color",
    "write_chart_image",
    "write_report",
)


def check_available() -> None:
    """Check that the report's optional dependency (matplotlib) is installed.

    Raises:
        BackendUnavailable: it is not (the message has the install command).
    """
    from .colors import _matplotlib

    _matplotlib()


def render_report(source: ReportInput | Mapping[str, Any], *, scale: str = "robust") -> str:
    """The HTML page of a report.

    Args:
        source: what :func:`load_source` returns, or a document in any ``--out`` form (e.g.
            ``explanation.to_dict()``).
        scale: the colour scale: ``robust`` (one dominant value does not bleach the rest) or
            ``linear`` (see :mod:`coalescence.report.colors`).

    Returns:
        The page's HTML text.

    Raises:
        InputError: a document that is not of the ``--out`` schema (field ``SOURCE``).
        BackendUnavailable: matplotlib is not installed.
    """
    from .sources import from_document

    report = source if isinstance(source, ReportInput) else from_document(source, "")
    return render_page(report, scale=scale)


class ReportView:
    """A report page that shows itself in Jupyter (the whole report's view) and saves itself.

    Args:
        document: an ``--out`` document (e.g. ``explanation.to_dict()``).
        scale: the colour scale (``robust`` or ``linear``).

    Attributes:
        html: the self-contained page's text.

    Raises:
        InputError: not an explanation document.
        BackendUnavailable: matplotlib is not installed.
    """

    def __init__(self, document: Mapping[str, Any], *, scale: str = "robust") -> None:
        self.document = document
        self.scale = scale
        self.html = render_report(document, scale=scale)

    def _repr_html_(self) -> str:
        return explanation_fragment(self.document, compact=False, scale=self.scale)

    def save(self, path: str | Path) -> Path:
        """Write the page to ``path`` (atomically, see :func:`write_report`); returns the path."""
        write_report(path, self.html)
        return Path(path)


def write_report(path: str | Path, html: str, *, field: str = "output") -> None:
    """Write a report page through a temporary file and a rename (all or nothing); a symbolic
    link is followed and a stream (``/dev/stdout``) written directly.

    Args:
        path: the HTML file written (its parent is created if missing).
        html: the page (:func:`render_report`).
        field: the option named in an error.

    Raises:
        ArchiveError: the place cannot be written (permission, not a directory).
        ArchiveWriteError: the write failed (disk full, I/O error); ``path`` is as it was.
    """
    from ..archive.layout import write_output

    write_output(Path(path), html.encode("utf-8"), field=field)


def image_format(path: str | Path, *, field: str = "image") -> str:
    """The image format of ``path`` by its suffix: ``png`` or ``svg`` (:data:`IMAGE_FORMATS`).

    Raises:
        ConfigError: any other suffix (naming ``field`` and the accepted suffixes).
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in IMAGE_FORMATS:
        accepted = ", ".join(f".{s}" for s in IMAGE_FORMATS)
        raise ConfigError(f"{str(path)!r} is no image path this can write; accepted suffixes: {accepted}", field=field)
    return suffix


def write_chart_image(
    path: str | Path, source: ReportInput | Mapping[str, Any], *, scale: str = "robust", field: str = "image"
) -> Path:
    """Write the report's ranked bar chart(s) as an image, PNG or SVG by the suffix of ``path``:
    the page's charts (same labels, colours, error bars), one panel per explanation, drawn by
    matplotlib (PNG at :data:`~.chart.PNG_DPI` dpi). Written through a temporary file and a rename
    (all or nothing), as :func:`write_report`.

    Args:
        path: the image file (``.png`` or ``.svg``; its parent is created if missing).
        source: what :func:`load_source` returns, or a document in any ``--out`` form.
        scale: the colour scale (``robust`` or ``linear``).
        field: the option named in an error.

    Returns:
        ``path``.

    Raises:
        ConfigError: a suffix other than ``.png`` or ``.svg`` (nothing is drawn or written).
        InputError: a document that is not of the ``--out`` schema (field ``SOURCE``).
        BackendUnavailable: matplotlib is not installed.
        ArchiveError, ArchiveWriteError: the file cannot be written; ``path`` is as it was.
    """
    from ..archive.layout import write_output
    from .sources import from_document

    fmt = image_format(path, field=field)
    report = source if isinstance(source, ReportInput) else from_document(source, "")
    data = chart_images(report, scale=scale, format=fmt)
    write_output(Path(path), data, field=field)
    return Path(path)
