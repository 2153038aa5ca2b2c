"""Hydration from the archive: archived rows into the hot store and the measurements, and a
game's pool read back from them with no model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa

from ..masking.codec import PackedMask
from ..masking.policies import AbsencePolicy
from ..pipeline import Measurement
from ..scheduler.store import ResultStore
from ..snapshot import ConversationSnapshot
from ..utility import ResolvedUtility
from .keys import UTILITY, game_utility, key_for

__all__ = ("fill_measurements", "fill_store", "pool_from_store")


def fill_store(store: ResultStore, rows: pa.Table) -> int:
    """Load archive rows (``coalition_key``, ``utility``) into a result store; returns the count."""
    if rows.num_rows == 0:
        return 0
    store.update(zip(rows["coalition_key"].to_pylist(), rows["utility"].to_pylist(), strict=True))
    return rows.num_rows


def fill_measurements(measurements: dict[str, Measurement], rows: pa.Table) -> int:
    """Load the archived measurements (per-token log-probabilities or generated texts) by evaluation key.

    Returns:
        The number of rows that carried a measurement (older archives carry none).
    """
    if rows.num_rows == 0:
        return 0
    keys = rows["evaluation_key"].to_pylist()
    logprobs = rows["token_logprobs"].to_pylist()
    texts = rows["generated_texts"].to_pylist()
    count = 0
    for key, lp, gen in zip(keys, logprobs, texts, strict=True):
        if key is None or key in measurements:
            continue
        if lp is not None:
            measurements[key] = np.asarray(lp, dtype=np.float32)
        elif gen is not None:
            measurements[key] = tuple(gen)
        else:
            continue
        count += 1
    return count


def pool_from_store(
    store: ResultStore,
    snapshot: ConversationSnapshot,
    policy: AbsencePolicy,
    model: Mapping[str, str],
    coalitions: Iterable[np.ndarray],
    *,
    utility: ResolvedUtility | None = None,
    measurements: Mapping[str, Measurement] | None = None,
    game: str = "exact",
) -> tuple[np.ndarray, np.ndarray, int]:
    """The stored utilities of the distinct coalitions among ``coalitions``, with no model.

    A coalition is found by its coalition key in ``store``, or else (given ``measurements``) its
    value is reduced from its evaluation's measurement under ``utility``.

    Args:
        utility: the utility (default: ``logprob`` over the whole target).
        measurements: measurements by evaluation key (see :func:`fill_measurements`).
        game: ``"exact"`` (default) or the proxy game whose rows to take (:func:`game_utility`).

    Returns:
        ``masks`` ``[m, n_players]`` bool and ``utilities`` ``[m]`` float64 (the utility's unit)
        of the coalitions found, and the number of distinct coalitions missing.
    """
    ckey = game_utility(utility.coalition_utility() if utility is not None else UTILITY, game)
    ekey = game_utility(utility.evaluation_utility(), game) if utility is not None else None
    seen: set[bytes] = set()
    found, values = [], []
    missing = 0
    for row in coalitions:
        mask = PackedMask.from_bools(np.asarray(row, dtype=bool))
        if mask.words in seen:
            continue
        seen.add(mask.words)
        value = store.get(key_for(snapshot, policy, model, mask, utility=ckey))
        if value is None and measurements and utility is not None and ekey is not None:
            measured = measurements.get(key_for(snapshot, policy, model, mask, utility=ekey))
            if measured is not None:
                if utility.spec.teacher_forced:
                    value = utility.from_token_logprobs(measured)
                else:
                    value = utility.from_generations(measured, snapshot.target)
        if value is None:
            missing += 1
        else:
            found.append(mask.to_bools())
            values.append(value)
    masks = np.array(found, dtype=bool).reshape(len(found), snapshot.n_players)
    return masks, np.array(values, dtype=np.float64), missing
