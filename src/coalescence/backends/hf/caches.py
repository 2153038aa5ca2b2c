"""Key/value cache helpers: a fork of a ``DynamicCache`` that shares its tensors, a prefix cache entry
resumed to a length, and a cache's size in bytes."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ("cache_bytes", "fork_cache", "resumed_cache")


def fork_cache(cache: Any) -> Any:
    """A ``DynamicCache`` that shares ``cache``'s key/value tensors but not its layer objects.

    transformers' dynamic layers never write into their tensors: ``update``, ``crop`` and
    ``batch_repeat_interleave`` assign new ones (``torch.cat``, a slice, a repeat), so a fork can be
    extended, cropped or repeated without touching the cached entry, and costs no copy (a deep copy
    of a 2,500-token entry is 115 MB on SmolLM2-135M). Any other layer kind is deep-copied.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers):
        return copy.deepcopy(cache)
    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in layers]
    return fork


def cache_bytes(cache: Any) -> int:
    """Bytes of the key/value tensors held by a ``DynamicCache``."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def resumed_cache(config: Any, entry_tokens: tuple[int, ...], state: Any, length: int) -> Any:
    """A cache holding the first ``length`` positions of a prefix cache entry (``entry_tokens``,
    ``state``): a fork of it, cropped; an empty ``DynamicCache`` for the model ``config`` when
    ``length`` is 0."""
    if length < 1:
        from transformers import DynamicCache

        return DynamicCache(config=config)
    cache = fork_cache(state)
    if len(entry_tokens) > length:
        cache.crop(-(len(entry_tokens) - length))
    return cache
