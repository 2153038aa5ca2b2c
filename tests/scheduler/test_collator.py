"""The lock-leader collator, on asyncio and trio, with a deterministic test backend and a real tiny model."""

from __future__ import annotations

import logging
import threading
import time

import anyio
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked

from coalescence.backends.base import ScoreRequest
from coalescence.errors import BatchFailed, ConfigError, EngineClosed
from coalescence.scheduler.collator import (
    Collator,
    CollatorBackend,
    CollatorRecord,
    CollatorStatistics,
    scoring_backend,
)

LOGGER = "coalescence.scheduler.collator"


class Recorder:
    """A deterministic batch function that records every call and the concurrency it saw.

    The first call can be held on ``gate`` (a threading.Event) so that later requests queue up
    behind it and then form one batch; ``hold`` holds every later call on its own event.
    """

    def __init__(self, *, delay: float = 0.0, gate: bool = False) -> None:
        self.delay = delay
        self.gate = threading.Event()
        if not gate:
            self.gate.set()
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.poison: set = set()
        self.fail_multi: str | None = None  # message for a failure of every multi-row call
        self.drop_one = False
        self.calls: list[tuple[list, dict, list]] = []
        self._lock = threading.Lock()
        self.active = 0
        self.max_active = 0

    def __call__(self, prompts, call_kwargs, row_kwargs):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            first = not self.calls
            self.calls.append((list(prompts), dict(call_kwargs), [dict(r) for r in row_kwargs]))
        try:
            self.entered.set()
            (self.gate if first else self.hold).wait(10)
            if self.delay:
                time.sleep(self.delay)
            if self.fail_multi is not None and len(prompts) > 1:
                raise RuntimeError(self.fail_multi)
            if any(p in self.poison for p in prompts):
                raise ValueError(f"poisoned batch of {len(prompts)}")
            out = [("out", p) for p in prompts]
            return out[:-1] if self.drop_one else out
        finally:
            with self._lock:
                self.active -= 1

    @property
    def sizes(self) -> list[int]:
        return [len(p) for p, _, _ in self.calls]


async def gated_round(collator: Collator, rec: Recorder, requests: list[dict]) -> dict:
    """Hold a warm-up call on the gate, queue ``requests`` behind it, open the gate, collect outcomes."""
    outcomes: dict = {}

    async def one(i, kw):
        try:
            outcomes[i] = ("ok", await collator.submit(**kw))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcomes[i] = ("err", exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "warmup", {"prompt": "warmup"})
        await anyio.to_thread.run_sync(rec.entered.wait, 10)
        for i, kw in enumerate(requests):  # one at a time: queue order is request order on every loop
            tg.start_soon(one, i, kw)
            await wait_all_tasks_blocked()
        rec.gate.set()
    return outcomes


# ---- construction and admission ---------------------------------------------------------------


def test_collator_validation():
    backend = CollatorBackend(fn=Recorder(), runtime_kwargs={"lora": "row"})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_batch_size"):
            Collator(backend, max_batch_size=bad)
    collator = Collator(backend)
    with pytest.raises(ConfigError, match="n_candidates"):
        collator.admit("p", n_candidates=0)
    with pytest.raises(ConfigError, match="key_extra"):
        collator.admit("p", key_extra=["not", "a", "tuple"])
    with pytest.raises(ConfigError, match="batch key"):
        collator.admit("p", call_kwargs={"obj": object()})
    with pytest.raises(ConfigError, match="reserved"):
        collator.admit("p", call_kwargs={"n_candidates": 2})
    assert collator.statistics() == CollatorStatistics()


def test_record_key_ignores_row_values_but_not_row_keys():
    collator = Collator(CollatorBackend(fn=Recorder(), runtime_kwargs={"lora": "row", "bias": "row"}))
    a = collator.admit("p", row_kwargs={"lora": "a"})
    b = collator.admit("q", row_kwargs={"lora": "b"})
    c = collator.admit("p", row_kwargs={"lora": "a", "bias": 1})
    d = collator.admit("p", row_kwargs={"lora": "a"}, call_kwargs={"seed": 3})
    e = collator.admit("p", row_kwargs={"lora": "a"}, n_candidates=2)
    f = collator.admit("p", row_kwargs={"lora": "a"}, key_extra=("model", "logprob", 32))
    assert a.batch_key == b.batch_key
    assert len({a.batch_key, c.batch_key, d.batch_key, e.batch_key, f.batch_key}) == 5
    assert isinstance(a, CollatorRecord) and a != collator.admit("p", row_kwargs={"lora": "a"})  # identity
    with pytest.raises(AttributeError):
        a.prompt = "x"  # frozen


def test_call_scoped_per_request_kwarg_rejected_naming_key():
    collator = Collator(CollatorBackend(fn=Recorder(), runtime_kwargs={"temperature": "call", "lora": "row"}))
    with pytest.raises(ConfigError, match="'temperature'.*call-scoped") as info:
        collator.admit("p", row_kwargs={"temperature": 0.5})
    assert "temperature" in info.value.field
    with pytest.raises(ConfigError, match="'temperature'.*call-scoped"):
        collator.admit("p", call_kwargs={"temperature": 0.5})
    with pytest.raises(ConfigError, match="'lora'.*row_kwargs"):
        collator.admit("p", call_kwargs={"lora": "x"})
    with pytest.raises(ConfigError, match="'seed'.*both"):
        collator.admit("p", call_kwargs={"seed": 1}, row_kwargs={"seed": 1})


def test_key_both_static_and_per_request_rejected():
    backend = CollatorBackend(fn=Recorder(), runtime_kwargs={"adapter": "row", "temperature": "call"})
    collator = Collator(backend, static_kwargs={"adapter": "a", "temperature": 0.7})
    with pytest.raises(ConfigError, match="'adapter'.*both statically and per request"):
        collator.admit("p", row_kwargs={"adapter": "b"})
    with pytest.raises(ConfigError, match="'temperature'.*both statically and per request"):
        collator.admit("p", call_kwargs={"temperature": 0.1})


@pytest.mark.anyio
async def test_undeclared_key_inert_recorded_logged_once_not_passed(anyio_backend, caplog):
    rec = Recorder()
    backend = CollatorBackend(fn=rec, runtime_kwargs={"lora": "row"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        collator = Collator(backend, static_kwargs={"ghost": 1})
        plain = collator.admit("p", row_kwargs={"lora": "a"})
        first = collator.admit("p", row_kwargs={"lora": "a", "mystery": 2})
        await collator.serve(first)
        await collator.submit("q", row_kwargs={"lora": "b", "mystery": 3})
    assert collator.inert_runtime_kwargs == frozenset({"ghost", "mystery"})
    assert first.batch_key == plain.batch_key
    assert dict(first.row_kwargs) == {"lora": "a"}
    for _, call_kwargs, rows in rec.calls:
        assert "ghost" not in call_kwargs and "mystery" not in call_kwargs
        assert all(set(r) == {"lora"} for r in rows)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'mystery'" in m for m in messages) == 1
    assert sum("'ghost'" in m for m in messages) == 1


@pytest.mark.anyio
async def test_static_and_row_kwargs_reach_backend_by_scope(anyio_backend):
    rec = Recorder(gate=True)
    backend = CollatorBackend(fn=rec, runtime_kwargs={"lora": "row", "bias": "row", "temperature": "call"})
    collator = Collator(backend, max_batch_size=8, static_kwargs={"temperature": 0.7, "bias": 1})
    requests = [{"prompt": f"p{i}", "row_kwargs": {"lora": f"l{i}"}, "call_kwargs": {"seed": 5}} for i in range(3)]
    outcomes = await gated_round(collator, rec, requests)
    assert all(outcomes[i] == ("ok", ("out", f"p{i}")) for i in range(3))
    prompts, call_kwargs, rows = rec.calls[1]
    assert prompts == ["p0", "p1", "p2"]
    assert call_kwargs == {"temperature": 0.7, "seed": 5}
    assert rows == [{"bias": 1, "lora": "l0"}, {"bias": 1, "lora": "l1"}, {"bias": 1, "lora": "l2"}]


# ---- batching -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_200_concurrent_requests_bounded_batches_own_results_one_call_at_a_time(anyio_backend):
    rec = Recorder(delay=0.002)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=16)
    results: dict[int, object] = {}

    async def one(i):
        results[i] = await collator.submit(i)

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert results == {i: ("out", i) for i in range(200)}
    assert all(1 <= n <= 16 for n in rec.sizes)
    assert sum(rec.sizes) == 200
    assert sorted(p for prompts, _, _ in rec.calls for p in prompts) == list(range(200))
    assert rec.max_active == 1
    stats = collator.statistics()
    assert stats.calls == len(rec.calls) < 200
    assert stats.rows == 200 and stats.failed_rows == 0 and stats.poison_reruns == 0
    assert 1 < stats.largest_batch <= 16


@pytest.mark.anyio
async def test_max_batch_size_one_serialises(anyio_backend):
    rec = Recorder(delay=0.001)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=1)
    results: dict[int, object] = {}

    async def one(i):
        results[i] = await collator.submit(i)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert results == {i: ("out", i) for i in range(20)}
    assert rec.sizes == [1] * 20
    assert rec.max_active == 1
    assert collator.statistics().largest_batch == 1


@pytest.mark.anyio
async def test_leader_takes_compatible_records_in_queue_order(anyio_backend):
    rec = Recorder(gate=True)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=3)
    outcomes = await gated_round(collator, rec, [{"prompt": i} for i in range(7)])
    assert all(outcomes[i] == ("ok", ("out", i)) for i in range(7))
    assert [p for p, _, _ in rec.calls[1:]] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.anyio
async def test_different_batch_keys_never_share_a_call(anyio_backend):
    rec = Recorder(gate=True)
    backend = CollatorBackend(fn=rec, runtime_kwargs={"lora": "row"})
    collator = Collator(backend, max_batch_size=16)
    variants = [
        {"call_kwargs": {"seed": 1}},
        {"call_kwargs": {"seed": 2}},
        {"call_kwargs": {"seed": 1}, "key_extra": ("m", "logprob", 64)},
        {"call_kwargs": {"seed": 1}, "key_extra": ("m", "logprob", 128)},
        {"call_kwargs": {"seed": 1}, "row_kwargs": {"lora": "x"}},
    ]
    requests = [{"prompt": (v, i), **variants[v]} for i in range(4) for v in range(len(variants))]
    outcomes = await gated_round(collator, rec, requests)
    assert all(outcomes[i] == ("ok", ("out", r["prompt"])) for i, r in enumerate(requests))
    groups = [{v for v, _ in prompts} for prompts, _, _ in rec.calls[1:]]
    assert all(len(g) == 1 for g in groups)
    assert sorted(rec.sizes[1:]) == [4] * len(variants)


@pytest.mark.anyio
async def test_multi_candidate_requests_dispatch_alone(anyio_backend):
    rec = Recorder(gate=True)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)
    requests = [{"prompt": f"one{i}"} for i in range(3)]
    requests += [{"prompt": f"three{i}", "n_candidates": 3} for i in range(2)]
    outcomes = await gated_round(collator, rec, requests)
    assert all(o[0] == "ok" for o in outcomes.values())
    singles = [(p, kw) for p, kw, _ in rec.calls[1:] if kw.get("n_candidates")]
    assert sorted(singles, key=lambda x: x[0]) == [(["three0"], {"n_candidates": 3}), (["three1"], {"n_candidates": 3})]
    assert (["one0", "one1", "one2"], {}, [{}, {}, {}]) in rec.calls


# ---- failures ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_poisoned_row_fails_alone_batch_mates_succeed(anyio_backend, caplog):
    rec = Recorder(gate=True)
    rec.poison = {"bad"}
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcomes = await gated_round(collator, rec, [{"prompt": p} for p in ("a", "bad", "b", "c")])
    assert outcomes[0] == ("ok", ("out", "a"))
    assert outcomes[2] == ("ok", ("out", "b")) and outcomes[3] == ("ok", ("out", "c"))
    kind, err = outcomes[1]
    assert kind == "err" and isinstance(err, BatchFailed) and isinstance(err.__cause__, ValueError)
    assert rec.sizes == [1, 4, 1, 1, 1, 1]  # the batch, then each member alone, once
    stats = collator.statistics()
    assert (stats.poison_reruns, stats.failed_rows, stats.calls, stats.rows) == (1, 1, 6, 5)
    assert not caplog.records  # a bad sample, not a batching bug


@pytest.mark.anyio
async def test_batch_only_failure_warns_once_per_distinct_message(anyio_backend, caplog):
    rec = Recorder()
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)

    async def round_(message):
        rec.calls.clear()
        rec.gate.clear()
        rec.entered.clear()
        rec.fail_multi = message
        outcomes = await gated_round(collator, rec, [{"prompt": p} for p in ("a", "b", "c")])
        assert all(outcomes[i] == ("ok", ("out", p)) for i, p in enumerate("abc"))
        assert rec.sizes == [1, 3, 1, 1, 1]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await round_("shape mismatch")
        await round_("shape mismatch")
        await round_("other shape bug")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "batch of 3 rows" in warnings[0] and "shape mismatch" in warnings[0]
    assert "other shape bug" in warnings[1]
    assert collator.statistics().failed_rows == 0 and collator.statistics().poison_reruns == 3


@pytest.mark.anyio
async def test_wrong_output_count_is_an_error_for_that_call(anyio_backend):
    rec = Recorder()
    rec.drop_one = True
    collator = Collator(CollatorBackend(fn=rec))
    with pytest.raises(BatchFailed, match="0 outputs for 1 rows"):
        await collator.submit("p")

    collator2 = Collator(CollatorBackend(fn=lambda prompts, c, r: None))
    with pytest.raises(BatchFailed, match="NoneType instead of a sequence"):
        await collator2.submit("p")
    assert collator2.statistics().failed_rows == 1


@pytest.mark.anyio
async def test_backend_error_of_our_tree_passes_through(anyio_backend):
    def fn(prompts, call_kwargs, row_kwargs):
        raise BatchFailed("model exploded")

    collator = Collator(CollatorBackend(fn=fn))
    with pytest.raises(BatchFailed, match="^model exploded$"):
        await collator.submit("p")


# ---- close and cancellation -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_close_refuses_new_work_and_in_flight_batch_completes(anyio_backend):
    rec = Recorder(gate=True)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)
    early = collator.admit("early")  # admitted before close, served after: refused
    outcomes: dict = {}

    async def one(name):
        outcomes[name] = await collator.submit(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "inflight")
        await anyio.to_thread.run_sync(rec.entered.wait, 10)
        tg.start_soon(one, "queued")
        await wait_all_tasks_blocked()
        collator.close()
        assert collator.closed
        with pytest.raises(EngineClosed, match="closed"):
            collator.admit("late")
        with pytest.raises(EngineClosed):
            await collator.submit("late")
        with pytest.raises(EngineClosed):
            await collator.serve(early)
        rec.gate.set()
    assert outcomes == {"inflight": ("out", "inflight"), "queued": ("out", "queued")}
    assert [p for p, _, _ in rec.calls] == [["inflight"], ["queued"]]


@pytest.mark.anyio
async def test_record_served_once_and_by_its_own_collator(anyio_backend):
    collator = Collator(CollatorBackend(fn=Recorder()))
    other = Collator(CollatorBackend(fn=Recorder()))
    record = collator.admit("p")
    with pytest.raises(ConfigError, match="another collator"):
        await other.serve(record)
    assert await collator.serve(record) == ("out", "p")
    with pytest.raises(ConfigError, match="already served"):
        await collator.serve(record)


@pytest.mark.anyio
async def test_cancelled_queued_waiter_withdraws_its_record(anyio_backend):
    rec = Recorder(gate=True)
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)
    outcomes: dict = {}
    scopes: dict = {}

    async def one(name):
        with anyio.CancelScope() as scope:
            scopes[name] = scope
            outcomes[name] = await collator.submit(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "leader")
        await anyio.to_thread.run_sync(rec.entered.wait, 10)
        for name in ("a", "gone", "b"):
            tg.start_soon(one, name)
            await wait_all_tasks_blocked()
        scopes["gone"].cancel()
        await wait_all_tasks_blocked()
        rec.gate.set()
    assert outcomes == {n: ("out", n) for n in ("leader", "a", "b")}
    assert [p for p, _, _ in rec.calls] == [["leader"], ["a", "b"]]
    assert collator.statistics().rows == 3


@pytest.mark.parametrize("cancel", ["mate", "leader"])
@pytest.mark.anyio
async def test_cancelled_waiter_in_running_batch_does_not_lose_batch_mates(anyio_backend, cancel):
    rec = Recorder(gate=True)
    rec.hold.clear()  # the second call (the batch under test) waits on `hold`
    collator = Collator(CollatorBackend(fn=rec), max_batch_size=8)
    outcomes: dict = {}
    scopes: dict = {}

    async def one(name):
        with anyio.CancelScope() as scope:
            scopes[name] = scope
            outcomes[name] = await collator.submit(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "warmup")
        await anyio.to_thread.run_sync(rec.entered.wait, 10)
        for name in ("r1", "r2", "r3"):
            tg.start_soon(one, name)
            await wait_all_tasks_blocked()
        rec.gate.set()
        while len(rec.calls) < 2:  # r1 leads [r1, r2, r3], held inside the backend
            await anyio.sleep(0.001)
        scopes["r1" if cancel == "leader" else "r2"].cancel()
        await wait_all_tasks_blocked()
        rec.hold.set()
    assert rec.calls[1][0] == ["r1", "r2", "r3"] and len(rec.calls) == 2  # the call ran to the end, once
    assert outcomes["r3"] == ("out", "r3")
    if cancel == "mate":
        assert outcomes["r1"] == ("out", "r1") and "r2" not in outcomes
    else:
        assert outcomes["r2"] == ("out", "r2")
    assert collator.statistics().rows == 4


# ---- real backend ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_real_tiny_model_batched_equals_one_at_a_time(anyio_backend, tiny_backend):
    rng = np.random.default_rng(0)
    vocab = len(tiny_backend.tokenizer)
    requests = [
        ScoreRequest(
            prompt_ids=tuple(int(x) for x in rng.integers(5, vocab, size=int(rng.integers(3, 20)))),
            target_ids=tuple(int(x) for x in rng.integers(5, vocab, size=int(rng.integers(1, 6)))),
        )
        for _ in range(12)
    ]
    expected = [tiny_backend.score([r])[0] for r in requests]
    collator = Collator(scoring_backend(tiny_backend), max_batch_size=8)
    key = (tiny_backend.model_id, "logprob", 32)
    results: dict = {}

    async def one(i):
        results[i] = await collator.submit(requests[i], key_extra=key)

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    assert collator.statistics().largest_batch > 1
    for i, exp in enumerate(expected):
        got = results[i]
        assert abs(got.utility - exp.utility) < 1e-4
        np.testing.assert_allclose(got.token_logprobs, exp.token_logprobs, atol=1e-4)
        # with prefix sharing the split between computed and reused depends on batch-mates and cache
        assert got.tokens_computed + got.tokens_reused == requests[i].n_tokens

    with pytest.raises(BatchFailed, match="ScoreRequest"):
        await collator.submit("not a request")
