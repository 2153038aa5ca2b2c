"""The faithfulness measures against independent references: the LDS and its interval against
scipy's Spearman correlation and percentile bootstrap, the removal drops against a game whose v(S)
is known in closed form."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import bootstrap, spearmanr

from coalescence.attribution.faithfulness import linear_datamodeling_score, random_removals, removal_drops, removal_rows


def test_the_lds_interval_is_scipys_percentile_bootstrap():
    """Our seeded percentile bootstrap against scipy.stats.bootstrap's (paired, percentile method):
    different draws, so the ends agree to the resampling noise of 2,000 resamples."""
    rng = np.random.default_rng(7)
    masks = rng.random((32, 8)) < 0.5
    phi = rng.normal(size=8)
    v = masks @ phi + rng.normal(scale=1.5, size=32)
    ours = linear_datamodeling_score(phi, masks, v, seed=3)
    x = masks.astype(float) @ phi
    assert ours.estimate == pytest.approx(spearmanr(x, v).statistic, abs=1e-12)
    ref = bootstrap((x, v), lambda a, b: spearmanr(a, b).statistic, paired=True, vectorized=False, method="percentile",
                    n_resamples=2000, confidence_level=0.95, rng=np.random.default_rng(0)).confidence_interval  # fmt: skip
    assert ours.low == pytest.approx(ref.low, abs=0.05) and ours.high == pytest.approx(ref.high, abs=0.05)
    assert ours.low < ours.estimate < ours.high


def test_removal_drops_of_an_additive_game_are_its_weights():
    """v(S) = the sum of w over S: removing T drops v by exactly the sum of w over T, so the top-k
    drop is the sum of the k largest weights (ties: the lower index first) and the random one the
    mean over its draws."""
    w = np.array([0.5, 3.0, -1.0, 2.0, 2.0, 0.25])
    labels = [f"p{i}" for i in range(6)]
    value_of = {np.packbits(r).tobytes(): float(w @ r) for r in removal_rows(w, draws=5, seed=4)}
    drops = removal_drops(w, labels, value_of, draws=5, seed=4)
    assert [d.removed for d in drops] == [("p1",), ("p1", "p3", "p4"), ("p1", "p3", "p4", "p0", "p5")]
    for d, top in zip(drops, (3.0, 7.0, 7.75), strict=True):
        assert d.top == pytest.approx(top, abs=1e-12)
        removed = ~random_removals(6, d.k, 5, 4)
        assert (removed.sum(axis=1) == d.k).all()
        mean = np.mean([w[r].sum() for r in removed])
        assert d.random.estimate == pytest.approx(mean, abs=1e-12)
        assert d.difference.estimate == pytest.approx(top - mean, abs=1e-12)
        assert d.difference.low == pytest.approx(top - d.random.high, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_held_out_coalitions_are_none_of_the_plans_own(seed):
    """The held-out coalitions of seed s are fresh against every sampling plan of seed s (a LASSO
    run's keep-half plan, banzhaf's, KernelSHAP's): on 20 players (2^20 coalitions) 32 independent
    draws meet a plan of 128 by chance with probability ~0.004, and the plans' own stream gave them
    all (numpy's SeedSequence pads [s, 0] to s)."""
    from coalescence.attribution.estimators import make_estimator
    from coalescence.attribution.faithfulness import held_out_coalitions

    n = 20
    held = {row.tobytes() for row in held_out_coalitions(n, 32, seed).masks}
    assert len(held) == 32
    for method in ("lasso", "banzhaf", "kernelshap"):
        plan = {np.asarray(row, dtype=bool).tobytes() for row in make_estimator(method, budget=128, seed=seed).plan(n)}
        assert not held & plan, method


def test_held_out_coalitions_skip_the_excluded_and_repeats_in_stream_order():
    """The stated rule by hand: the stream's rows in order, each kept unless excluded or seen."""
    from coalescence.attribution.faithfulness import held_out_coalitions

    rows = np.random.default_rng([3, 0x68656C64]).random((500, 5)) < 0.5
    exclude = {tuple(r) for r in rows[:6]}  # the first draws are a plan's: each must be skipped
    kept, seen, plan, repeat = [], set(), 0, 0
    for r in rows:
        if tuple(r) in exclude:
            plan += 1
        elif tuple(r) in seen:
            repeat += 1
        else:
            seen.add(tuple(r))
            kept.append(r)
            if len(kept) == 12:
                break
    held = held_out_coalitions(5, 12, 3, exclude={np.packbits(np.array(r)).tobytes() for r in exclude})
    assert held.masks.tolist() == np.array(kept).tolist()
    assert (held.skipped_plan, held.skipped_repeat, held.available, held.capped) == (plan, repeat, 32 - len(exclude), False)
    assert plan >= 6


def test_held_out_coalitions_are_capped_at_what_exists_in_bounded_memory():
    """100,000 asked of a 5-player game: its 32 coalitions minus the excluded, each once, by integer
    mask; the draw and the LDS on 5,000 coalitions stay within tens of MB (before: 12.9 GB at 100,000)."""
    import tracemalloc

    from coalescence.attribution.faithfulness import held_out_coalitions

    exclude = {np.packbits(np.array([i >> k & 1 for k in range(5)], dtype=bool)).tobytes() for i in (0, 31, 7)}
    tracemalloc.start()
    try:
        held = held_out_coalitions(5, 100_000, 0, exclude=exclude)
        by_hand = [[bool(i >> k & 1) for k in range(5)] for i in range(32) if i not in (0, 31, 7)]
        assert held.masks.tolist() == by_hand and held.capped and held.coalitions == 29
        tracemalloc.reset_peak()
        big = held_out_coalitions(40, 5_000, 1)
        assert len({r.tobytes() for r in big.masks}) == 5_000
        phi = np.linspace(-1, 1, 40)
        v = big.masks @ phi + np.random.default_rng(0).normal(size=5_000)
        tracemalloc.reset_peak()
        lds = linear_datamodeling_score(phi, big.masks, v, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50e6, peak  # one bootstrap chunk: 52 resamples x 5,000; all 2,000 at once held over 300 MB
    assert lds.low < lds.estimate < lds.high
