"""Interaction indices: the names of the Shapley interaction indices the estimators compute, and
which of them are efficient. Core constants, with no optional library behind them (the exact
estimator checks its ``--index`` here; the shapiq methods compute the sampled ones)."""

from __future__ import annotations

__all__ = ("EFFICIENT_INDICES", "INTERACTION_INDICES")

INTERACTION_INDICES: tuple[str, ...] = ("SII", "k-SII", "FSII", "STII")
"""The interaction indices ``--index`` takes: the Shapley interaction index (Grabisch & Roubens
1999), its k-additive aggregation k-SII (Bordt & von Luxburg 2023), Faith-Shap FSII (Tsai, Yeh &
Ravikumar 2023) and the Shapley-Taylor index STII (Sundararajan, Dhamdhere & Agarwal 2020)."""

EFFICIENT_INDICES: frozenset[str] = frozenset({"k-SII", "FSII", "STII"})
"""The indices whose terms of every order up to k sum to v(N) - v(empty); with them an estimate's
``values`` are order-1 terms and its efficiency gap counts the interactions too."""
