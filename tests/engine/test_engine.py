"""The engine on a tiny real model, on asyncio and trio: each distinct coalition evaluated once."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow.parquet as pq
import pytest

from helpers.snapshots import eiffel_snapshot as snapshot

from coalescence.archive import RunArchive, read_pool, read_rows
from coalescence.attribution.estimators import ExactShapley, LeaveOneOut, PermutationShapley
from coalescence.backends.base import ScoreRequest
from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.engine import Engine
from coalescence.errors import EngineClosed, InputError
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy


def direct_utilities(backend, renderer, snap, policy) -> dict[tuple[bool, ...], float]:
    """Every coalition scored one at a time, bypassing the engine."""
    target = renderer.target_tokens(snap).ids
    out = {}
    for present in itertools.product([False, True], repeat=snap.n_players):
        prompt = renderer.coalition_prompt(snap, policy, np.array(present))
        [res] = backend.score([ScoreRequest(prompt_ids=tuple(prompt), target_ids=target)])
        out[present] = res.utility
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("policy", [DropPolicy(), PlaceholderPolicy()], ids=["drop", "placeholder"])
async def test_exact_through_engine_equals_direct_scoring(tiny_backend, tmp_path, policy):
    snap = snapshot()
    archive = RunArchive.create(tmp_path / "run", {"test": True}, flush_rows=5)
    engine = Engine(tiny_backend, archive=archive, batch_size=3)
    explanation = await engine.explain(snap, ExactShapley(), policy)
    engine.close()
    n = snap.n_players
    direct = direct_utilities(tiny_backend, engine.renderer, snap, policy)
    masks, utilities = read_pool(tmp_path / "run", snap.snapshot_id)
    assert masks.shape == (2**n, n)
    for row, u in zip(masks, utilities, strict=True):
        assert abs(u - direct[tuple(bool(x) for x in row)]) < 1e-4  # batching never changes a value
    # the estimate equals exact Shapley on the directly scored game
    all_masks = np.array(list(direct), dtype=bool)
    truth = ExactShapley().fit(all_masks, np.array(list(direct.values())))
    np.testing.assert_allclose(explanation.values, truth.values, atol=1e-4)
    assert abs(explanation.estimate.efficiency_gap) < 1e-9
    assert explanation.estimate.v_full == pytest.approx(direct[(True,) * n], abs=1e-4)
    assert explanation.estimate.v_empty == pytest.approx(direct[(False,) * n], abs=1e-4)
    stats = engine.statistics()
    assert stats.executed == 2**n == explanation.n_evaluations
    assert stats.requested == stats.executed + stats.deduplicated + stats.cache_hits + stats.failed
    rows = read_rows(tmp_path / "run")
    assert rows.num_rows == 2**n
    assert len(set(rows["coalition_key"].to_pylist())) == 2**n
    assert set(rows["batch_size"].to_pylist()) <= {1, 2, 3}
    # every row names its model call; a call's rows share its size and its model time
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for b, size, ms in zip(rows["batch_id"].to_pylist(), rows["batch_size"].to_pylist(), rows["elapsed_ms"].to_pylist(), strict=True):
        by_batch.setdefault(b, []).append((size, ms))
    assert None not in by_batch
    for members in by_batch.values():
        assert {size for size, _ in members} == {len(members)} and len({ms for _, ms in members}) == 1
    assert all(t is not None and t > 0 for t in rows["tokens_computed"].to_pylist())
    assert not any(rows["cache_hit"].to_pylist())
    parts = sorted((tmp_path / "run" / "parts").glob("*.parquet"))
    assert len(parts) == -(-(2**n) // 5)
    assert pq.ParquetFile(parts[0]).metadata.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.anyio
async def test_each_distinct_key_once_and_store_hits(tiny_backend):
    snap = snapshot()
    engine = Engine(tiny_backend, batch_size=4)
    perm = PermutationShapley(budget=4 * snap.n_players, seed=2)
    first = await engine.explain(snap, perm, DropPolicy())
    s1 = engine.statistics()
    planned = list(perm.plan(snap.n_players))
    distinct = {np.packbits(r, bitorder="little").tobytes() for r in planned}
    assert s1.requested == len(planned)
    assert s1.executed == len(distinct) == first.n_evaluations
    # repeated coalitions in one plan are folded, and a second pass is served from the store
    masks, values = await engine.evaluate(snap, DropPolicy(), planned[:5] + planned[:5])
    s1 = engine.statistics()
    assert s1.deduplicated == 5 and s1.cache_hits == 5 and s1.executed == len(distinct)
    assert masks.shape == (5, snap.n_players)
    # a second estimator on the same engine evaluates only what it lacks
    loo = await engine.explain(snap, LeaveOneOut(), DropPolicy())
    s2 = engine.statistics()
    loo_distinct = {np.packbits(r, bitorder="little").tobytes() for r in LeaveOneOut().plan(snap.n_players)}
    assert s2.executed - s1.executed == len(loo_distinct - distinct) == loo.n_evaluations
    assert s2.cache_hits - s1.cache_hits == len(loo_distinct & distinct)
    assert s2.requested == s2.executed + s2.deduplicated + s2.cache_hits + s2.failed
    # same game, same seed: identical values
    again = await Engine(tiny_backend, batch_size=1).explain(snap, perm, DropPolicy())
    np.testing.assert_allclose(again.values, first.values, atol=1e-4)
    assert first.estimate.stderr is not None and first.estimate.stderr.shape == (snap.n_players,)


@pytest.mark.anyio
async def test_closed_engine_refuses_work(tiny_backend):
    engine = Engine(tiny_backend)
    engine.close()
    with pytest.raises(EngineClosed):
        await engine.explain(snapshot(), LeaveOneOut(), DropPolicy())


def test_prepare_generates_a_missing_target(tiny_backend):
    convo = Conversation(messages=(Message(role="user", content="When was the tower completed?"),), target=None)
    engine = Engine(tiny_backend)
    try:
        snap = engine.prepare(convo, unit="turn", max_new_tokens=6)
    except InputError as exc:  # a random model may emit only special tokens: a clear error
        assert exc.field == "target"
        return
    prompt = engine.renderer.encode_prompt(convo.messages)
    generated = tiny_backend.generate(prompt, max_new_tokens=6)
    if generated[-1] == tiny_backend.tokenizer.convert_tokens_to_ids("<|im_end|>"):  # the stop token is not the answer's
        generated = generated[:-1]
    # the ids as generated, shown as their decoding (not stripped, special tokens kept)
    assert snap.conversation.target_ids == tuple(generated)
    assert snap.target == tiny_backend.tokenizer.decode(generated, skip_special_tokens=False)
    assert snap.conversation.target_source == "generated"


@pytest.mark.anyio
async def test_explain_until_target_stderr_rounds(tiny_backend):
    from coalescence.attribution.estimators import make_estimator
    from coalescence.errors import ConfigError

    def sampled(method):  # the rounds' estimators: the method at each round's budget, one seed
        return lambda budget: make_estimator(method, budget=budget, seed=0)

    snap = snapshot()
    n = snap.n_players
    # a loose target is met in the first round
    engine = Engine(tiny_backend, batch_size=4)
    loose = await engine.explain_until(snap, sampled("permutation"), DropPolicy(), budget=64, target_stderr=1e6, first_budget=4 * n)
    assert loose.stopping["reason"] == "target" and loose.stopping["rounds"] == 1
    # an unreachable target spends the budget; every round's coalitions are reused by the next
    engine = Engine(tiny_backend, batch_size=4)
    tight = await engine.explain_until(snap, sampled("permutation"), DropPolicy(), budget=14, target_stderr=1e-12, first_budget=2 * n)
    assert tight.stopping["reason"] == "budget" and tight.stopping["rounds"] >= 2
    # 4 players, budget 14 of 2^4 = 16: the errors are unknown (NaN), so no largest error is claimed
    assert tight.stopping["max_stderr"] is None and tight.stopping["unknown_stderr"] == n
    last_plan = {np.packbits(r, bitorder="little").tobytes() for r in make_estimator("permutation", budget=14, seed=0).plan(n)}
    assert tight.n_evaluations == engine.statistics().executed == len(last_plan) <= 14
    assert engine.statistics().cache_hits > 0
    direct = await Engine(tiny_backend, batch_size=4).explain(snap, make_estimator("permutation", budget=14, seed=0), DropPolicy())
    np.testing.assert_allclose(tight.values, direct.values, atol=1e-4)  # same as one run at the final budget
    # a target any known error would meet is not met by unknown ones: with budgets where every
    # error is NaN (one pair at 2n = 8, then within 4n of 2^4) the run spends the budget
    engine = Engine(tiny_backend, batch_size=4)
    unknown = await engine.explain_until(snap, sampled("permutation"), DropPolicy(), budget=15, target_stderr=1e9, first_budget=2 * n)
    assert np.all(np.isnan(unknown.estimate.stderr))
    assert unknown.stopping["reason"] == "budget" and unknown.stopping["rounds"] == 2
    assert unknown.stopping["max_stderr"] is None and unknown.stopping["unknown_stderr"] == n
    assert "4 standard errors unknown" in unknown.format_table()
    # ... and with a budget of 2^n the errors are known again and the loose target is met
    known = await Engine(tiny_backend, batch_size=4).explain_until(snap, sampled("permutation"), DropPolicy(), budget=16, target_stderr=1e9, first_budget=2 * n)
    assert known.stopping["reason"] == "target" and np.all(np.isfinite(known.estimate.stderr))
    # a budget that covers every coalition makes Banzhaf exact
    exact = await Engine(tiny_backend).explain_until(snap, sampled("banzhaf"), DropPolicy(), budget=2**n, target_stderr=1e-12)
    assert exact.stopping["reason"] == "exact" and exact.estimate.stderr is None
    assert "stopped after" in exact.format_table() and exact.to_dict()["stopping"]["reason"] == "exact"
    with pytest.raises(ConfigError) as info:
        await Engine(tiny_backend).explain_until(snap, lambda budget: make_estimator("exact"), DropPolicy(), budget=16, target_stderr=0.1)
    assert info.value.field == "target_stderr"


@pytest.mark.parametrize("method", ["kernelshap", "regression-msr", "auto"])
def test_target_stderr_rounds_never_spend_more_than_the_budget(chatml_tokenizer, method):
    """The budget caps the distinct coalitions of all rounds together, not each round's: the
    kernel plans of two budgets are not nested (a larger budget enumerates more sizes), so their
    union can outgrow the budget (428 distinct rows for budget 400 at n = 10 before the cap)."""
    import anyio

    from coalescence.attribution.estimators import make_estimator
    from coalescence.backends.testing import FakeBackend

    snap = ConversationSnapshot.build(Conversation(messages=(Message(role="user", content=" ".join(f"w{i}" for i in range(10))),), target="OK."), unit="word")
    backend = FakeBackend(chatml_tokenizer, max_batch_size=64)
    engine = Engine(backend, batch_size=64)
    estimator_for = lambda budget: make_estimator(method, budget=budget, seed=0)  # noqa: E731
    explanation = anyio.run(lambda: engine.explain_until(snap, estimator_for, DropPolicy(), budget=400, target_stderr=1e-12))
    engine.close()
    assert sum(backend.calls) <= 400  # every row that reached the game, counted by the backend itself
    assert explanation.n_evaluations == sum(backend.calls) and explanation.stopping["reason"] == "budget"
    assert explanation.estimate.stderr is not None and np.all(np.isfinite(explanation.estimate.stderr))


# twins (symmetric players get exactly equal values) and context refusals are part of every
# backend's contract: tests/backends/test_contract.py


@pytest.mark.anyio
async def test_the_engine_reads_lanes_notes_records_and_shutdown_from_the_backend(chatml_tokenizer, tmp_path, anyio_backend):
    # what RayBackend does with workers, here with two fake backends as lanes: each conversation's
    # calls go to its lane's backend whole, the notes reach the explanation, the record the manifest
    import json

    from coalescence.backends.testing import FakeBackend

    class TwoLanes(FakeBackend):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, shutdown_with_engine=True)
            self.lanes = [FakeBackend(tokenizer), FakeBackend(tokenizer)]
            self.taken: list[tuple[str, int]] = []
            self.released: list[int] = []

        def acquire_lane(self, snapshot_id):
            known = dict(self.taken)
            lane = known.get(snapshot_id, len(known) % 2)  # a new conversation takes the next lane
            self.taken.append((snapshot_id, lane))
            return lane

        def lane(self, lane):
            return self if lane is None else self.lanes[lane]

        def release_lane(self, lane):
            self.released.append(lane)

        def run_notes(self, snapshot_id=""):
            return ("two fake lanes",)

        def run_record(self):
            return {"lanes": {"calls": [len(b.calls) for b in self.lanes]}}

    backend = TwoLanes(chatml_tokenizer)
    first = snapshot()
    second = ConversationSnapshot.build(
        Conversation(messages=(Message(role="user", content="Lisbon has sardines. Porto has wine."),), target="Sardines."), unit="sentence"
    )
    archive = RunArchive.create(tmp_path / "run", {"test": True})
    engine = Engine(backend, archive=archive, batch_size=2)
    one = await engine.explain(first, ExactShapley(), DropPolicy())
    two = await engine.explain(second, ExactShapley(), DropPolicy())
    assert [lane for _, lane in backend.taken] == [0, 1] and backend.released == [0, 1]
    assert backend.calls == [] and sum(backend.lanes[0].calls) == 2**first.n_players and sum(backend.lanes[1].calls) == 2**second.n_players
    assert "two fake lanes" in one.notes and "two fake lanes" in two.notes
    engine.close()
    run = json.loads((tmp_path / "run" / "manifest.json").read_text())["runs"][-1]
    assert run["lanes"] == {"calls": [len(backend.lanes[0].calls), len(backend.lanes[1].calls)]} and run["status"] == "complete"
    with pytest.raises(EngineClosed):  # shut down with the engine
        backend.score([ScoreRequest(prompt_ids=(5,), target_ids=(6,))])
