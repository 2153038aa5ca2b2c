"""The engine's two fidelities: proxy rows keyed, scored, archived and resumed apart from exact ones.

The fake backend's proxy game is a presence game applied to the prompt as the tail sees it (the
full prompt less the hidden ranges). Weighting only token ids that one player alone brings makes
the value of a row a function of which players' tokens the tail sees, so the test's reference
for a proxy row is the same presence game on the *exact* game's rendering of the coalition (which
holds exactly the present players' tokens): equal only if the hidden ranges cover exactly the
absent players' tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from helpers.models import build_model
from helpers.presence import own_id_weights
from helpers.snapshots import snapshot_of

from coalescence.archive import RunArchive, read_rows
from coalescence.attribution.estimators import ExactShapley, LeaveOneOut
from coalescence.attribution.estimators.base import Capabilities
from coalescence.backends.hf import HFBackend
from coalescence.backends.testing import FakeBackend, presence_game
from coalescence.engine import Engine, ProxyGame
from coalescence.masking.codec import PackedMask
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy
from coalescence.scheduler.buckets import LengthBuckets
from coalescence.snapshot import ConversationSnapshot

GAME = "kv-proxy-compact:after-last-player"


def snapshot() -> ConversationSnapshot:
    return snapshot_of(
        "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859.\n\n- The Colosseum in Rome was opened in the year 80.",
        "When was the tower completed?",
    )


def own_token_weights(tokenizer, snap, scale: float) -> dict[int, float]:
    """Weights on the word tokens (two letters or more: a one-letter token of this tiny BPE moves with
    its neighbours) that exactly one player brings into the prompt (whitespace
    between players, which the exact game collapses and the proxy leaves in place, weighs nothing)."""
    probe = Engine(FakeBackend(tokenizer), batch_size=4)
    full = set(probe.target_tokens(snap, DropPolicy()).full_prompt_ids)
    n = snap.n_players
    brings = []
    for i in range(n):
        without = np.ones(n, dtype=bool)
        without[i] = False
        brings.append(full - set(probe.renderer.coalition_prompt(snap, DropPolicy(), without)))
    weights = own_id_weights(brings, scale=scale, keep=lambda t: sum(ch.isalnum() for ch in tokenizer.decode([t])) >= 2)
    assert len({i for i, ids in enumerate(brings) if ids & set(weights)}) == n  # every player weighs
    return weights


def planned(n: int) -> list[np.ndarray]:
    """The test estimator's exact plan: every coalition but one (player 0 alone: a plan of every
    coalition leaves a control variate nothing to do, and the engine plays no proxy game there)."""
    rows = [np.array([(k >> i) & 1 for i in range(n)], dtype=bool) for k in range(1 << n)]
    return [r for k, r in enumerate(rows) if k != 1]


@dataclass(frozen=True)
class Recording:
    """A two-fidelity estimator for the test: leave-one-out values of the exact pool (every
    coalition but one), recording the pools."""

    proxy_rows: tuple[tuple[bool, ...], ...]
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=False, reports_stderr=False, two_fidelity=True)
    name: ClassVar[str] = "recording"
    seen: list = None  # type: ignore[assignment]

    def validate(self, n_players: int, *, proxy: bool = False) -> None:
        ExactShapley().validate(n_players)

    def plan(self, n_players: int):
        return iter(planned(n_players))

    def proxy_plan(self, n_players: int):
        return (np.array(r, dtype=bool) for r in self.proxy_rows)

    def fit(self, masks, utilities):
        self.seen.append(("exact-only", masks, utilities))
        return LeaveOneOut().fit(masks, utilities)

    def fit_two_fidelity(self, masks, utilities, proxy_masks, proxy_utilities):
        self.seen.append(("two", masks, utilities, proxy_masks, proxy_utilities))
        return LeaveOneOut().fit(masks, utilities)


@pytest.mark.anyio
async def test_proxy_rows_are_their_own_game_in_keys_archive_and_resume(chatml_tokenizer, tmp_path, anyio_backend):
    snap = snapshot()
    n = snap.n_players
    exact_w = own_token_weights(chatml_tokenizer, snap, 1.0)
    proxy_w = {t: w * (1.0 + 0.5 * (t % 3)) for t, w in exact_w.items()}  # correlated, not proportional
    exact_game, proxy_game = presence_game(exact_w, base=-0.5), presence_game(proxy_w, base=-0.25)
    backend = FakeBackend(chatml_tokenizer, game=exact_game, proxy_game=proxy_game)
    extra = tuple(tuple(bool((k >> i) & 1) for i in range(n)) for k in (3, 5, 6))  # also in the exact plan
    est = Recording(proxy_rows=extra, seen=[])
    archive = RunArchive.create(tmp_path / "run", {"test": True}, flush_rows=7)
    engine = Engine(backend, archive=archive, batch_size=4, proxy_game=ProxyGame(tail="after-last-player"))
    explanation = await engine.explain(snap, est, DropPolicy())
    engine.close()

    kind, masks, utilities, pmasks, putils = est.seen[-1]
    assert kind == "two"
    m = 2**n - 1  # the plan's coalitions: every one but player 0 alone
    assert masks.shape == (m, n)
    # the proxy game is played on every exact coalition too (the control variate needs c(S) there)
    assert {tuple(r) for r in pmasks} == {tuple(r) for r in masks} | set(extra)
    target = engine.target_tokens(snap, DropPolicy()).ids
    for row, c in zip(pmasks, putils, strict=True):
        rendered = tuple(engine.renderer.coalition_prompt(snap, DropPolicy(), row))
        assert c == pytest.approx(sum(proxy_game(rendered, target)), abs=1e-5)
    for row, v in zip(masks, utilities, strict=True):
        rendered = tuple(engine.renderer.coalition_prompt(snap, DropPolicy(), row))
        assert v == pytest.approx(sum(exact_game(rendered, target)), abs=1e-5)
    # the values are the exact game's (leave-one-out: v(N) - v(N without i), by the rule)
    v_of = {tuple(r): v for r, v in zip(masks, utilities, strict=True)}
    full = v_of[(True,) * n]
    loo = [full - v_of[tuple(j != i for j in range(n))] for i in range(n)]
    np.testing.assert_allclose(explanation.values, loo, atol=1e-9)
    assert explanation.n_evaluations == m  # exact evaluations; proxy rows are counted apart
    proxy = explanation.proxy
    assert proxy["game"] == GAME and proxy["coalitions"] == m == proxy["evaluations"] == proxy["shared"]
    v, c = utilities, np.array([dict(zip(map(tuple, pmasks), putils, strict=True))[tuple(r)] for r in masks])
    assert proxy["pearson"] == pytest.approx(np.corrcoef(v, c)[0, 1], abs=1e-9)
    assert explanation.to_dict()["proxy"]["game"] == GAME

    rows = read_rows(tmp_path / "run")
    games = rows["game"].to_pylist()
    assert games.count("exact") == m and games.count(GAME) == m
    keys = rows["coalition_key"].to_pylist()
    assert len(set(keys)) == len(keys)  # a proxy row never shares a key with an exact one
    # proxy rows compute their tail only and reuse the shared prefix
    reused = [r for r, g in zip(rows["tokens_reused"].to_pylist(), games, strict=True) if g == GAME]
    assert min(reused) > 0

    from coalescence.archive.reader import archive_info, format_archive_info

    info = archive_info(tmp_path / "run")
    assert info["games"] == {"exact": m, GAME: m}
    assert f"games           {m} exact, {m} {GAME}" in format_archive_info(info)

    # resume: both fidelities come back from the archive with no model call
    calls = len(backend.calls)
    again = Engine(backend, archive=RunArchive.open(tmp_path / "run", {"test": True}), batch_size=4, proxy_game=ProxyGame(tail="after-last-player"))
    resumed = await again.explain(snap, Recording(proxy_rows=extra, seen=est.seen), DropPolicy())
    again.close()
    assert len(backend.calls) == calls and resumed.n_evaluations == 0 and resumed.proxy["evaluations"] == 0
    np.testing.assert_allclose(est.seen[-1][4], putils)


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["no-capability", "placeholder", "off"])
async def test_no_proxy_game_where_it_is_not_defined_says_why(chatml_tokenizer, tmp_path, case, anyio_backend):
    snap = snapshot()
    backend = FakeBackend(chatml_tokenizer, supports_proxy=case != "no-capability")
    policy = PlaceholderPolicy() if case == "placeholder" else DropPolicy()
    est = Recording(proxy_rows=(), seen=[])
    archive = RunArchive.create(tmp_path / "run", {"test": True})
    engine = Engine(backend, archive=archive, proxy_game=None if case == "off" else ProxyGame(tail="after-last-player"))
    explanation = await engine.explain(snap, est, policy)
    engine.close()
    assert est.seen[-1][0] == "exact-only" and explanation.proxy is None
    assert set(read_rows(tmp_path / "run")["game"].to_pylist()) == {"exact"}
    notes = [n for n in explanation.notes if n.startswith("exact rows only")]
    expected = {
        "no-capability": "FakeBackend cannot score the shared-KV proxy game",
        "placeholder": "drop policy only",
        "off": None,
    }[case]
    if expected is None:
        assert notes == []  # not asked for: nothing to explain
    else:
        assert len(notes) == 1 and expected in notes[0]


LONG = (
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It was designed by the "
    "engineering company of Gustave Eiffel. Big Ben, the great bell of the clock at Westminster, "
    "was finished in 1859. The Colosseum in Rome was opened in the year 80 under the emperor Titus. "
    "The Statue of Liberty was dedicated in New York harbour in 1886. The Sydney Opera House was "
    "opened by the Queen in 1973."
)


@pytest.mark.anyio
@pytest.mark.parametrize("plays", [True, False], ids=["proxy", "no-proxy"])
async def test_the_surrogate_runs_on_8_exact_coalitions_only_where_the_proxy_game_is_played(chatml_tokenizer, plays, anyio_backend):
    """``lasso`` at 8 exact coalitions: with the proxy game played it runs (8 exact rows, its
    proxy rows apart); where the backend cannot play it, refused before any model call, saying
    why and what the floor is without it."""
    from coalescence.attribution.estimators.proxy import ControlVariateLasso
    from coalescence.errors import ConfigError

    snap = snapshot_of(LONG, "When was the tower completed?")
    assert snap.n_players == 8  # 2^8 coalitions: the exact-only floor is 16
    backend = FakeBackend(chatml_tokenizer, supports_proxy=plays)
    engine = Engine(backend, batch_size=8, proxy_game=ProxyGame(tail="after-last-player"))
    est = ControlVariateLasso(budget=8, seed=0, holdout=0.0, proxy_budget=40)
    if plays:
        explanation = await engine.explain(snap, est, DropPolicy())
        assert explanation.n_evaluations == 8 and explanation.proxy["game"] == GAME
        assert explanation.proxy["coalitions"] >= 40 and explanation.estimate.diagnostics["proxy_used"] == 1.0
    else:
        with pytest.raises(ConfigError) as caught:
            await engine.explain(snap, est, DropPolicy())
        message = caught.value.message
        assert caught.value.field == "budget" and "minimum of 16" in message and "8 where the proxy game is played" in message
        assert "FakeBackend cannot score the shared-KV proxy game" in message
        assert backend.calls == []
    engine.close()


def test_proxy_and_exact_keys_differ_and_exact_keys_are_unchanged(chatml_tokenizer):
    from coalescence.engine import key_for
    from coalescence.masking.codec import PackedMask

    snap = snapshot()
    engine = Engine(FakeBackend(chatml_tokenizer), proxy_game=ProxyGame(tail="after-last-player"))
    policy = DropPolicy()
    for bits in itertools.product([False, True], repeat=snap.n_players):
        mask = PackedMask.from_bools(np.array(bits))
        exact = engine.key(snap, policy, mask)
        # the exact key is the one every earlier archive holds: the plain key of the utility
        assert exact == key_for(snap, policy, engine.model, mask, utility=engine.resolved_utility(snap, policy).coalition_utility())
        assert engine.key(snap, policy, mask, game=GAME) != exact


class CountingHF(HFBackend):
    """The transformers backend, counting the rows of each proxy call it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proxy_calls: list[int] = []

    def score_proxy(self, requests):
        self.proxy_calls.append(len(requests))
        return super().score_proxy(requests)


@pytest.mark.anyio
async def test_proxy_rows_of_a_long_conversation_go_out_in_few_full_batches(chatml_tokenizer, anyio_backend):
    """Proxy rows are counted by their tails (their shared KV once per call), so a call of a
    conversation near the buckets' top takes a full batch, not the two rows its whole length
    allows; the values are those of the rows scored one by one."""
    snap = snapshot_of(LONG, "When was the tower completed?")
    n = snap.n_players
    buckets = LengthBuckets(ceilings=(16, 64, 512), padded_token_budget=1024, max_tokens=512)
    backend = CountingHF(build_model(chatml_tokenizer, seed=3), chatml_tokenizer, model_id="tiny")
    engine = Engine(backend, batch_size=8, buckets=buckets, proxy_game=ProxyGame(tail="after-last-player"))
    rng = np.random.default_rng(11)
    rows = [np.ones(n, dtype=bool)] + [rng.random(n) < 0.5 for _ in range(47)]
    masks, utilities = await engine.evaluate(snap, DropPolicy(), rows, game=GAME)
    engine.close()

    layout = engine.proxy_layout(snap, DropPolicy())
    requests = [layout.request(r) for r in masks]
    m = len(requests)
    full = requests[0]
    assert 256 < full.n_tokens <= 512 and full.n_tokens == full.shared_tokens + full.tail_tokens + 1
    # hand-computed: whole rows fall in the 512 bucket, 1024 // 512 = 2 rows a call; their tails
    # (at most 16 tokens with the last) in the 16 bucket, (1024 - shared) // 16 > 8: batch_size binds
    assert all(r.n_tokens - r.shared_tokens <= 16 and r.shared_tokens == full.shared_tokens for r in requests)
    assert buckets.max_rows(buckets.bucket(full.n_tokens), 8) == 2
    assert buckets.max_rows(16, 8, shared_tokens=full.shared_tokens) == 8
    calls = backend.proxy_calls
    assert sum(calls) == m and max(calls) == 8
    assert len(calls) <= -(-m // 8) + 1 < -(-m // 2)  # one short first call at most, against m / 2 calls
    alone = [backend.score_proxy([r])[0].utility for r in requests]
    np.testing.assert_allclose(utilities, alone, rtol=0, atol=1e-5)



@pytest.mark.anyio
async def test_no_proxy_rows_where_the_exact_plan_holds_every_coalition(chatml_tokenizer, tmp_path, anyio_backend):
    """A plan of all 2^n coalitions has the exact values: the proxy game is not played (no proxy
    row computed or archived), and the note says why."""

    @dataclass(frozen=True)
    class Covering(Recording):
        def plan(self, n_players: int):
            return ExactShapley().plan(n_players)

    snap = snapshot()
    n = snap.n_players
    backend = FakeBackend(chatml_tokenizer)
    archive = RunArchive.create(tmp_path / "run", {"test": True})
    engine = Engine(backend, archive=archive, batch_size=4, proxy_game=ProxyGame(tail="after-last-player"))
    est = Covering(proxy_rows=((True,) * n,), seen=[])
    explanation = await engine.explain(snap, est, DropPolicy())
    engine.close()
    assert est.seen[-1][0] == "exact-only" and explanation.proxy is None
    assert read_rows(tmp_path / "run")["game"].to_pylist() == ["exact"] * 2**n
    assert any(f"the budget covers all {2**n} coalitions" in note for note in explanation.notes)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("proxy_row_delay", "budget", "limit", "played"),
    [
        (0.02, 16, 3.0, False),  # a proxy row as dear as an exact one: 100 rows = 6.25x the 16 exact rows' time
        (0.0, 16, 3.0, True),  # a proxy row of no cost: played
        (0.02, 16, None, True),  # no limit (a tail rule named explicitly): played whatever it costs
        (0.02, 8, 3.0, True),  # below the exact-only floor (16): played all the same, with a note
    ],
    ids=["dear", "cheap", "no-limit", "below-the-exact-floor"],
)
async def test_the_proxy_game_is_played_only_where_its_measured_cost_pays(
    chatml_tokenizer, tmp_path, proxy_row_delay, budget, limit, played, anyio_backend
):
    """The proxy's rows cost (measured: exact rows sleep 20 ms each, proxy rows ``proxy_row_delay``)
    at most ``limit`` times the exact rows' time, or the rest of its plan is not evaluated and the
    values are the exact rows' fit (docs: engine/two_fidelity.py)."""
    from coalescence.attribution.estimators.proxy import ControlVariateLasso
    from coalescence.engine.two_fidelity import PROBE_ROWS

    snap = snapshot_of(LONG, "When was the tower completed?")
    backend = FakeBackend(chatml_tokenizer, row_delay=0.02, proxy_row_delay=proxy_row_delay)
    archive = RunArchive.create(tmp_path / "run", {"test": True})
    engine = Engine(backend, archive=archive, batch_size=4, proxy_game=ProxyGame(tail="after-last-player", cost_limit=limit))
    est = ControlVariateLasso(budget=budget, seed=0, holdout=0.0, proxy_budget=100)
    explanation = await engine.explain(snap, est, DropPolicy())
    engine.close()
    games = read_rows(tmp_path / "run")["game"].to_pylist()
    m = games.count("exact")
    assert m == explanation.n_evaluations == budget
    if played:
        assert explanation.proxy is not None and explanation.proxy["game"] == GAME
        assert games.count(GAME) == explanation.proxy["coalitions"] >= 100
        said = [n for n in explanation.notes if "the proxy game was played although" in n]
        # dear rows played anyway: below the exact-only floor, or named for the run (no limit)
        assert bool(said) == (proxy_row_delay > 0)
        if said:
            assert ("named for this run" in said[0]) == (limit is None) and ("minimum of 16" in said[0]) == (limit is not None)
    else:
        assert explanation.proxy is None
        # the proxy on the exact coalitions and a probe of its plan, no more
        assert m < games.count(GAME) <= m + PROBE_ROWS
        (note,) = [n for n in explanation.notes if n.startswith("the proxy game was not played")]
        share = float(note.split("a proxy row took ")[1].split(" of")[0])
        assert 0.5 < share < 2.0 and "above the 3x where it pays" in note
        # the values are the exact rows' own fit
        rows = read_rows(tmp_path / "run")
        exact = [i for i, g in enumerate(games) if g == "exact"]
        masks = np.array([PackedMask(rows["mask"][i].as_py(), snap.n_players).to_bools() for i in exact])
        utilities = np.array([rows["utility"][i].as_py() for i in exact])
        np.testing.assert_allclose(explanation.values, est.fit(masks, utilities).values, atol=1e-12)
