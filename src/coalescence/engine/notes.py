"""What an explanation records about its utility and its prompt, beside the values."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..masking.policies import AbsencePolicy
from ..masking.render import ChatRenderer, TargetTokens
from ..snapshot import ConversationSnapshot
from ..utility import ResolvedUtility

__all__ = ("template_notes", "utility_detail")


def utility_detail(resolved: ResolvedUtility) -> dict[str, Any]:
    """The utility of an explanation as recorded in its JSON document."""
    out = resolved.spec.to_dict()
    out["description"] = resolved.describe()
    if resolved.tokens is not None:
        out["target_tokens"] = list(resolved.tokens)
        out["char_span"] = list(resolved.char_span or ())
        out["span_text"] = resolved.span_text
        out["span_cuts_token"] = resolved.cut
    return out


def template_notes(
    renderer: ChatRenderer,
    target: TargetTokens,
    snapshot: ConversationSnapshot,
    policy: AbsencePolicy,
    *,
    empty: np.ndarray | None = None,
) -> tuple[str, ...]:
    """What the chat template does to ``snapshot``'s prompts that a reader of its values should
    know, one sentence each: the target's own notes, a pinned date, text the template inserts
    before the answer, a template lead joined to the first answer token, special-token text in
    the conversation, and a default system prompt the template injects.

    Args:
        empty: ``[n_players]`` bool, the game's emptiest coalition: every player absent unless
            given (a hierarchy's refined fine game holds its other players present, so a system
            player held present is never absent there).
    """
    notes: tuple[str, ...] = target.notes()
    if renderer.renders_date:
        notes += (f"the template renders a date: pinned to {renderer.now:%Y-%m-%d}",)
    if target.inserted:
        notes += (
            f"the chat template writes {target.inserted!r} between the assistant header and the answer; "
            "it is prompt (conditioned on, not scored)",
        )
    if target.lead:
        notes += (
            f"the answer's first scored token starts with the template's {target.lead!r} (the "
            "tokenizer joins them); the answer's first word is scored with it",
        )
    found = renderer.special_text((*(m.content for m in snapshot.conversation.messages), snapshot.target))
    if found:
        notes += (
            f"the conversation contains the special-token text {', '.join(map(repr, found))}; it is "
            "encoded as text, never as the control token",
        )
    return notes + _default_system_notes(renderer, snapshot, policy, empty)


def _default_system_notes(
    renderer: ChatRenderer, snapshot: ConversationSnapshot, policy: AbsencePolicy, empty: np.ndarray | None
) -> tuple[str, ...]:
    if not renderer.injects_default_system:
        return ()
    messages = snapshot.conversation.messages
    if not any(m.role == "system" for m in messages):
        return (
            "the chat template injects its own default system prompt because the conversation "
            "has no system message; every coalition is scored with it",
        )
    none = np.zeros(snapshot.n_players, dtype=bool) if empty is None else np.asarray(empty, dtype=bool)
    if not any(m.role == "system" for m in policy.render(snapshot, none)):
        return (
            "the chat template injects its own default system prompt in coalitions where every "
            "system player is absent (the system message is removed)",
        )
    return ()
