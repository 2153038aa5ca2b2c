"""The collator's sleeping requests: each is woken when its call is delivered, or (the oldest
queued) to lead the next call; cancellations at any point never strand the others."""

from __future__ import annotations

import random
import threading
import time

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from coalescence.scheduler.collator import Collator, CollatorBackend


def echo(delay: float = 0.0):
    calls: list[list] = []

    def fn(prompts, call_kwargs, row_kwargs):
        calls.append(list(prompts))
        if delay:
            time.sleep(delay)
        return [("out", p) for p in prompts]

    return fn, calls


@pytest.mark.parametrize("when", ["sleeping", "woken to lead"])
@pytest.mark.anyio
async def test_cancelled_oldest_sleeper_hands_the_lead_on(anyio_backend, when):
    # one row per call: the leader's call holds the lock while "a" (oldest queued), "b" and "c"
    # sleep; "a" is cancelled while it sleeps, or just after the end of the call woke it to lead
    # (before it runs): either way "b" must lead next, then "c"
    gate = threading.Event()
    calls: list[list] = []

    def fn(prompts, call_kwargs, row_kwargs):
        calls.append(list(prompts))
        if prompts == ["leader"]:
            gate.wait(10)
        return [("out", p) for p in prompts]

    collator = Collator(CollatorBackend(fn=fn), max_batch_size=1)
    outcomes: dict = {}
    scopes: dict = {}

    async def one(name):
        with anyio.CancelScope() as scope:
            scopes[name] = scope
            outcomes[name] = await collator.submit(name)
        if name == "leader" and when == "woken to lead":
            scopes["a"].cancel()  # no checkpoint since the call's end woke "a"

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "leader")
            while not calls:
                await anyio.sleep(0.001)
            for name in ("a", "b", "c"):
                tg.start_soon(one, name)
                await wait_all_tasks_blocked()
            if when == "sleeping":
                scopes["a"].cancel()
                await wait_all_tasks_blocked()
            gate.set()
    assert outcomes == {n: ("out", n) for n in ("leader", "b", "c")}
    assert calls == [["leader"], ["b"], ["c"]]  # queue order, "a" withdrawn


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.anyio
async def test_random_cancellations_never_strand_a_request(anyio_backend, seed):
    # many requests over a few batch keys, some cancelled at random moments (queued, sleeping,
    # woken to lead, in a running call): every other one gets its own row's output, and the
    # collator ends empty and unlocked
    rng = random.Random(seed)
    fn, calls = echo(delay=0.0005)
    collator = Collator(CollatorBackend(fn=fn), max_batch_size=rng.choice([1, 2, 4, 8]))
    n_keys = rng.choice([1, 2, 3])
    outcomes: dict = {}
    scopes: dict = {}

    async def one(i):
        with anyio.CancelScope() as scope:
            scopes[i] = scope
            outcomes[i] = await collator.submit(i, key_extra=(i % n_keys,))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(one, i)
                if rng.random() < 0.3:
                    await anyio.sleep(0)
                if rng.random() < 0.2 and scopes:
                    scopes[rng.choice(list(scopes))].cancel()
            for _ in range(20):
                await anyio.sleep(rng.choice([0, 0, 0.0003]))
                scopes[rng.choice(list(scopes))].cancel()
    for i, scope in scopes.items():
        if i in outcomes:
            assert outcomes[i] == ("out", i)
        else:
            assert scope.cancel_called
    served = [p for call in calls for p in call]
    assert len(served) == len(set(served))  # no row twice
    assert set(outcomes) <= set(served)
    assert all(len({p % n_keys for p in call}) == 1 for call in calls)  # one batch key per call
    assert not collator._fifo and not collator._queues and not collator._lock.locked()
