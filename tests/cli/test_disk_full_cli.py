"""A full disk during a run ends the command with exactly one line on stderr and exit code 3 (the
manifest's own failure to record it is not a second line).

A real full disk cannot be made here (root, no tmpfs): the run's OS write calls under the archive
fail with ENOSPC from the ``after``-th on (``tests/helpers/archive_faults.py``), in a real
``coalescence explain`` subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = """
import sys
sys.path.insert(0, {faults!r})
import pytest
from helpers.archive_faults import DiskFault
from coalescence.cli import main
mp = pytest.MonkeyPatch()
DiskFault(mp, {root!r}, after={after})
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("after", [2, 6])
def test_a_full_disk_is_one_line(after: int, tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "One. Two.\\nThree."}, {"role": "assistant", "content": "Four."}]}))
    run_dir = tmp_path / "run"
    argv = ["explain", str(path), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact", "--archive", str(run_dir), "--no-progress", "--flush-rows", "2"]
    faults = str(Path(__file__).parents[1])  # tests/, where the helpers package is
    code = DRIVER.format(faults=faults, root=str(run_dir), after=after, argv=argv)
    paths = [p for p in (os.environ.get("PYTHONPATH", ""), str(Path(__file__).parents[2] / "src")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the caller's sources first
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 3, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("coalescence: error: "), lines[0]
    assert "No space left on device" in lines[0] or "disk" in lines[0], lines[0]
