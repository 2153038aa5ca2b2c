"""The pool of evaluated coalitions: packed mask keys, the pool's checks, and the planned
coalitions' utilities looked up from it (re-exported by :mod:`.base`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from ...errors import EstimatorError, MaskError

__all__ = ("check_pool", "gather", "pool_lookup", "row_keys")

logger = logging.getLogger("coalescence.attribution.estimators.base")  # where the pool's warnings always came from


def row_keys(masks: np.ndarray) -> list[bytes]:
    """Pack each row of a boolean matrix to its mask bytes.

    Args:
        masks: ``[m, n_players]`` bool.

    Returns:
        ``m`` byte strings, each ``np.packbits(row, bitorder="little").tobytes()`` (``ceil(n / 8)``
        bytes, pad bits zero), the same bytes as :class:`coalescence.masking.codec.PackedMask`.
    """
    m = masks.shape[0]
    packed = np.ascontiguousarray(np.packbits(masks, axis=1, bitorder="little"))
    width = packed.shape[1]
    buf = packed.tobytes()
    return [buf[r * width : (r + 1) * width] for r in range(m)]


def check_pool(masks: np.ndarray, utilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate a pool and return it as ``(bool [m, n], float64 [m])`` arrays.

    Raises:
        MaskError: ``masks`` is not a 2-D boolean array.
        EstimatorError: ``utilities`` is not 1-D with one value per mask row.
    """
    masks = np.asarray(masks)
    if masks.ndim != 2 or masks.dtype != np.bool_:
        raise MaskError(
            "the pool's masks must be a 2-D bool array [m, n_players], "
            f"got {masks.dtype} of shape {masks.shape}",
            field="masks",
        )
    utilities = np.asarray(utilities, dtype=np.float64)
    if utilities.shape != (masks.shape[0],):
        raise EstimatorError(
            f"the pool has {masks.shape[0]} masks but utilities of shape {utilities.shape}; "
            "pass one utility per mask row"
        )
    return masks, utilities


def pool_lookup(masks: np.ndarray, utilities: np.ndarray) -> dict[bytes, float]:
    """Map each pooled coalition's packed mask bytes to its utility.

    Duplicate rows are allowed; when a duplicate carries a different utility the first one is kept
    and a warning is logged once per call.

    Args:
        masks: ``[m, n_players]`` bool coalitions.
        utilities: ``[m]`` float64 utilities (nats).

    Returns:
        ``{np.packbits(row, bitorder="little").tobytes(): utility}`` over the distinct rows.

    Raises:
        MaskError: ``masks`` is not a 2-D boolean array.
        EstimatorError: ``utilities`` does not have one value per mask row.
    """
    masks, utilities = check_pool(masks, utilities)
    lookup: dict[bytes, float] = {}
    conflicts = 0
    for key, value in zip(row_keys(masks), utilities.tolist(), strict=True):
        kept = lookup.setdefault(key, value)
        if kept != value and not (math.isnan(kept) and math.isnan(value)):
            conflicts += 1
    if conflicts:
        logger.warning(
            "pool holds %s duplicate coalitions with differing utilities; kept the first", conflicts
        )
    return lookup


def gather(lookup: dict[bytes, float], keys: Sequence[bytes], method: str) -> np.ndarray:
    """Utilities of the planned coalitions ``keys`` from a pool lookup.

    Args:
        lookup: from :func:`pool_lookup`.
        keys: packed masks of the planned coalitions.
        method: estimator name, for the error message.

    Returns:
        ``[len(keys)]`` float64 utilities, in the order of ``keys``.

    Raises:
        EstimatorError: some planned coalitions are missing from the pool, or have non-finite
            utilities.
    """
    missing = sum(1 for k in keys if k not in lookup)
    if missing:
        raise EstimatorError(
            f"the pool misses {missing} of the {len(keys)} coalitions planned by {method}; "
            "evaluate the whole plan before fitting"
        )
    out = np.fromiter((lookup[k] for k in keys), dtype=np.float64, count=len(keys))
    bad = int(np.count_nonzero(~np.isfinite(out)))
    if bad:
        raise EstimatorError(
            f"{bad} of the {len(keys)} coalitions planned by {method} have non-finite utilities; "
            "check the backend's outputs"
        )
    return out
