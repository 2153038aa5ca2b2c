"""TEMPORARY (plumbing branch): a minimal proxy layout until the proxy-kernel branch lands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.base import ProxyScoreRequest
from ..errors import ConfigError

__all__ = ("DEFAULT_TAIL", "TAIL_RULES", "ProxyLayout", "proxy_layout")

TAIL_RULES = ("after-last-player", "last-turn", "answer")
DEFAULT_TAIL = "after-last-player"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyLayout:
    prompt_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    player_ranges: tuple[tuple[tuple[int, int], ...], ...]
    tail_start: int
    tail: str

    def request(self, present: np.ndarray, *, prefix_group: str = "") -> ProxyScoreRequest:
        ranges = sorted(r for i, rs in enumerate(self.player_ranges) if not present[i] for r in rs)
        merged: list[tuple[int, int]] = []
        for a, b in ranges:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            elif a < b:
                merged.append((a, b))
        return ProxyScoreRequest(
            prompt_ids=self.prompt_ids, target_ids=self.target_ids, tail_start=self.tail_start,
            hidden=tuple(merged), prefix_group=prefix_group,
        )


def proxy_layout(renderer: Any, snapshot: Any, target: Any, *, tail: str = DEFAULT_TAIL, policy: Any = None) -> ProxyLayout:
    if tail not in TAIL_RULES:
        raise ConfigError(f"unknown tail rule {tail!r}; choose one of {', '.join(TAIL_RULES)}", field="proxy_game")
    text = target.full_text
    prompt = target.full_prompt_ids
    ids, offsets = renderer._tokenize(text)
    bos = len(ids) < len(prompt) + len(target.ids) and len(prompt) and prompt[0] != ids[0]
    shift = 1 if bos else 0
    pos, starts = 0, {}
    for m, msg in enumerate(snapshot.conversation.messages):
        at = text.find(msg.content, pos)
        starts[m] = at
        if at >= 0:
            pos = at + len(msg.content)
    ranges = []
    for p in snapshot.players:
        spans = [(p.message_index, p.start, p.end), *p.extra]
        rs = []
        for m, a, b in spans:
            ca, cb = starts[m] + a, starts[m] + b
            toks = [k + shift for k, (x, y) in enumerate(offsets) if x < cb and y > ca and k + shift < len(prompt)]
            if toks:
                rs.append((toks[0], toks[-1] + 1))
        ranges.append(tuple(rs))
    last = max((r[-1][1] for r in ranges if r), default=1)
    return ProxyLayout(prompt_ids=tuple(prompt), target_ids=tuple(target.ids), player_ranges=tuple(ranges),
                       tail_start=min(max(last, 1), len(prompt) - 1), tail=tail)
