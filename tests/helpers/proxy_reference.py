"""A proxy row's value at the full conversation's positions (the first proxy game, no compaction),
by a plain forward with a hand-built mask: the contrast the compacted proxy game's tests hold it to."""

from __future__ import annotations

from typing import Any

import numpy as np


def reference_at_original_positions(model: Any, r: Any) -> float:
    """The sum over ``r``'s target tokens of their log-probabilities (nats, float64) when the tail
    (from ``r.tail_start``) sees every prompt position but ``r.hidden``'s ranges, every position
    the full conversation's. ``r``: a :class:`~coalescence.backends.base.ProxyScoreRequest`."""
    import torch

    seq = list(r.prompt_ids) + list(r.target_ids[:-1])
    n = len(seq)
    visible = np.ones(n, dtype=bool)
    for a, b in r.hidden:
        visible[a:b] = False
    allowed = np.tril(np.ones((n, n), dtype=bool))
    allowed[r.tail_start :] &= visible[None, :]
    mask = torch.zeros((1, 1, n, n))
    mask[0, 0][~torch.from_numpy(allowed)] = torch.finfo(torch.float32).min
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = len(r.prompt_ids)
    return float(sum(logp[p - 1 + j, t].item() for j, t in enumerate(r.target_ids)))
