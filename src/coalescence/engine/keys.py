"""Coalition keys: the content address of a coalition's value, and of its model evaluation.

A key hashes the snapshot, the absence policy, the model identity, the packed mask and the utility
(:func:`~coalescence.masking.codec.coalition_key`); a proxy game's rows add the game to the
utility part (:func:`game_utility`), so they never share a key with an exact row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..backends.base import ScoringBackend
from ..masking.codec import PackedMask, coalition_key
from ..masking.policies import AbsencePolicy
from ..masking.render import ChatRenderer
from ..snapshot import ConversationSnapshot

__all__ = ("UTILITY", "game_utility", "key_for", "model_identity")

UTILITY: dict[str, Any] = {"kind": "logprob", "reduce": "sum", "unit": "nats"}
"""The key of the default utility: log p(target tokens | masked prompt), summed, in nats."""


def key_for(
    snapshot: ConversationSnapshot,
    policy: AbsencePolicy,
    model: Mapping[str, str],
    mask: PackedMask,
    *,
    utility: Mapping[str, Any] = UTILITY,
) -> str:
    """The coalition key of ``mask`` for a model identity ``{"id", "revision", "dtype", "sha256"}``
    (a model record without ``sha256``, from an archive written before fingerprints, gives the
    schema-1 key it was archived under).

    Args:
        utility: the utility part of the key: :meth:`ResolvedUtility.coalition_utility` for a
            coalition key, :meth:`ResolvedUtility.evaluation_utility` for an evaluation key
            (default: the ``logprob`` utility over the whole target).
    """
    return coalition_key(
        snapshot_id=snapshot.snapshot_id,
        mask=mask,
        policy_id=policy.id,
        policy_params=policy.params(),
        model_id=model["id"],
        model_revision=model["revision"],
        dtype=model["dtype"],
        utility=utility,
        model_sha256=model.get("sha256"),
        template_now=model.get("template_now"),
    )


def game_utility(utility: Mapping[str, Any], game: str) -> Mapping[str, Any]:
    """The utility part of a key in ``game``: the utility itself for the exact game (its keys are
    those of every archive written before proxy games), with ``"game"`` added for a proxy game,
    so a proxy row never shares a key with an exact one."""
    return utility if game == "exact" else {**utility, "game": game}


def model_identity(backend: ScoringBackend, renderer: ChatRenderer) -> dict[str, str]:
    """The model identity that enters coalition keys: ``{"id", "revision", "dtype", "sha256"}``
    (``sha256``: the content fingerprint of the weight, tokenizer and template files, ``""`` for a
    model with no files), and ``template_now``, the pinned instant, when the chat template renders
    a date (the same model renders other prompts on another day)."""
    model = {
        "id": backend.model_id,
        "revision": backend.revision,
        "dtype": backend.dtype,
        "sha256": str(backend.fingerprint or ""),
    }
    if renderer.renders_date:
        model["template_now"] = renderer.now.isoformat()
    return model
