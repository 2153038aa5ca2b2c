"""Harsanyi-dividend games with closed-form Shapley values, and a correlated proxy of one (the
two-fidelity estimators' tests and the proxy-guided plan's, tests/benchmarks/test_guided.py).

``v(S) = v0 + sum_T d_T [T subset of S]`` over singletons, pairs and triples; each dividend split
equally among its members is the Shapley value (``phi_i = sum_{T containing i} d_T / |T|``; Harsanyi
1963), written here, never by the package. The proxy ``C`` is the game of other dividends plus a
smooth nonlinear term (correlated, biased: its own Shapley values are not v's); ``NOISE`` is
independent noise (useless).
"""

from __future__ import annotations

import itertools

import numpy as np

N = 8


def every_coalition(n: int) -> np.ndarray:
    """``[2^n, n]`` bool, row k has player i iff bit i of k (written here, not the package's)."""
    return np.array([[(k >> i) & 1 for i in range(n)] for k in range(1 << n)], dtype=bool)


def dividend_game(n: int, seed: int, scale: float = 1.0):
    """``(dividends, v0)``: dividends on every singleton, 6 pairs and 3 triples."""
    rng = np.random.default_rng(seed)
    terms = {(i,): float(rng.normal(0.0, 1.0)) for i in range(n)}
    pairs = list(itertools.combinations(range(n), 2))
    for k in rng.choice(len(pairs), size=6, replace=False):
        terms[pairs[k]] = float(rng.normal(0.0, 1.5 * scale))
    triples = list(itertools.combinations(range(n), 3))
    for k in rng.choice(len(triples), size=3, replace=False):
        terms[triples[k]] = float(rng.normal(0.0, 2.0 * scale))
    return terms, float(rng.normal())


def play(terms: dict, v0: float, masks: np.ndarray) -> np.ndarray:
    out = np.full(masks.shape[0], v0)
    for players, d in terms.items():
        out += d * masks[:, list(players)].all(axis=1)
    return out


def shapley_of(terms: dict, n: int) -> np.ndarray:
    """Closed form: each dividend split equally among its players."""
    phi = np.zeros(n)
    for players, d in terms.items():
        phi[list(players)] += d / len(players)
    return phi


MASKS = every_coalition(N)
TERMS, V0 = dividend_game(N, seed=7)
V = play(TERMS, V0, MASKS)
PHI = shapley_of(TERMS, N)
# the proxy: OTHER, the dividends moved (0.25 sd) and scaled, plus a smooth nonlinear term of the coalition
_rng = np.random.default_rng(11)
OTHER = {t: 0.8 * d + float(_rng.normal(0.0, 0.25)) for t, d in TERMS.items()}
THETA = _rng.normal(0.0, 0.4, size=N)
C = play(OTHER, 0.3, MASKS) + 0.6 * np.sin(MASKS @ THETA)
NOISE = np.random.default_rng(12).normal(0.0, float(V.std()), size=V.shape[0])
