"""Adding a backend from outside the package (issue 48, docs/extending.md "Adding a backend"): a
server backend is one folder (``tests/helpers/toy_server``: the backend, its loader, the server it talks to)
and one registration; its declared capabilities are what the run's checks ask (it needs a URL, it
generates nothing), and ``explain`` runs on it, from the command line and from Python.

The toy server scores the public fake backend's presence game made additive
(``helpers.presence``), so every player's exact Shapley value has a closed form, computed there
from the rendered prompts' token ids, independent of the backend under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import coalescence
from coalescence.backends.kinds import BACKENDS, Capabilities
from coalescence.backends.settings import BackendSettings
from coalescence.errors import ConfigError

from helpers import toy_server
from helpers.cli import run_cli_quiet as run
from helpers.presence import additive_presence_game, eiffel
from helpers.toy_server.server import toy_server as serving


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, toy_server.KIND, None)  # a free name, and undone after the test
    toy_server.register()
    assert BACKENDS[toy_server.KIND].capabilities == Capabilities(generate=False, needs_url=True, remote_dtype=True)


@pytest.fixture
def game(chatml_tokenizer):
    snap = eiffel()
    engine, expected, _ = additive_presence_game(chatml_tokenizer, snap)
    conversation = snap.conversation
    doc = {"messages": [{"role": m.role, "content": m.content} for m in conversation.messages], "target": conversation.target}
    return engine.backend.game, expected, doc


def test_a_registered_server_backend_explains_from_the_command_line(registered, game, tiny_model_dir, tmp_path):
    score, expected, doc = game
    source = tmp_path / "eiffel.json"
    source.write_text(json.dumps(doc), encoding="utf-8")
    out, archive = tmp_path / "out.json", tmp_path / "run"
    with serving(score) as (url, calls):
        code, stdout, err = run([
            "explain", str(source), "--backend", "toy-server", "--server-url", url, "--model", str(tiny_model_dir),
            "--unit", "sentence", "--method", "exact", "--batch-size", "3", "--archive", str(archive), "--out", str(out),
        ])  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text(encoding="utf-8"))
    np.testing.assert_allclose([p["value"] for p in result["players"]], expected, atol=1e-4)
    assert calls and max(calls) <= 3  # the server scored, at most --batch-size rows a call
    record = json.loads((archive / "manifest.json").read_text())["runs"][-1]
    assert record["backend"] == {"backend": "toy-server"} and record["model"]["dtype"] == "server"


def test_a_server_backend_is_given_a_whole_backend_settings_by_the_explainer(registered, game, tiny_model_dir):
    score, expected, doc = game
    with serving(score) as (url, calls):
        settings = BackendSettings(model=str(tiny_model_dir), backend="toy-server", server_url=url, batch_size=4)
        assert BackendSettings(model=str(tiny_model_dir), backend="toy-server", vllm_url=url, batch_size=4) == settings  # its earlier name
        with coalescence.Explainer(settings) as explainer:
            assert explainer.backend_settings is settings and explainer.backend.url == url
            explanation = explainer.explain(doc, unit="sentence", method="exact")
    np.testing.assert_allclose(explanation.values, expected, atol=1e-4)
    assert calls and max(calls) <= 4


def test_what_the_kind_declares_is_asked_before_anything_loads(registered, tiny_model_dir, tmp_path):
    # it needs a URL: refused when the settings are built, naming the field
    with pytest.raises(ConfigError) as info:
        BackendSettings(model=str(tiny_model_dir), backend="toy-server")
    assert info.value.field == "server_url" and "toy-server" in info.value.message
    # it generates nothing: a conversation without an answer is refused before the server is asked
    chat = tmp_path / "chat.json"
    chat.write_text('{"messages": [{"role": "user", "content": "Hi."}]}', encoding="utf-8")
    with serving(lambda p, t: [0.0] * len(t)) as (url, calls):
        code, _, err = run(["explain", str(chat), "--backend", "toy-server", "--server-url", url, "--model", str(tiny_model_dir),
                            "--archive", str(tmp_path / "run"), "--no-progress"])  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "target: " in lines[0] and "a run through --server-url (backend toy-server) does not generate" in lines[0], err
    assert calls == [] and not (tmp_path / "run").exists()
    # a kind that loads its weights here takes no URL
    with pytest.raises(ConfigError) as info:
        BackendSettings(backend="hf", server_url="http://127.0.0.1:1")
    assert info.value.field == "server_url"


def test_the_docs_entry_script_runs_the_command_line_on_the_registered_backend(game, tiny_model_dir, tmp_path):
    """docs/extending.md's entry script, copied from the page, in a process of its own: the
    registration it makes is the one ``--backend toy-server`` needs (nothing registered here)."""
    page = (Path(__file__).parents[2] / "docs" / "extending.md").read_text(encoding="utf-8")
    script = re.search(r"```python\n(# toy_explain\.py.*?)```", page, re.S)
    assert script is not None, "docs/extending.md has no toy_explain.py entry script"
    entry = tmp_path / "toy_explain.py"
    entry.write_text(script.group(1), encoding="utf-8")
    score, expected, doc = game
    source, out = tmp_path / "eiffel.json", tmp_path / "out.json"
    source.write_text(json.dumps(doc), encoding="utf-8")
    tests_dir = str(Path(__file__).parents[1])  # where `helpers` is importable from, as the page's PYTHONPATH
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, *filter(None, [os.environ.get("PYTHONPATH")])]), "HF_HUB_OFFLINE": "1"}
    with serving(score) as (url, calls):
        done = subprocess.run(
            [sys.executable, str(entry), "explain", str(source), "--backend", "toy-server", "--server-url", url,
             "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "exact", "--archive", str(tmp_path / "run"),
             "--out", str(out), "--no-progress"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert calls  # the server scored
    values = [p["value"] for p in json.loads(out.read_text(encoding="utf-8"))["players"]]
    np.testing.assert_allclose(values, expected, atol=1e-4)
