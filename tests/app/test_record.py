"""The run record's model options: every field of the backend settings reaches the manifest's
``run_config`` (a field added by a subclass too: no hand list), the batch size recorded is the
engine's effective one, and an archive whose runs recorded only the options today's archives hold
(``device``, ``batch_size``, ``ray``) still resumes and replays.

Real parts: the real CLI in this process, the tiny random Llama, real Parquet parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from helpers.cli import run_cli

from coalescence.app.record import model_options
from coalescence.archive import read_manifest
from coalescence.backends.settings import BackendSettings


@dataclass(frozen=True, slots=True, kw_only=True)
class TunedSettings(BackendSettings):
    """Backend settings with one option more, as a new option would be added."""

    kv_cache_gib: float = 2.5


def test_a_field_added_to_the_backend_settings_is_recorded_with_no_list_to_keep():
    recorded = model_options(TunedSettings(model="m", kv_cache_gib=4.0), batch_size=8)
    assert recorded == {
        "model": "m", "backend": "hf", "device": "cpu", "dtype": "float32", "batch_size": 8,
        "server_url": None, "kv_cache_gib": 4.0,
    }  # fmt: skip
    with_workers = model_options(TunedSettings(model=Path("/m"), workers=2, threads_per_worker=1), batch_size=3)
    assert with_workers["ray"] == {"workers": 2, "ray_address": None, "gpus_per_worker": 0.0, "threads_per_worker": 1}
    assert with_workers["model"] == "/m" and with_workers["kv_cache_gib"] == 2.5 and "workers" not in with_workers
    json.dumps(with_workers)  # the manifest is JSON


def test_a_server_urls_password_is_not_recorded():
    """A credential in the server URL stays out of the archive (the user and host stay: they say
    which server scored); a URL without one is recorded as given."""
    secret = model_options(BackendSettings(model="m", server_url="http://ann:s3cret@10.0.0.7:8000"), batch_size=4)
    assert secret["server_url"] == "http://ann:***@10.0.0.7:8000"
    assert "s3cret" not in json.dumps(secret)
    plain = model_options(BackendSettings(model="m", server_url="http://10.0.0.7:8000/v1"), batch_size=4)
    assert plain["server_url"] == "http://10.0.0.7:8000/v1"


CHAT = {
    "messages": [
        {"role": "user", "content": "Paris is in France. Rome is in Italy. Where is Paris?"},
        {"role": "assistant", "content": "In France."},
    ]
}


def test_a_run_records_its_model_options_and_an_archive_with_todays_keys_resumes_and_replays(tmp_path, tiny_model_dir):
    source = tmp_path / "chat.json"
    source.write_text(json.dumps(CHAT), encoding="utf-8")
    run_dir, out = tmp_path / "run", tmp_path / "out.json"
    argv = ["explain", str(source), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact",
            "--archive", str(run_dir), "--out", str(out), "--no-progress"]  # fmt: skip
    code, _, err = run_cli(argv)
    assert code == 0, err
    manifest = read_manifest(run_dir)
    config = manifest["runs"][0]["run_config"]
    # the options as given, and the hf backend's own batch (16 rows) where none was given
    assert {k: config[k] for k in ("model", "backend", "device", "dtype", "batch_size", "server_url")} == {
        "model": str(tiny_model_dir), "backend": "hf", "device": "cpu", "dtype": "float32", "batch_size": 16, "server_url": None,
    }  # fmt: skip
    assert "ray" not in config and "workers" not in config
    first = json.loads(out.read_text(encoding="utf-8"))

    # the run_config an archive written before this change holds: no model, backend, dtype or URL
    for key in ("model", "backend", "dtype", "server_url"):
        del config[key]
    (run_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    rows = manifest["rows"]
    out.unlink()
    code, _, err = run_cli(argv)
    assert code == 0, err
    resumed = read_manifest(run_dir)
    assert len(resumed["runs"]) == 1 and "resumed_at" in resumed["runs"][0] and resumed["rows"] == rows
    assert resumed["runs"][0]["run_config"]["model"] == str(tiny_model_dir)
    again = json.loads(out.read_text(encoding="utf-8"))
    assert [p["value"] for p in again["players"]] == [p["value"] for p in first["players"]]

    config = resumed["runs"][0]["run_config"]
    for key in ("model", "backend", "dtype", "server_url"):
        del config[key]
    (run_dir / "manifest.json").write_text(json.dumps(resumed), encoding="utf-8")
    replayed = tmp_path / "replayed.json"
    code, _, err = run_cli(["replay", str(run_dir), "--method", "exact", "--out", str(replayed), "--no-progress"])
    assert code == 0, err
    (explanation,) = json.loads(replayed.read_text(encoding="utf-8"))["explanations"]
    values = [p["value"] for p in explanation["players"]]
    assert values == [p["value"] for p in first["players"]]
