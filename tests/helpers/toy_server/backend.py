"""The toy server backend: rows go to ``POST {url}/score`` as JSON token ids, log-probabilities
come back; everything else (refusing long rows, translating errors, validating and counting) is
the envelope of :class:`~coalescence.backends.base.BackendBase`."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from coalescence.backends.base import BackendBase
from coalescence.backends.models import load_config, load_tokenizer, model_context, model_fingerprint
from coalescence.backends.rows import ScoreRequest, ScoreResult
from coalescence.errors import BackendUnavailable


class ToyServerBackend(BackendBase):
    """Scores teacher-forced rows on a toy scoring server (no generation, no proxy game)."""

    call_failed = "the toy server failed"

    def __init__(self, url: str, tokenizer: Any, *, model_id: str, revision: str, fingerprint: str, max_context: int, max_batch_size: int) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.model_id, self.revision, self.fingerprint = model_id, revision, fingerprint
        self.dtype = "server"  # the server computes in its own dtype
        self.max_context, self.max_batch_size = max_context, max_batch_size
        self.pads_rows = False

    def identity(self) -> dict[str, str]:
        return {"backend": "toy-server"}

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        rows = [{"prompt_ids": list(r.prompt_ids), "target_ids": list(r.target_ids)} for r in batch]
        request = urllib.request.Request(f"{self.url}/score", data=json.dumps({"rows": rows}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            logprobs = json.loads(response.read())["logprobs"]
        out = []
        for r, lp in zip(batch, logprobs, strict=True):
            values = np.asarray(lp, dtype=np.float32)
            out.append(ScoreResult(token_logprobs=values, utility=float(values.astype(np.float64).sum()), tokens_computed=r.n_tokens))
        return out


def load_toy_server(source: Any, settings: Any, preloaded: Any) -> ToyServerBackend:
    """The loader: the settings whole (its URL, its batch size), the model's tokenizer and context
    read here unless the caller read them already (``preloaded``)."""
    if not settings.server_url:  # the settings check refuses this first, asking the kind's capabilities
        raise BackendUnavailable("the toy server needs its URL", field="server_url")
    tokenizer = preloaded.tokenizer if preloaded.tokenizer is not None else load_tokenizer(source)
    config = preloaded.config if preloaded.config is not None else load_config(source)
    return ToyServerBackend(
        settings.server_url,
        tokenizer,
        model_id=source.model_id,
        revision=source.revision,
        fingerprint=preloaded.fingerprint if preloaded.fingerprint is not None else model_fingerprint(source),
        max_context=model_context(config, tokenizer),
        max_batch_size=settings.batch_size or 8,
    )
