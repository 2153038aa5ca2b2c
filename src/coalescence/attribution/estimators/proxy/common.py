"""What both two-fidelity estimators share: the proxy plan's seed and budget, the pools' checks,
the proxy's correlation with the exact game (:mod:`.` for the mathematics)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....errors import ConfigError, EstimatorError
from ..base import check_pool, gather, pool_lookup

__all__ = (
    "PROXY_BUDGET_MULTIPLE", "PROXY_PER_PLAYER", "TwoFidelityPools", "default_proxy_budget", "proxy_budget_notes", "proxy_correlation",
    "proxy_pools", "proxy_seed", "two_fidelity_pools",
)

PROXY_BUDGET_MULTIPLE = 16
"""Default proxy budget: at least this many proxy coalitions per exact one, and at least
:data:`PROXY_PER_PLAYER` per player, capped at 2^n (``benchmarks/RESULTS.md``, "Two-fidelity
estimators": the control-variate LASSO's LDS on the long games grows with the proxy coalitions up to
about 1,024 for 67-73 players, whatever the exact budget; proxy-shapley's error on 10-12 players is
the same from 4 per exact coalition on). A proxy row computes about 1/100 of an exact row's tokens
on those games (19 tail tokens against 1,943) and takes about 1/30 of its time on the CPU (its
queries read the whole shared KV, rotated to the row's positions: 64 ms against ~2 s)."""

PROXY_PER_PLAYER = 4
"""Default proxy budget's floor per player (see :data:`PROXY_BUDGET_MULTIPLE`), measured with the
compacted proxy game (``benchmarks/RESULTS.md``, "The race at 8 exact coalitions"): at 8 exact
coalitions the surrogate's median LDS on the long games (67-73 players) is flat from about 256
proxy coalitions on (0.79-0.81 / 0.91-0.93 / 0.92-0.93 at 256-1,024 over draws of the recorded
pools: what is left is the proxy game's own bias, which more proxy rows do not remove), while a proxy
row of ~2,000 shared tokens costs about 1/30 of an exact one on the CPU (16 per player, the first
game's default, was 1,136 rows: twice the exact rows' time)."""

def proxy_seed(seed: int) -> int:
    """The seed of a proxy plan, derived from the exact plan's: a pure function of ``seed``,
    independent of it as a random stream (``numpy.random.SeedSequence([seed, 0x70726F78])``), so
    the proxy's coalitions are independent of the exact ones.

    Returns:
        An int in ``[0, 2**32)``.
    """
    return int(np.random.SeedSequence([int(seed), 0x70726F78]).generate_state(1, dtype=np.uint32)[0])


def default_proxy_budget(budget: int, n_players: int) -> int:
    """``max(PROXY_BUDGET_MULTIPLE * budget, PROXY_PER_PLAYER * n)``, capped at 2^n: the proxy
    coalitions planned when none are given.

    Args:
        budget: the exact game's budget (distinct coalitions).
        n_players: number of players n >= 1.
    """
    k = max(PROXY_BUDGET_MULTIPLE * budget, PROXY_PER_PLAYER * n_players)
    return min(k, 1 << n_players) if n_players < 62 else k


def _proxy_budget(budget: int, proxy_budget: int | None, n_players: int) -> int:
    """``proxy_budget`` or :func:`default_proxy_budget`, capped at 2^n."""
    if proxy_budget is None:
        return default_proxy_budget(budget, n_players)
    k = proxy_budget
    return min(k, 1 << n_players) if n_players < 62 else k


def proxy_budget_notes(proxy_budget: int | None, n_players: int) -> tuple[str, ...]:
    """A note where a given ``proxy_budget`` is above the game's 2^n coalitions (it is capped
    there: every coalition is played once), else ``()``.

    Args:
        proxy_budget: the proxy budget asked for, or None (the default, capped by its rule).
        n_players: number of players n >= 1.
    """
    if proxy_budget is None or n_players >= 62 or proxy_budget <= (1 << n_players):
        return ()
    return (
        f"the proxy budget {proxy_budget} is above the {1 << n_players} coalitions of {n_players} players: "
        f"the proxy game was played on at most those {1 << n_players}",
    )


def _check_proxy_budget(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"must be a positive integer or None (a multiple of the budget), got {value!r}", field="proxy_budget")


def proxy_correlation(u: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """Pearson and Spearman correlations of the exact utilities ``u`` and the proxy's ``c`` over
    the same coalitions (``[m]`` float64 each); NaN when either is constant or m < 3."""
    from scipy.stats import spearmanr

    if u.shape[0] < 3 or np.ptp(u) == 0 or np.ptp(c) == 0:
        return math.nan, math.nan
    return float(np.corrcoef(u, c)[0, 1]), float(spearmanr(u, c).statistic)


def _exact_and_proxy(
    name: str, keys: tuple[bytes, ...], masks: np.ndarray, utilities: np.ndarray,
    proxy_masks: np.ndarray, proxy_utilities: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The exact utilities and the proxy's on the planned coalitions ``keys`` (``[m]`` each)."""
    u = gather(pool_lookup(masks, utilities), keys, name)
    try:
        c = gather(pool_lookup(proxy_masks, proxy_utilities), keys, f"{name} (the proxy game on its exact coalitions)")
    except EstimatorError as exc:
        raise EstimatorError(
            f"{exc}; the proxy game must be evaluated on the exact plan's coalitions too (the control variate needs c(S) there)"
        ) from None
    return u, c



def proxy_pools(
    estimator: Any, masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Both pools checked (:func:`.base.check_pool`), the estimator's ``validate(n, proxy=True)``
    run (the proxy game is played), and the player counts compared.

    Returns:
        ``(masks, utilities, proxy_masks, proxy_utilities, n_players)``, the arrays as
        :func:`.base.check_pool` returns them.

    Raises:
        EstimatorError: the pools have different player counts, or as ``validate``.
        ConfigError: as ``validate``.
        MaskError: a pool's masks are not 2-D bool.
    """
    masks, utilities = check_pool(masks, utilities)
    proxy_masks, proxy_utilities = check_pool(proxy_masks, proxy_utilities)
    n = masks.shape[1]
    estimator.validate(n, proxy=True)
    if proxy_masks.shape[1] != n:
        raise EstimatorError(f"the proxy pool has {proxy_masks.shape[1]} players, the exact pool {n}; pass pools of one game")
    return masks, utilities, proxy_masks, proxy_utilities, n


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoFidelityPools:
    """What every two-fidelity fit starts from (:func:`two_fidelity_pools`).

    Attributes:
        masks: ``[m_pool, n]`` bool and ``utilities`` ``[m_pool]`` float64: the exact pool, checked.
        proxy_masks: ``[k, n]`` bool and ``proxy_utilities`` ``[k]`` float64: the proxy pool, checked
            (and transformed, where the fit asked: e.g. to logits).
        n: number of players.
        plan: the estimator's exact plan of ``n`` players (its ``keys`` and ``rows``).
        u: ``[m]`` float64 the exact utilities on ``plan.keys``, in plan order.
        c: ``[m]`` float64 the proxy's utilities on the same coalitions.
        pearson, spearman: the correlations of ``u`` and ``c`` (:func:`proxy_correlation`).
    """

    masks: np.ndarray
    utilities: np.ndarray
    proxy_masks: np.ndarray
    proxy_utilities: np.ndarray
    n: int
    plan: Any
    u: np.ndarray  # [m] float64
    c: np.ndarray  # [m] float64
    pearson: float
    spearman: float

    def diagnostics(self, proxy_evaluations: int) -> dict[str, float]:
        """The diagnostics every two-fidelity estimate reports: ``proxy_pearson``, ``proxy_spearman``,
        ``proxy_evaluations`` (the proxy plan's distinct coalitions) and ``exact_evaluations``."""
        return {
            "proxy_pearson": self.pearson, "proxy_spearman": self.spearman,
            "proxy_evaluations": float(proxy_evaluations), "exact_evaluations": float(len(self.plan.keys)),
        }


def two_fidelity_pools(
    estimator: Any,
    masks: np.ndarray,
    utilities: np.ndarray,
    proxy_masks: np.ndarray,
    proxy_utilities: np.ndarray,
    *,
    make_plan: Callable[[int], Any],
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> TwoFidelityPools:
    """The shared start of a two-fidelity fit: both pools checked and the estimator validated
    (:func:`proxy_pools`), its exact plan made (``make_plan(n)``), both games gathered on the plan's
    coalitions, ``transform`` applied to them and to the proxy pool's utilities where given, and
    their correlation measured.

    Raises:
        EstimatorError: a pool misses planned coalitions (which pool, with the count), or as
            :func:`proxy_pools`.
        ConfigError, MaskError: as :func:`proxy_pools`.
    """
    masks, utilities, proxy_masks, proxy_utilities, n = proxy_pools(estimator, masks, utilities, proxy_masks, proxy_utilities)
    plan = make_plan(n)
    u, c = _exact_and_proxy(estimator.name, plan.keys, masks, utilities, proxy_masks, proxy_utilities)
    if transform is not None:
        u, c, proxy_utilities = transform(u), transform(c), transform(proxy_utilities)
    pearson, spearman = proxy_correlation(u, c)
    return TwoFidelityPools(
        masks=masks, utilities=utilities, proxy_masks=proxy_masks, proxy_utilities=proxy_utilities, n=n, plan=plan,
        u=u, c=c, pearson=pearson, spearman=spearman,
    )
