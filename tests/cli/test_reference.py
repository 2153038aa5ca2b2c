"""docs/cli.md, the generated command-line reference, is what ``--help`` prints.

Two checks: the page is byte for byte what :mod:`coalescence.cli.reference` generates now (so a
new or changed option fails here until the page is regenerated, and the failure says how); and,
independently of the generator, each command's section read back from the Markdown is what
``coalescence COMMAND --help`` prints through the real command line in a terminal of the page's
width (argparse wraps at ``$COLUMNS - 2``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from coalescence import cli
from coalescence.cli import reference

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"
COMMANDS = ["", "explain", "replay", "sweep", "report", "compare", "evaluate", "show", "archive", "archive info", "archive compact"]


def _sections(text: str) -> dict[str, str]:
    """``## coalescence NAME`` heading -> its section's text, read from the Markdown."""
    parts = re.split(r"^## (coalescence(?: [\w ]+)?)\n", text, flags=re.M)
    return {heading.removeprefix("coalescence").strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_the_page_is_what_the_generator_writes_now():
    assert PAGE.read_text(encoding="utf-8") == reference.render(), (
        f"docs/cli.md is out of date with the parser: run `{reference.REGENERATE}` from the repository root"
    )


def test_the_page_has_one_section_per_command_and_each_is_its_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(reference.WIDTH + 2))
    page = PAGE.read_text(encoding="utf-8")
    sections = _sections(page)
    assert list(sections) == COMMANDS
    for command in COMMANDS:
        with pytest.raises(SystemExit) as stopped:
            cli.main([*command.split(), "--help"])
        assert stopped.value.code == 0
        printed = capsys.readouterr().out
        body, _, epilog = printed.partition("\n\nexample:\n" if command else "\n\nexit codes:\n")
        blocks = re.findall(r"^```text\n(.*?)\n```$", sections[command], flags=re.M | re.S)
        assert "\n\n".join(blocks) == body.rstrip("\n"), command
        examples = re.findall(r"^```sh\n(.*?)\n```$", sections[command], flags=re.M | re.S)
        if command:  # every subcommand's --help ends with one example command, then the exit codes
            assert examples == [epilog.split("\n\n", 1)[0].strip()], command
        else:
            assert examples == []
    # the exit codes, the same at the end of every --help, once at the top of the page
    codes = re.search(r"^## Exit codes\n.*?^```text\n(.*?)\n```$", page, flags=re.M | re.S)
    assert codes is not None and printed.rstrip("\n").endswith(codes.group(1))
    assert re.findall(r"^    (\d+) ", codes.group(1), flags=re.M) == ["0", "1", "2", "3", "4", "130", "141", "143"]


def test_every_option_of_every_help_is_on_the_page(capsys, monkeypatch):
    """A second reading, by option: each long option ``--help`` lists is in its command's section."""
    monkeypatch.setenv("COLUMNS", str(reference.WIDTH + 2))
    sections = _sections(PAGE.read_text(encoding="utf-8"))
    for command in ("explain", "replay", "sweep", "evaluate"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        options = set(re.findall(r"^\s{2}(?:-\w, )?(--[\w-]+)", capsys.readouterr().out, flags=re.M))
        assert {"--help", "--model", "--no-progress"} <= options
        listed = set(re.findall(r"^\s{2}(?:-\w, )?(--[\w-]+)", sections[command], flags=re.M))
        assert options == listed, command


def test_check_says_the_command_that_regenerates_a_stale_page(tmp_path):
    stale = tmp_path / "cli.md"
    stale.write_text(PAGE.read_text(encoding="utf-8").replace("--flush-rows", "--flush-lines", 1), encoding="utf-8")
    run = [sys.executable, "-m", "coalescence.cli.reference", "--check"]
    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    got = subprocess.run([*run, str(stale)], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert got.returncode == 1 and reference.REGENERATE in got.stderr, got.stderr
    assert subprocess.run([*run, str(PAGE)], capture_output=True, text=True, env=env, cwd=ROOT, check=False).returncode == 0
    # and writing it makes the stale copy current
    assert subprocess.run([*run[:-1], str(stale)], env=env, cwd=ROOT, check=False).returncode == 0
    assert stale.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
