"""The one error tree of coalescence.

Every error the library raises on purpose derives from :class:`CoalescenceError`; third-party
errors are translated at the boundary with ``raise ... from exc``::

    CoalescenceError
    ├── ConfigError        (also ValueError)  a setting is invalid: bad option value, impossible budget
    ├── InputError         (also ValueError)  the input conversation is invalid: malformed JSON, unknown role
    │   └── TemplateRefused                   the model's chat template refuses a coalition's conversation
    ├── MaskError          (also ValueError)  a coalition mask is malformed: wrong length, pad bits set
    ├── EstimatorError                        an estimator cannot run: too many players, pool misses coalitions
    ├── BackendError                          the model backend failed
    │   ├── BackendUnavailable                a model or optional dependency is missing (with an install hint)
    │   └── BatchFailed                       a model call failed or returned invalid outputs
    ├── ArchiveError                          the run archive cannot be read, or is not a place to write one
    │   └── ArchiveWriteError                 a write failed: disk full, I/O error (what was flushed stays)
    ├── ReportError                           the HTML report could not be drawn or written (the results stay)
    └── EngineClosed                          work was submitted to a closed engine

Errors that come from user input carry a ``field`` (the input field or CLI option at fault) so the
CLI can print one line naming the field and the fix, and exit with code 2 (3 for an
:class:`ArchiveWriteError`, 1 for a :class:`BatchFailed`, 4 for a :class:`ReportError`; the CLI's module docstring has the table).
"""

from __future__ import annotations

__all__ = (
    "ArchiveError",
    "ArchiveWriteError",
    "BackendError",
    "BackendUnavailable",
    "BatchFailed",
    "CoalescenceError",
    "ConfigError",
    "EngineClosed",
    "EstimatorError",
    "InputError",
    "MaskError",
    "ReportError",
    "TemplateRefused",
)


class CoalescenceError(Exception):
    """Root of every error raised by coalescence.

    Args:
        message: one line saying what is wrong and how to fix it.
        field: the input field or CLI option at fault (e.g. ``"messages[2].role"`` or ``"budget"``; the CLI names the option, ``--budget``),
            or ``None`` when no single field is at fault.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        if self.field:
            return f"{self.field}: {self.message}"
        return self.message


class ConfigError(CoalescenceError, ValueError):
    """A setting is invalid (an option value, an impossible budget, an unknown method)."""


class InputError(CoalescenceError, ValueError):
    """The input conversation is invalid (malformed JSON, unknown role, empty target, no players)."""


class TemplateRefused(InputError):
    """The model's chat template raised on a conversation (e.g. roles that do not alternate), or
    renders the answer other than verbatim; the message quotes the template's own words.

    Attributes:
        reason: the template's own words (its ``raise_exception`` message), or ``""``.
    """

    def __init__(self, message: str, *, field: str | None = None, reason: str = "") -> None:
        super().__init__(message, field=field)
        self.reason = reason


class MaskError(CoalescenceError, ValueError):
    """A coalition mask is malformed (wrong number of bits, pad bits set, wrong byte length)."""


class EstimatorError(CoalescenceError):
    """An estimator cannot run on this game (too many players, a pool that lacks needed coalitions)."""


class BackendError(CoalescenceError):
    """The model backend failed."""


class BackendUnavailable(BackendError):
    """A model or an optional dependency is missing; the message carries the install hint."""


class BatchFailed(BackendError):
    """A model call failed or returned invalid outputs (wrong row count, non-finite values)."""


class ArchiveError(CoalescenceError):
    """The run archive cannot be read (damaged, foreign, newer), or its place cannot be written (not
    writable, not a directory): refused before anything is written."""


class ArchiveWriteError(ArchiveError):
    """Writing the archive or an output file failed (disk full, I/O error). Parts already flushed
    stay intact and the manifest records the failure when it can be written at all; a resume after
    the cause is fixed completes the run."""


class ReportError(CoalescenceError):
    """The HTML report could not be drawn or written after the run's results were (the archive and
    the ``--out`` document are complete); ``coalescence report RUN_DIR -o PATH`` makes it again."""


class EngineClosed(CoalescenceError):
    """Work was submitted to an engine that was already closed."""
