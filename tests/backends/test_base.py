"""The backend envelope (issue 35): ``BackendBase.score``, ``score_proxy`` and ``generate_batch``
refuse long rows, map errors, validate and count once, around the one method a backend writes.

The backend here is the smallest one can write: an identity and ``_score_batch`` (plus
``_score_proxy_batch`` and ``_generate_batch``), each returning hand-set values. Every expected
count below is worked out by hand from the rows in the test (the rule: a row of ``p`` prompt and
``t`` target tokens is ``p + t`` tokens), never read back from the envelope.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from coalescence.backends.base import (
    BackendBase,
    GenerateRequest,
    GenerateResult,
    ProxyScoreRequest,
    ScoreRequest,
    ScoreResult,
    ScoringStatistics,
    check_backend,
)
from coalescence.errors import BackendError, BatchFailed, EngineClosed


class Minimal(BackendBase):
    """Only the identity and the model calls; every result is log p = -0.5 nats a target token,
    with the row's positions split as ``computed`` / ``reused`` by a fixed rule (2 reused a row)."""

    model_id = "minimal"
    revision = ""
    dtype = "float32"
    tokenizer = None

    def __init__(self, *, max_context: int = 10, fail: BaseException | None = None, split: int = 0) -> None:
        self.max_context = max_context
        self.fail = fail
        self.split = split
        self.calls: list[int] = []  # rows per call of a model method

    def _score_calls(self, requests):
        if not self.split:
            return super()._score_calls(requests)
        return [requests[i : i + self.split] for i in range(0, len(requests), self.split)]

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        self.calls.append(len(batch))
        self._note(prefix_forwards=1)  # kept only when the call succeeds
        if self.fail is not None:
            raise self.fail
        return [_result(r.n_tokens, len(r.target_ids)) for r in batch]

    def _score_proxy_batch(self, batch: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        self.calls.append(len(batch))
        return [_result(r.n_tokens, len(r.target_ids)) for r in batch]

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        self.calls.append(len(requests))
        if self.fail is not None:
            raise self.fail
        runs = lambda r: 1 if r.greedy else r.n_samples  # noqa: E731
        # every decode produces 2 new tokens and runs prompt + 1 positions
        return [
            GenerateResult(token_ids=((7, 8),) * r.n_samples, tokens_computed=runs(r) * (len(r.prompt_ids) + 1))
            for r in requests
        ]


def _result(n_tokens: int, n_target: int) -> ScoreResult:
    lp = np.full(n_target, -0.5, dtype=np.float32)
    return ScoreResult(token_logprobs=lp, utility=float(lp.sum()), tokens_computed=n_tokens - 2, tokens_reused=2)


def row(p: int, t: int = 1) -> ScoreRequest:
    return ScoreRequest(prompt_ids=tuple(range(1, p + 1)), target_ids=(99,) * t)


def test_a_backend_of_one_method_is_a_whole_backend() -> None:
    check_backend(Minimal())  # nothing missing
    out = Minimal().score([row(3), row(4, 2)])
    assert [list(x.token_logprobs) for x in out] == [[-0.5], [-0.5, -0.5]]


def test_a_long_row_is_refused_before_the_model_and_counts_nothing() -> None:
    backend = Minimal(max_context=10)
    backend.supports_proxy = True
    with pytest.raises(BatchFailed, match=r"^a sequence of 11 tokens exceeds the model's context of 10$"):
        backend.score([row(3), row(9, 2)])  # 4 and 11 tokens
    with pytest.raises(BatchFailed, match="a sequence of 11 tokens exceeds"):
        backend.score_proxy([ProxyScoreRequest(prompt_ids=tuple(range(1, 10)), target_ids=(5, 6), tail_start=2)])
    with pytest.raises(BatchFailed, match=r"^a prompt of 8 tokens plus 3 new tokens exceeds the model's context of 10$"):
        backend.generate_batch([GenerateRequest(prompt_ids=tuple(range(8)), max_new_tokens=3)])
    assert backend.calls == [] and backend.statistics() == ScoringStatistics()


def test_every_call_is_counted_once() -> None:
    backend = Minimal(max_context=20)
    backend.score([row(3), row(5, 2)])  # 4 + 7 = 11 tokens, 2 + 5 = 7 computed, 4 reused
    backend.score([row(10, 3)])  # 13 tokens, 11 computed, 2 reused
    assert backend.statistics() == ScoringStatistics(
        batches=2, rows=3, tokens=24, tokens_computed=18, tokens_reused=6, prefix_forwards=2
    )
    # a backend that splits a call into model calls of 2 rows: 5 rows are 3 model calls
    split = Minimal(split=2)
    split.score([row(3)] * 5)
    assert split.calls == [2, 2, 1]
    assert split.statistics() == ScoringStatistics(batches=3, rows=5, tokens=20, tokens_computed=10, tokens_reused=10, prefix_forwards=3)
    assert split.score([]) == [] and split.statistics().batches == 3  # an empty call runs nothing


def test_a_library_error_becomes_batch_failed_and_counts_nothing() -> None:
    boom = RuntimeError("CUDA out of memory")
    backend = Minimal(fail=boom)
    with pytest.raises(BatchFailed, match=r"^model call failed on a batch of 2 rows: CUDA out of memory$") as info:
        backend.score([row(3), row(4)])
    assert info.value.__cause__ is boom
    assert backend.calls == [2] and backend.statistics() == ScoringStatistics()  # the noted forward is dropped too
    with pytest.raises(BatchFailed, match=r"^generation failed on a batch of 1 requests: CUDA out of memory$"):
        backend.generate_batch([GenerateRequest(prompt_ids=(1, 2), max_new_tokens=2)])
    # our own errors pass unchanged (an engine closed is not a failed batch)
    closed = Minimal(fail=EngineClosed("shut down"))
    with pytest.raises(EngineClosed, match="shut down"):
        closed.score([row(3)])
    # then a good call counts only itself
    backend.fail = None
    backend.score([row(3)])
    assert backend.statistics() == ScoringStatistics(batches=1, rows=1, tokens=4, tokens_computed=2, tokens_reused=2, prefix_forwards=1)


def test_a_wrong_answer_is_refused_as_a_whole() -> None:
    class Short(Minimal):
        def _score_batch(self, batch):
            return super()._score_batch(batch)[:-1]

    backend = Short()
    with pytest.raises(BatchFailed, match="returned 1 results for 2 rows"):
        backend.score([row(3), row(4)])
    assert backend.statistics() == ScoringStatistics()


def test_a_proxy_row_shares_its_kv_and_computes_its_tail() -> None:
    # 9 prompt tokens and 2 target tokens: positions [0, 4) shared, the 6 others but the last run
    r = ProxyScoreRequest(prompt_ids=tuple(range(1, 10)), target_ids=(5, 6), tail_start=4)
    assert (r.n_tokens, r.shared_tokens, r.tail_tokens) == (11, 4, 6)
    # a tail starting at the prompt's end still runs the last prompt token (it predicts the target)
    r = ProxyScoreRequest(prompt_ids=tuple(range(1, 10)), target_ids=(5, 6), tail_start=9)
    assert (r.shared_tokens, r.tail_tokens) == (8, 2)


def test_proxy_rows_are_counted_apart_and_a_backend_without_them_says_so() -> None:
    with pytest.raises(BackendError, match="the Minimal backend has no proxy game"):
        Minimal().score_proxy([ProxyScoreRequest(prompt_ids=(1, 2, 3), target_ids=(4,), tail_start=2)])
    backend = Minimal()
    backend.supports_proxy = True
    rows = [ProxyScoreRequest(prompt_ids=(1, 2, 3), target_ids=(4, 5), tail_start=2)] * 3  # 5 tokens each
    assert len(backend.score_proxy(rows)) == 3
    assert backend.statistics() == ScoringStatistics(proxy_rows=3, proxy_tokens_computed=9, proxy_tokens_reused=6)


def test_generation_counts_one_decode_per_greedy_request_and_per_sample() -> None:
    backend = Minimal()
    greedy = GenerateRequest(prompt_ids=(1, 2, 3), max_new_tokens=2, seeds=(0, 1, 2))  # 1 decode
    sampled = GenerateRequest(prompt_ids=(1, 2), max_new_tokens=2, temperature=0.7, seeds=(5, 6))  # 2 decodes
    out = backend.generate_batch([greedy, sampled])
    assert [x.token_ids for x in out] == [((7, 8),) * 3, ((7, 8),) * 2]
    # 3 decodes of 2 new tokens; positions: greedy 3 + 1, sampled 2 x (2 + 1)
    assert backend.statistics() == ScoringStatistics(decodes=3, generated_tokens=6, generation_tokens_computed=10)
    assert backend.generate((1, 2), max_new_tokens=2) == [7, 8]  # through generate_batch
    assert backend.statistics().decodes == 4


@pytest.mark.parametrize(
    "path",
    [
        "coalescence.backends.hf:HFBackend",
        "coalescence.backends.testing:FakeBackend",
        "coalescence.backends.vllm:VLLMBackend",
        "coalescence.backends.vllm:VLLMServerBackend",
    ],
)
def test_every_backend_of_the_package_writes_only_its_model_calls(path: str) -> None:
    # no backend keeps a copy of the envelope (issue 35): the public calls and the statistics are
    # BackendBase's own, and the backend writes _score_batch (importing the vLLM backends needs no
    # vLLM: tests/backends/test_vllm.py runs them on a real engine and a real server)
    import importlib

    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BackendBase)
    for member in ("score", "score_proxy", "generate_batch", "statistics", "_translated", "_count"):
        assert getattr(cls, member) is getattr(BackendBase, member), f"{name} overrides {member}"
    assert cls._score_batch is not BackendBase._score_batch
