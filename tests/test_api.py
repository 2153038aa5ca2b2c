"""The Python API: one call, the same run (archive and manifest) as the command line, notebook views.

Real parts throughout: the tiny random Llama of ``conftest`` (saved with save_pretrained and loaded
by path, as a user would), real archives, real asyncio and trio loops.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import anyio
import numpy as np
import pyarrow.dataset as ds
import pytest

from helpers.cli import run_cli_quiet

import coalescence
from coalescence.archive import read_manifest, read_rows
from coalescence.errors import ConfigError

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The Eiffel Tower was completed in 1889.\nBig Ben's clock tower in London was finished in 1859.\n\nWhen was the tower completed?"},
    {"role": "assistant", "content": "It was completed in 1889."},
]


def cli(argv: list[str]) -> tuple[int, str]:
    code, _, err = run_cli_quiet(argv)
    return code, err


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("api") / "chat.json"
    path.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    return path


def test_one_call_explains_every_source_form_alike(chat, tiny_model_dir):
    by_path = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence")
    by_dict = coalescence.explain({"messages": MESSAGES}, model=str(tiny_model_dir), unit="sentence")
    by_list = coalescence.explain(MESSAGES, model=str(tiny_model_dir), unit="sentence")
    assert isinstance(by_path, coalescence.Explanation) and by_path.n_evaluations == 2**by_path.snapshot.n_players
    for other in (by_dict, by_list):
        assert other.snapshot.snapshot_id == by_path.snapshot.snapshot_id
        np.testing.assert_allclose(other.values, by_path.values, atol=1e-4)
    # exact Shapley: efficient
    assert abs(by_path.values.sum() - (by_path.estimate.v_full - by_path.estimate.v_empty)) < 1e-6


def test_python_and_cli_runs_write_the_same_archive_and_resume_each_other(chat, tiny_model_dir, tmp_path):
    from_cli, from_api = tmp_path / "cli-run", tmp_path / "api-run"
    code, err = cli(["explain", str(chat), "--model", str(tiny_model_dir), "--unit", "sentence", "--archive", str(from_cli), "--out", str(tmp_path / "cli.json")])
    assert code == 0, err
    api = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence", archive=from_api)
    skip = {"run_id", "started_at", "resumed_at", "template_now"}  # when each run started
    runs = [{k: v for k, v in read_manifest(d)["runs"][0].items() if k not in skip} for d in (from_cli, from_api)]
    assert runs[0] == runs[1]
    assert read_manifest(from_cli)["snapshots"] == read_manifest(from_api)["snapshots"]
    tables = [read_rows(d).sort_by("coalition_key") for d in (from_cli, from_api)]
    assert tables[0]["coalition_key"].to_pylist() == tables[1]["coalition_key"].to_pylist()
    np.testing.assert_allclose(tables[0]["utility"].to_numpy(), tables[1]["utility"].to_numpy(), atol=1e-4)
    doc = json.loads((tmp_path / "cli.json").read_text(encoding="utf-8"))
    np.testing.assert_allclose([p["value"] for p in doc["players"]], api.values, atol=1e-4)
    # the CLI resumes the Python run, and Python resumes the CLI run: nothing is evaluated again
    code, err = cli(["explain", str(chat), "--model", str(tiny_model_dir), "--unit", "sentence", "--archive", str(from_api), "--out", str(tmp_path / "again.json")])
    assert code == 0 and "resuming" not in err  # --no-progress is quiet
    assert json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))["n_evaluations"] == 0
    resumed = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence", archive=from_cli)
    assert resumed.n_evaluations == 0
    np.testing.assert_allclose(resumed.values, api.values, atol=1e-4)
    # and either replays the other's archive with no model
    code, err = cli(["replay", str(from_api), "--method", "exact,loo"])
    assert code == 0, err
    assert ds.dataset(str(from_api / "parts"), format="parquet").count_rows() == 2 ** api.snapshot.n_players


def test_an_explainer_loads_the_model_once(chat, tiny_model_dir, monkeypatch):
    from coalescence.backends import registry

    explainer = coalescence.Explainer(str(tiny_model_dir), batch_size=2)

    def no_second_load(*args, **kwargs):
        raise AssertionError("the model was loaded again")

    monkeypatch.setattr(registry, "load_backend", no_second_load)
    monkeypatch.setattr(registry, "load_tokenizer", no_second_load)
    first = explainer.explain(chat, unit="sentence", method="loo")
    second = explainer.explain(MESSAGES[:2] + [{"role": "assistant", "content": "In 1889."}], unit="turn", method="exact")
    assert first.n_evaluations == first.snapshot.n_players + 2 and second.snapshot.target == "In 1889."


@pytest.mark.anyio
async def test_the_async_twin_runs_in_the_callers_loop(chat, tiny_model_dir, anyio_backend):
    explainer = await anyio.to_thread.run_sync(lambda: coalescence.Explainer(str(tiny_model_dir)))
    sync = await anyio.to_thread.run_sync(lambda: explainer.explain(chat, unit="sentence", method="loo"))
    async_ = await explainer.explain_async(chat, unit="sentence", method="loo")
    np.testing.assert_allclose(async_.values, sync.values, atol=1e-4)


def test_notebook_views(chat, tiny_model_dir):
    e = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence", method="loo")
    frame = e.to_pandas()
    assert list(frame.columns) == ["label", "role", "message_index", "start", "end", "text", "value", "stderr", "rank"]
    assert list(frame["label"]) == [p.label for p in e.snapshot.players]
    np.testing.assert_array_equal(frame["value"].to_numpy(), e.values)
    assert frame["stderr"].isna().all()  # leave-one-out has no standard errors
    # rank 1 is the largest value; the stated rule, checked independently of ranking()
    expected = np.argsort(-e.values, kind="stable")
    assert [int(frame["rank"][i]) for i in expected] == list(range(1, len(expected) + 1))
    for p in e.snapshot.players:
        assert frame.loc[p.index, "text"] == MESSAGES[p.message_index]["content"][p.start : p.end]

    import matplotlib

    matplotlib.use("Agg")
    ax = e.plot()
    widths = [bar.get_width() for bar in ax.patches]
    np.testing.assert_allclose(widths, sorted(e.values, reverse=True))
    def bar_label(p):  # the HTML chart's rule: the label, then the text's first 28 characters (whitespace runs as one space)
        text = " ".join(p.text.split())
        return f"{p.label} {text if len(text) <= 28 else text[:27] + chr(0x2026)}"

    assert [t.get_text() for t in ax.get_yticklabels()] == [bar_label(e.snapshot.players[i]) for i in e.ranking()]

    page = e._repr_html_()
    assert page is not None and "<script" not in page.lower()
    for p in e.snapshot.players:
        assert p.text.split("\n")[0] in html.unescape(page)


def test_unknown_options_are_refused_by_name(chat, tiny_model_dir):
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, model=str(tiny_model_dir), unitt="sentence")
    assert info.value.field == "unitt" and "unit" in info.value.message
    # the list names every keyword explain() takes, the model and backend ones too
    accepted = info.value.message.split("use one of ", 1)[1].split(", ")
    assert {"model", "device", "dtype", "batch_size", "backend", "progress", "unit", "method", "budget"} <= set(accepted)
    # an Explainer holds its model: the backend options given to explain() are refused, saying whose they are
    explainer = coalescence.Explainer(str(tiny_model_dir))
    with pytest.raises(ConfigError) as info:
        explainer.explain(chat, device="cpu")
    assert info.value.field == "device" and "are the Explainer's" in info.value.message
    assert "device" not in info.value.message.split("use one of ", 1)[1].split(", ")


def test_estimator_policy_and_utility_objects_run_as_their_names(chat, tiny_model_dir):
    """An object given for the method, the absence policy or the utility is the same run as its
    name with the same settings (same coalitions, same values), recorded under that name."""
    from coalescence.attribution.estimators.kernel import KernelSHAP
    from coalescence.masking.policies import get_policy
    from coalescence.utility import UtilitySpec

    common = {"model": str(tiny_model_dir), "unit": "sentence"}
    named = coalescence.explain(
        chat, **common, method="kernelshap", budget=12, seed=3, absence_policy="placeholder", placeholder="[gone]", utility="mean_logprob"
    )
    objects = coalescence.explain(
        chat,
        **common,
        method=KernelSHAP(budget=12, seed=3),
        absence_policy=get_policy("placeholder", text="[gone]"),
        utility=UtilitySpec(kind="mean_logprob"),
    )
    for run in (named, objects):
        assert (run.estimate.method, run.absence_policy, run.utility) == ("kernelshap", "placeholder", "mean_logprob")
    assert objects.n_evaluations == named.n_evaluations <= 12
    np.testing.assert_allclose(objects.values, named.values, atol=1e-6)
    # what the object carries cannot be contradicted apart from it
    for given, field in (({"budget": 16}, "budget"), ({"seed": 4}, "seed")):
        with pytest.raises(ConfigError) as info:
            coalescence.explain(chat, **common, method=KernelSHAP(budget=12, seed=3), **given)
        assert info.value.field == field
    # an object built without a seed has its default one; the message says where the seed goes
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, **common, method=KernelSHAP(budget=12), seed=5)
    assert info.value.field == "seed" and "KernelSHAP(..., seed=5)" in info.value.message and "--" not in info.value.message
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, **common, method="kernelshap", budget=3)
    assert info.value.field == "budget" and info.value.message.startswith("3 is below the minimum") and "--" not in info.value.message
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, **common, method=object())
    assert info.value.field == "method"
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, **common, absence_policy=get_policy("drop"), placeholder="x")
    assert info.value.field == "placeholder"


def test_the_notebook_views_are_short_and_the_report_one_call_away(chat, tiny_model_dir, tmp_path):
    e = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence")
    n = e.snapshot.n_players
    short = repr(e)
    top = e.snapshot.players[e.ranking()[0]]
    assert short.startswith(f"<Explanation exact: {n} players, v(full) \u2212 v(empty) = ") and top.label in short
    assert len(short) < 200 and "\n" not in short
    compact = e._repr_html_()
    full = e.report()
    assert compact.count("<mark") == n and "<svg" not in compact  # the conversation, no chart
    assert "<svg" in full._repr_html_() and len(compact) < len(full._repr_html_()) / 2
    assert "robust" in full._repr_html_() and "robust" not in e.report(scale="linear")._repr_html_()  # the scale asked for
    page = e.report(tmp_path / "report.html")
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == page.html
    assert page.html.startswith("<!DOCTYPE html>") and "<script" not in page.html.lower()


@pytest.mark.anyio
async def test_the_blocking_call_works_inside_a_running_event_loop(chat, tiny_model_dir, anyio_backend):
    """As in a Jupyter cell (an asyncio loop runs the cell): explain() cannot start a second loop in
    this thread, so it runs the evaluation in a worker thread and waits; asyncio and trio alike."""
    e = coalescence.explain(chat, model=str(tiny_model_dir), unit="sentence", method="loo")
    assert e.n_evaluations == e.snapshot.n_players + 2  # leave-one-out: n + 2 coalitions, all evaluated


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"threads_per_worker": 2}, "threads_per_worker"),
        ({"workers": 2, "gpus_per_worker": 1}, "gpus_per_worker"),
        ({"ray_address": " "}, "ray_address"),
        ({"dtype": "float8"}, "dtype"),
        ({"workers": 10**9}, "workers"),  # would hang starting the workers
        ({"workers": 10**9, "ray_address": "auto"}, "workers"),
        ({"server_url": 8000}, "server_url"),
        ({"vllm_url": 8000}, "server_url"),  # the URL's earlier name: the same field
        ({"backend": "hf", "server_url": "http://127.0.0.1:8000"}, "server_url"),
        ({"server_url": "http://127.0.0.1:8000", "vllm_url": "http://127.0.0.1:9000"}, "server_url"),  # both, different
    ],
)
def test_an_explainer_refuses_bad_ray_settings_naming_the_field_before_loading(tiny_model_dir, monkeypatch, options, field):
    from coalescence.backends import registry

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(registry, "load_backend", no_load)
    monkeypatch.setattr(registry, "load_tokenizer", no_load)
    with pytest.raises(ConfigError) as info:
        coalescence.Explainer(str(tiny_model_dir), **options)
    assert info.value.field == field


def test_an_explainer_refuses_more_workers_than_this_machine_hosts(tiny_model_dir, monkeypatch):
    """Without ray_address the workers run on a local cluster: one per CPU (2 at least, the default)."""
    import os
    import sys

    from coalescence.backends import registry

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(registry, "load_backend", no_load)
    monkeypatch.setattr(registry, "load_tokenizer", no_load)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # no Ray session of another test counts
    with pytest.raises(ConfigError) as info:
        coalescence.Explainer(str(tiny_model_dir), workers=5)
    assert info.value.field == "workers" and "4 CPUs" in info.value.message and "at most 4 workers" in info.value.message
    with pytest.raises(ConfigError) as info:
        coalescence.Explainer(str(tiny_model_dir), workers=1025, ray_address="auto")
    assert info.value.field == "workers" and "1024" in info.value.message
    from coalescence.app.backend import BackendSettings

    assert BackendSettings(workers=4).workers == 4 and BackendSettings(workers=5, ray_address="auto").workers == 5
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert BackendSettings(workers=2).workers == 2  # the default count of a joined cluster is always allowed


def test_a_proxy_game_with_a_method_that_does_not_play_it_is_refused_as_the_proxy_budget_is(chat, tiny_model_dir):
    """An explicit tail rule with a method that fits the exact game alone was dropped silently; the
    default (auto) and none stay accepted with every method."""
    for method, options in (("exact", {}), ("loo", {}), ("kernelshap", {"budget": 64})):
        with pytest.raises(ConfigError) as info:
            coalescence.explain(chat, model=str(tiny_model_dir / "never-loaded"), method=method, proxy_game="last-turn", **options)
        assert info.value.field == "proxy_game" and f"method {method}" in info.value.message
        assert "two-fidelity methods (lasso, proxy-shapley, proxy-shapley-shrunk, auto, default)" in info.value.message
    from coalescence.app.settings import RunSettings

    for game in ("auto", "none"):
        assert RunSettings(method="exact", proxy_game=game).proxy_game == game
    assert RunSettings(method="lasso", budget=16, proxy_game="last-turn").proxy.tail == "last-turn"


def test_a_misspelt_proxy_game_gets_the_nearest_name(chat, tiny_model_dir):
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, model=str(tiny_model_dir / "never-loaded"), method="lasso", budget=16, proxy_game="last_turn")
    assert info.value.field == "proxy_game" and "did you mean last-turn?" in info.value.message
    with pytest.raises(ConfigError) as info:
        coalescence.explain(chat, model=str(tiny_model_dir / "never-loaded"), proxy_game="zzz")
    assert "did you mean" not in info.value.message  # nothing close: no guess


def test_an_explainer_runs_are_recorded_as_the_commands_with_its_backend_settings(chat, tiny_model_dir, tmp_path):
    """An Explainer's settings are the command's ``BackendSettings``; its runs record them as the
    command records its options, and explain() refuses them as the Explainer's."""
    from coalescence.app.backend import BackendSettings

    with coalescence.Explainer(str(tiny_model_dir), batch_size=3) as explainer:
        assert explainer.backend_settings == BackendSettings(model=str(tiny_model_dir), batch_size=3)
        explainer.explain(chat, unit="sentence", method="loo", archive=tmp_path / "api")
        with pytest.raises(ConfigError) as info:
            explainer.explain(chat, workers=2)
        assert info.value.field == "workers" and "are the Explainer's" in info.value.message
    code, err = cli(["explain", str(chat), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "loo",
                     "--batch-size", "3", "--archive", str(tmp_path / "cli")])  # fmt: skip
    assert code == 0, err
    configs = [read_manifest(tmp_path / d)["runs"][0]["run_config"] for d in ("api", "cli")]
    assert configs[0] == {**configs[1], "input": configs[0]["input"]}
    assert configs[0]["batch_size"] == 3 and configs[0]["device"] == "cpu"


def test_backend_settings_are_exported_and_an_explainer_takes_them_whole(chat, tiny_model_dir, tmp_path):
    """``coalescence.BackendSettings`` is the public name of the backend settings: an Explainer given
    one whole runs as with the same options as keywords (its runs record the same run_config), and
    refuses an option beside it, naming the option."""
    from coalescence import BackendSettings

    assert "BackendSettings" in coalescence.__all__
    settings = BackendSettings(model=str(tiny_model_dir), batch_size=3)
    with coalescence.Explainer(settings) as explainer:
        assert explainer.backend_settings == settings
        whole = explainer.explain(chat, unit="sentence", method="loo", archive=tmp_path / "whole")
    with coalescence.Explainer(str(tiny_model_dir), batch_size=3) as explainer:
        keywords = explainer.explain(chat, unit="sentence", method="loo", archive=tmp_path / "keywords")
    assert whole.values.tolist() == keywords.values.tolist()
    configs = [read_manifest(tmp_path / d)["runs"][0]["run_config"] for d in ("whole", "keywords")]
    assert configs[0] == configs[1] and configs[0]["batch_size"] == 3
    with pytest.raises(ConfigError) as info:
        coalescence.Explainer(settings, device="cpu")
    assert info.value.field == "device"
