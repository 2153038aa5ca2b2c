"""The command-line reference, ``docs/cli.md``, generated from the parser itself.

Every section is what ``coalescence COMMAND --help`` prints (at :data:`WIDTH` columns), cut at its
argparse groups so that each group gets a heading: the usage and description, then one block per
options group (model, players and absence, utility, ...; the groups of the settings the options
are generated from, :mod:`coalescence.app.options`), then the command's example. The exit codes,
the same for every command, are printed once at the top. Nothing in the page is written by hand,
so it cannot disagree with ``--help``; ``tests/cli/test_reference.py`` fails when the page drifts
from what this module generates, and checks the page against ``--help`` itself.

Regenerate the page (from the repository root)::

    PYTHONPATH=src python -m coalescence.cli.reference           # writes docs/cli.md
    PYTHONPATH=src python -m coalescence.cli.reference --check   # exit 1 when docs/cli.md is stale
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from .exit_codes import EXIT_CODES
from .parser import build_parser

__all__ = ("REGENERATE", "WIDTH", "commands", "help_blocks", "help_text", "main", "render")

WIDTH = 100
"""Columns of the help text in the page (``--help`` itself wraps at the terminal's width)."""

REGENERATE = "PYTHONPATH=src python -m coalescence.cli.reference"
"""The command that rewrites ``docs/cli.md`` (run from the repository root)."""

_DEFAULT_PATH = Path("docs") / "cli.md"


def commands(parser: argparse.ArgumentParser | None = None) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every command of the ``coalescence`` parser, depth first, the parser itself first.

    Args:
        parser: the parser (default: :func:`coalescence.cli.parser.build_parser`'s).

    Returns:
        ``(name, summary, parser)`` triples: ``name`` the words after ``coalescence`` (``""``
        for the top level, ``"archive info"``), ``summary`` the one-line help the parent lists.
    """
    parser = parser or build_parser()
    yield from _walk(parser, "", "")


def _walk(parser: argparse.ArgumentParser, name: str, summary: str) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    yield name, summary, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}".strip(), helps.get(sub_name, ""))


def help_text(parser: argparse.ArgumentParser) -> str:
    """What ``--help`` prints for ``parser`` in a terminal :data:`WIDTH` columns wide.

    Args:
        parser: one command's parser.

    Returns:
        The help text, usage to epilog, ending in a newline.
    """
    kind = parser.formatter_class
    parser.formatter_class = functools.partial(kind, width=WIDTH)
    try:
        return parser.format_help()
    finally:
        parser.formatter_class = kind


def help_blocks(parser: argparse.ArgumentParser) -> list[tuple[str | None, str]]:
    """A command's ``--help`` (:func:`help_text`, without its epilog) cut where its groups begin.

    Args:
        parser: one command's parser.

    Returns:
        ``(title, text)`` pairs in ``--help`` order: first ``(None, usage and description)``, then
        one per argument group shown (``"positional arguments"``, ``"options"``, ``"model"``,
        ...), its text as ``--help`` prints it (title line included), no trailing newline; joined
        by blank lines they are ``--help`` up to its epilog.
    """
    text = help_text(parser)
    if parser.epilog:
        text = text[: text.rindex("\n\n" + parser.epilog.splitlines()[0] + "\n")]
    titles = [g.title for g in parser._action_groups if g.title and any(a.help is not argparse.SUPPRESS for a in g._group_actions)]
    blocks: list[tuple[str | None, str]] = []
    title: str | None = None
    for name in titles:
        cut = text.index(f"\n\n{name}:\n")
        blocks.append((title, text[:cut].strip("\n")))
        title, text = name, text[cut + 2 :]
    blocks.append((title, text.strip("\n")))
    return blocks


def _example(parser: argparse.ArgumentParser) -> str | None:
    epilog = parser.epilog or ""
    if not epilog.startswith("example:"):
        return None
    return epilog.split("\n\n", 1)[0].removeprefix("example:").strip()


def _title(name: str) -> str:
    return f"coalescence {name}".strip()


def _anchor(name: str) -> str:
    return _title(name).replace(" ", "-")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The Markdown text of ``docs/cli.md``.

    Args:
        parser: the parser (default: :func:`coalescence.cli.parser.build_parser`'s).

    Returns:
        The page: a contents list, the exit codes once, then one ``##`` section per command (its
        summary, its help blocks as ``text`` code blocks with a ``###`` heading per options group,
        its example command), ending in a newline.
    """
    found = list(commands(parser))
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated from the parser by `python -m coalescence.cli.reference`: do not edit by hand;",
        f"     run `{REGENERATE}` from the repository root after changing an option. -->",
        "",
        f"Every command's `--help`, as it prints at {WIDTH} columns, one section per command and a heading",
        "per group of options. The options are generated from the settings' fields",
        "(`coalescence.app.options`), so this page, `--help` and the Python API's keywords cannot disagree;",
        "`tests/cli/test_reference.py` fails when this page drifts from `--help`.",
        "",
    ]
    lines += [f"- [`{_title(name)}`](#{_anchor(name)}){': ' + summary if summary else ''}" for name, summary, _ in found]
    lines += [
        "",
        "## Exit codes",
        "",
        "The same for every command (the end of every `--help`); every error is one line on stderr,",
        "`coalescence: error: FIELD: what is wrong and the fix`.",
        "",
        "```text",
        EXIT_CODES.rstrip("\n"),
        "```",
    ]
    for name, summary, sub in found:
        lines += ["", f"## {_title(name)}", ""]
        if summary:
            lines += [summary[:1].upper() + summary[1:] + ".", ""]
        for title, text in help_blocks(sub):
            if title is not None:
                lines += [f"### {_title(name)}: {title}", ""]
            lines += ["```text", text, "```", ""]
        example = _example(sub)
        if example:
            lines += ["Example:", "", "```sh", example, "```", ""]
        while lines[-1] == "":
            lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``docs/cli.md`` (or check it): ``python -m coalescence.cli.reference [--check] [PATH]``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when the page was written or is current; 1 with ``--check`` when it is stale (a line on
        stderr says the command that regenerates it).
    """
    args = argparse.ArgumentParser(prog="python -m coalescence.cli.reference", description=__doc__.split("\n\n")[0])
    args.add_argument("path", nargs="?", type=Path, default=_DEFAULT_PATH, help=f"the page (default: {_DEFAULT_PATH})")
    args.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page differs from the generated one")
    ns = args.parse_args(argv)
    text = render()
    if ns.check:
        current = ns.path.read_text(encoding="utf-8") if ns.path.is_file() else None
        if current != text:
            print(f"{ns.path} is out of date with the parser: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    ns.path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
