"""Packed coalition masks and coalition keys.

A coalition is a subset S of the players; its mask has bit i set when player i is present.
:class:`PackedMask` stores it in little-endian bit order (bit i lives in byte ``i // 8`` at bit
``i % 8``, as ``numpy.packbits(..., bitorder="little")``), with the trailing pad bits of the last
byte zero, so equal coalitions have equal bytes. :func:`coalition_key` hashes everything that
changes a coalition's utility and nothing else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MaskError

__all__ = ("KEY_SCHEMA", "PackedMask", "coalition_key", "pack_rows", "unpack_rows")

KEY_SCHEMA = 2
"""Version of the coalition key's canonical encoding; bump it when the encoding or the rendering
rules change (so no archived value is served for a game it was not computed on). 2: the model's
content fingerprint; removal keeps line structure; answers located in each coalition's full
rendering. Schema-1 keys (no fingerprint) are still computed for replaying older archives."""


@dataclass(frozen=True, slots=True)
class PackedMask:
    """A coalition mask packed into bytes.

    Args:
        words: ``ceil(n_bits / 8)`` bytes, little-endian bit order, trailing pad bits zero.
        n_bits: number of players n (>= 0).

    Raises:
        MaskError: negative ``n_bits``, wrong byte length, or a pad bit set.
    """

    words: bytes
    n_bits: int

    def __post_init__(self) -> None:
        words, n_bits = self.words, self.n_bits
        if (  # the common case, in one expression (exact types; others take the checks below)
            type(words) is bytes and type(n_bits) is int and n_bits >= 0 and len(words) == (n_bits + 7) >> 3
            and not (n_bits & 7 and words[-1] >> (n_bits & 7))
        ):
            return
        if not isinstance(self.words, bytes):
            raise MaskError(f"words must be bytes, got {type(self.words).__name__}", field="mask")
        if not isinstance(self.n_bits, int) or self.n_bits < 0:
            raise MaskError(f"n_bits must be a non-negative int, got {self.n_bits!r}", field="mask")
        need = (self.n_bits + 7) // 8
        if len(self.words) != need:
            raise MaskError(
                f"{self.n_bits} bits need {need} bytes, got {len(self.words)}", field="mask"
            )
        spare = need * 8 - self.n_bits
        if spare and self.words[-1] >> (8 - spare):
            raise MaskError(
                f"pad bits above bit {self.n_bits - 1} must be zero (last byte "
                f"0x{self.words[-1]:02x})",
                field="mask",
            )

    @classmethod
    def from_bools(cls, row: Any) -> PackedMask:
        """Pack a 1-D boolean row ``[n_players]`` (True = present).

        Raises:
            MaskError: the row is not one-dimensional or not boolean.
        """
        arr = np.asarray(row)
        if arr.ndim != 1:
            raise MaskError(f"a mask row must be 1-D, got shape {arr.shape}", field="mask")
        if arr.dtype is not _BOOL and arr.dtype != np.bool_:  # identity first: numpy's one bool dtype
            raise MaskError(f"a mask row must be bool, got dtype {arr.dtype}", field="mask")
        return cls(np.packbits(arr, bitorder="little").tobytes(), int(arr.shape[0]))

    @classmethod
    def from_indices(cls, present: Any, n_bits: int) -> PackedMask:
        """The coalition of the given player indices among ``n_bits`` players.

        Raises:
            MaskError: an index outside ``[0, n_bits)``.
        """
        row = np.zeros(n_bits, dtype=bool)
        idx = np.asarray(list(present), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n_bits):
            raise MaskError(f"player index out of range [0, {n_bits})", field="mask")
        row[idx] = True
        return cls.from_bools(row)

    def to_bools(self) -> np.ndarray:
        """The mask as a ``[n_bits]`` bool array."""
        bits = np.unpackbits(np.frombuffer(self.words, dtype=np.uint8), bitorder="little")
        return bits[: self.n_bits].astype(bool)

    def count(self) -> int:
        """Number of present players |S|."""
        return int(sum(b.bit_count() for b in self.words))

    def __contains__(self, player: int) -> bool:
        if not 0 <= player < self.n_bits:
            return False
        return bool(self.words[player >> 3] >> (player & 7) & 1)

    def hex(self) -> str:
        """The mask bytes as lowercase hex (little-endian bit order)."""
        return self.words.hex()


def pack_rows(masks: Any) -> list[PackedMask]:
    """Pack every row of a ``[m, n]`` bool array."""
    arr = np.asarray(masks)
    if arr.ndim != 2 or arr.dtype != np.bool_:
        raise MaskError(f"masks must be a 2-D bool array, got {arr.dtype} {arr.shape}", field="mask")
    packed = np.packbits(arr, axis=1, bitorder="little")
    return [PackedMask(row.tobytes(), int(arr.shape[1])) for row in packed]


def unpack_rows(masks: list[PackedMask]) -> np.ndarray:
    """Unpack masks of equal width into a ``[m, n]`` bool array.

    Raises:
        MaskError: masks of different widths.
    """
    if not masks:
        return np.zeros((0, 0), dtype=bool)
    n = masks[0].n_bits
    if any(m.n_bits != n for m in masks):
        raise MaskError("masks have different numbers of players", field="mask")
    raw = np.frombuffer(b"".join(m.words for m in masks), dtype=np.uint8).reshape(len(masks), -1)
    return np.unpackbits(raw, axis=1, bitorder="little")[:, :n].astype(bool)


_BOOL = np.dtype(np.bool_)

_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode
"""``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``, built once
(``json.dumps`` with non-default options builds a new encoder on every call)."""


def _canonical(obj: Any) -> bytes:
    return _ENCODE(obj).encode()


_SCALARS = frozenset((str, int, float, bool, type(None)))
_KEY_MEMO_LIMIT = 4096
_key_memo: dict[tuple[Any, ...], tuple[bytes, bytes, bytes]] = {}


def _signature(params: Any) -> tuple[Any, ...] | None:
    """A hashable stand-in for a flat mapping whose equality implies an equal canonical encoding
    (type tags keep 1, 1.0 and True apart; floats by ``repr`` so -0.0 and 0.0 differ), or
    ``None`` when it is not a flat mapping (it is then encoded in full, as written)."""
    if type(params) is not dict and not isinstance(params, Mapping):  # dict: no ABC check
        return None
    if not params:
        return ()
    out = []
    for k, v in params.items():
        t = type(v)
        if type(k) is not str or t not in _SCALARS:
            return None
        out.append((k, t, repr(v) if t is float else v))
    return tuple(out)


def _key_parts(
    snapshot_id: str, policy_id: str, policy_params: Mapping[str, Any], model: dict[str, Any],
    utility: Mapping[str, Any], generation: Mapping[str, Any] | None, schema: int,
) -> tuple[bytes, bytes, bytes]:
    """The canonical encoding of a key's payload cut around its two per-coalition fields.

    The payload's keys sort as generation, mask, model, n_bits, policy, schema, snapshot_id,
    utility, and a nested value encodes alone as it does inside the whole (no indentation), so
    ``head + mask_hex + middle + str(n_bits) + tail`` is byte for byte ``_canonical(payload)``.
    """
    enc = _ENCODE
    head = '{"generation":' + enc(dict(generation or {})) + ',"mask":"'
    middle = '","model":' + enc(model) + ',"n_bits":'
    tail = (
        ',"policy":' + enc({"id": policy_id, "params": dict(policy_params)}) + ',"schema":' + enc(schema)
        + ',"snapshot_id":' + enc(snapshot_id) + ',"utility":' + enc(dict(utility)) + "}"
    )
    return head.encode(), middle.encode(), tail.encode()


def coalition_key(
    *,
    snapshot_id: str,
    mask: PackedMask,
    policy_id: str,
    policy_params: Mapping[str, Any],
    model_id: str,
    model_revision: str,
    dtype: str,
    utility: Mapping[str, Any],
    generation: Mapping[str, Any] | None = None,
    model_sha256: str | None = None,
    template_now: str | None = None,
) -> str:
    """The identity of one coalition's utility value.

    SHA-256 (64 hex chars) over the canonical JSON encoding (sorted keys, compact, UTF-8) of every
    input that changes the value: the snapshot, the packed mask bytes and n_bits, the absence policy
    id and parameters, the model id, revision, content fingerprint and dtype, the utility spec and
    the generation config (including its seed). Batch size, concurrency and timing never enter it.

    Args:
        model_sha256: the model's content fingerprint (``""`` when unknown). Keys carrying it are
            of schema :data:`KEY_SCHEMA` (the rendering rules of this version: structure-keeping
            removal, answers located in each coalition's full rendering); ``None`` computes a
            schema-1 key, as archives written before fingerprints recorded them (replay only).
        template_now: the instant (ISO) a chat template that renders the date was pinned to, or
            ``None`` for a template that writes no date (the key is then unchanged).

    Raises:
        MaskError: ``mask`` is not a :class:`PackedMask`.
    """
    if not isinstance(mask, PackedMask):
        raise MaskError(f"mask must be a PackedMask, got {type(mask).__name__}", field="mask")
    schema = KEY_SCHEMA if model_sha256 is not None else 1
    n_bits = mask.n_bits
    # the fixed part of the payload is encoded once per distinct setting (one per snapshot, policy
    # and utility in a run), not once per coalition; _key_parts says why the bytes are the same
    memo: tuple[Any, ...] | None = None
    parts = None
    sigs = (_signature(policy_params), _signature(utility), _signature(generation) if generation else ())
    if (
        None not in sigs and type(n_bits) is int and type(snapshot_id) is str and type(policy_id) is str
        and type(model_id) is str and type(model_revision) is str and type(dtype) is str
        and (model_sha256 is None or type(model_sha256) is str) and (template_now is None or type(template_now) is str)
    ):
        memo = (snapshot_id, policy_id, model_id, model_revision, dtype, model_sha256, template_now, *sigs)
        parts = _key_memo.get(memo)
    if parts is None:
        model: dict[str, Any] = {"id": model_id, "revision": model_revision, "dtype": dtype}
        if model_sha256 is not None:
            model["sha256"] = model_sha256
        if template_now is not None:
            model["template_now"] = template_now
        if memo is None:  # nested or unusual values: the whole payload, encoded as written
            payload = {
                "schema": schema,
                "snapshot_id": snapshot_id,
                "mask": mask.words.hex(),
                "n_bits": n_bits,
                "policy": {"id": policy_id, "params": dict(policy_params)},
                "model": model,
                "utility": dict(utility),
                "generation": dict(generation or {}),
            }
            return hashlib.sha256(_canonical(payload)).hexdigest()
        parts = _key_parts(snapshot_id, policy_id, policy_params, model, utility, generation, schema)
        if len(_key_memo) < _KEY_MEMO_LIMIT:
            _key_memo[memo] = parts
    head, middle, tail = parts
    return hashlib.sha256(head + mask.words.hex().encode() + middle + str(n_bits).encode() + tail).hexdigest()
