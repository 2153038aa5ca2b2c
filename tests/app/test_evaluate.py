"""``coalescence evaluate``: an explanation's LDS and top-k removal drops on fresh exact coalitions,
checked against an independent computation on an analytic game (the fake backend's, whose v(S) is
known in closed form), and the held-out coalitions archived (a second evaluation makes no model
call; a replay of the run's method fits the same values after them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from coalescence.app.explain import explain_run
from coalescence.app.fit import fit_archive
from coalescence.app.settings import RunSettings
from coalescence.backends.testing import FakeBackend

import coalescence

SENTENCES = (
    "The Eiffel Tower was completed in 1889.",
    "Big Ben's clock tower in London was finished in 1859.",
    "The Colosseum in Rome was opened in the year 80.",
    "I am planning a weekend in Lisbon.",
    "Order the grilled sardines.",
    "When was the tower completed?",
)
WORDS = ("Eiffel", "Ben", "Colosseum", "Lisbon", "sardines", "When")
"""One word only each sentence holds: the game sees a player as present when its word is in the prompt."""
WEIGHTS = (3.0, 0.5, 2.0, 1.0, 0.25, 1.5)
PAIR = -2.5
"""v(S) = -12 + sum of WEIGHTS over S + PAIR when players 0 and 1 are both present: a quadratic game."""


def v(present: np.ndarray) -> float:
    """The game's value of a coalition, by its definition (nats)."""
    return -12.0 + sum(w for w, here in zip(WEIGHTS, present, strict=True) if here) + (PAIR if present[0] and present[1] else 0.0)


def make_backend(tokenizer) -> FakeBackend:
    def game(prompt_ids: tuple[int, ...], target_ids: tuple[int, ...]) -> list[float]:
        text = tokenizer.decode(prompt_ids)
        present = np.array([w in text for w in WORDS])
        return [v(present) / len(target_ids)] * len(target_ids)

    return FakeBackend(tokenizer, game=game)


@pytest.fixture(scope="module")
def game_run(tmp_path_factory, chatml_tokenizer):
    """A kernelshap run of the quadratic game (budget 20, below the 64 coalitions): its archive and
    ``--out`` document, with the backend it used."""
    where = tmp_path_factory.mktemp("evaluate")
    backend = make_backend(chatml_tokenizer)
    source = {"messages": [{"role": "user", "content": " ".join(SENTENCES)}, {"role": "assistant", "content": "In 1889."}]}
    settings = RunSettings(model="fake", unit="sentence", method="kernelshap", budget=20, archive=where / "run", out=where / "run.json")
    result = explain_run(source, settings, backend=backend)
    assert [p.text for p in result.explanations[0].snapshot.players] == list(SENTENCES)
    return where, backend


def archived(run_dir: Path, n: int) -> set[tuple[bool, ...]]:
    """The coalitions the archive holds as exact-game rows, read with plain pyarrow (little-endian
    mask bits; ``game`` null or ``exact``: a proxy row is never a fit's v(S))."""
    import pyarrow.dataset as ds

    table = ds.dataset(run_dir / "parts", format="parquet").to_table(columns=["mask", "game"])
    masks = [m for m, g in zip(table["mask"].to_pylist(), table["game"].to_pylist(), strict=True) if g in (None, "exact")]
    return {tuple(bool(b) for b in np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little")[:n]) for m in masks}


def held_by_rule(n: int, count: int, seed: int, plans: set[tuple[bool, ...]]) -> tuple[np.ndarray, int, int]:
    """The held-out coalitions by the stated rule, by hand: the rows of numpy's
    ``default_rng([seed, b"held" as an int]).random((rows, n)) < 0.5`` in order (a stream apart from
    the plans', ``default_rng(seed)``), each kept unless a plan holds it or an earlier row gave it,
    until ``count`` are kept. Returns them, the rows skipped as a plan's and as repeats."""
    rows = np.random.default_rng([seed, 0x68656C64]).random((10_000, n)) < 0.5
    kept: list[np.ndarray] = []
    seen: set[tuple[bool, ...]] = set()
    in_plan = repeats = 0
    for row in rows:
        t = tuple(bool(b) for b in row)
        if t in plans:
            in_plan += 1
        elif t in seen:
            repeats += 1
        else:
            seen.add(t)
            kept.append(row)
            if len(kept) == count:
                return np.array(kept), in_plan, repeats
    raise AssertionError("the reference ran out of rows")


def copy_run(where: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(where / "run", tmp_path / "run")
    return tmp_path / "run"


def test_lds_and_drops_match_an_independent_computation(game_run, chatml_tokenizer, tmp_path):
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    # the document with values set by hand: the additive part of the game, which misses the pair term
    doc = json.loads((where / "run.json").read_text())
    phi = [3.0, 0.5, 2.0, 1.0, 0.25, 1.5]
    for p, value in zip(doc["players"], phi, strict=True):
        p["value"] = value
    doc["archive"] = str(run_dir)
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    backend = make_backend(chatml_tokenizer)
    plan = archived(run_dir, 6)  # the kernelshap run's 20-row plan
    evaluation = coalescence.evaluate(tmp_path / "doc.json", coalitions=32, seed=5, backend=backend, random_draws=6)
    (r,) = evaluation.results
    held, in_plan, repeats = held_by_rule(6, 32, 5, plan)
    assert (r.coalitions, r.skipped_plan, r.skipped_repeat, r.plan_coalitions) == (32, in_plan, repeats, len(plan))
    rho = spearmanr(held.astype(float) @ np.array(phi), [v(s) for s in held]).statistic
    assert 0.5 < rho < 0.999  # the pair term makes the additive values imperfect
    assert r.lds.estimate == pytest.approx(rho, abs=1e-6)
    assert r.lds.low <= r.lds.estimate <= r.lds.high
    assert r.v_full == pytest.approx(-12.0 + sum(WEIGHTS) + PAIR, abs=1e-5)
    full = np.ones(6, dtype=bool)
    top = {1: [0], 3: [0, 2, 5], 5: [0, 2, 5, 3, 1]}  # players by decreasing phi
    assert [d.k for d in r.drops] == [1, 3, 5]
    for d in r.drops:
        without = full.copy()
        without[top[d.k]] = False
        assert d.top == pytest.approx(v(full) - v(without), abs=1e-5)
        assert d.removed == tuple(doc["players"][i]["label"] for i in top[d.k])
        rng = np.random.default_rng([5, 1, d.k])
        drops = []
        for _ in range(6):
            row = full.copy()
            row[rng.choice(6, size=d.k, replace=False)] = False
            drops.append(v(full) - v(row))
        assert d.random.estimate == pytest.approx(np.mean(drops), abs=1e-5)
        assert d.difference.estimate == pytest.approx(d.top - np.mean(drops), abs=1e-5)
        assert min(drops) <= d.random.low <= d.random.estimate <= d.random.high <= max(drops)
    assert d.top == pytest.approx(3.0 + 2.0 + 1.5 + 1.0 + 0.5 - 2.5, abs=1e-5)  # k = 5 by hand: every player but 4
    # the held-out coalitions were evaluated with the fake model (those the 20-row plan lacked)
    assert evaluation.model_evaluations == sum(backend.calls) > 0


def test_second_evaluation_is_served_from_the_archive_and_replay_is_unchanged(game_run, chatml_tokenizer, tmp_path):
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    before = fit_archive(run_dir)["explanations"][0]["players"]
    backend = make_backend(chatml_tokenizer)
    first = coalescence.evaluate(run_dir, backend=backend, seed=1)
    assert first.model_evaluations == sum(backend.calls) > 0
    after = fit_archive(run_dir)["explanations"][0]["players"]
    assert [p["value"] for p in after] == [p["value"] for p in before]  # the replay fits its own plan only
    # again, with no backend at all: every coalition is in the archive, no model is loaded
    second = coalescence.evaluate(run_dir, seed=1)
    assert second.model_evaluations == 0
    assert second.from_archive == first.model_evaluations + first.from_archive
    assert second.to_dict()["results"] == first.to_dict()["results"]
    # the archive holds the run's plan and the evaluation's rows, each coalition once
    assert coalescence.read_rows(run_dir).num_rows == len(set(coalescence.read_rows(run_dir)["coalition_key"].to_pylist()))


def test_strict_json_of_the_exact_shapley_values(game_run, chatml_tokenizer, tmp_path):
    """The game's exact Shapley values (by hand: each weight, the pair term split between players 0
    and 1) as a document: the JSON written is strict (no NaN) and equals the returned evaluation."""
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    doc = json.loads((where / "run.json").read_text())
    shapley = [3.0 + PAIR / 2, 0.5 + PAIR / 2, 2.0, 1.0, 0.25, 1.5]
    for p, value in zip(doc["players"], shapley, strict=True):
        p["value"] = value
    doc["archive"] = None
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    backend = make_backend(chatml_tokenizer)
    evaluation = coalescence.evaluate(tmp_path / "doc.json", archive=run_dir, backend=backend, out=tmp_path / "e.json")
    payload = json.loads((tmp_path / "e.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert payload == json.loads(json.dumps(evaluation.to_dict()))
    (r,) = evaluation.results
    held, _, _ = held_by_rule(6, 32, 0, archived(where / "run", 6))
    rho = spearmanr(held.astype(float) @ np.array(shapley), [v(s) for s in held]).statistic
    assert r.lds.estimate == pytest.approx(rho, abs=1e-6)
    assert payload["results"][0]["lds"]["estimate"] == pytest.approx(rho, abs=1e-6)


def test_document_with_no_archive_recreates_its_game_in_a_new_one(game_run, chatml_tokenizer, tmp_path):
    """A document that names no archive, given a new --archive: the game is re-created from the
    document (same snapshot, model, policy, utility), and its values agree with the run's archive."""
    where, _ = game_run
    doc = json.loads((where / "run.json").read_text())
    doc["archive"] = None
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    with pytest.raises(coalescence.ConfigError, match="names no run archive") as refused:
        coalescence.evaluate(tmp_path / "doc.json")
    assert refused.value.field == "archive"
    backend = make_backend(chatml_tokenizer)
    fresh = coalescence.evaluate(tmp_path / "doc.json", archive=tmp_path / "new", backend=backend, seed=2)
    assert fresh.model_evaluations == sum(backend.calls) > 0
    manifest = coalescence.read_manifest(tmp_path / "new")
    assert manifest["runs"][0]["snapshot_ids"] == [doc["snapshot_id"]]
    assert manifest["runs"][0]["run_config"]["command"] == "evaluate" and "method" not in manifest["runs"][0]["run_config"]
    (r,) = fresh.results
    held, _, repeats = held_by_rule(6, 32, 2, set())  # a new archive holds no plan: only repeats are skipped
    assert (r.plan_coalitions, r.skipped_plan, r.skipped_repeat) == (0, 0, repeats)
    # the document names no budget or seed: the held-out draw cannot avoid kernelshap's 20, and it says so
    assert [n for n in r.notes if "names no plan of kernelshap" in n] and "names no plan" in fresh.format()
    phi = [p["value"] for p in doc["players"]]
    rho = spearmanr(held.astype(float) @ np.array(phi), [v(s) for s in held]).statistic
    assert r.lds.estimate == pytest.approx(rho, abs=1e-6)
    again = coalescence.evaluate(tmp_path / "doc.json", archive=tmp_path / "new", seed=2)
    assert again.model_evaluations == 0 and again.to_dict()["results"] == fresh.to_dict()["results"]


def test_held_out_coalitions_are_none_of_any_plan_the_archive_holds(game_run, chatml_tokenizer, tmp_path):
    """The draw skips every coalition the archive holds as a plan's row: the kernelshap run's 20 and
    a lasso plan resumed into the same archive. Before, the first rows of the stream were taken as
    they came, plan coalitions and repeats included (on 6 players two small plans hold half the game)."""
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    source = {"messages": [{"role": "user", "content": " ".join(SENTENCES)}, {"role": "assistant", "content": "In 1889."}]}
    explain_run(source, RunSettings(model="fake", unit="sentence", method="lasso", budget=12, archive=run_dir), backend=make_backend(chatml_tokenizer))
    plans = archived(run_dir, 6)
    assert len(plans) > 20  # both plans: the lasso's and the kernelshap run's
    first = np.random.default_rng([0, 0x68656C64]).random((32, 6)) < 0.5
    assert {tuple(bool(b) for b in row) for row in first} & plans  # what the old draw took as held out
    backend = make_backend(chatml_tokenizer)
    evaluation = coalescence.evaluate(run_dir, method="kernelshap", budget=20, coalitions=16, backend=backend)
    (r,) = evaluation.results
    held, in_plan, repeats = held_by_rule(6, 16, 0, plans)
    assert not {tuple(bool(b) for b in row) for row in held} & plans
    assert (r.coalitions, r.asked, r.plan_coalitions, r.skipped_plan, r.skipped_repeat) == (16, 16, len(plans), in_plan, repeats)
    assert in_plan > 0 and not r.capped
    phi = [p["value"] for p in fit_archive(run_dir, methods=["kernelshap"], budget=20)["explanations"][0]["players"]]
    rho = spearmanr(held.astype(float) @ np.array(phi), [v(s) for s in held]).statistic
    assert r.lds.estimate == pytest.approx(rho, abs=1e-6)
    text = evaluation.format()
    assert f"held out: 16 distinct coalitions drawn fresh, none of the {len(plans)} coalitions in the archive's plans; " in text
    assert f"skipped {in_plan} draw{'s' if in_plan != 1 else ''} a plan held and {repeats} repeat" in text
    held_dict = evaluation.to_dict()["results"][0]["held_out"]
    assert held_dict == {"asked": 16, "fresh": 16, "capped": False, "plan_coalitions": len(plans), "skipped_in_plans": in_plan, "skipped_repeats": repeats}
    # evaluate's own rows are no plan's: the same command again draws the same coalitions, from the archive
    again = coalescence.evaluate(run_dir, method="kernelshap", budget=20, coalitions=16)
    assert again.model_evaluations == 0 and again.to_dict()["results"] == evaluation.to_dict()["results"]


def test_more_coalitions_than_exist_are_capped_at_those_outside_the_plans(game_run, chatml_tokenizer, tmp_path):
    """4,096 (the most) asked of a 6-player game whose archive holds a 20-row plan: every one of the other
    coalitions (64 minus the plan's), each once, with a note; not 4,096 rows of repeats."""
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    plans = archived(run_dir, 6)
    evaluation = coalescence.evaluate(run_dir, coalitions=4096, backend=make_backend(chatml_tokenizer))
    (r,) = evaluation.results
    assert r.coalitions == 64 - len(plans) and r.asked == 4096 and r.capped
    every = {tuple(bool(int(c)) for c in f"{i:06b}") for i in range(64)}
    # the archive now holds the plan, the held-out coalitions (all the others) and the removals
    assert archived(run_dir, 6) == every
    assert f"held out: capped at the {64 - len(plans)} coalitions of the game outside the {len(plans)} coalitions in the archive's plans (4096 asked, 64 in all)" in evaluation.format()
    assert evaluation.to_dict()["results"][0]["held_out"]["capped"] is True


def test_another_models_archive_is_refused_and_nothing_is_written(game_run, tmp_path):
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    doc = json.loads((where / "run.json").read_text())
    doc["model_id"], doc["archive"] = "another-model", str(run_dir)
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    before = sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*") if p.is_file())
    with pytest.raises(coalescence.InputError, match="the explanation's model another-model .* is not the archive's model fake") as refused:
        coalescence.evaluate(tmp_path / "doc.json", out=tmp_path / "e.json")
    assert refused.value.field == "archive"
    assert sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*") if p.is_file()) == before
    assert not (tmp_path / "e.json").exists()


def test_a_damaged_part_is_skipped_under_skip_corrupt_as_replay_does(game_run, chatml_tokenizer, tmp_path):
    """An archive whose evaluate part fails verification: refused, naming --skip-corrupt; with it, the
    part is left out, its coalitions evaluated again and the part quarantined."""
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    first = coalescence.evaluate(run_dir, backend=make_backend(chatml_tokenizer))
    parts = sorted((run_dir / "parts").rglob("*.parquet"))
    assert len(parts) == 2  # the plan's, evaluate's
    data = bytearray(parts[-1].read_bytes())
    data[len(data) // 3] ^= 0x04
    parts[-1].write_bytes(bytes(data))
    with pytest.raises(coalescence.ArchiveError, match="--skip-corrupt"):
        coalescence.evaluate(run_dir, backend=make_backend(chatml_tokenizer))
    backend = make_backend(chatml_tokenizer)
    again = coalescence.evaluate(run_dir, backend=backend, skip_corrupt=True)
    assert again.model_evaluations == sum(backend.calls) == first.model_evaluations
    assert again.to_dict()["results"] == first.to_dict()["results"]
    assert [q["part"] for q in coalescence.read_manifest(run_dir)["quarantine"]] == [parts[-1].name]


def test_a_two_fidelity_method_fitted_on_exact_rows_alone_says_so(game_run, chatml_tokenizer, tmp_path):
    """proxy-shapley on a run that played no proxy game is its exact rows' fit: the result says so,
    as explain does ("exact rows only: ..."); the run's own kernelshap has no such note."""
    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    evaluation = coalescence.evaluate(run_dir, method="proxy-shapley,kernelshap", budget=20, backend=make_backend(chatml_tokenizer))
    proxy, kernel = evaluation.results
    assert proxy.notes == ("exact rows only: the run played no proxy game, so the archive holds no proxy rows",)
    assert kernel.notes == ()
    assert "  note: exact rows only: the run played no proxy game" in evaluation.format()
    assert evaluation.to_dict()["results"][0]["notes"] == list(proxy.notes)


def test_a_plan_evaluated_after_an_evaluation_is_still_held_apart(game_run, chatml_tokenizer, tmp_path):
    """A lasso plan resumed into the archive after an evaluation finds the coalitions it shares with
    the held-out ones there, under evaluate's rows; evaluating that lasso run holds its own plan out
    all the same (regenerated from the run's method, budget and seed)."""
    from coalescence.attribution.estimators import make_estimator

    where, _ = game_run
    run_dir = copy_run(where, tmp_path)
    first = coalescence.evaluate(run_dir, coalitions=16, backend=make_backend(chatml_tokenizer))
    source = {"messages": [{"role": "user", "content": " ".join(SENTENCES)}, {"role": "assistant", "content": "In 1889."}]}
    explain_run(source, RunSettings(model="fake", unit="sentence", method="lasso", budget=24, archive=run_dir), backend=make_backend(chatml_tokenizer))
    lasso = {tuple(bool(b) for b in row) for row in make_estimator("lasso", budget=24, seed=0).plan(6)}
    assert first.results[0].coalitions == 16
    evaluation = coalescence.evaluate(run_dir, method="lasso", budget=24, coalitions=10, backend=make_backend(chatml_tokenizer))
    (r,) = evaluation.results
    assert lasso & (archived(run_dir, 6) - archived_plans(run_dir, 6))  # coalitions of its plan under evaluate's rows
    held, _, _ = held_by_rule(6, 10, 0, lasso | archived_plans(run_dir, 6))
    assert not {tuple(bool(b) for b in row) for row in held} & lasso
    phi = [p["value"] for p in fit_archive(run_dir, methods=["lasso"], budget=24)["explanations"][0]["players"]]
    rho = spearmanr(held.astype(float) @ np.array(phi), [v(s) for s in held]).statistic
    assert r.coalitions == 10 and r.lds.estimate == pytest.approx(rho, abs=1e-6)


def archived_plans(run_dir: Path, n: int) -> set[tuple[bool, ...]]:
    """The exact rows of the archive that evaluate did not write (their run_id is not evaluate:...)."""
    import pyarrow.dataset as ds

    table = ds.dataset(run_dir / "parts", format="parquet").to_table(columns=["mask", "game", "run_id"]).to_pydict()
    return {
        tuple(bool(b) for b in np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little")[:n])
        for m, g, r in zip(table["mask"], table["game"], table["run_id"], strict=True)
        if g in (None, "exact") and not str(r).startswith("evaluate:")
    }
