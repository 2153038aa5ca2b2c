"""Ray workers: a dataset run across two model workers gives the single-process values with every
coalition archived once, survives a worker killed mid-run, resumes after its driver is killed, and
refuses a missing ray package or bad settings with one line.

Real parts: a local Ray cluster (one per module, 4 logical CPUs on this small machine), the tiny
random Llama saved to disk (``tiny_model_dir``), real archives, the CLI in-process and as a
subprocess.

Values are compared with ``atol=1e-4``: a worker batches the rows of the conversations routed to it,
the single process batches rows of any conversations in flight, and float32 matrix products of
rows padded to other lengths round differently in the last bits (the same tolerance the dataset
tests use between batch compositions).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import coalescence  # noqa: E402
from coalescence.archive import read_rows  # noqa: E402
from coalescence.cli import main  # noqa: E402
from coalescence.app.settings import RunSettings  # noqa: E402
from coalescence.errors import ConfigError  # noqa: E402

from helpers.cli import run_cli_quiet as run  # noqa: E402
from helpers.datasets import conversations  # noqa: E402

SRC = str(Path(coalescence.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module; its workers import this checkout of coalescence."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [before])])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray-data") / "data.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(9)), encoding="utf-8")
    return path


def _argv(dataset: Path, model: Path, archive: Path, out: Path, *options: str) -> list[str]:
    return [
        "explain", str(dataset), "--model", str(model), "--unit", "sentence", "--method", "loo",
        "--archive", str(archive), "--out", str(out), "--batch-size", "2", *options,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory, dataset, tiny_model_dir):
    """The single-process run: its explanations and its archived keys."""
    tmp = tmp_path_factory.mktemp("single")
    code, _, err = run(_argv(dataset, tiny_model_dir, tmp / "run", tmp / "out.json"))
    assert code == 0, err
    return json.loads((tmp / "out.json").read_text())["explanations"], _keys(tmp / "run"), tmp / "run"


def _keys(run_dir: Path) -> list[str]:
    return read_rows(run_dir).column("coalition_key").to_pylist()


def _same(explanations: list[dict], reference: list[dict]) -> None:
    assert [e["snapshot_id"] for e in explanations] == [e["snapshot_id"] for e in reference]
    for got, want in zip(explanations, reference, strict=True):
        np.testing.assert_allclose([p["value"] for p in got["players"]], [p["value"] for p in want["players"]], atol=1e-4)
        assert got["v_full"] == pytest.approx(want["v_full"], abs=1e-4)
        assert got["v_empty"] == pytest.approx(want["v_empty"], abs=1e-4)


def _check_archive(run_dir: Path, reference_keys: list[str]) -> None:
    keys = _keys(run_dir)
    assert len(keys) == len(set(keys)), "a coalition archived twice"
    assert set(keys) == set(reference_keys)


def test_two_workers_give_the_single_process_values_with_every_coalition_once(tmp_path, cluster, dataset, tiny_model_dir, single):
    code, _, err = run(_argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2"))
    assert code == 0, err
    _same(json.loads((tmp_path / "out.json").read_text())["explanations"], single[0])
    _check_archive(tmp_path / "run", single[1])
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["runs"][-1]
    assert record["ray"]["workers"] == 2 and record["ray"]["lost_workers"] == []
    assert all(calls > 0 for calls in record["ray"]["calls_per_worker"]), "conversations went to both workers"
    assert record["run_config"]["ray"]["workers"] == 2
    assert record["backend"] == {"backend": "hf"}  # Ray places the calls; the workers' transformers compute


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_worker_killed_mid_run_loses_only_its_calls_in_flight(tmp_path, cluster, dataset, tiny_model_dir, single, monkeypatch, how):
    from coalescence.distributed import RayBackend

    call = RayBackend.call
    seen = {"calls": 0, "killed": False}

    def killing(self, index, method, *args):
        seen["calls"] += 1
        if not seen["killed"] and seen["calls"] >= 4 and self.workers[1].calls > 0:
            seen["killed"] = True
            # while its next call is on the way: that call is lost and run again elsewhere
            if how == "ray.kill":
                self.kill_worker(1)
            else:  # the worker process dies as in a crash (same machine here)
                os.kill(self.workers[1].pid, signal.SIGKILL)
        return call(self, index, method, *args)

    monkeypatch.setattr(RayBackend, "call", killing)
    code, _, err = run(_argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2"))
    assert code == 0, err
    assert seen["killed"]
    explanations = json.loads((tmp_path / "out.json").read_text())["explanations"]
    _same(explanations, single[0])
    _check_archive(tmp_path / "run", single[1])
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["runs"][-1]
    assert record["status"] == "complete"
    assert [lost["worker"] for lost in record["ray"]["lost_workers"]] == [1]
    assert record["ray"]["calls_run_again"] >= 1
    assert any("Ray workers were lost" in note for note in explanations[-1]["notes"])


def test_the_command_starts_and_stops_its_own_local_cluster(tmp_path, cluster, dataset, tiny_model_dir, single):
    argv = _argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2", "--no-progress")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "coalescence.cli", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    _same(json.loads((tmp_path / "out.json").read_text())["explanations"], single[0])
    _check_archive(tmp_path / "run", single[1])
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["runs"][-1]
    assert record["ray"]["workers"] == 2 and record["ray"]["threads_per_worker"] == [max(1, (os.cpu_count() or 1) // 2)] * 2


def test_with_every_worker_lost_the_run_fails_as_a_model_failure(tmp_path, cluster, dataset, tiny_model_dir, monkeypatch):
    from coalescence.distributed import RayBackend

    call = RayBackend.call

    def killing(self, index, method, *args):
        for k in range(len(self.workers)):
            if self.workers[k].alive:
                self.kill_worker(k)
        return call(self, index, method, *args)

    monkeypatch.setattr(RayBackend, "call", killing)
    code, _, err = run(_argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2"))
    assert code == 1, err
    assert "every Ray worker was lost (2 of 2)" in err.strip().splitlines()[-1]
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["runs"][-1]
    assert record["status"] == "failed" and len(record["ray"]["lost_workers"]) == 2


def test_a_killed_driver_resumes_with_the_same_command(tmp_path, cluster, dataset, tiny_model_dir, single):
    argv = _argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2", "--ray-address", cluster)
    argv += ["--flush-rows", "2", "--max-conversations-in-flight", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "coalescence.cli", *argv]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts = tmp_path / "run" / "parts"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.exists() and len(list(parts.glob("*.parquet"))) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    before = len(_keys(tmp_path / "run"))
    assert 0 < before < len(single[1])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    _same(json.loads((tmp_path / "out.json").read_text())["explanations"], single[0])
    _check_archive(tmp_path / "run", single[1])


def test_replay_with_a_model_evaluates_what_is_missing_on_workers(tmp_path, cluster, tiny_model_dir, single):
    docs = {}
    for name, options in (("alone", []), ("workers", ["--workers", "2"])):
        run_dir = tmp_path / name
        shutil.copytree(single[2], run_dir, symlinks=True)
        out = tmp_path / f"{name}.json"
        code, _, err = run(["replay", str(run_dir), "--method", "exact", "--model", str(tiny_model_dir), "--out", str(out), *options])
        assert code == 0, err
        docs[name] = json.loads(out.read_text())["explanations"]
        keys = _keys(run_dir)
        assert len(keys) == len(set(keys)) > len(single[1])
    assert sum(d["n_evaluations"] for d in docs["workers"]) > 0
    _same(docs["workers"], docs["alone"])


def test_without_ray_one_line_names_the_extra(tmp_path, dataset, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, _, err = run(_argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", "--workers", "2"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'coalescence[ray]'" in lines[0] and "--workers" in lines[0]


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (["--workers", "0"], "--workers"),
        (["--workers", "2", "--gpus-per-worker", "1"], "--gpus-per-worker"),
        (["--gpus-per-worker", "1", "--device", "cuda"], "--gpus-per-worker"),
        (["--threads-per-worker", "2"], "--threads-per-worker"),
        (["--workers", "2", "--gpus-per-worker", "-1"], "--gpus-per-worker"),
    ],
)
def test_bad_ray_settings_exit_2_with_one_line(tmp_path, dataset, tiny_model_dir, options, flag):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([*_argv(dataset, tiny_model_dir, tmp_path / "run", tmp_path / "out.json", *options), "--no-progress"])
        except SystemExit as exc:  # refused by the argument parser
            code = exc.code
    err = stderr.getvalue()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], err


def test_run_settings_validate_the_ray_settings():
    with pytest.raises(ConfigError, match="positive integer"):
        RunSettings(workers=0)
    with pytest.raises(ConfigError, match="empty"):
        RunSettings(ray_address=" ")
    with pytest.raises(ConfigError, match="applies to Ray workers"):
        RunSettings(threads_per_worker=2)
    assert RunSettings(ray_address="auto").distributed and not RunSettings().distributed
    # GPUs for workers that compute on the CPU are refused; vLLM picks its device itself
    with pytest.raises(ConfigError, match="add --device cuda"):
        RunSettings(workers=2, gpus_per_worker=1)
    assert RunSettings(workers=2, gpus_per_worker=1, backend="vllm").gpus_per_worker == 1


def test_an_explainer_on_two_workers_gives_the_in_process_values_and_keeps_them_for_every_call(cluster, tiny_model_dir):
    """``Explainer(workers=2)`` loads the model by the command's path (the module's cluster is
    joined): its values are the in-process Explainer's, the workers serve a second call (a run's
    engine leaves them running), and ``close`` stops them."""
    from coalescence.errors import EngineClosed

    source = conversations(1, documents=False)[0]
    local = coalescence.Explainer(str(tiny_model_dir), batch_size=4).explain(source, unit="sentence", method="loo")
    with coalescence.Explainer(str(tiny_model_dir), batch_size=4, workers=2) as explainer:
        assert [w.alive for w in explainer.backend.workers] == [True, True]
        first = explainer.explain(source, unit="sentence", method="loo")
        again = explainer.explain(source, unit="sentence", method="loo")
    assert first.n_evaluations == len(first.snapshot.players) + 2 > 2
    np.testing.assert_allclose(first.values, local.values, atol=1e-5)
    np.testing.assert_allclose(again.values, local.values, atol=1e-5)
    assert sum(w.calls for w in explainer.backend.workers) > 0  # the workers scored, not this process
    with pytest.raises(EngineClosed):
        explainer.explain(source, unit="sentence", method="loo")
    assert ray.is_initialized()  # the cluster the Explainer joined is not its own to stop


def test_progress_over_ray_workers_is_one_monotone_count_over_the_dataset(tmp_path, cluster, dataset, tiny_model_dir):
    """Issue 24 item 11 on Ray: a run over two workers showed one conversation's total and a count
    that jumped back. The rule: one total, the sum of each conversation's leave-one-out plan (its
    players + the empty and full coalitions, counted here from the output), counts that never
    decrease, and a last count equal to that total."""
    from coalescence.app.explain import explain_run

    from helpers.datasets import RecordingProgress

    progress = RecordingProgress()
    settings = RunSettings(
        model=str(tiny_model_dir), unit="sentence", method="loo", archive=str(tmp_path / "run"),
        workers=2, ray_address=cluster, batch_size=2,
    )  # fmt: skip
    explanations = explain_run(str(dataset), settings, progress=progress).explanations
    expected = sum(len(e.snapshot.players) + 2 for e in explanations)
    assert len(explanations) >= 9 and expected > 2 * (3 + 2)  # many conversations over two lanes
    assert progress.planned and progress.planned[-1] == expected
    assert progress.planned == sorted(progress.planned)
    dones = [d for d, _ in progress.finished]
    assert dones == sorted(dones) and dones[-1] == expected  # lanes may report several at once, never back
    assert all(d <= t for d, t in progress.finished)
    assert [t for _, t in progress.finished] == sorted(t for _, t in progress.finished)


def _long_conversations(n: int) -> list[dict]:
    """``n`` conversations of 18 sentence players (a system sentence and 17 user facts): more than
    exact Shapley values take, so a two-fidelity method plays the proxy game on them."""
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen".split()
    return [
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": " ".join(f"Tower {k} has fact {w}." for w in words)},
                {"role": "assistant", "content": f"Tower {k} was completed in {1880 + k}."},
            ]
        }
        for k in range(n)
    ]


def test_two_workers_play_the_proxy_game_with_the_in_process_values(tmp_path, cluster, tiny_model_dir):
    """Issue 48 item 3: Ray is an executor that runs every capability of the workers' backend, so
    ``--workers 2`` on long conversations plays the shared-KV proxy game as the in-process run does
    (it was silently off behind the Ray wrapper): the same proxy game named in each explanation,
    proxy rows computed and archived apart from the exact ones, and the same values within 1e-5."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _long_conversations(3)), encoding="utf-8")

    def explain(name: str, *options: str) -> tuple[list[dict], dict]:
        argv = [
            "explain", str(data), "--model", str(tiny_model_dir), "--unit", "sentence", "--method", "lasso",
            "--budget", "8", "--seed", "1", "--proxy-game", "after-last-player", "--batch-size", "1",
            "--archive", str(tmp_path / name), "--out", str(tmp_path / f"{name}.json"), *options,
        ]  # fmt: skip
        code, _, err = run(argv)
        assert code == 0, err
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        return json.loads((tmp_path / f"{name}.json").read_text())["explanations"], manifest

    local, _ = explain("local")
    workers, manifest = explain("workers", "--workers", "2")
    assert len(workers) == len(local) == 3
    for got, want in zip(workers, local, strict=True):
        assert len(got["players"]) == 18
        assert want["proxy"] is not None and want["proxy"]["game"] == "kv-proxy-compact:after-last-player"
        assert got["proxy"] is not None, got["notes"]  # the proxy game is played on the workers
        assert got["proxy"]["game"] == want["proxy"]["game"]
        assert got["proxy"]["evaluations"] == want["proxy"]["evaluations"] > 0
        assert got["n_evaluations"] == want["n_evaluations"] == 8
        assert got["diagnostics"]["proxy_used"] == want["diagnostics"]["proxy_used"]
        np.testing.assert_allclose([p["value"] for p in got["players"]], [p["value"] for p in want["players"]], rtol=0, atol=1e-5)
        assert got["v_full"] == pytest.approx(want["v_full"], abs=1e-5)
    # the archive holds the exact rows and the proxy rows apart, each once
    proxy_rows = sum(e["proxy"]["evaluations"] for e in workers)
    assert manifest["rows"] == sum(e["n_evaluations"] for e in workers) + proxy_rows
    keys = _keys(tmp_path / "workers")
    assert len(keys) == len(set(keys)) and set(keys) == set(_keys(tmp_path / "local"))
    record = manifest["runs"][-1]
    assert record["ray"]["workers"] == 2 and sum(record["ray"]["calls_per_worker"]) > 0
