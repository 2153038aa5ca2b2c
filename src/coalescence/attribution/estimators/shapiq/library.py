"""Loading shapiq, the optional library behind the ``shapiq:<Approximator>`` methods: the only
place that imports it, with a one-line install hint when it is missing."""

from __future__ import annotations

import warnings
from typing import Any

from ....errors import BackendUnavailable

__all__ = ("INSTALL", "PREFIX", "shapiq_version")

PREFIX = "shapiq:"
"""The method-name prefix of shapiq's approximators (``shapiq:KernelSHAP``)."""

INSTALL = "pip install -c constraints.txt 'coalescence[shapiq]'"
"""The command that installs the shapiq extra (named in every error about a missing shapiq)."""


def _shapiq() -> Any:
    """The shapiq module, or a one-line error naming the install command."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import shapiq
    except ImportError:
        raise BackendUnavailable(f"the shapiq methods need the shapiq extra: {INSTALL}") from None
    return shapiq


def shapiq_version() -> str:
    """The installed shapiq's version string (from the package metadata).

    Raises:
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    from importlib.metadata import version

    _shapiq()
    return version("shapiq")


def _in_process_available() -> bool:
    try:
        _shapiq()
    except BackendUnavailable:
        return False
    return True
