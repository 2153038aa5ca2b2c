"""The shared-KV proxy game as one object (:class:`ProxyGame`: its name, tail rule, layout and where
it is refused), and its agreement with the exact game.

The run's settings build it once from ``--proxy-game`` (:func:`proxy_game_of`), the
:class:`~coalescence.engine.Engine` plays it, and keys and archive rows carry its :attr:`ProxyGame.name`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, InputError, TemplateRefused
from ..masking.codec import PackedMask
from ..masking.proxy import DEFAULT_TAIL, TAIL_RULES, ProxyLayout, proxy_layout
from ..userinput import did_you_mean

if TYPE_CHECKING:
    from ..masking.policies import AbsencePolicy
    from ..masking.render import ChatRenderer, TargetTokens
    from ..snapshot import ConversationSnapshot

__all__ = (
    "PROXY_COST_MULTIPLE",
    "PROXY_GAME",
    "PROXY_OFF",
    "ProxyGame",
    "proxy_agreement",
    "proxy_game_choices",
    "proxy_game_name",
    "proxy_game_of",
    "validate_exact_only",
)


PROXY_GAME = "kv-proxy-compact"
"""The shared-KV proxy game's name stem; a game's full name adds its tail rule (:attr:`ProxyGame.name`).
``compact``: positions compacted as the exact game lays them out (:mod:`coalescence.backends.hf.proxy`);
the first proxy game, at the full conversation's positions, was ``kv-proxy`` (archives holding its
rows are refitted from their exact rows alone, with a note: the two games are not mixed)."""

PROXY_COST_MULTIPLE = 3.0
"""``--proxy-game auto`` plays the proxy game where its rows cost at most this many times the exact
rows' time (:mod:`coalescence.engine.two_fidelity`)."""

PROXY_OFF = "the proxy game is off (proxy_game none)"
"""Why no proxy game is played where none was asked for (``proxy_game none``)."""


def proxy_game_name(tail: str) -> str:
    """The name of the proxy game with tail rule ``tail``, as keys and archive rows carry it:
    ``"kv-proxy-compact:<tail>"`` (e.g. ``"kv-proxy-compact:after-last-player"``)."""
    return f"{PROXY_GAME}:{tail}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyGame:
    """The shared-KV proxy game a two-fidelity estimator's control variate is played on
    (:mod:`coalescence.masking.proxy`: the full conversation's KV once, each coalition's tail
    attending to the present players only).

    Args:
        tail: the tail rule's name (a rule of :data:`~coalescence.masking.proxy.TAIL_RULES`,
            default :data:`~coalescence.masking.proxy.DEFAULT_TAIL`), checked here, once.
        cost_limit: where given, the game is played only where its rows cost at most this many
            times the exact rows' time, measured on the run's own rows
            (:mod:`~coalescence.engine.two_fidelity`; ``--proxy-game auto`` gives
            :data:`PROXY_COST_MULTIPLE`); ``None`` (the default): played whatever it costs.

    Raises:
        ConfigError: an unknown ``tail`` (field ``proxy_game``, with a "did you mean"), or a
            ``cost_limit`` that is not a number > 0 (field ``proxy_cost_limit``).
    """

    tail: str = DEFAULT_TAIL
    cost_limit: float | None = None

    def __post_init__(self) -> None:
        TAIL_RULES.lookup(self.tail)
        limit = self.cost_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0):
            raise ConfigError(f"must be a number > 0 or None, got {limit!r}", field="proxy_cost_limit")

    @property
    def name(self) -> str:
        """The game's name, as its keys and archive rows carry it (``"kv-proxy-compact:<tail>"``)."""
        return proxy_game_name(self.tail)

    def layout(
        self, renderer: ChatRenderer, snapshot: ConversationSnapshot, target: TargetTokens, policy: AbsencePolicy | None = None
    ) -> ProxyLayout:
        """The game's layout of ``snapshot`` by this tail rule
        (:func:`~coalescence.masking.proxy.proxy_layout`, whose arguments and errors these are)."""
        return proxy_layout(renderer, snapshot, target, tail=self.tail, policy=policy)

    def refusal(
        self, backend: Any, *, teacher_forced: bool, policy_id: str, lay_out: Callable[[], object] | None = None
    ) -> str | None:
        """Why this game is not played, as a sentence, or ``None`` when it is.

        The proxy game is played where it is defined and was measured: a backend that scores it
        (``supports_proxy``), a teacher-forced utility (the answer's ids are fixed, so the tail is
        one sequence for every coalition) and the ``drop`` policy (an absent player's tokens are
        simply unseen; a placeholder would have to be written into the shared KV), on a conversation
        that ``lay_out`` (the engine's :meth:`~coalescence.engine.Engine.proxy_layout`) can lay out.

        Args:
            backend: the scoring backend (its ``supports_proxy``, and the reason it gives,
                ``proxy_refusal_reason``, where it has one), or None before one is loaded (not asked then).
            teacher_forced: whether the resolved utility scores a fixed answer.
            policy_id: the absence policy's id.
            lay_out: makes the conversation's proxy layout; raises ConfigError, InputError or
                TemplateRefused where it cannot; None before the conversation is rendered (not asked).
        """
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


def proxy_game_choices() -> tuple[str, ...]:
    """``--proxy-game``'s choices: ``auto``, ``none`` and the registered tail rules (read live)."""
    return ("auto", "none", *TAIL_RULES)


def proxy_game_of(choice: object) -> ProxyGame | None:
    """The proxy game of a ``--proxy-game`` choice: ``auto``, the default tail rule where it pays
    (cost limit :data:`PROXY_COST_MULTIPLE`); a tail rule's name, that rule whatever it costs;
    ``none``, no proxy game (``None``).

    Raises:
        ConfigError: any other choice (field ``proxy_game``, with a "did you mean" and the choices).
    """
    choices = proxy_game_choices()
    if not isinstance(choice, str) or choice not in choices:
        raise ConfigError(
            f"unknown proxy game {choice!r}{did_you_mean(choice, choices)}; choose one of {', '.join(choices)}", field="proxy_game"
        )
    if choice == "none":
        return None
    return ProxyGame(cost_limit=PROXY_COST_MULTIPLE) if choice == "auto" else ProxyGame(tail=choice)


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


def validate_exact_only(estimator: Any, n_players: int, refused: str) -> None:
    """A two-fidelity ``estimator``'s ``validate(n_players, proxy=False)`` for a run that fits the
    exact rows alone because the proxy game is not played, the reason (``refused``, from
    :meth:`ProxyGame.refusal`) added to a refusal.

    Raises:
        ConfigError: the budget is below the exact-only floor (e.g. 8 exact coalitions for the
            surrogate, whose floor is 16 without the proxy game), naming ``refused``.
        EstimatorError: as ``validate``.
    """
    try:
        estimator.validate(n_players, proxy=False)
    except ConfigError as exc:
        raise ConfigError(f"{exc.message} (the proxy game is not played here: {refused})", field=exc.field) from None
