"""``BackendSettings``: a ``vllm_url`` that cannot work is refused when the settings are built,
naming the field, before a tokenizer or weights load; the CLI gives it as one line, exit 2."""

from __future__ import annotations

import pytest

from helpers.cli import run_cli

from coalescence.app.backend import BackendSettings
from coalescence.app.settings import RunSettings
from coalescence.errors import ConfigError

BAD_SERVER_SETTINGS = [
    ({"vllm_url": ""}, "is empty"),
    ({"vllm_url": "   "}, "is empty"),
    ({"vllm_url": "notaurl"}, "must be http://HOST:PORT"),
    ({"vllm_url": "ftp://host:8000"}, "must be http://HOST:PORT"),
    ({"vllm_url": "http://"}, "must be http://HOST:PORT"),
    ({"vllm_url": "http://host:port"}, "must be http://HOST:PORT"),
    ({"vllm_url": 8000}, "must be a running vllm serve's URL, a string http://HOST:PORT (or https), got 8000 (int)"),
    ({"backend": "hf", "vllm_url": "http://127.0.0.1:8000"}, "only the vllm-server backend takes a URL, and backend 'hf'"),
    ({"backend": "vllm", "vllm_url": "http://127.0.0.1:8000"}, "drop backend (--backend"),
    ({"backend": "vllm-server"}, "give its http://HOST:PORT"),
    ({"vllm_url": "http://127.0.0.1:8000", "workers": 2}, "give one of them"),
    ({"vllm_url": "http://127.0.0.1:8000", "ray_address": "auto"}, "give one of them"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SERVER_SETTINGS)
def test_server_settings_that_cannot_work_are_refused_naming_vllm_url(options, message):
    for build in (BackendSettings, RunSettings):
        with pytest.raises(ConfigError) as info:
            build(**options)
        assert info.value.field == "vllm_url" and message in info.value.message


def test_good_server_settings_pass_and_name_the_server_backend():
    for url in ("http://127.0.0.1:8000", "https://example.org", "http://[::1]:8000/"):
        settings = BackendSettings(vllm_url=url)
        assert settings.backend_name == "vllm-server" and not settings.distributed
    assert BackendSettings().backend_name == "hf"
    # a URL alone picks the server backend, and the settings hold the name chosen
    chosen = BackendSettings(vllm_url="http://127.0.0.1:8000")
    assert chosen.backend == "vllm-server" and BackendSettings().backend == "hf"
    assert BackendSettings(backend="vllm-server", vllm_url="http://127.0.0.1:8000") == chosen
    assert RunSettings(vllm_url="http://127.0.0.1:8000").backend_settings().backend == "vllm-server"


@pytest.mark.parametrize(
    "options",
    [
        ["--vllm-url", ""],
        ["--vllm-url", "notaurl"],
        ["--backend", "vllm-server"],
        ["--vllm-url", "http://127.0.0.1:8000", "--workers", "2"],
        ["--backend", "hf", "--vllm-url", "http://127.0.0.1:8000"],
    ],
)
def test_the_cli_refuses_them_in_one_line_before_loading(tmp_path, monkeypatch, options):
    from coalescence.backends import registry

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    for name in ("load_backend", "load_tokenizer", "load_config"):
        monkeypatch.setattr(registry, name, no_load)
    chat = tmp_path / "chat.json"
    chat.write_text('{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}')
    code, out, err = run_cli(["explain", str(chat), "--archive", str(tmp_path / "run"), "--no-progress", *options])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--vllm-url" in lines[0], err
    assert not (tmp_path / "run").exists()
