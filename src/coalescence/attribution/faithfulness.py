"""How faithful are attributions to their game? Two measures on fresh exact coalitions, with
percentile-bootstrap intervals (numerics only: the game's values are given, by the coalition).

- **LDS**, the linear datamodeling score (Park et al., 2023, TRAK; Cohen-Wang et al., 2024,
  ContextCite): Spearman's rank correlation, over distinct random keep-half coalitions S (each
  player present with probability 1/2, independently; none of them in the plans the explanation
  could have been fitted on: :func:`held_out_coalitions`), of the additive
  prediction ``sum_{i in S} phi_i`` against the game's value ``v(S)``, with a percentile-bootstrap
  95% interval (the coalitions resampled with replacement): :func:`linear_datamodeling_score`.
- **Top-k removal drops**, k = 1, 3, 5 (those below the player count: :data:`DROP_KS`):
  ``v(N) - v(N \\ T_k)`` with ``T_k`` the k players of largest value (ties: the lower player
  index), against the same drop for k players drawn at random (the mean over ``draws`` draws, with
  a percentile-bootstrap 95% interval of the mean), and their difference (top minus random: how
  much more the top players matter than chance picks): :func:`removal_drops`, over the coalitions
  of :func:`removal_rows`.

Every coalition and resample is deterministic given the seed (``numpy.random.default_rng`` of
``[seed, stream, ...]``, one stream per use), so that the held-out coalitions of a game depend only
on its player count, their number, the seed and the coalitions excluded. No stream is 0:
``SeedSequence`` pads its entropy with zeros, so ``[seed, 0]`` is the stream of ``seed`` alone,
the one the estimators' plans draw from (:func:`~.estimators.banzhaf.uniform_plan`): held out that
way, the coalitions of a LASSO run's plan would come back as its "fresh" ones. A stream apart makes a meeting rare, not
impossible (on 6 players a 20-row plan holds a third of the 64 coalitions): the plans' coalitions
are excluded from the draw by name (``exclude``), which makes them disjoint by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = (
    "CONFIDENCE",
    "DROP_KS",
    "HELD_OUT_STREAM",
    "MAX_COALITIONS",
    "MIN_COALITIONS",
    "RESAMPLES",
    "Drop",
    "HeldOut",
    "Interval",
    "held_out_coalitions",
    "linear_datamodeling_score",
    "random_removals",
    "removal_drops",
    "removal_rows",
)

DROP_KS = (1, 3, 5)
"""The k of the top-k removal drops (those below the player count are reported)."""

RESAMPLES = 2000
"""Bootstrap resamples of every interval."""

CONFIDENCE = 0.95
"""The intervals' coverage (percentile bootstrap)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A statistic with its percentile-bootstrap interval (``None`` where undefined: ``low``/``high``
    of fewer than two distinct resampled values, or a statistic of constant data)."""

    estimate: float | None
    low: float | None
    high: float | None

    def to_dict(self) -> dict[str, float | None]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high}

    def format(self, spec: str = "+.3f") -> str:
        if self.estimate is None:
            return "n/a"
        if self.low is None or self.high is None:
            return f"{self.estimate:{spec}}"
        return f"{self.estimate:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop:
    """The top-k removal drop against k random players (module docs); values in the game's unit.

    Attributes:
        k: players removed.
        removed: the labels of the k players of largest value, in value order.
        top: ``v(N) - v(N without them)`` in the utility's unit.
        random: the mean drop over random k-subsets, with its interval.
        difference: ``top - random``, its interval ``top`` minus the random mean's.
    """

    k: int
    removed: tuple[str, ...]
    top: float
    random: Interval
    difference: Interval

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "removed": list(self.removed), "top": _finite(self.top), "random": self.random.to_dict(), "difference": self.difference.to_dict()}


HELD_OUT_STREAM = 0x68656C64
"""The held-out coalitions' random stream (``b"held"``; module docs: never 0)."""

MIN_COALITIONS = 10
"""The fewest held-out coalitions an LDS is computed over. Below it the interval means nothing: a
bootstrap resample of m coalitions holds at most two distinct ones with probability about
``C(m, 2) (2/m)^m`` (0.10 at m = 5, 4e-4 at m = 8, 5e-6 at m = 10), and on two points Spearman's
correlation is +1 or -1, so a small m fills the 2.5% tails with such resamples (2 coalitions gave
``+1.000 [+1.000, +1.000]``); and at m = 10 a correlation must pass 0.65 to differ from 0 at the
5% level (Spearman's critical value), so fewer rank too little to tell anything apart."""

MAX_COALITIONS = 4096
"""The most held-out coalitions an evaluation asks for: each is an exact model evaluation (a long
context's costs seconds), and the LDS interval narrows as ``1/sqrt(m)``: about +-0.03 at 4,096 for a
correlation near 0.8 (Fisher's z: +-1.96 (1 - rho^2) / sqrt(m)). More is refused, not capped
silently (10**8 on a 21-player game started 2 million model evaluations)."""

_CHUNK_CELLS = 1 << 20
"""Booleans (rows x players) drawn or enumerated at once: memory stays bounded whatever the number
of coalitions asked."""

_BOOTSTRAP_CELLS = 1 << 18
"""Bootstrap cells (resamples x coalitions) drawn and ranked at once (ranking holds several
float64 copies of them): all :data:`RESAMPLES` at once up to 131 coalitions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldOut:
    """The held-out coalitions of a game (:func:`held_out_coalitions`).

    Attributes:
        masks: ``[coalitions, n_players]`` bool, distinct, none in ``exclude``.
        asked: coalitions asked for.
        available: coalitions of the game outside ``exclude`` (``2^n_players - len(exclude)``).
        skipped_plan: draws of the stream skipped because ``exclude`` (the plans) held them.
        skipped_repeat: draws skipped because an earlier draw gave the same coalition.
    """

    masks: np.ndarray  # [coalitions, n_players] bool
    asked: int
    available: int
    skipped_plan: int
    skipped_repeat: int

    @property
    def coalitions(self) -> int:
        """The held-out coalitions: ``min(asked, available)``."""
        return int(self.masks.shape[0])

    @property
    def capped(self) -> bool:
        """Whether fewer than asked exist outside the plans (every one of them is then taken)."""
        return self.coalitions < self.asked


def held_out_coalitions(n_players: int, count: int, seed: int, *, exclude: Set[bytes] = frozenset()) -> HeldOut:
    """``count`` distinct keep-half coalitions, none of them in ``exclude`` (the plans' coalitions).

    The rule: row j of the stream is ``numpy.random.default_rng([seed, HELD_OUT_STREAM]).random((j + 1,
    n_players))[j] < 0.5`` (each player present with probability 1/2, independently, on a stream apart
    from every plan's); rows are read in order and a row is skipped when ``exclude`` holds it or an
    earlier row gave it, until ``count`` are kept. Where no more than ``count`` coalitions of the game
    lie outside ``exclude`` (``available <= count``), every one of them is taken, in the order of its
    integer mask (bit i = player i), and the result is capped at them. The stream is read in chunks
    of at most :data:`_CHUNK_CELLS` booleans (doubles are drawn one 64-bit word each, so chunking does
    not change the rows) and the enumeration too, so memory is bounded by ``count`` rows.

    Args:
        n_players: players of the game (>= 1).
        count: coalitions asked for (>= 1).
        seed: the seed.
        exclude: coalitions to leave out, each as ``np.packbits(row).tobytes()`` of an
            ``[n_players]`` bool row.

    Returns:
        A :class:`HeldOut` of ``min(count, available)`` coalitions.

    Raises:
        ValueError: ``n_players`` or ``count`` below 1.
    """
    if n_players < 1 or count < 1:
        raise ValueError(f"need n_players >= 1 and count >= 1, got {n_players} and {count}")
    excluded = {k for k in exclude if len(k) == (n_players + 7) // 8}
    available = 2**n_players - len(excluded)
    if available <= count:
        return HeldOut(masks=_every_coalition_but(n_players, excluded), asked=count, available=available, skipped_plan=0, skipped_repeat=0)
    rng = np.random.default_rng([seed, HELD_OUT_STREAM])
    masks = np.empty((count, n_players), dtype=bool)
    seen: set[bytes] = set()
    kept = plan = repeat = 0
    chunk = max(1, _CHUNK_CELLS // n_players)
    while kept < count:
        rows = rng.random((min(chunk, 2 * (count - kept) + 16), n_players)) < 0.5
        for row, key in zip(rows, (bytes(k) for k in np.packbits(rows, axis=1)), strict=True):
            if key in excluded:
                plan += 1
            elif key in seen:
                repeat += 1
            else:
                seen.add(key)
                masks[kept] = row
                kept += 1
                if kept == count:
                    break
    return HeldOut(masks=masks, asked=count, available=available, skipped_plan=plan, skipped_repeat=repeat)


def _every_coalition_but(n_players: int, excluded: Set[bytes]) -> np.ndarray:
    """``[available, n_players]`` bool: every coalition not in ``excluded``, by increasing integer mask
    (called only where their number is at most the count asked, so bounded by it)."""
    bits = np.arange(n_players, dtype=np.uint64)
    chunk = max(1, _CHUNK_CELLS // n_players)
    out = []
    for start in range(0, 2**n_players, chunk):
        ints = np.arange(start, min(start + chunk, 2**n_players), dtype=np.uint64)
        rows = ((ints[:, None] >> bits) & np.uint64(1)).astype(bool)
        keep = [bytes(k) not in excluded for k in np.packbits(rows, axis=1)]
        out.append(rows[np.array(keep, dtype=bool)])
    return np.concatenate(out) if out else np.zeros((0, n_players), dtype=bool)


def random_removals(n_players: int, k: int, draws: int, seed: int) -> np.ndarray:
    """``[draws, n_players]`` bool: every player present but ``k`` drawn uniformly without
    replacement, per draw (``numpy.random.default_rng([seed, 1, k])``)."""
    rng = np.random.default_rng([seed, 1, k])
    rows = np.ones((draws, n_players), dtype=bool)
    for row in rows:
        row[rng.choice(n_players, size=k, replace=False)] = False
    return rows


def _ranks(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x, axis=-1)


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's correlation of each row pair (ties averaged); NaN for a constant row."""
    rx, ry = _ranks(x), _ranks(y)
    rx = rx - rx.mean(axis=-1, keepdims=True)
    ry = ry - ry.mean(axis=-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(axis=-1) * (ry * ry).sum(axis=-1))
    num = (rx * ry).sum(axis=-1)
    out = np.full(num.shape, np.nan)
    ok = den > 0
    out[ok] = num[ok] / den[ok]
    return out


def _percentile(samples: np.ndarray) -> tuple[float | None, float | None]:
    finite = samples[np.isfinite(samples)]
    if finite.size < 2:
        return None, None
    a = (1 - CONFIDENCE) / 2
    low, high = np.quantile(finite, [a, 1 - a])
    return float(low), float(high)


def linear_datamodeling_score(values: Sequence[float], masks: np.ndarray, utilities: Sequence[float], *, seed: int = 0) -> Interval:
    """The LDS: Spearman's rank correlation of ``masks @ values`` against ``utilities``, with a
    percentile-bootstrap interval over the coalitions (:data:`RESAMPLES` resamples,
    ``numpy.random.default_rng([seed, 2])``, drawn and ranked in chunks of at most
    :data:`_BOOTSTRAP_CELLS` cells: one chunk up to 131 coalitions).

    Args:
        values: ``[n_players]`` attributions (phi).
        masks: ``[m, n_players]`` bool coalitions.
        utilities: ``[m]`` their values v(S).

    Returns:
        The score (``None`` when either side is constant) and its interval.
    """
    phi = np.asarray(values, dtype=np.float64)
    x = np.asarray(masks, dtype=bool).astype(np.float64) @ phi
    y = np.asarray(utilities, dtype=np.float64)
    estimate = float(_spearman_rows(x[None], y[None])[0])
    if not math.isfinite(estimate):
        return Interval(estimate=None, low=None, high=None)
    rng = np.random.default_rng([seed, 2])
    m = len(y)
    per = max(1, _BOOTSTRAP_CELLS // m)  # resamples ranked at once: memory bounded whatever m
    samples = []
    for start in range(0, RESAMPLES, per):
        idx = rng.integers(0, m, size=(min(per, RESAMPLES - start), m))
        samples.append(_spearman_rows(x[idx], y[idx]))
    low, high = _percentile(np.concatenate(samples))
    return Interval(estimate=estimate, low=low, high=high)


def removal_drops(
    values: Sequence[float],
    labels: Sequence[str],
    value_of: Mapping[bytes, float],
    *,
    draws: int,
    seed: int,
) -> tuple[Drop, ...]:
    """The top-k removal drops against k random players, for each k of :data:`DROP_KS` below the
    player count (module docs).

    Args:
        values: ``[n_players]`` attributions (an unknown one, ``NaN``, ranks last).
        labels: the players' labels.
        value_of: v(S) by the coalition's ``np.packbits`` bytes, for every row of :func:`removal_rows`.
        draws, seed: as :func:`random_removals`.
    """
    n = len(values)
    full = value_of[np.packbits(np.ones(n, dtype=bool)).tobytes()]
    order = _top_order(values)
    out = []
    for k in (k for k in DROP_KS if k < n):
        top_row = np.ones(n, dtype=bool)
        top_row[order[:k]] = False
        top = full - value_of[np.packbits(top_row).tobytes()]
        random = np.array([full - value_of[np.packbits(r).tobytes()] for r in random_removals(n, k, draws, seed)])
        mean = float(random.mean())
        rng = np.random.default_rng([seed, 3, k])
        per = max(1, _BOOTSTRAP_CELLS // draws)  # resamples at once: memory bounded whatever draws
        means = np.concatenate(
            [random[rng.integers(0, draws, size=(min(per, RESAMPLES - start), draws))].mean(axis=1) for start in range(0, RESAMPLES, per)]
        )
        low, high = _percentile(means)
        out.append(
            Drop(
                k=k,
                removed=tuple(labels[i] for i in order[:k]),
                top=float(top),
                random=Interval(estimate=mean, low=low, high=high),
                difference=Interval(
                    estimate=float(top) - mean,
                    low=None if high is None else float(top) - high,
                    high=None if low is None else float(top) - low,
                ),
            )
        )
    return tuple(out)


def removal_rows(values: Sequence[float], *, draws: int, seed: int) -> list[np.ndarray]:
    """The coalitions :func:`removal_drops` needs: the full one, each top-k removal and the random ones."""
    n = len(values)
    order = _top_order(values)
    rows = [np.ones(n, dtype=bool)]
    for k in (k for k in DROP_KS if k < n):
        row = np.ones(n, dtype=bool)
        row[order[:k]] = False
        rows.append(row)
        rows.extend(random_removals(n, k, draws, seed))
    return rows


def _top_order(values: Sequence[float]) -> list[int]:
    """Player indices by decreasing value (ties: lower index first; unknown values last)."""
    v = [float(x) if x is not None and math.isfinite(float(x)) else -math.inf for x in values]
    return sorted(range(len(v)), key=lambda i: (-v[i], i))


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
