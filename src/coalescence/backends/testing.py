"""A fake backend for tests: an analytic game in place of a model (httpx's ``MockTransport`` is the model).

:class:`FakeBackend` is a full :class:`~coalescence.backends.base.ScoringBackend` that runs no
model: a row's per-token log-probabilities are a function of its token ids that you give (a
*game*), so the engine, the collator, the archive and the estimators can be exercised, and their
values checked by hand, in milliseconds and without weights. It needs only a tokenizer with a
chat template (the engine renders with it). Failures and delays can be injected: a row that
poisons every batch it is in (the collator then scores each member alone and only that row
fails), a failure on given calls, a delay per call, and a pause that holds calls at their start
until :meth:`FakeBackend.resume` (to test what happens while a call is in flight).

Two games come with it:

- :func:`presence_game`: every target token's log-probability is ``base`` minus the weights of
  the weighted token ids absent from the prompt. Its utility is additive in the weighted tokens,
  so a player's exact Shapley value is ``n_target`` times the weights of the weighted tokens only
  that player holds (tokens the template writes are always present).
- :func:`hashed_game` (the default): a pseudo language model; the log-probability of each target
  token is a hash of the sequence up to it, so it depends on every earlier token, like a causal LM.

Its shared-KV proxy game (:meth:`FakeBackend.score_proxy`) is a game too, ``proxy_game`` (default:
the same game), applied to the prompt as the tail sees it: the full prompt without its hidden
ranges. With :func:`presence_game` and the default, the proxy equals the exact game wherever a
coalition's rendering drops exactly its absent players' tokens.

Example::

    from coalescence.backends.testing import FakeBackend, presence_game

    ids = tokenizer.encode(" 1889", add_special_tokens=False)
    backend = FakeBackend(tokenizer, game=presence_game({i: 1.0 for i in ids}, base=-0.5))
    explanation = await Engine(backend).explain(snapshot, ExactShapley(), DropPolicy())
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import BatchFailed, ConfigError, EngineClosed
from .base import (
    DEFAULT_BATCH_SIZE,
    BackendBase,
    GenerateRequest,
    GenerateResult,
    ProxyScoreRequest,
    ScoreRequest,
    ScoreResult,
)

__all__ = ("FakeBackend", "Game", "hashed_game", "presence_game")

Game = Callable[[tuple[int, ...], tuple[int, ...]], Sequence[float]]
"""``game(prompt_ids, target_ids) -> [n_target]`` log p(target_j | prompt, target_<j) in nats
(finite, <= 0): what a fake backend's model would have said."""


def presence_game(weights: Mapping[int, float], *, base: float = -1.0) -> Game:
    """A game additive in the presence of token ids in the prompt.

    Every target token's log-probability is ``base - sum(weights[t] for t in weights if t not in
    prompt_ids)`` nats, so a row's utility is ``n_target * (base - absent weight)``.

    Args:
        weights: token id -> nats (>= 0, finite) lost by every target token when that id is
            absent from the prompt.
        base: the log-probability of each target token with every weighted id present (<= 0).

    Raises:
        ConfigError: a negative or non-finite weight (field ``weights``), a positive or
            non-finite ``base`` (field ``base``).
    """
    table = {int(t): float(w) for t, w in weights.items()}
    for t, w in table.items():
        if not (math.isfinite(w) and w >= 0):
            raise ConfigError(f"the weight of token {t} must be a finite number >= 0 (nats), got {w!r}", field="weights")
    if not (math.isfinite(base) and base <= 0):
        raise ConfigError(f"must be a finite log-probability <= 0 (nats), got {base!r}", field="base")

    def game(prompt_ids: tuple[int, ...], target_ids: tuple[int, ...]) -> list[float]:
        present = set(prompt_ids)
        lp = base - sum(w for t, w in table.items() if t not in present)
        return [lp] * len(target_ids)

    return game


def hashed_game(seed: int = 0) -> Game:
    """A pseudo language model: log p(target_j | ...) = ``-(0.01 + 4 u)`` nats, with ``u`` in
    ``[0, 1)`` from the BLAKE2b digest of ``seed`` and the token ids up to and including
    ``target_j`` (so each value depends on every earlier token and on nothing else)."""

    def game(prompt_ids: tuple[int, ...], target_ids: tuple[int, ...]) -> list[float]:
        h = hashlib.blake2b(int(seed).to_bytes(8, "little", signed=True), digest_size=8)
        h.update(np.asarray(prompt_ids, dtype=np.int64).tobytes())
        out = []
        for t in target_ids:
            h.update(int(t).to_bytes(8, "little", signed=True))
            u = int.from_bytes(h.copy().digest(), "little") / 2**64
            out.append(-(0.01 + 4.0 * u))
        return out

    return game


class FakeBackend(BackendBase):
    """A scoring backend with an analytic game instead of a model (module docs).

    Args:
        tokenizer: a transformers tokenizer with a chat template (the engine renders with it;
            the fake decodes and encodes only its ``replies``).
        game: the per-token log-probabilities of a row (default: :func:`hashed_game`).
        proxy_game: the proxy game's, applied to the full prompt less the hidden ranges
            (default: ``game``); ``supports_proxy=False`` makes a fake with no proxy game.
        replies: the texts generation returns: a greedy request gets ``replies[0]``; sample ``s``
            of a sampled request gets one drawn by a RNG seeded by the prompt and ``seeds[s]``.
            Each is encoded, followed by the tokenizer's EOS, and cut at ``max_new_tokens``.
        model_id, revision, dtype, fingerprint: the identity in coalition keys.
        max_context: the longest sequence (tokens) accepted; longer rows are refused before the
            game runs (nothing counted).
        max_batch_size: rows per call the engine uses by default (>= 1).
        poison: ``poison(prompt_ids) -> bool``: a row for which it is true fails every call it
            is in (:class:`BatchFailed`), so its batch-mates succeed only when scored without it.
        fail_calls: call numbers (1-based, ``score`` and ``generate_batch`` together) that fail
            with :class:`BatchFailed`, whatever their rows.
        delay: seconds every call sleeps before computing (>= 0).
        row_delay: seconds a call sleeps per exact row it scores (>= 0: a backend whose time
            grows with its rows).
        proxy_row_delay: seconds a call sleeps per proxy row it scores (>= 0; default
            ``row_delay``).
        shutdown_with_engine: whether the engine shuts this backend down when it closes.

    Attributes:
        calls: rows per call that reached the game, in call order (failed calls included).

    Its :meth:`statistics` are the envelope's of :class:`~coalescence.backends.base.BackendBase`:
    an exact row computes its ``n_tokens`` (the fake shares no prefix), a proxy row its tail
    (``proxy_tokens_computed``) and reuses ``tail_start`` (``proxy_tokens_reused``); refused rows
    and failed calls count nothing.

    Raises:
        ConfigError: ``max_context`` or ``max_batch_size`` < 1, a negative ``delay``, ``row_delay`` or ``proxy_row_delay``, no replies.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        game: Game | None = None,
        proxy_game: Game | None = None,
        supports_proxy: bool = True,
        replies: Sequence[str] = ("OK.",),
        model_id: str = "fake",
        revision: str = "",
        dtype: str = "float32",
        fingerprint: str = "",
        max_context: int = 4096,
        max_batch_size: int = DEFAULT_BATCH_SIZE,
        poison: Callable[[tuple[int, ...]], bool] | None = None,
        fail_calls: Collection[int] = (),
        delay: float = 0.0,
        row_delay: float = 0.0,
        proxy_row_delay: float | None = None,
        shutdown_with_engine: bool = False,
    ) -> None:
        for name, value in (("max_context", max_context), ("max_batch_size", max_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be an int >= 1, got {value!r}", field=name)
        proxy_row_delay = row_delay if proxy_row_delay is None else proxy_row_delay
        for name, value in (("delay", delay), ("row_delay", row_delay), ("proxy_row_delay", proxy_row_delay)):
            if isinstance(value, bool) or not (isinstance(value, int | float) and value >= 0):
                raise ConfigError(f"must be a number of seconds >= 0, got {value!r}", field=name)
        if isinstance(replies, str) or not replies:
            raise ConfigError(f"must be a sequence of at least one text, got {replies!r}", field="replies")
        self.tokenizer = tokenizer
        self.game: Game = game if game is not None else hashed_game()
        self.proxy_game: Game = proxy_game if proxy_game is not None else self.game
        self.supports_proxy = bool(supports_proxy)
        eos = tokenizer.eos_token_id
        self._replies = [
            tuple(tokenizer.encode(text, add_special_tokens=False)) + ((int(eos),) if eos is not None else ())
            for text in replies
        ]
        self.model_id = model_id
        self.revision = revision
        self.dtype = dtype
        self.fingerprint = fingerprint
        self.max_context = max_context
        self.max_batch_size = max_batch_size
        self.shutdown_with_engine = bool(shutdown_with_engine)
        self.poison = poison
        self.fail_calls = frozenset(int(n) for n in fail_calls)
        self.delay = float(delay)
        self.row_delay, self.proxy_row_delay = float(row_delay), float(proxy_row_delay)
        self.calls: list[int] = []
        self._lock = threading.Lock()
        self._open = threading.Event()  # set: calls run; clear: calls wait at their start
        self._open.set()
        self._waiting = threading.Condition(self._lock)
        self._in_call = 0
        self._closed = False

    # -- controls --------------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold every call from now on at its start (after the context check) until :meth:`resume`."""
        self._open.clear()

    def resume(self) -> None:
        """Let the held calls, and every later one, run."""
        self._open.set()

    def wait_for_call(self, timeout: float = 10.0) -> bool:
        """Block until a call is in flight (held or running); whether one was, within ``timeout`` s."""
        with self._waiting:
            return self._waiting.wait_for(lambda: self._in_call > 0, timeout)

    def identity(self) -> dict[str, str]:
        """``{"backend": "fake"}``."""
        return {"backend": "fake"}

    def shutdown(self) -> None:
        """Refuse later calls (:class:`~coalescence.errors.EngineClosed`); a call in flight finishes."""
        self._closed = True

    # -- the protocol: the envelope of BackendBase (refusal, errors, counting) around these ----------
    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The game's log-probabilities of each row's target (nats, float32), in order.

        Raises:
            BatchFailed: a poisoned row in the call, an injected failure, or (the envelope) a game
                value that is not finite; a row longer than ``max_context`` is refused before.
            EngineClosed: after :meth:`shutdown`.
        """
        return self._play(batch, lambda r: (r.prompt_ids, r.n_tokens, 0), self.game, self.row_delay)

    def _score_proxy_batch(self, batch: Sequence[ProxyScoreRequest]) -> list[ScoreResult]:
        """The proxy game's log-probabilities of each row's target: ``proxy_game`` of the prompt
        without its hidden ranges (nats, float32), in order. Each row computes its tail
        (``tokens_computed``) and reuses the shared prefix (``tokens_reused = tail_start``); a
        fake made with ``supports_proxy=False`` has no proxy game (``BackendError``).

        Raises:
            BatchFailed, EngineClosed: as :meth:`_score_batch`.
        """
        return self._play(batch, lambda r: (_visible(r), r.n_tokens - r.tail_start, r.tail_start), self.proxy_game, self.proxy_row_delay)

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """The replies (module docs), one result per request, in order.

        Raises:
            BatchFailed: a poisoned row, or an injected failure.
            EngineClosed: after :meth:`shutdown`.
        """
        with self._call([r.prompt_ids for r in requests]):
            results = []
            for r in requests:
                runs = [self._reply(r, seed) for seed in (r.seeds[:1] if r.greedy else r.seeds)]
                cost = sum(len(r.prompt_ids) + max(len(ids) - 1, 0) for ids in runs)
                samples = tuple(runs) * r.n_samples if r.greedy else tuple(runs)
                results.append(GenerateResult(token_ids=samples, tokens_computed=cost))
            return results

    # -- inside --------------------------------------------------------------------------------------
    def _reply(self, request: GenerateRequest, seed: int) -> tuple[int, ...]:
        if request.greedy:
            ids = self._replies[0]
        else:
            h = hashlib.blake2b(np.asarray(request.prompt_ids, dtype=np.int64).tobytes(), digest_size=8)
            h.update(f"{seed}:{request.temperature!r}:{request.top_p!r}".encode())
            ids = self._replies[random.Random(h.digest()).randrange(len(self._replies))]
        return ids[: request.max_new_tokens]

    def _call(self, prompts: list[tuple[int, ...]]) -> _InCall:
        return _InCall(self, prompts)

    def _play(
        self, rows: Sequence[Any], view: Callable[[Any], tuple[tuple[int, ...], int, int]], game: Game, row_delay: float
    ) -> list[ScoreResult]:
        """One call of ``game`` on each row: ``view(row)`` gives the prompt the game sees, the
        positions the row computes and those it reuses; the call sleeps ``row_delay`` per row."""
        with self._call([r.prompt_ids for r in rows]):
            if row_delay:
                time.sleep(row_delay * len(rows))
            results = []
            for r in rows:
                prompt, computed, reused = view(r)
                lp = np.asarray(game(prompt, r.target_ids), dtype=np.float32)
                results.append(
                    ScoreResult(
                        token_logprobs=lp, utility=float(lp.astype(np.float64).sum()), tokens_computed=computed, tokens_reused=reused
                    )
                )
            return results


def _visible(r: ProxyScoreRequest) -> tuple[int, ...]:
    """The prompt as a proxy row's tail sees it: the full prompt without its hidden ranges."""
    visible, start = [], 0
    for a, b in r.hidden:
        visible += r.prompt_ids[start:a]
        start = b
    visible += r.prompt_ids[start:]
    return tuple(visible)


class _InCall:
    """One call of a :class:`FakeBackend`: numbered, held while paused, delayed, failed as injected."""

    def __init__(self, owner: FakeBackend, prompts: list[tuple[int, ...]]) -> None:
        self.owner = owner
        self.prompts = prompts

    def __enter__(self) -> None:
        o = self.owner
        if o._closed:
            raise EngineClosed("the fake backend was shut down")
        with o._waiting:
            o.calls.append(len(self.prompts))
            number = len(o.calls)
            o._in_call += 1
            o._waiting.notify_all()
        try:
            o._open.wait()
            if o.delay:
                time.sleep(o.delay)
            if number in o.fail_calls:
                raise BatchFailed(f"injected failure on call {number} ({len(self.prompts)} rows)")
            if o.poison is not None:
                for i, ids in enumerate(self.prompts):
                    if o.poison(ids):
                        raise BatchFailed(f"row {i} poisons its batch of {len(self.prompts)} rows")
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        with self.owner._waiting:
            self.owner._in_call -= 1
