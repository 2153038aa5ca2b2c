"""Masking: packed coalition masks, absence policies, and rendering to token ids."""

from .codec import PackedMask, coalition_key, pack_rows, unpack_rows
from .policies import AbsencePolicy, DropPolicy, PlaceholderPolicy, available_policies, get_policy, register_policy
from .render import ChatRenderer, TargetTokens

__all__ = (
    "AbsencePolicy",
    "ChatRenderer",
    "DropPolicy",
    "PackedMask",
    "PlaceholderPolicy",
    "TargetTokens",
    "available_policies",
    "coalition_key",
    "get_policy",
    "pack_rows",
    "register_policy",
    "unpack_rows",
)
