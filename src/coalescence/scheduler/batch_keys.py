"""Batch keys: which collated rows may share a backend call.

Two requests share a call iff their batch keys match. A key is the SHA-256 of the canonical JSON
of the call-scoped kwargs (seed and stop strings included), the sorted key set of the per-row
runtime kwargs, a single-candidate flag and the caller's ``key_extra`` (for scoring: model, call
kind (score, proxy, generate)), plus the length bucket of requests admitted with ``n_tokens`` when
the collator has :class:`~coalescence.scheduler.buckets.LengthBuckets` (and, for rows that share
cached tokens, such as the proxy game's, the count of those tokens). Per-row values never enter
it. :class:`BatchKeyMemo` serves the keys of the handful of distinct requests a run makes
without hashing again.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ("BatchKeyMemo", "batch_key", "canonical")

_MEMO_SCALARS = frozenset((str, int, float, bool, type(None)))
_MEMO_SIZE = 4096


def canonical(value: Any, where: str) -> Any:
    """A JSON-encodable canonical form of ``value`` (tuples and lists alike, dict keys sorted).

    Args:
        value: None, bool, int, float (non-finite ones tagged), str, bytes, numpy scalars, or
            lists, tuples and string-keyed mappings of them.
        where: the setting named by an error (e.g. ``"call_kwargs"``).

    Returns:
        The value as JSON-encodable lists, dicts and scalars.

    Raises:
        ConfigError: a value with no canonical encoding, or a mapping key that is not a string.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, Mapping):
        out = {}
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"mapping keys must be strings, got {key!r}", field=where)
            out[key] = canonical(value[key], f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [canonical(v, where) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return canonical(item(), where)
    raise ConfigError(
        f"cannot enter a batch key: {value!r} ({type(value).__name__}); use str, int, float, bool, "
        "None, bytes, or lists/tuples/dicts of them",
        field=where,
    )


def batch_key(
    call_kwargs: Mapping[str, Any],
    row_keys: frozenset[str] | set[str],
    *,
    single_candidate: bool,
    key_extra: tuple[Any, ...] = (),
) -> str:
    """The SHA-256 batch key of a request (two requests may share a call iff their keys match).

    Args:
        call_kwargs: the effective call-scoped kwargs (static call-scoped + per request).
        row_keys: the names of the effective per-row runtime kwargs (their values never enter).
        single_candidate: whether the request asks for exactly one candidate.
        key_extra: what else makes rows batchable for the backend (model, utility, length bucket).

    Returns:
        64 lowercase hex digits.

    Raises:
        ConfigError: a value that has no canonical encoding (e.g. an arbitrary object).
    """
    payload = {
        "call": canonical(call_kwargs, "call_kwargs"),
        "row_keys": sorted(row_keys),
        "single": bool(single_candidate),
        "extra": canonical(tuple(key_extra), "key_extra"),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class BatchKeyMemo:
    """:func:`batch_key`, memoised for hashable inputs (most requests share a handful of keys).

    Keys of scalar-valued call kwargs and extras are kept (at most 4,096); type tags keep ``1``,
    ``1.0`` and ``True`` apart, as the canonical encoding does, and floats go by ``repr`` so
    ``0.0`` and ``-0.0`` (equal, but encoded apart) do too. Other inputs are hashed every time.
    """

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[tuple[Any, ...], str] = {}

    def __call__(self, call: Mapping[str, Any], row: Mapping[str, Any], single: bool, extra: tuple[Any, ...]) -> str:
        """The batch key of effective call kwargs ``call``, row kwargs ``row`` (their names enter),
        the single-candidate flag and ``extra``: 64 lowercase hex digits (see :func:`batch_key`).

        Raises:
            ConfigError: a value that has no canonical encoding.
        """
        tagged = []
        for v in extra:
            t = type(v)
            if t not in _MEMO_SCALARS:
                return batch_key(call, set(row), single_candidate=single, key_extra=extra)
            tagged.append((t, repr(v) if t is float else v))
        if call or row:
            for v in call.values():
                if type(v) not in _MEMO_SCALARS:
                    return batch_key(call, set(row), single_candidate=single, key_extra=extra)
            memo: tuple[Any, ...] = (
                tuple((k, type(v), repr(v) if type(v) is float else v) for k, v in sorted(call.items())),
                tuple(sorted(row)),
                single,
                tuple(tagged),
            )
        else:
            memo = ((), (), single, tuple(tagged))
        key = self._memo.get(memo)
        if key is None:
            key = batch_key(call, set(row), single_candidate=single, key_extra=extra)
            if len(self._memo) < _MEMO_SIZE:
                self._memo[memo] = key
        return key
