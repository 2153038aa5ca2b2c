"""The shared-KV proxy game: its names, where it is refused, and its agreement with the exact game."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError, TemplateRefused
from ..masking.codec import PackedMask

__all__ = ("PROXY_GAME", "proxy_agreement", "proxy_game_name", "proxy_refusal", "validate_exact_only")


PROXY_GAME = "kv-proxy-compact"
"""The shared-KV proxy game's name stem; a game's full name adds its tail rule (:func:`proxy_game_name`).
``compact``: positions compacted as the exact game lays them out (:mod:`coalescence.backends.hf.proxy`);
the first proxy game, at the full conversation's positions, was ``kv-proxy`` (archives holding its
rows are refitted from their exact rows alone, with a note: the two games are not mixed)."""


def proxy_game_name(tail: str) -> str:
    """The name of the proxy game with tail rule ``tail``, as keys and archive rows carry it:
    ``"kv-proxy-compact:<tail>"`` (e.g. ``"kv-proxy-compact:after-last-player"``)."""
    return f"{PROXY_GAME}:{tail}"


def proxy_agreement(
    masks: np.ndarray, utilities: np.ndarray, proxy_masks: np.ndarray, proxy_utilities: np.ndarray
) -> dict[str, Any]:
    """How well the proxy game tracks the exact one on the coalitions scored in both.

    Args:
        masks: ``[m, n]`` bool and ``utilities`` ``[m]`` float64: the exact game's pool.
        proxy_masks: ``[k, n]`` bool and ``proxy_utilities`` ``[k]`` float64: the proxy's pool.

    Returns:
        ``{"shared": count, "pearson": r, "spearman": rho}``: Pearson's and Spearman's correlation
        of v(S) and the proxy c(S) over the shared coalitions (``None`` under three shared
        coalitions or with a constant side: no correlation is defined).
    """
    from scipy.stats import pearsonr, spearmanr

    proxy = {PackedMask.from_bools(row).words: u for row, u in zip(proxy_masks, proxy_utilities, strict=True)}
    pairs = [(float(u), float(proxy[w])) for row, u in zip(masks, utilities, strict=True) if (w := PackedMask.from_bools(row).words) in proxy]
    out: dict[str, Any] = {"shared": len(pairs), "pearson": None, "spearman": None}
    if len(pairs) >= 3:
        v, c = np.array(pairs).T
        if np.ptp(v) > 0 and np.ptp(c) > 0:
            out["pearson"] = float(pearsonr(v, c).statistic)
            out["spearman"] = float(spearmanr(v, c).statistic)
    return out


def proxy_refusal(
    tail: str | None, backend: Any, *, teacher_forced: bool, policy_id: str, lay_out: Callable[[], object] | None
) -> str | None:
    """Why the proxy game with tail rule ``tail`` is not played, as a sentence, or ``None`` when it is.

    The proxy game is played where it is defined and was measured: a backend that scores it
    (``supports_proxy``), a teacher-forced utility (the answer's ids are fixed, so the tail is
    one sequence for every coalition) and the ``drop`` policy (an absent player's tokens are
    simply unseen; a placeholder would have to be written into the shared KV), on a conversation
    that ``lay_out`` (the engine's :meth:`~coalescence.engine.Engine.proxy_layout`) can lay out.

    Args:
        tail: the engine's tail rule (``None``: the proxy game is off).
        backend: the scoring backend (its ``supports_proxy``, and the reason it gives,
            ``proxy_refusal_reason``, where it has one), or None before one is loaded (not asked then).
        teacher_forced: whether the resolved utility scores a fixed answer.
        policy_id: the absence policy's id.
        lay_out: makes the conversation's proxy layout; raises ConfigError, InputError or
            TemplateRefused where it cannot; None before the conversation is rendered (not asked).
    """
    if tail is None:
        return "the proxy game is off (proxy_game none)"
    if backend is not None and not backend.supports_proxy:
        reason = getattr(backend, "proxy_refusal_reason", None)
        return f"backend {type(backend).__name__} cannot score the shared-KV proxy game" + (f": {reason}" if reason else "")
    if not teacher_forced:
        return "the utility generates a new answer per coalition, which the proxy game does not score"
    if policy_id != "drop":
        return f"the proxy game is defined for the drop policy only, not {policy_id}"
    try:
        if lay_out is not None:
            lay_out()
    except (ConfigError, InputError, TemplateRefused) as exc:  # e.g. a player owning the first token
        return f"the proxy game cannot lay out this conversation ({exc})"
    return None


def validate_exact_only(estimator: Any, n_players: int, refused: str) -> None:
    """A two-fidelity ``estimator``'s ``validate(n_players, proxy=False)`` for a run that fits the
    exact rows alone because the proxy game is not played, the reason (``refused``, from
    :func:`proxy_refusal`) added to a refusal.

    Raises:
        ConfigError: the budget is below the exact-only floor (e.g. 8 exact coalitions for the
            surrogate, whose floor is 16 without the proxy game), naming ``refused``.
        EstimatorError: as ``validate``.
    """
    try:
        estimator.validate(n_players, proxy=False)
    except ConfigError as exc:
        raise ConfigError(f"{exc.message} (the proxy game is not played here: {refused})", field=exc.field) from None
