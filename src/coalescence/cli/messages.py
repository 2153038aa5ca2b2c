"""Errors as the command prints them: one line, naming the option (``--budget``) that the library
calls by its setting's name (``budget``)."""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import CoalescenceError

__all__ = ("FLAGS", "error_line", "fail", "flags_of", "named")


FLAGS: dict[str, str] = {}
"""The library's field names (settings, e.g. ``budget``) mapped to the running command's options
(``--budget``); filled by :func:`_command` from the parser of the command it runs."""


_LINE = re.compile(r"^(line \d+: )?(.*)$", re.S)


def flags_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Field name -> option of the subcommand ``args`` ran (its long option), so a library error
    about ``budget`` names ``--budget`` and one about ``archive`` names ``--archive`` under
    ``explain`` and ``RUN_DIR`` under ``replay``."""
    out: dict[str, str] = {}
    for name in (args.command, getattr(args, "archive_command", None)):
        if name is not None:
            parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    for action in parser._actions:
        if action.option_strings:
            out.setdefault(action.dest, max(action.option_strings, key=len))
        elif action.dest == "run_dir":  # replay, archive info/compact: the archive is RUN_DIR
            out.setdefault("archive", str(action.metavar))
    if "methods" in out:  # replay, evaluate, sweep take several; the library's errors say "method"
        out.setdefault("method", out["methods"])
    return out


def named(field: str | None) -> str | None:
    """The option (or field) an error names, e.g. ``budget`` -> ``--budget``, ``line 3: unit`` ->
    ``line 3: --unit``; input fields such as ``messages[1].content`` stay as they are."""
    if field is None:
        return None
    match = _LINE.match(field)
    assert match is not None
    prefix, name = match.group(1) or "", match.group(2)
    return prefix + FLAGS.get(name, name)


def error_line(exc: CoalescenceError) -> str:
    """``coalescence: error: OPTION: message`` on one line, whatever the message holds."""
    field = named(exc.field)
    text = f"{field}: {exc.message}" if field else exc.message
    return f"coalescence: error: {' '.join(text.split())}"


def fail(exc: CoalescenceError, code: int) -> int:
    print(error_line(exc), file=sys.stderr)
    return code
