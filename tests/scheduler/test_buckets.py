"""Length buckets and the padded-token budget in the collator; whole-batch output validation."""

from __future__ import annotations

import functools
import itertools
import threading

import anyio
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked

from coalescence.backends.base import BackendBase, ScoreRequest, ScoreResult, ScoringBackend
from coalescence.errors import BatchFailed, ConfigError, InputError
from coalescence.scheduler.buckets import LengthBuckets, share_order
from coalescence.scheduler.collator import Collator, CollatorBackend, scoring_backend


def test_bucket_config_is_checked_at_construction():
    b = LengthBuckets()
    assert b.ceilings == (128, 512, 2048, 8192)
    assert [b.bucket(n) for n in (1, 128, 129, 512, 8192)] == [128, 128, 512, 512, 8192]
    assert b.max_rows(128, 8) == 8 and b.max_rows(8192, 64) == b.padded_token_budget // 8192
    for bad in [(), (0, 4), (64, 32), (16, 16), ("a",)]:
        with pytest.raises(ConfigError):
            LengthBuckets(ceilings=bad)
    with pytest.raises(ConfigError, match="8192"):
        LengthBuckets(padded_token_budget=4096)  # the largest bucket does not fit the budget
    with pytest.raises(ConfigError):
        LengthBuckets(max_tokens=0)
    with pytest.raises(InputError, match="9000 tokens.*8192"):
        b.bucket(9000)
    with pytest.raises(InputError, match="600 tokens.*context of 512"):
        LengthBuckets(max_tokens=512).bucket(600)
    assert LengthBuckets(max_tokens=512).limit == 512


class Recorder:
    """Records every call's prompts (here: token lengths); can hold the first call on a gate."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate = threading.Event()

    def __call__(self, prompts, call_kwargs, row_kwargs):
        self.gate.wait(5)
        self.calls.append(list(prompts))
        return [("ok", p) for p in prompts]


@pytest.mark.anyio
async def test_budget_bound_holds_for_every_dispatched_batch(anyio_backend):
    buckets = LengthBuckets(ceilings=(8, 32, 128), padded_token_budget=128)
    rec = Recorder()
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=12, buckets=buckets)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 129, 80)]
    got: dict[int, object] = {}

    async def one(i):
        got[i] = await collator.submit(lengths[i], key_extra=("m",), n_tokens=lengths[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(lengths)):
            tg.start_soon(one, i)
        await anyio.sleep(0.05)
        rec.gate.set()
    assert got == {i: ("ok", n) for i, n in enumerate(lengths)}
    assert any(len(c) > 1 for c in rec.calls)
    for call in rec.calls:
        ceilings = {buckets.bucket(n) for n in call}
        assert len(ceilings) == 1  # one bucket per call
        assert len(call) * ceilings.pop() <= buckets.padded_token_budget
        assert len(call) <= 12
    assert any(len(c) == 4 and 8 < max(c) <= 32 for c in rec.calls)  # 128 // 32 rows: the budget binds
    assert all(len(c) == 1 for c in rec.calls if max(c) > 32)


@pytest.mark.anyio
async def test_oversized_request_fails_alone_before_any_model_call(anyio_backend):
    rec = Recorder()
    rec.gate.set()
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=4, buckets=LengthBuckets(max_tokens=1000))
    results: dict[str, object] = {}

    async def one(name, n):
        try:
            results[name] = await collator.submit(name, n_tokens=n)
        except InputError as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        for name, n in [("a", 10), ("huge", 1001), ("b", 300), ("giant", 9000)]:
            tg.start_soon(one, name, n)
    assert results["a"] == ("ok", "a") and results["b"] == ("ok", "b")
    assert "1001 tokens" in str(results["huge"]) and "1000" in str(results["huge"])
    assert "9000 tokens" in str(results["giant"])
    assert all(p not in ("huge", "giant") for call in rec.calls for p in call)
    rec.calls.clear()
    with pytest.raises(InputError):
        collator.admit("x", n_tokens=5000)
    assert rec.calls == []


class FakeScorer(BackendBase):
    """A scoring backend whose outputs can be malformed; counts calls and rows."""

    model_id, revision, dtype, tokenizer, max_context = "malformed", "", "float32", None, 64

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls: list[int] = []

    def score(self, requests):
        self.calls.append(len(requests))
        call = len(self.calls)
        out = []
        for r in requests:
            lp = np.full(len(r.target_ids), -1.0, dtype=np.float32)
            if self.mode == "nan" and r.prompt_ids == (99,):
                lp[0] = np.nan
            if self.mode == "width":
                lp = np.append(lp, -1.0).astype(np.float32)
            out.append(ScoreResult(token_logprobs=lp, utility=float(lp.sum()), tokens_computed=call))
        return out[:-1] if self.mode == "rows" else out

    def generate_batch(self, requests):
        raise BatchFailed("this test backend only scores")


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["nan", "rows", "width"])
async def test_malformed_backend_output_fails_the_whole_batch(anyio_backend, mode):
    fake = FakeScorer(mode)
    assert isinstance(fake, ScoringBackend)
    collator = Collator(scoring_backend(fake), max_batch_size=4)
    reqs = [ScoreRequest(prompt_ids=(p,), target_ids=(1, 2)) for p in (5, 99, 6)]
    outcomes: dict[int, object] = {}

    async def one(i):
        try:
            outcomes[i] = await collator.submit(reqs[i])
        except BatchFailed as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(one, i)
    assert fake.calls[0] == 3  # one batch; it failed validation as a whole ...
    # ... so no row got a value from it: each member was re-run alone (poison isolation)
    assert fake.calls[1:] == [1, 1, 1]
    if mode == "nan":
        assert isinstance(outcomes[1], BatchFailed)
        for i in (0, 2):
            assert isinstance(outcomes[i], ScoreResult) and outcomes[i].tokens_computed > 1
    else:  # malformed on every call: every member fails
        assert all(isinstance(outcomes[i], BatchFailed) for i in range(3))


def test_share_order_is_depth_first_over_the_player_trie():
    masks = np.array(list(itertools.product([False, True], repeat=4)), dtype=bool)
    rng = np.random.default_rng(0)
    masks = masks[rng.permutation(len(masks))]
    order = share_order(masks)
    assert sorted(order.tolist()) == list(range(len(masks)))
    ordered = masks[order]
    assert ordered[0].all() and not ordered[-1].any()  # present first
    # every prefix pattern of the first k players is one contiguous run
    for k in range(1, 5):
        runs = [tuple(r[:k]) for r in ordered]
        changes = sum(1 for a, b in zip(runs, runs[1:]) if a != b)
        assert changes == 2**k - 1
    assert share_order(np.zeros((0, 3), dtype=bool)).shape == (0,)


def test_rows_sharing_cached_tokens_are_counted_by_their_own_tokens():
    buckets = LengthBuckets(ceilings=(8, 32, 128, 512), padded_token_budget=1024)
    # a whole row of 400 tokens: bucket 512, 1024 // 512 = 2 rows a call
    assert buckets.max_rows(buckets.bucket(400), 32) == 2
    # 380 of them shared once per call, 20 its own: bucket 32, (1024 - 380) // 32 = 20 rows
    assert buckets.max_rows(buckets.bucket(400 - 380), 32, shared_tokens=380) == 20
    assert buckets.max_rows(buckets.bucket(20), 12, shared_tokens=380) == 12  # max_batch_size binds
    assert buckets.max_rows(8, 32, shared_tokens=1020) == 1  # one row always goes
    collator = Collator(CollatorBackend(fn=Recorder()), max_batch_size=32, buckets=buckets)
    shared = collator.admit("p", key_extra=("m",), n_tokens=400, shared_tokens=380)
    whole = collator.admit("p", key_extra=("m",), n_tokens=400)
    other = collator.admit("p", key_extra=("m",), n_tokens=401, shared_tokens=381)  # same own bucket, other KV length
    assert (shared.max_rows, whole.max_rows) == (20, 2)
    assert len({shared.batch_key, whole.batch_key, other.batch_key}) == 3
    with pytest.raises(InputError, match="600 tokens"):  # the whole row must still fit the largest bucket
        collator.admit("p", n_tokens=600, shared_tokens=590)
    for bad in (-1, 400, 401, 1.5):
        with pytest.raises(ConfigError, match="shared_tokens"):
            collator.admit("p", n_tokens=400, shared_tokens=bad)


@pytest.mark.anyio
@pytest.mark.parametrize("shared", [380, 0])
async def test_calls_of_shared_rows_follow_the_hand_computed_split(anyio_backend, shared):
    # 45 rows of 400 tokens queue behind a held call; counted by their own 20 tokens (380 shared
    # once) a call takes (1024 - 380) // 32 = 20 of them: 20, 20, 5; counted whole, 1024 // 512 = 2
    buckets = LengthBuckets(ceilings=(8, 32, 128, 512), padded_token_budget=1024)
    rec = Recorder()
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=32, buckets=buckets)
    got: dict[int, object] = {}

    async def one(i):
        got[i] = await collator.submit(i, key_extra=("m",), n_tokens=400, shared_tokens=shared)

    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(collator.submit, "held", n_tokens=5))
        await wait_all_tasks_blocked()  # the held call is running
        for i in range(45):
            tg.start_soon(one, i)
        await wait_all_tasks_blocked()
        rec.gate.set()
    assert got == {i: ("ok", i) for i in range(45)}
    assert rec.calls[0] == ["held"]
    sizes = [len(c) for c in rec.calls[1:]]
    assert sizes == ([20, 20, 5] if shared else [2] * 22 + [1])
    assert sorted(p for c in rec.calls[1:] for p in c) == list(range(45))  # each row once
    for size in sizes:
        assert shared + size * buckets.bucket(400 - shared) <= buckets.padded_token_budget
