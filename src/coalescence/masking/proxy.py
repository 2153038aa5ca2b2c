"""The shared-KV proxy game's rendering side: where each player's tokens are in the full prompt.

The proxy game (issue 37) approximates the exact game v(S) of a teacher-forced utility under the
``drop`` policy by one encoding of the *full* conversation: the key/value states of its prompt up
to :attr:`ProxyLayout.tail_start` are computed once with every player present (the shared KV), and
for a coalition S only the *tail* (the prompt from ``tail_start`` on, then the answer) is computed,
at the original positions, with the tokens of the absent players masked out of the tail's
attention. A proxy row is a :class:`~coalescence.backends.base.ProxyScoreRequest`: the full
prompt, the answer, ``tail_start`` and the hidden token ranges (its semantics are written there).
The proxy is only ever a control variate for the exact game (its values are never reported).

Player ranges. The scoring prompt is the exact game's full coalition prompt, byte for byte
(:meth:`~coalescence.masking.render.ChatRenderer.scoring_prompt` of the policy's full coalition,
encoded). Each player's characters in that text are found by rendering the conversation once
more with a private-use marker around every player piece (so the template places them itself:
a default system prompt, a folded system message, trimmed content); when the marked rendering is
not the rendering with markers added (a template that treats content by its characters), each
message's content is searched for in order instead. A token belongs to a player when its
characters overlap the player's text: a token that also holds the whitespace before a player
(``" B"``) is the player's, and a token straddling two players' text belongs to both (it is hidden
when either is absent). Template text, and whitespace between players that no player token
covers, belongs to no player and is never hidden.

Tail rules (:data:`TAIL_RULES`, a :class:`~coalescence.registry.Registry` of named rules; a new one
is added with :func:`register_tail_rule`; the built-in ones measured in ``benchmarks/proxy_tail.py``,
the default :data:`DEFAULT_TAIL` chosen there):

- ``"after-last-player"``: the tail starts at the first token after the last player token. Every
  player is in the shared KV; the text after the players (a question after a context, the
  template's turn ends and the assistant header) and the answer form the tail.
- ``"last-turn"``: the tail starts at the first token of the last prompt message's content (its
  turn header stays shared). Players in that message (a question that is a player, context
  sentences of a one-message RAG prompt, a system prompt placed last) are inside the tail and
  hidden there from the later positions' attention.
- ``"answer"``: the tail starts at the first token after the last prompt message's content: the
  end of that turn, the assistant header and the answer.

``tail_start`` is at least 1 (the first token is always shared) and at most ``len(prompt_ids)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..backends.base import ProxyScoreRequest
from ..conversation import Message
from ..errors import ConfigError, MaskError, TemplateRefused
from ..registry import Registry
from ..snapshot import ConversationSnapshot
from .policies import AbsencePolicy, merge_adjacent_messages
from .render import ChatRenderer, TargetTokens

__all__ = ("DEFAULT_TAIL", "TAIL_RULES", "ProxyLayout", "TailRule", "TailSite", "proxy_layout", "register_tail_rule")

_Range = tuple[int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class TailSite:
    """What a tail rule sees of one conversation's full prompt.

    Attributes:
        text: the scoring prompt's text (the exact game's full coalition).
        offsets: ``[n_tokens]`` half-open character ranges ``(start, end)`` of each prompt token in ``text``.
        player_ranges: per player, its sorted token ranges ``[a, b)`` (:attr:`ProxyLayout.player_ranges`).
        messages: the full coalition's messages, as rendered.
    """

    text: str
    offsets: tuple[_Range, ...]
    player_ranges: tuple[tuple[_Range, ...], ...]
    messages: tuple[Message, ...]

    @property
    def n_tokens(self) -> int:
        """The prompt's token count."""
        return len(self.offsets)


TailRule = Callable[[TailSite], int]
"""A tail rule: the token index where a proxy row's tail starts in a :class:`TailSite` (clipped to
``[1, n_tokens]`` by :func:`proxy_layout`); raises :class:`~coalescence.errors.TemplateRefused` (or
:class:`~coalescence.errors.ConfigError`) where it cannot place the tail in this conversation."""


def _check_rule(name: str, rule: object) -> None:
    if not callable(rule):
        raise ConfigError(f"a tail rule is a function of a TailSite returning a token index, got {type(rule).__name__}", field="proxy_game")


TAIL_RULES: Registry[TailRule] = Registry("tail rule", field="proxy_game", check=_check_rule)
"""The tail rules by name, in registration order (module docs): where a proxy row's tail begins."""


def register_tail_rule(name: str, rule: TailRule, *, replace: bool = False) -> None:
    """Register a tail rule under ``name`` (then a choice of ``--proxy-game`` and of
    :class:`~coalescence.engine.proxy.ProxyGame`'s ``tail``).

    Args:
        name: the rule's name (a game's name carries it: ``kv-proxy-compact:<name>``).
        rule: ``rule(site) -> int``, the first tail token of a :class:`TailSite`.
        replace: replace a rule already registered under ``name``.

    Raises:
        ConfigError: an empty name, a ``rule`` that is not callable, or a name already bound to
            another rule without ``replace`` (field ``proxy_game``).
    """
    TAIL_RULES.register(name, rule, replace=replace)


def _after_last_player(site: TailSite) -> int:
    """The first token after the last player token (every player in the shared KV)."""
    return max((b for ranges in site.player_ranges for _, b in ranges), default=site.n_tokens)


def _in_last_message(name: str, *, at_end: bool) -> TailRule:
    """A rule cutting at the last prompt message's content: its first token (``at_end`` False), or the
    first token after it."""

    def rule(site: TailSite) -> int:
        last = site.messages[-1].content if site.messages else ""
        body = last.strip()
        at = site.text.rfind(body) if body else -1
        if at < 0:
            raise TemplateRefused(
                "the chat template does not render the last message's content verbatim, so the proxy "
                f"game's tail rule {name!r} cannot locate it; use the tail rule 'after-last-player'",
                field="chat template",
            )
        char = at + len(body) if at_end else at
        # the first token not wholly before that character
        return next((k for k, (s, e) in enumerate(site.offsets) if e > char and e > s), site.n_tokens)

    rule.__qualname__ = rule.__name__ = f"tail_rule_{name.replace('-', '_')}"
    return rule


register_tail_rule("after-last-player", _after_last_player)
register_tail_rule("last-turn", _in_last_message("last-turn", at_end=False))
register_tail_rule("answer", _in_last_message("answer", at_end=True))

DEFAULT_TAIL = "after-last-player"
"""The tail rule used unless told otherwise (benchmarks/RESULTS.md, "The proxy game's tail")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyLayout:
    """One conversation's proxy game: the full prompt, the answer, the players' token ranges and
    where the tail starts (module docs).

    Attributes:
        prompt_ids: the full conversation's scoring prompt (every player present), byte-identical
            to what the exact game's full coalition scores.
        target_ids: the answer's token ids, as the exact game scores them.
        player_ranges: per player, the sorted disjoint half-open token ranges ``[a, b)`` of
            ``prompt_ids`` that overlap its text (module docs: a token straddling two players is
            in both); ``()`` for a player with no text.
        tail_start: positions ``[0, tail_start)`` are the shared KV; ``1 <= tail_start <=
            len(prompt_ids)``.
        tail: the name of the rule that chose ``tail_start`` (one of :data:`TAIL_RULES`).
    """

    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    player_ranges: tuple[tuple[_Range, ...], ...]
    tail_start: int
    tail: str

    @property
    def n_players(self) -> int:
        """Number of players."""
        return len(self.player_ranges)

    @property
    def tail_tokens(self) -> int:
        """Token positions a proxy row computes: the tail of the prompt and the answer but its last
        token (whose logits are never needed)."""
        return len(self.prompt_ids) + len(self.target_ids) - 1 - min(self.tail_start, len(self.prompt_ids) - 1)

    def hidden(self, present: np.ndarray) -> tuple[_Range, ...]:
        """The token ranges of the absent players, merged and sorted.

        Args:
            present: ``[n_players]`` bool, True where the player is in the coalition.

        Raises:
            MaskError: ``present`` is not a bool array of shape ``(n_players,)``.
        """
        arr = np.asarray(present)
        if arr.dtype != np.bool_ or arr.shape != (self.n_players,):
            raise MaskError(
                f"coalition must be a bool array of shape ({self.n_players},), got {arr.dtype} {arr.shape}",
                field="mask",
            )
        return _merge(r for i in np.flatnonzero(~arr) for r in self.player_ranges[i])

    def request(self, present: np.ndarray, *, prefix_group: str = "") -> ProxyScoreRequest:
        """The proxy row of one coalition.

        Args:
            present: ``[n_players]`` bool, True where the player is in the coalition.
            prefix_group: the batching hint of :class:`~coalescence.backends.base.ScoreRequest`
                (the pipeline passes the snapshot id).

        Returns:
            A :class:`~coalescence.backends.base.ProxyScoreRequest` whose ``hidden`` are the absent
            players' token ranges (:meth:`hidden`).

        Raises:
            MaskError: ``present`` is not a bool array of shape ``(n_players,)``.
        """
        return ProxyScoreRequest(
            prompt_ids=self.prompt_ids,
            target_ids=self.target_ids,
            tail_start=self.tail_start,
            hidden=self.hidden(present),
            prefix_group=prefix_group,
        )


def _merge(ranges: Sequence[_Range] | object) -> tuple[_Range, ...]:
    """Sorted, merged half-open ranges (touching ranges join); empty ranges dropped."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):  # type: ignore[union-attr]
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def proxy_layout(
    renderer: ChatRenderer,
    snapshot: ConversationSnapshot,
    target: TargetTokens,
    *,
    tail: str = DEFAULT_TAIL,
    policy: AbsencePolicy | None = None,
) -> ProxyLayout:
    """The proxy layout of a snapshot (module docs).

    Args:
        renderer: the model's chat renderer.
        snapshot: the conversation and its players.
        target: the snapshot's target tokens (as the exact game scores them, under ``policy``).
        tail: the name of a rule of :data:`TAIL_RULES`.
        policy: the absence policy whose full coalition the exact game scores (``None``: the
            snapshot's messages as they are, which is ``drop``'s and ``placeholder``'s full
            coalition unless they merge adjacent messages).

    Returns:
        The :class:`ProxyLayout`.

    Raises:
        ConfigError: an unknown ``tail`` (field ``proxy_game``, with a "did you mean"), or a player
            owns the prompt's first token (the proxy game needs it shared and visible; field
            ``proxy_game``).
        TemplateRefused: the template does not render a player's text (or, for the rules
            ``last-turn`` and ``answer``, the last message's content) verbatim, so it cannot be
            located.
    """
    rule = TAIL_RULES.lookup(tail)
    original = list(snapshot.conversation.messages)
    ones = np.ones(snapshot.n_players, dtype=bool)
    messages = policy.render(snapshot, ones) if policy is not None else original
    text = _prompt_text(renderer, messages, target)
    prompt_ids, offsets = renderer.encode_with_offsets(text)
    chars = _marked_pieces(renderer, snapshot, original, messages, target, text)
    if chars is None:
        chars = _searched_pieces(snapshot, original, text)
    player_ranges = tuple(_token_ranges(offsets, pieces) for pieces in chars)
    if any(a == 0 for ranges in player_ranges for a, _ in ranges):
        raise ConfigError(
            "a player's text starts the prompt (no BOS or template text before it), and the proxy game "
            "needs the first token shared by every coalition; use --proxy-game none",
            field="proxy_game",
        )
    n = len(prompt_ids)
    site = TailSite(text=text, offsets=tuple(offsets), player_ranges=player_ranges, messages=tuple(messages))
    start = int(rule(site))
    return ProxyLayout(
        prompt_ids=tuple(prompt_ids),
        target_ids=tuple(target.ids),
        player_ranges=player_ranges,
        tail_start=min(max(start, 1), n),
        tail=tail,
    )


def _prompt_text(renderer: ChatRenderer, messages: Sequence[Message], target: TargetTokens) -> str:
    """The text the exact game's coalition of ``messages`` is scored after (the pipeline's rule)."""
    return renderer.scoring_prompt(messages, target)


def _pieces(snapshot: ConversationSnapshot) -> dict[int, list[tuple[int, int, int]]]:
    """Per message index, its player pieces ``(start, end, player)`` in text order (empty ones left out)."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for p in snapshot.players:
        for m, a, b in p.spans:
            if a < b:
                out.setdefault(m, []).append((a, b, p.index))
    for pieces in out.values():
        pieces.sort()
    return out


def _marked_pieces(
    renderer: ChatRenderer,
    snapshot: ConversationSnapshot,
    original: list[Message],
    messages: list[Message],
    target: TargetTokens,
    text: str,
) -> list[list[_Range]] | None:
    """Each player's character spans in ``text``, found by a rendering with markers around every
    piece; ``None`` when that rendering is not ``text`` with markers (module docs)."""
    if messages == original:
        merge = False
    elif merge_adjacent_messages(original) == messages:
        merge = True
    else:
        return None
    pieces = _pieces(snapshot)
    used = set(text).union(*(set(m.content) for m in original), set(target.answer))
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
    open_, close = next(free), next(free)
    marked: list[Message] = []
    order: list[tuple[int, int, int, int]] = []  # (message, start, end, player) in marked order
    for m, message in enumerate(original):
        content = message.content
        parts, at = [], 0
        for a, b, player in pieces.get(m, ()):
            parts += [content[at:a], open_, content[a:b], close]
            at = b
            order.append((m, a, b, player))
        parts.append(content[at:])
        marked.append(replace(message, content="".join(parts)) if m in pieces else message)
    if merge:
        marked = merge_adjacent_messages(marked)
    try:
        rendered = _prompt_text(renderer, marked, target)
    except Exception:  # a template that treats the markers differently: search instead
        return None
    out: list[list[_Range]] = [[] for _ in range(snapshot.n_players)]
    plain: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    at = 0
    for ch in rendered:
        if ch == open_:
            starts.append(at)
        elif ch == close:
            ends.append(at)
        else:
            plain.append(ch)
            at += 1
    if "".join(plain) != str(text) or len(starts) != len(order) or len(ends) != len(order):
        return None
    for (m, a, b, player), s, e in zip(order, starts, ends, strict=True):
        if text[s:e] != original[m].content[a:b]:
            return None
        out[player].append((s, e))
    return out


def _searched_pieces(snapshot: ConversationSnapshot, original: list[Message], text: str) -> list[list[_Range]]:
    """Each player's character spans in ``text``, found by searching each message's content (or
    its stripped content, or its pieces one by one) in order.

    Raises:
        TemplateRefused: a piece's text is not in the rendering after the previous one.
    """
    pieces = _pieces(snapshot)
    out: list[list[_Range]] = [[] for _ in range(snapshot.n_players)]
    cursor = 0
    for m, message in enumerate(original):
        content = message.content
        mine = pieces.get(m, [])
        at = text.find(content, cursor) if content else -1
        base = at
        if at < 0 and content.strip():
            body = content.strip()
            lead = len(content) - len(content.lstrip())
            at = text.find(body, cursor)
            base = at - lead if at >= 0 else -1
            if at >= 0 and any(a < lead or b > lead + len(body) for a, b, _ in mine):
                base = -1
        if base >= 0:
            for a, b, player in mine:
                out[player].append((base + a, base + b))
            cursor = base + len(content) if at == base else at + len(content.strip())
            continue
        for a, b, player in mine:
            piece = content[a:b]
            found = text.find(piece, cursor)
            if found < 0:
                raise TemplateRefused(
                    f"the chat template does not render the text of player {snapshot.players[player].label} "
                    "verbatim, so the proxy game cannot locate its tokens",
                    field="chat template",
                )
            out[player].append((found, found + len(piece)))
            cursor = found + len(piece)
    return out


def _token_ranges(offsets: Sequence[_Range], spans: Sequence[_Range]) -> tuple[_Range, ...]:
    """The token ranges whose characters overlap ``spans`` (module docs), merged."""
    ranges = []
    for a, b in spans:
        ks = [k for k, (s, e) in enumerate(offsets) if s < b and e > a and e > s]
        if ks:
            ranges.append((ks[0], ks[-1] + 1))
    return _merge(ranges)
