"""One batch knob: the engine's calls take the backend's declared ``max_batch_size`` unless told a
smaller one; zero, a bool or more than the backend runs in one call are refused; a backend that
does not pad (vLLM) gets rows of any length in one call.

The fake backend is the public one (coalescence.backends.testing), whose ``calls`` record the rows
of each call that reached it."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from coalescence.backends.testing import FakeBackend
from coalescence.conversation import Conversation, Message
from coalescence.engine import Engine
from coalescence.errors import ConfigError
from coalescence.masking.policies import DropPolicy
from coalescence.snapshot import ConversationSnapshot


def snapshot(padding_words: int = 0) -> ConversationSnapshot:
    """Six sentences; the first is ``padding_words`` words long (to push full coalitions past 128 tokens)."""
    first = " ".join(["tower"] * padding_words) + " The Eiffel Tower was completed in 1889." if padding_words else "The Eiffel Tower was completed in 1889."
    c = Conversation(
        messages=(
            Message(role="user", content=f"{first} Big Ben was finished in 1859. Lisbon has trams."),
            Message(role="user", content="Rome has a colosseum. Paris has a river. When was the tower completed?"),
        ),
        target="It was completed in 1889.",
    )
    return ConversationSnapshot.build(c, unit="sentence")


def all_masks(n: int) -> np.ndarray:
    return np.array([[(k >> i) & 1 for i in range(n)] for k in range(2**n)], dtype=bool)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(chatml_tokenizer, bad):
    with pytest.raises(ConfigError) as err:
        Engine(FakeBackend(chatml_tokenizer), batch_size=bad)
    assert err.value.field == "batch_size"


def test_a_batch_size_above_the_backends_is_refused_naming_the_one_knob(chatml_tokenizer):
    with pytest.raises(ConfigError, match="exceed the backend's max_batch_size of 4") as err:
        Engine(FakeBackend(chatml_tokenizer, max_batch_size=4), batch_size=5)
    assert err.value.field == "batch_size"


def test_the_engine_takes_the_backends_declared_batch(chatml_tokenizer):
    backend = FakeBackend(chatml_tokenizer, max_batch_size=7)
    engine = Engine(backend)
    assert engine.batch_size == 7
    snap = engine.prepare(snapshot().conversation, unit="sentence")
    anyio.run(engine.evaluate, snap, DropPolicy(), all_masks(snap.n_players))
    # 64 coalitions, none longer than 128 tokens: calls of at most 7 rows, and the collator fills one
    assert sum(backend.calls) == 2**snap.n_players
    assert max(backend.calls) == 7


class _Lengths(FakeBackend):
    """The fake backend, recording the token lengths of each call's rows."""

    def score(self, requests):
        self.lengths.append([r.n_tokens for r in requests])
        return super().score(requests)


@pytest.mark.parametrize("pads", [True, False])
def test_only_a_backend_that_pads_gets_its_rows_split_by_length_bucket(chatml_tokenizer, pads):
    backend = _Lengths(chatml_tokenizer, max_batch_size=64)
    backend.lengths = []
    backend.pads_rows = pads
    engine = Engine(backend)
    snap = engine.prepare(snapshot(padding_words=60).conversation, unit="sentence")
    anyio.run(engine.evaluate, snap, DropPolicy(), all_masks(snap.n_players))
    rows = [n for call in backend.lengths for n in call]
    assert min(rows) <= 128 < max(rows)  # the game spans the 128-token bucket's ceiling
    mixed = [call for call in backend.lengths if min(call) <= 128 < max(call)]
    # a padding backend never gets a call mixing both sides of a bucket ceiling; vLLM's does
    assert bool(mixed) is (not pads)
