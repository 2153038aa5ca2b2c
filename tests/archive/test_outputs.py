"""Output files (``--out``, ``--html``, ``report -o``) are written through symbolic links and to
streams, never replacing a link (a new user's ``report -o /dev/stdout`` turned the link into a file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from coalescence.archive.writer import write_json_atomic
from coalescence.report import write_report


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    target = tmp_path / "real" / "out.json"
    target.parent.mkdir()
    target.write_text("old", encoding="utf-8")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json_atomic(link, {"a": 1}, field="out")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text(encoding="utf-8")) == {"a": 1}
    write_report(link, "<p>page</p>", field="html")
    assert link.is_symlink() and target.read_text(encoding="utf-8") == "<p>page</p>"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]  # no temporary left


def test_a_dangling_link_gets_its_target_written(tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "later.json")
    write_json_atomic(link, [1, 2], field="out")
    assert link.is_symlink() and json.loads((tmp_path / "later.json").read_text(encoding="utf-8")) == [1, 2]


def test_a_pipe_is_written_as_a_stream(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        write_report(Path(f"/proc/self/fd/{write_end}"), "<p>streamed</p>", field="html")
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        assert fh.read() == b"<p>streamed</p>"
