"""A cost model for choosing, per batch, between prefix sharing and a plain batched forward.

Prefix sharing runs fewer token positions than a plain right-padded forward, but not always
faster: a tree-attention row over rows that share little has a dense ``N x (P + N)`` mask over
all its nodes, while a plain batch attends only within each row. So the transformers backend
(:class:`~coalescence.backends.hf.HFBackend`, ``path="auto"``) estimates, per prefix group of a
batch, the seconds of each path and takes the cheaper one.

Cost formula. Each forward a path would run is described by ``(kind, tokens, pairs)``: ``kind``
is ``"causal"`` (a plain right-padded batch, a prefix forward, a single row on its cached prefix)
or ``"tree"`` (a tree-attention row or right-padded suffixes on a repeated cache), ``tokens`` the
positions it runs (padding included) and ``pairs`` the query-key pairs its attention computes
(masked pairs included: ``rows x width^2`` for a padded batch of ``rows`` rows of ``width``
positions, ``N x (P + N)`` for a tree of ``N`` nodes on ``P`` cached positions). Its work in
floating-point operations is (:func:`forward_flops`)

    flops = 2 * W * tokens + 4 * L * H * d * pairs

with ``W`` the model's weights outside the embeddings, ``L`` its layers, ``H * d`` its attention
channels (query heads x head size), and its estimated time is ``flops / rate_kind(flops)``:
the forward rate (FLOP/s) of that kind of forward, measured by a short calibration at a couple
of sizes (:class:`PathRates`) and interpolated linearly in ``log(flops)`` between them (the
nearest measured rate outside them). A path's estimate is the sum over its forwards.

The calibration is measured once per backend (in memory) and, for a fingerprinted model, kept on
disk as JSON under a directory the registry gives (``cache_root()/calibration/``), keyed by
:func:`calibration_key` (model fingerprint, dtype, device, torch threads, machine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ("KINDS", "PATHS", "Forward", "PathRates", "calibration_key", "forward_flops", "load_rates", "model_shape", "save_rates")

logger = logging.getLogger(__name__)

PATHS = ("auto", "shared", "plain")
"""Values of the backend's ``path`` option: choose per prefix group by cost, always share, never share."""

KINDS = ("causal", "tree")
"""Kinds of forward whose rates are calibrated separately."""

Forward = tuple[str, int, int]
"""One forward a path would run: ``(kind, tokens, pairs)`` (see the module docs)."""


def _check_samples(name: str, samples: Any) -> tuple[tuple[float, float], ...]:
    try:
        out = tuple(sorted((float(f), float(r)) for f, r in samples))
    except (TypeError, ValueError):
        raise ConfigError(f"must be (flops, flop/s) pairs, got {samples!r}", field=f"path_rates.{name}") from None
    if not out or any(not (math.isfinite(f) and f > 0 and math.isfinite(r) and r > 0) for f, r in out):
        raise ConfigError(f"needs at least one (flops, flop/s) pair, both finite and > 0, got {samples!r}", field=f"path_rates.{name}")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PathRates:
    """Measured forward rates of the two kinds of forward, at a few sizes each.

    Args:
        causal: ``(flops, flop_per_second)`` pairs (at least one; both > 0) measured on causal
            forwards (plain padded batches, a single row): the work of a forward in FLOPs
            (:func:`forward_flops`) and how many FLOPs per second it ran at.
        tree: the same for tree-attention forwards on a cached prefix.

    Raises:
        ConfigError: an empty list, or a pair that is not two finite positive numbers.
    """

    causal: tuple[tuple[float, float], ...]
    tree: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "causal", _check_samples("causal", self.causal))
        object.__setattr__(self, "tree", _check_samples("tree", self.tree))

    def rate(self, kind: str, flops: float) -> float:
        """The forward rate (FLOP/s) of a ``kind`` forward of ``flops`` FLOPs: linear in
        ``log(flops)`` between the measured sizes, the nearest measured rate outside them.

        Raises:
            ConfigError: ``kind`` not in :data:`KINDS`.
        """
        if kind not in KINDS:
            raise ConfigError(f"unknown kind of forward {kind!r}; use one of {', '.join(KINDS)}", field="kind")
        samples = self.causal if kind == "causal" else self.tree
        if flops <= samples[0][0]:
            return samples[0][1]
        for (f0, r0), (f1, r1) in zip(samples, samples[1:]):
            if flops <= f1:
                w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0)) if f1 > f0 else 1.0
                return r0 + w * (r1 - r0)
        return samples[-1][1]

    def seconds(self, model_shape: tuple[float, float], forwards: Sequence[Forward]) -> float:
        """Estimated seconds of ``forwards`` on a model of ``model_shape``
        (``(2 * W, 4 * L * H * d)``, see :func:`forward_flops`): the sum of ``flops / rate``."""
        total = 0.0
        for kind, tokens, pairs in forwards:
            flops = forward_flops(model_shape, tokens, pairs)
            if flops > 0:
                total += flops / self.rate(kind, flops)
        return total

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``{"causal": [[flops, rate], ...], "tree": [...]}``)."""
        return {"causal": [list(x) for x in self.causal], "tree": [list(x) for x in self.tree]}


def model_shape(model: Any) -> tuple[float, float]:
    """``(2 * W, 4 * L * H * d)`` of a transformers model: FLOPs per token position of its
    weights outside the embeddings, and per query-key pair of its attention (scores and the
    weighted sum of values over every layer and channel)."""
    c = model.config
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    linear = 2.0 * model.num_parameters(exclude_embeddings=True)
    return linear, 4.0 * int(c.num_hidden_layers) * heads * head_dim


def forward_flops(model_shape: tuple[float, float], tokens: int, pairs: int) -> float:
    """FLOPs of one forward: ``2 * W * tokens + 4 * L * H * d * pairs``.

    Args:
        model_shape: ``(2 * W, 4 * L * H * d)`` (:func:`model_shape`).
        tokens: token positions run (padding included).
        pairs: query-key pairs the attention computes (masked ones included).

    Returns:
        Floating-point operations (the LM head of the scored positions left out).
    """
    linear, attention = model_shape
    return linear * tokens + attention * pairs


def calibration_key(*, fingerprint: str, model_id: str, dtype: str, device: str, threads: int) -> str:
    """The file stem of a calibration on disk: SHA-256 (hex, first 32 digits) of the model's
    fingerprint and id, dtype, device, torch's thread count and this machine (host name,
    architecture, processor, CPU count)."""
    parts = {
        "fingerprint": fingerprint,
        "model_id": model_id,
        "dtype": dtype,
        "device": device,
        "threads": int(threads),
        "machine": [platform.node(), platform.machine(), platform.processor(), os.cpu_count()],
        "version": 1,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load_rates(directory: Path, key: str) -> PathRates | None:
    """The calibration stored as ``directory/<key>.json``, or ``None`` when there is none or it
    cannot be read (a damaged file is ignored, and measured again)."""
    path = Path(directory) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return PathRates(causal=data["causal"], tree=data["tree"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        logger.debug("ignoring the calibration file %s: %s", path, exc)
        return None


def save_rates(directory: Path, key: str, rates: PathRates) -> None:
    """Store ``rates`` as ``directory/<key>.json`` (written beside and renamed into place); an
    unwritable directory is logged and ignored (the rates stay in memory)."""
    directory = Path(directory)
    path = directory / f"{key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(rates.to_json()))
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("could not store the calibration in %s: %s", path, exc)
