"""Real explanations for the report tests: ``coalescence explain`` run in-process on the tiny random
Llama (``tiny_model_dir``), writing the ``--out`` document, the run archive and the ``--html`` page.

The conversations hold the text a report gets wrong first: tabs, runs of spaces, a CRLF, blank
lines, a no-break space, a combining accent, an emoji, right-to-left text and HTML-looking text
(``<script>``, ``&amp;``), which must come back byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.cli import run_cli


SYSTEM = "You are a helpful assistant.\tAnswer  briefly."
USER = (
    "The Eiffel Tower was completed in 1889.  Big Ben's clock tower in London was finished in 1859.\r\n"
    "A <script>alert('x')</script> & &amp; \u201cquotes\u201d caf\u00e9\u00a0na\u00efve e\u0301 \U0001f5fc \u05e2\u05d1\u05e8\u05d9\u05ea.\n\n"
    "  When was the tower completed?  "
)
ANSWER = "It was completed in 1889."
TRICKY = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": ANSWER},
    ]
}
"""A conversation whose prompt text a report must show exactly (no ``http`` anywhere in it)."""

SECOND = {
    "messages": [
        {"role": "user", "content": "Big Ben's clock tower in London was finished in 1859. When was Big Ben finished?"},
        {"role": "assistant", "content": "It was finished in 1859."},
    ]
}

WORDS = ("tower", "fair", "Paris", "clock", "London", "Rome", "year", "opened")
HUNDRED_WORDS = " ".join(WORDS[i % len(WORDS)] for i in range(100))
"""100 words and no punctuation: 100 players at ``--unit word --roles user``."""
HUNDRED = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": HUNDRED_WORDS},
        {"role": "assistant", "content": ANSWER},
    ]
}


@dataclass(frozen=True)
class Run:
    """One ``explain`` run: its exit code, output, document, archive and report page."""

    code: int
    stdout: str
    stderr: str
    doc: Any
    out: Path
    run_dir: Path
    html: Path
    inputs: list[dict[str, Any]]


def explain(base: Path, model_dir: Path, inputs: Any, *options: str) -> Run:
    """Run ``explain`` with ``--out``, ``--archive`` and ``--html`` in ``base`` (a list of inputs is a JSONL batch)."""
    base.mkdir(parents=True, exist_ok=True)
    batch = isinstance(inputs, list)
    path = base / ("inputs.jsonl" if batch else "input.json")
    items = inputs if batch else [inputs]
    path.write_text("\n".join(json.dumps(x) for x in items) + "\n" if batch else json.dumps(inputs), encoding="utf-8")
    out, run_dir, html = base / "out.json", base / "run", base / "report.html"
    argv = [
        "explain", str(path), "--model", str(model_dir), *options,
        "--archive", str(run_dir), "--out", str(out), "--html", str(html), "--no-progress",
    ]  # fmt: skip
    code, stdout, stderr = run_cli(argv)
    doc = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
    return Run(code, stdout, stderr, doc, out, run_dir, html, items)


def prompt_messages(conversation: dict[str, Any]) -> list[dict[str, str]]:
    """The prompt messages of an input (its last assistant message is the answer explained)."""
    return conversation["messages"][:-1]
