"""``BackendSettings``: a ``server_url`` that cannot work is refused when the settings are built,
naming the field, before a tokenizer or weights load; the CLI gives it as one line, exit 2. Its
earlier name, ``vllm_url`` (``--vllm-url``), is taken as the same field everywhere it was, and
both names given with different URLs are refused naming both."""

from __future__ import annotations

import pytest

from helpers.cli import run_cli

from coalescence.app.backend import BackendSettings
from coalescence.app.settings import RunSettings
from coalescence.errors import ConfigError

BAD_SERVER_SETTINGS = [
    ({"server_url": ""}, "is empty"),
    ({"server_url": "   "}, "is empty"),
    ({"server_url": "notaurl"}, "must be http://HOST:PORT"),
    ({"server_url": "ftp://host:8000"}, "must be http://HOST:PORT"),
    ({"server_url": "http://"}, "must be http://HOST:PORT"),
    ({"server_url": "http://host:port"}, "must be http://HOST:PORT"),
    ({"server_url": 8000}, "must be a running server's URL, a string http://HOST:PORT (or https), got 8000 (int)"),
    ({"backend": "hf", "server_url": "http://127.0.0.1:8000"}, "only a server backend (vllm-server, or one registered) takes a URL, and backend 'hf'"),
    ({"backend": "vllm", "server_url": "http://127.0.0.1:8000"}, "drop backend (--backend"),
    ({"backend": "vllm-server"}, "give its http://HOST:PORT"),
    ({"server_url": "http://127.0.0.1:8000", "workers": 2}, "give one of them"),
    ({"server_url": "http://127.0.0.1:8000", "ray_address": "auto"}, "give one of them"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SERVER_SETTINGS)
def test_server_settings_that_cannot_work_are_refused_naming_server_url(options, message):
    for build in (BackendSettings, RunSettings):
        with pytest.raises(ConfigError) as info:
            build(**options)
        assert info.value.field == "server_url" and message in info.value.message
        if "server_url" in options:  # the same under the URL's earlier name
            with pytest.raises(ConfigError) as info:
                build(**{("vllm_url" if k == "server_url" else k): v for k, v in options.items()})
            assert info.value.field == "server_url" and message in info.value.message


def test_good_server_settings_pass_and_name_the_server_backend():
    for url in ("http://127.0.0.1:8000", "https://example.org", "http://[::1]:8000/"):
        settings = BackendSettings(server_url=url)
        assert settings.backend_name == "vllm-server" and not settings.distributed
    assert BackendSettings().backend_name == "hf"
    # a URL alone picks the server backend, and the settings hold the name chosen
    chosen = BackendSettings(server_url="http://127.0.0.1:8000")
    assert chosen.backend == "vllm-server" and BackendSettings().backend == "hf"
    assert BackendSettings(backend="vllm-server", server_url="http://127.0.0.1:8000") == chosen
    assert RunSettings(server_url="http://127.0.0.1:8000").backend_settings().backend == "vllm-server"


@pytest.mark.parametrize(
    "options",
    [
        ["--server-url", ""],
        ["--server-url", "notaurl"],
        ["--vllm-url", "notaurl"],  # the earlier name: the same option
        ["--backend", "vllm-server"],
        ["--server-url", "http://127.0.0.1:8000", "--workers", "2"],
        ["--backend", "hf", "--vllm-url", "http://127.0.0.1:8000"],
        ["--server-url", "http://127.0.0.1:8000", "--vllm-url", "http://127.0.0.1:9000"],  # both names, two URLs
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
    assert code == 2 and len(lines) == 1 and lines[0].startswith("coalescence: error: --server-url: "), err
    assert not (tmp_path / "run").exists()


URL = "http://127.0.0.1:8000"


def test_the_urls_earlier_name_is_the_same_field_and_two_different_urls_are_refused():
    from coalescence.app.settings import EvaluateSettings, ReplaySettings
    from coalescence.cli.parser import build_parser

    assert BackendSettings(vllm_url=URL) == BackendSettings(server_url=URL) == BackendSettings(server_url=URL, vllm_url=URL)
    assert BackendSettings(vllm_url=URL).server_url == URL and BackendSettings(vllm_url=None).server_url is None
    for build in (RunSettings, ReplaySettings, EvaluateSettings):
        settings = build(vllm_url=URL, methods="loo") if build is not RunSettings else build(vllm_url=URL)
        assert settings.server_url == URL and settings.backend_settings() == BackendSettings(model=settings.model, server_url=URL)
    for build in (BackendSettings, RunSettings):
        with pytest.raises(ConfigError) as info:
            build(server_url=URL, vllm_url="http://127.0.0.1:9000")
        assert info.value.field == "server_url"
        assert f"server_url='{URL}'" in info.value.message and "vllm_url='http://127.0.0.1:9000'" in info.value.message
    parser = build_parser()
    for command in (["explain", "chat.json"], ["replay", "run", "--method", "loo"], ["evaluate", "run"]):
        for flag in ("--server-url", "--vllm-url"):
            assert parser.parse_args([*command, flag, URL]).server_url == URL
        assert parser.parse_args([*command, "--server-url", URL, "--vllm-url", URL]).server_url == URL  # the same URL twice


def test_an_archive_run_that_recorded_vllm_url_is_still_read_as_a_servers():
    """A run written before backends were recorded named its server only by the ``vllm_url`` key."""
    from coalescence.app.record import recorded_backend

    old = {"run_id": "a1", "model": {"id": "m", "dtype": "float32"}, "vllm_url": URL, "served_model": "m"}
    assert recorded_backend(old) == ({"backend": "vllm-server"}, False)
    assert recorded_backend({"run_id": "a2", "model": {"id": "m", "dtype": "float32"}}) == (None, False)


@pytest.mark.parametrize("batch_size", [0, -1, True, 2.5, "4"])
def test_backend_settings_refuse_a_batch_size_that_is_not_a_positive_integer(batch_size):
    """Checked when the settings are made (the CLI's ``positive_int`` says the same): 0 is not the
    backend's default, ``None`` is."""
    with pytest.raises(ConfigError) as info:
        BackendSettings(batch_size=batch_size)
    assert info.value.field == "batch_size" and repr(batch_size) in info.value.message
    assert BackendSettings(batch_size=None).batch_size is None and BackendSettings(batch_size=3).batch_size == 3


def test_a_settings_group_given_for_the_model_is_named_before_anything_loads():
    """``Explainer(ModelSettings(...))`` or ``BackendSettings(model={...})``: a message that names
    what it takes, not an "unknown model" quoting the object's repr."""
    from coalescence import Explainer
    from coalescence.app.groups import ModelSettings

    with pytest.raises(ConfigError) as info:
        Explainer(ModelSettings(model="smollm2-135m"))
    assert info.value.field == "model" and "BackendSettings" in info.value.message and "ModelSettings" in info.value.message
    with pytest.raises(ConfigError) as info:
        BackendSettings(model={"model": "smollm2-135m"})
    assert info.value.field == "model" and "got a dict" in info.value.message


def test_every_backend_setting_is_an_option_of_every_command_that_loads_a_model():
    """An option that reaches the model is a field of BackendSettings and an option of the same
    name: the rule, checked on the real parser (a field added to BackendSettings alone, with no
    command-line option, fails here)."""
    import argparse
    from dataclasses import fields

    from coalescence.cli.parser import build_parser

    commands = {
        name: sub
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }
    every = {f.name for f in fields(BackendSettings)}
    ray = {"workers", "ray_address", "gpus_per_worker", "threads_per_worker"}  # written out: the Ray workers' fields
    # a sweep runs its model in this process (no Ray workers); the other commands may run it in workers
    for command, wanted in (("explain", every), ("replay", every), ("evaluate", every), ("sweep", every - ray)):
        dests = {a.dest for a in commands[command]._actions}
        assert wanted <= dests, f"{command} lacks --{', --'.join(sorted(wanted - dests))}"
    assert ray <= every  # the Ray fields are backend settings: the rule above covers them
