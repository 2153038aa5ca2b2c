"""The public fake backend's presence game made additive (a closed-form value per player), on a
three-message conversation of sentences: the game the extension-point tests register against."""

from __future__ import annotations

import numpy as np

from helpers.snapshots import snapshot_of

from coalescence.backends.testing import FakeBackend, presence_game
from coalescence.engine import Engine
from coalescence.masking.policies import DropPolicy
from coalescence.snapshot import ConversationSnapshot

def eiffel() -> ConversationSnapshot:
    """Five players: the system sentence, two facts, an order and the question."""
    return snapshot_of(
        "The Eiffel Tower was completed in 1889.\nBig Ben was finished in 1859.",
        "Order the grilled sardines in Lisbon.\n- When was the tower completed?",
    )


def own_id_weights(brings: list[set[int]], *, scale: float = 1.0, keep=lambda t: True) -> dict[int, float]:
    """A weight ``scale * (0.1 + 0.01 * (t % 7))`` nats on each token id ``t`` (passing ``keep``)
    that exactly one player brings (``brings[i]``: the ids player i brings into the prompt)."""
    weights = {}
    for i, ids in enumerate(brings):
        for t in ids:
            if keep(t) and all(t not in other for j, other in enumerate(brings) if j != i):
                weights[t] = scale * (0.1 + 0.01 * (t % 7))
    return weights


def additive_presence_game(tokenizer, snap: ConversationSnapshot) -> tuple[Engine, list[float], int]:
    """An engine on the fake backend whose game is additive over ``snap``'s players, the closed-form
    value of each player, and the target's token count.

    The rule: every target token loses w_t nats for each weighted id t absent from the prompt;
    weighting only ids that one player alone brings into the prompt makes the game additive, so
    player i's value (Shapley, leave-one-out, leave-one-in alike) is n_target * (the weights of
    the ids it alone brings)."""
    n = snap.n_players
    probe = Engine(FakeBackend(tokenizer), batch_size=4)
    target = probe.target_tokens(snap, DropPolicy())

    def prompt(row):
        return set(probe.renderer.encode(probe.renderer.scoring_prompt(DropPolicy().render(snap, np.array(row)), target)))

    empty = prompt([False] * n)
    brings = [prompt([j == i for j in range(n)]) - empty for i in range(n)]
    weights = own_id_weights(brings)
    assert len(weights) >= n
    engine = Engine(FakeBackend(tokenizer, game=presence_game(weights, base=-0.5)), batch_size=4)
    expected = [len(target.ids) * sum(weights.get(t, 0.0) for t in ids) for ids in brings]
    return engine, expected, len(target.ids)
