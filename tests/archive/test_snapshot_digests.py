"""Every field of a snapshot record in the manifest is covered by a digest checked on read.

The rule: a replay shows players by the labels and roles the manifest records, so an edit of any
field of a snapshot record (a label, a role, a span, a message's text, the target...) must be
refused, with one line naming that field and exit code 2, and nothing printed as a result. Before
the digests, the snapshot id covered the conversation and the spans only: a renamed player replayed
with exit 0 under its new name. A real archive throughout: the CLI's ``explain`` on the tiny random
Llama, then the CLI's ``replay`` on a copy with one field edited.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.cli import run_cli_quiet as run


LEGACY = Path(__file__).parent.parent / "data" / "legacy-v1-run"
CHAT = {
    "messages": [
        {"role": "system", "content": "You answer in one line.\nNo lists."},
        {"role": "user", "content": "Notes:\n- The Eiffel Tower was completed in 1889.\n- Big Ben was finished in 1859."},
        {"role": "assistant", "content": "The Eiffel Tower, in 1889."},
    ]
}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    base = tmp_path_factory.mktemp("digests")
    (base / "chat.json").write_text(json.dumps(CHAT), encoding="utf-8")
    code, _, err = run(["explain", str(base / "chat.json"), "--model", str(tiny_model_dir), "--unit", "sentence",
                        "--method", "exact", "--archive", str(base / "run")])
    assert code == 0, err
    return base / "run"


def edited_copy(archive: Path, tmp_path: Path, edit) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(archive, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    edit(manifest["snapshots"][0])
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return run_dir


def _set(path: str, value: object):
    def edit(record: dict) -> None:
        *parents, last = path.split(".")
        target = record
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[int(last) if last.isdigit() else last] = value(target[int(last) if last.isdigit() else last])

    return edit


# (what is edited, how, the field the refusal must name)
EDITS = [
    ("players.1.label", lambda v: "user[1].s0 (edited)", "players[].label"),
    ("players.0.role", lambda v: "user", "players[].role"),
    ("players.1.start", lambda v: v + 1, "players[].start"),
    ("players.2.end", lambda v: v - 1, "players[].end"),
    ("players.1.index", lambda v: 2, "players[].index"),
    ("players.2.message_index", lambda v: 0, "players[].message_index"),
    ("messages.1.content", lambda v: v.replace("1889", "1890"), "messages[].content"),
    ("messages.0.role", lambda v: "developer", "messages[].role"),
    ("target", lambda v: v + " Yes.", "target"),
    ("target_source", lambda v: "field", "target_source"),
    ("unit", lambda v: "turn", "unit"),
    ("snapshot_id", lambda v: "0" * 64, "snapshot_id"),
    ("template_injects_default_system", lambda v: not v, "template_injects_default_system"),
]


@pytest.mark.parametrize(("where", "change", "field"), EDITS, ids=[e[0] for e in EDITS])
def test_an_edit_of_any_field_of_a_snapshot_record_is_refused_naming_it(archive: Path, tmp_path: Path, where, change, field) -> None:
    code, out, _ = run(["replay", str(archive), "--method", "exact"])
    assert code == 0 and "user[1].s0" in out  # as written: replays
    run_dir = edited_copy(archive, tmp_path, _set(where, change))
    code, out, err = run(["replay", str(run_dir), "--method", "exact"])
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1, err
    assert f"snapshots[0].{field} " in err and "manifest.json" in err and "(edited)" not in err, err


def test_an_added_or_removed_field_is_refused_naming_it(archive: Path, tmp_path: Path) -> None:
    added = edited_copy(archive, tmp_path / "a", lambda r: r["players"][0].update(note="x"))
    code, _, err = run(["replay", str(added), "--method", "exact"])
    assert code == 2 and "snapshots[0].players[].note is not covered" in err, err
    removed = edited_copy(archive, tmp_path / "b", lambda r: r.pop("default_system_in_play"))
    code, _, err = run(["replay", str(removed), "--method", "exact"])
    assert code == 2 and "snapshots[0].default_system_in_play is missing" in err, err


def test_records_written_before_digests_still_replay(archive: Path, tmp_path: Path) -> None:
    """A record without ``digests`` (this format before them; the legacy v1 archive) is accepted as
    it is; its content is still checked through its snapshot id."""
    plain = edited_copy(archive, tmp_path / "a", lambda r: r.pop("digests"))
    code, out, err = run(["replay", str(plain), "--method", "exact"])
    assert code == 0 and "user[1].s0" in out, err
    legacy = tmp_path / "legacy"
    shutil.copytree(LEGACY, legacy)
    assert "digests" not in json.loads((legacy / "manifest.json").read_text(encoding="utf-8"))["snapshots"][0]
    code, _, err = run(["replay", str(legacy), "--method", "exact"])
    assert code == 0, err
    # without digests an edit of the text is still caught, by the snapshot id
    texts = edited_copy(archive, tmp_path / "b", lambda r: (r.pop("digests"), r["messages"][1].update(content="x" * 90)))
    code, _, err = run(["replay", str(texts), "--method", "exact"])
    assert code == 2, err
