"""Games as tables over all 2^n coalitions (row r is the coalition of the set bits of r), for the
estimator tests' brute-force references."""

from __future__ import annotations

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
