"""The engine: wires snapshot, planner, masking, scheduler, collator, backend, store and archive.

``core`` (:class:`Engine`: evaluation and explanation), ``rounds`` (target-stderr rounds within a
budget), ``keys`` (coalition and evaluation keys, the proxy game's included), ``hydrate`` (the hot
store and measurements from the archive, pools with no model), ``proxy`` (the proxy game as one
object, :class:`ProxyGame`: its name, tail rule, layout and refusal; its agreement with the exact
game) and ``notes`` (what an explanation records beside its values).
"""

from .core import Engine, counting_evaluations
from .hydrate import fill_measurements, fill_store, pool_from_store
from .keys import UTILITY, game_utility, key_for
from .notes import utility_detail
from .proxy import PROXY_GAME, ProxyGame, proxy_agreement, proxy_game_name, proxy_game_of

__all__ = (
    "UTILITY",
    "PROXY_GAME",
    "ProxyGame",
    "proxy_game_of",
    "game_utility",
    "proxy_agreement",
    "proxy_game_name",
    "counting_evaluations",
    "Engine",
    "fill_measurements",
    "fill_store",
    "key_for",
    "pool_from_store",
    "utility_detail",
)
