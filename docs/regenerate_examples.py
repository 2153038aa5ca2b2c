"""Run the demo again and rewrite the example output in README.md and docs/ from it.

Usage (from the repository root, after ``make install``; about 3 minutes on 2 CPU cores)::

    HF_HUB_OFFLINE=1 .venv/bin/python docs/regenerate_examples.py

What it does:

1. runs the demo command of the README (``make demo``'s ``coalescence explain examples/eiffel.json
   --model smollm2-135m --unit sentence --method exact``) into a temporary directory;
2. records that run in ``docs/demo/``: the run archive (``eiffel-run/``, what ``coalescence compare``,
   ``report`` and ``replay`` read with no model), the ``--out`` document (``eiffel.json``) and
   what the command printed (``explain.txt``);
3. rewrites every block of README.md and docs/*.md between ``<!-- example: NAME -->`` and
   ``<!-- end example -->`` with the current code's output: ``explain`` (the demo's printout),
   ``compare`` (run on the recorded archive) and ``evaluate``; the README's demo printout keeps
   the first four rows of the ranked table and the last;
4. for ``evaluate`` (whose held-out coalitions are none of an archive's plans, and the exact run's
   plan is every coalition): evaluates the recorded ``--out`` document in a new archive,
   ``docs/demo/eiffel-held-out/`` (its game re-created there, its held-out coalitions evaluated with
   the model and recorded), then prints the block from a second evaluation, served from it.

Paths of the temporary run are written as the README's demo names them (``runs/eiffel-<time>``,
``runs/eiffel.json``, ``runs/eiffel.html``, ``runs/eiffel-held-out``). The prose around the blocks (the values a paragraph
quotes) is checked, not rewritten: ``tests/test_readme.py`` fails when a quoted number no longer
matches the recorded run, naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "docs" / "demo"
COALESCENCE = [sys.executable, "-m", "coalescence.cli"]
DEMO_ARGS = ["examples/eiffel.json", "--model", "smollm2-135m", "--unit", "sentence", "--method", "exact"]
COMPARE_ARGS = ["--method", "exact,kernelshap,lasso,loo", "--budget", "64"]
BLOCK = re.compile(r"(<!-- example: (?P<name>[\w-]+) -->\n```\n)(?P<body>.*?)(```\n<!-- end example -->)", re.S)


def _run(args: list[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(COALESCENCE + args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"regenerate_examples: {' '.join(args[:2])} failed (exit {done.returncode}):\n{done.stderr}")
    return done.stdout


def elide(printed: str, keep: int = 4) -> str:
    """The printout with the ranked table cut to its first ``keep`` rows, ``...`` and its last row."""
    lines = printed.splitlines(keepends=True)
    rows = [i for i, line in enumerate(lines) if re.match(r"\s+\d+\s+[+-]\d", line)]
    if len(rows) <= keep + 1:
        return printed
    return "".join(lines[: rows[keep]] + ["   ...\n"] + lines[rows[-1] :])


def compare_output(command: str = "compare", args: list[str] = COMPARE_ARGS) -> str:
    """``coalescence compare`` on the recorded archive, its path written as the README's."""
    out = _run([command, str(DEMO / "eiffel-run"), *args, "--no-progress"])
    line = " ".join([f"coalescence {command} runs/eiffel-<time>", *args])
    return line + "\n" + out.replace(str(DEMO / "eiffel-run"), "runs/eiffel-<time>")


def evaluate_output() -> str:
    """``coalescence evaluate`` of the recorded document in a new archive, recorded in
    docs/demo/eiffel-held-out/; the printout of a second evaluation (from that archive, no model
    call), its paths written as the README's."""
    held = DEMO / "eiffel-held-out"
    if held.exists():
        shutil.rmtree(held)
    args = ["evaluate", str(DEMO / "eiffel.json"), "--archive", str(held), "--no-progress"]
    _run(args)  # the game re-created in the new archive, its coalitions evaluated with the model
    (held / ".lock").unlink(missing_ok=True)
    out = _run(args)
    return "coalescence evaluate runs/eiffel.json --archive runs/eiffel-held-out\n" + out.replace(str(held), "runs/eiffel-held-out")


def record_demo() -> str:
    """Run the demo into a temporary directory, record it in docs/demo/, return its printout."""
    with tempfile.TemporaryDirectory() as tmp:
        run, out, html = Path(tmp, "eiffel-run"), Path(tmp, "eiffel.json"), Path(tmp, "eiffel.html")
        printed = _run(["explain", *DEMO_ARGS, "--archive", str(run), "--out", str(out), "--html", str(html)])
        printed = printed.replace(str(run), "runs/eiffel-<time>").replace(str(out), "runs/eiffel.json")
        printed = printed.replace(str(html), "runs/eiffel.html")
        # make demo's own last line
        printed += "report: runs/eiffel.html (open it in a browser: it needs no network)\n"
        if DEMO.exists():
            shutil.rmtree(DEMO)
        DEMO.mkdir(parents=True)
        (run / ".lock").unlink(missing_ok=True)
        shutil.copytree(run, DEMO / "eiffel-run", symlinks=True)
        document = json.loads(out.read_text(encoding="utf-8"))
        document["archive"] = "docs/demo/eiffel-run"
        (DEMO / "eiffel.json").write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (DEMO / "explain.txt").write_text(printed, encoding="utf-8")
    return printed


def rewrite(blocks: dict[str, str]) -> list[str]:
    """Replace each named block in README.md and docs/*.md; the files changed."""
    changed = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")

        def fill(m: re.Match[str]) -> str:
            body = blocks.get(m["name"])
            return m.group(0) if body is None else m.group(1) + body + m.group(4)

        new = BLOCK.sub(fill, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main() -> None:
    blocks = {"explain": elide(record_demo())}
    blocks["compare"] = compare_output()
    blocks["evaluate"] = evaluate_output()  # with the model once (about 1.5 minutes), then from its archive
    changed = rewrite(blocks)
    print(f"recorded the demo in {DEMO.relative_to(ROOT)}; rewrote: {', '.join(changed) or 'nothing (unchanged)'}")
    print("now run: .venv/bin/python -m pytest tests/test_readme.py")


if __name__ == "__main__":
    main()
