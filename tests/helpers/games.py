"""Games as tables over all 2^n coalitions (row r is the coalition of the set bits of r), for the
estimator tests' brute-force references."""

from __future__ import annotations

import itertools
import math

import numpy as np

def all_masks(n: int) -> np.ndarray:
    """``[2^n, n]`` bool; row r is the coalition of the set bits of r."""
    return ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(bool)


def third_order_table(n: int, seed: int, amplitude: float = 1.0) -> np.ndarray:
    """Additive weights plus n unanimity games on random triples (interactions of order 3),
    each of weight ``amplitude`` x a standard normal."""
    rng = np.random.default_rng(seed)
    z = all_masks(n).astype(np.float64)
    table = z @ rng.normal(size=n)
    for _ in range(n):
        triple = rng.choice(n, 3, replace=False)
        table += amplitude * rng.normal() * z[:, triple].prod(axis=1)
    return table


def brute_force_shapley(game, n: int) -> np.ndarray:
    """phi_i = sum_S |S|! (n-|S|-1)! / n! (v(S+i) - v(S)), every S, written out."""
    phi = np.zeros(n)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for r in range(n):
            for subset in itertools.combinations(others, r):
                with_i = np.zeros(n, bool)
                with_i[list(subset)] = True
                without = with_i.copy()
                with_i[i] = True
                weight = math.factorial(r) * math.factorial(n - r - 1) / math.factorial(n)
                phi[i] += weight * (game(with_i)[0] - game(without)[0])
    return phi
