"""Per-token scores, utility kinds and answer sub-spans through the engine, archive and replay."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from helpers.snapshots import eiffel_snapshot as snapshot

from coalescence.archive import RunArchive, read_rows
from coalescence.attribution.estimators import ExactShapley
from coalescence.backends.base import ScoreRequest
from coalescence.engine import Engine, fill_measurements, pool_from_store
from coalescence.masking.codec import PackedMask
from coalescence.masking.policies import DropPolicy
from coalescence.scheduler.store import ResultStore
from coalescence.utility import UtilitySpec

TARGET = "It was completed in 1889."


def all_rows(n: int) -> list[np.ndarray]:
    return [np.array(p, dtype=bool) for p in itertools.product([False, True], repeat=n)]


def direct_token_logprobs(backend, engine, snap, policy) -> dict[bytes, np.ndarray]:
    """Per-token log-probabilities of every coalition, one row per model call (no engine)."""
    target = engine.target_tokens(snap).ids
    out = {}
    for row in all_rows(snap.n_players):
        prompt = tuple(engine.renderer.coalition_prompt(snap, policy, row))
        [res] = backend.score([ScoreRequest(prompt_ids=prompt, target_ids=target)])
        out[row.tobytes()] = np.asarray(res.token_logprobs, dtype=np.float64)
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_backend):
    """An exact run of the default utility, archived (per-token scores included)."""
    import anyio

    run_dir = tmp_path_factory.mktemp("utility") / "run"
    snap = snapshot()
    policy = DropPolicy()
    archive = RunArchive.create(run_dir, {"test": "full"})
    engine = Engine(tiny_backend, archive=archive, batch_size=3)

    async def go():
        return await engine.explain(snap, ExactShapley(), policy)

    explanation = anyio.run(go)
    engine.close()
    direct = direct_token_logprobs(tiny_backend, engine, snap, policy)
    return run_dir, snap, policy, explanation, engine, direct


def test_archive_keeps_per_token_scores_and_the_utility_is_their_sum(full_run) -> None:
    run_dir, snap, _, _, engine, direct = full_run
    rows = read_rows(run_dir)
    n_target = len(engine.target_tokens(snap).ids)
    assert rows.num_rows == 2**snap.n_players
    assert len(set(rows["evaluation_key"].to_pylist())) == rows.num_rows
    for mask, lp, utility in zip(rows["mask"].to_pylist(), rows["token_logprobs"].to_pylist(), rows["utility"].to_pylist()):
        row = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: snap.n_players].astype(bool)
        assert len(lp) == n_target
        assert utility == float(np.asarray(lp, dtype=np.float32).astype(np.float64).sum())
        np.testing.assert_allclose(lp, direct[row.tobytes()], atol=1e-4)  # batched equals one at a time


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["mean_logprob", "logit_prob", "prob"])
async def test_kinds_agree_with_their_definitions_and_need_no_model_call(full_run, tiny_backend, kind: str) -> None:
    run_dir, snap, policy, _, _, direct = full_run
    archive = RunArchive.open(run_dir, {"utility": {"kind": kind}}, new_run=True)
    engine = Engine(tiny_backend, archive=archive, batch_size=3, utility=UtilitySpec(kind=kind))
    masks, values = await engine.evaluate(snap, policy, all_rows(snap.n_players))
    stats = engine.statistics()
    engine.close()
    assert stats.executed == 0 and stats.cache_hits == 2**snap.n_players  # reduced from the archive
    for row, value in zip(masks, values, strict=True):
        lp = direct[row.tobytes()]
        want = {
            "mean_logprob": lp.mean(),
            "prob": math.exp(lp.sum()),
            "logit_prob": lp.sum() - math.log1p(-math.exp(lp.sum())),
        }[kind]
        assert value == pytest.approx(want, rel=1e-4, abs=1e-5)
    # the derived rows are archived under their own coalition keys, with the same evaluation keys
    rows = read_rows(run_dir).to_pylist()
    original = [r for r in rows if not r["cache_hit"]]
    derived = [r for r in rows if r["cache_hit"]]
    assert len(original) == 2**snap.n_players and len(derived) >= 2**snap.n_players
    assert {r["evaluation_key"] for r in derived} == {r["evaluation_key"] for r in original}
    assert all(r["token_logprobs"] is not None for r in derived)


@pytest.mark.anyio
async def test_a_kind_run_on_a_fresh_engine_evaluates_with_the_model(tiny_backend) -> None:
    snap = snapshot()
    policy = DropPolicy()
    engine = Engine(tiny_backend, batch_size=4, utility=UtilitySpec(kind="mean_logprob"))
    masks, values = await engine.evaluate(snap, policy, all_rows(snap.n_players))
    assert engine.statistics().executed == 2**snap.n_players
    direct = direct_token_logprobs(tiny_backend, engine, snap, policy)
    for row, value in zip(masks, values, strict=True):
        assert value == pytest.approx(direct[row.tobytes()].mean(), abs=1e-4)


def subspan_direct(backend, engine, snap, policy, lo: int, hi: int) -> dict[bytes, float]:
    """A fresh evaluation whose target is the sub-span's tokens: the answer before them joins the prompt."""
    target = engine.target_tokens(snap).ids
    out = {}
    for row in all_rows(snap.n_players):
        prompt = tuple(engine.renderer.coalition_prompt(snap, policy, row)) + target[:lo]
        [res] = backend.score([ScoreRequest(prompt_ids=prompt, target_ids=target[lo:hi])])
        out[row.tobytes()] = res.utility
    return out


@pytest.mark.parametrize("spec", [UtilitySpec(substring="1889"), UtilitySpec(span=(8, 21))], ids=["substring", "cutting-span"])
def test_subspan_replay_equals_a_fresh_run_on_the_subspan_tokens(full_run, tiny_backend, spec: UtilitySpec) -> None:
    run_dir, snap, policy, _, engine, _ = full_run
    target = engine.target_tokens(snap)
    resolved = spec.resolve(snap.target, target.offsets)
    lo, hi = resolved.tokens
    assert 0 < lo < hi < len(target.ids)  # a proper sub-span: tokens before and after it
    fresh = subspan_direct(tiny_backend, engine, snap, policy, lo, hi)
    # replay: no model, only the archive's per-token scores
    rows = read_rows(run_dir)
    measurements: dict = {}
    fill_measurements(measurements, rows)
    masks, values, missing = pool_from_store(
        ResultStore(), snap, policy, engine.model, all_rows(snap.n_players), utility=resolved, measurements=measurements
    )
    assert missing == 0 and len(values) == 2**snap.n_players
    for row, value in zip(masks, values, strict=True):
        assert value == pytest.approx(fresh[row.tobytes()], abs=1e-4)
    # and so are the Shapley values of the sub-span game
    fresh_values = ExactShapley().fit(masks, np.array([fresh[r.tobytes()] for r in masks])).values
    np.testing.assert_allclose(ExactShapley().fit(masks, values).values, fresh_values, atol=1e-4)


@pytest.mark.anyio
async def test_subspan_explain_over_the_archive_needs_no_model_call(full_run, tiny_backend) -> None:
    run_dir, snap, policy, whole, _, _ = full_run
    archive = RunArchive.open(run_dir, {"utility": {"kind": "span"}}, new_run=True)
    engine = Engine(tiny_backend, archive=archive, utility=UtilitySpec(substring="1889"))
    explanation = await engine.explain(snap, ExactShapley(), policy)
    engine.close()
    assert explanation.n_evaluations == 0
    assert explanation.utility_detail["span_text"] == " 1889"
    assert explanation.utility_detail["span_cuts_token"] is True
    assert any("inside a token" in n for n in explanation.notes)
    doc = explanation.to_dict()
    assert doc["value_unit"] == "nats" and doc["utility"] == "logprob"
    # the sub-span's values differ from the whole answer's (the span is a part of it)
    assert not np.allclose(explanation.values, whole.values)


# -- regenerate-and-compare ------------------------------------------------------------------


def rows_by_mask(run_dir, n_players: int) -> dict[bytes, dict]:
    out = {}
    for r in read_rows(run_dir).to_pylist():
        row = np.unpackbits(np.frombuffer(r["mask"], dtype=np.uint8), bitorder="little")[:n_players].astype(bool)
        out.setdefault(row.tobytes(), []).append(r)
    return out


@pytest.mark.anyio
async def test_greedy_regeneration_archives_texts_and_scores_their_similarity(tmp_path, tiny_backend) -> None:
    import torch

    from coalescence.similarity import get_similarity
    from coalescence.utility import GenerationConfig

    snap = snapshot()
    policy = DropPolicy()
    gen = GenerationConfig(max_new_tokens=6)
    archive = RunArchive.create(tmp_path / "run", {"utility": "token_f1"})
    engine = Engine(tiny_backend, archive=archive, batch_size=4, utility=UtilitySpec(kind="token_f1", generation=gen))
    coalitions = all_rows(snap.n_players)[::3]
    masks, values = await engine.evaluate(snap, policy, coalitions)
    engine.close()
    by_mask = rows_by_mask(tmp_path / "run", snap.n_players)
    f1 = get_similarity("token_f1")
    for row, value in zip(masks, values, strict=True):
        [record] = by_mask[row.tobytes()]
        [text] = record["generated_texts"]
        # greedy equals the model's own generate on this coalition's prompt
        prompt = torch.tensor([engine.renderer.coalition_prompt(snap, policy, row)])
        own = tiny_backend.model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=6,
            pad_token_id=tiny_backend.pad_token_id,
        )[0, prompt.shape[1]:]
        assert text == tiny_backend.tokenizer.decode(own, skip_special_tokens=True).strip()
        assert value == float(f1([text], snap.target)[0])
        assert record["token_logprobs"] is None and record["evaluation_key"] is not None


@pytest.mark.anyio
async def test_sampled_texts_do_not_depend_on_batch_mates(tiny_backend) -> None:
    from coalescence.utility import GenerationConfig

    snap = snapshot()
    policy = DropPolicy()
    spec = UtilitySpec(kind="exact_match", generation=GenerationConfig(temperature=1.5, num_samples=3, max_new_tokens=12, seed=11))
    rows = all_rows(snap.n_players)
    target = rows[5]

    async def texts(coalitions, batch_size, seed_spec=spec):
        engine = Engine(tiny_backend, batch_size=batch_size, utility=seed_spec)
        await engine.evaluate(snap, policy, coalitions)
        mask = PackedMask.from_bools(target)
        return engine.measurements[engine.evaluation_key(snap, policy, mask)]

    alone = await texts([target], 1)
    with_neighbours = await texts([rows[1], target, rows[9], rows[12]], 4)
    assert alone == with_neighbours
    assert len(alone) == 3 and len(set(alone)) == 3  # different sample indices, different texts
    other_seed = await texts([target], 1, UtilitySpec(kind="exact_match", generation=GenerationConfig(temperature=1.5, num_samples=3, max_new_tokens=12, seed=12)))
    assert other_seed != alone


@pytest.mark.anyio
async def test_another_similarity_replays_from_archived_texts(tmp_path, tiny_backend) -> None:
    from coalescence.similarity import get_similarity
    from coalescence.utility import GenerationConfig

    snap = snapshot()
    policy = DropPolicy()
    gen = GenerationConfig(temperature=1.0, num_samples=2, max_new_tokens=8, seed=3)
    coalitions = all_rows(snap.n_players)[:6]
    archive = RunArchive.create(tmp_path / "run", {"utility": "exact_match"})
    first = Engine(tiny_backend, archive=archive, utility=UtilitySpec(kind="exact_match", generation=gen))
    await first.evaluate(snap, policy, coalitions)
    first.close()
    archive = RunArchive.open(tmp_path / "run", {"utility": "rouge_l"}, new_run=True)
    second = Engine(tiny_backend, archive=archive, utility=UtilitySpec(kind="rouge_l", generation=gen))
    masks, values = await second.evaluate(snap, policy, coalitions)
    second.close()
    assert second.statistics().executed == 0 and second.statistics().cache_hits == len(coalitions)
    rouge = get_similarity("rouge_l")
    for row, value in zip(masks, values, strict=True):
        texts = second.measurements[second.evaluation_key(snap, policy, PackedMask.from_bools(row))]
        assert value == pytest.approx(float(np.mean(rouge(list(texts), snap.target))), abs=1e-12)
