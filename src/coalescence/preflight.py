"""Checks that need the input and the model's tokenizer, not its weights: run before they load.

Loading weights takes seconds to minutes; everything the input, the chat template and the
tokenizer alone can reveal is checked first (:func:`check_game`):

- the full conversation renders, the template renders the answer verbatim, and prompt and answer
  tokens separate (:meth:`~coalescence.masking.render.ChatRenderer.target_tokens`);
- the conversation with its answer fits the model's context;
- every coalition the estimator's plan needs renders with the model's chat template (a template
  that requires alternating roles refuses the coalition that drops one turn of a multi-turn chat)
  and fits the context. A plan of more than ``exhaustive_limit`` distinct coalitions is checked on
  its empty, full and leave-one-out coalitions plus one coalition per *message structure* (which
  messages survive the removal, which decides every refusal seen in real templates); the rest is
  rendered when evaluated.

A refusal raises :class:`~coalescence.errors.TemplateRefused` with one line naming the coalition,
the roles it renders and the template's own words, and the remedies (``--unit exchange``,
``--merge-adjacent``, ``--empty-turns empty``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass

import numpy as np

from .snapshot import ConversationSnapshot
from .errors import InputError, TemplateRefused
from .masking.codec import PackedMask
from .masking.policies import AbsencePolicy
from .masking.render import ChatRenderer, TargetTokens

__all__ = ("REMEDIES", "PreflightReport", "check_game", "describe_coalition", "refusal", "remedies")

REMEDIES = (
    ("exchange", "--unit exchange (a user turn and the reply to it form one player)"),
    ("merge_adjacent", "--merge-adjacent (adjacent messages of one role are joined)"),
    ("empty_turns", "--empty-turns empty (a message whose players are all absent stays, empty)"),
)
"""The remedies for templates that require alternating roles (see docs/rendering.md, "Chat templates")."""


def remedies(snapshot: ConversationSnapshot, policy: AbsencePolicy, roles: Sequence[str], reason: str) -> str:
    """What to tell a user whose template refused a coalition with these rendered ``roles``: the
    alternation remedies not already in use when the refusal is about alternation (the template
    says so, two turns of one role meet, or the conversation starts with the assistant), else
    that this template cannot render such a coalition."""
    params = policy.params()
    adjacent = any(a == b and a in ("user", "assistant") for a, b in zip(roles, roles[1:]))
    starts_wrong = bool(roles) and [r for r in roles if r != "system"][:1] == ["assistant"]
    if "alternat" in reason.lower() or adjacent or starts_wrong:
        used = {"exchange": snapshot.unit == "exchange", "merge_adjacent": bool(params.get("merge_adjacent")),
                "empty_turns": params.get("empty_turns") == "empty"}  # fmt: skip
        left = [text for name, text in REMEDIES if not used[name]]
        if left:
            return "templates that require alternating roles need " + ", or ".join(left)
    return "this template cannot render such a coalition: choose another --unit or --absence-policy"


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightReport:
    """What :func:`check_game` checked.

    Attributes:
        target: the scored target tokens of the full conversation (``None`` when checked with a
            provisional answer, before the answer is generated).
        coalitions: distinct coalitions rendered.
        exhaustive: whether every coalition of the plan was rendered.
        longest: the longest rendered coalition, prompt and answer, in tokens.
    """

    target: TargetTokens | None
    coalitions: int
    exhaustive: bool
    longest: int


def describe_coalition(snapshot: ConversationSnapshot, present: np.ndarray) -> str:
    """A short name of a coalition for messages: "the empty coalition", "the coalition without
    user[2]", "the coalition with only system[0]", or the absent labels."""
    absent = [p.label for p in snapshot.players if not present[p.index]]
    kept = [p.label for p in snapshot.players if present[p.index]]
    if not kept:
        return "the empty coalition (every player absent)"
    if not absent:
        return "the full conversation"
    if len(absent) == 1:
        return f"the coalition without {absent[0]}"
    if len(kept) == 1:
        return f"the coalition with only {kept[0]}"
    shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
    return f"the coalition without {shown}"


def refusal(
    snapshot: ConversationSnapshot, policy: AbsencePolicy, present: np.ndarray, messages: Sequence[Any], exc: TemplateRefused, *, during: bool = False
) -> TemplateRefused:
    """The one-line error for a template that refused coalition ``present``: which coalition, its
    roles, the template's words and the remedies (``during``: met during a run, not before it)."""
    roles = [m.role for m in messages] + ["assistant"]
    shown = ", ".join(roles[:-1]) + (", " if messages else "") + "assistant (the answer)"
    words = f" ({exc.reason})" if exc.reason else f": {exc.message}"
    when = (
        " during the run (a plan of more than 4,096 coalitions is checked on a subset before it; the "
        "coalitions evaluated so far are in the archive)" if during else ""
    )
    return TemplateRefused(
        f"the model's chat template refuses {describe_coalition(snapshot, present)}, whose roles are "
        f"[{shown}]{words}{when}; {remedies(snapshot, policy, roles, exc.reason)}",
        field=exc.field,
        reason=exc.reason,
    )


def _structure(snapshot: ConversationSnapshot, policy: AbsencePolicy, present: np.ndarray) -> tuple[str, ...]:
    return tuple(m.role + ("" if m.content else "-") for m in policy.render(snapshot, present))


def _needed(
    snapshot: ConversationSnapshot, policy: AbsencePolicy, plan: Iterable[np.ndarray] | None, limit: int
) -> tuple[list[np.ndarray], bool]:
    """The coalitions to render: the plan's distinct ones, or the essential ones of a large plan."""
    n = snapshot.n_players
    essential = [np.ones(n, dtype=bool)]
    for i in range(n):
        row = np.ones(n, dtype=bool)
        row[i] = False
        essential.append(row)
    essential.append(np.zeros(n, dtype=bool))
    distinct: dict[bytes, np.ndarray] = {}
    for row in essential:
        distinct.setdefault(PackedMask.from_bools(row).words, row)
    exhaustive = True
    extra: dict[bytes, np.ndarray] = {}
    structures: dict[tuple[str, ...], np.ndarray] = {}
    for row in plan if plan is not None else ():
        row = np.asarray(row, dtype=bool)
        words = PackedMask.from_bools(row).words
        if words in distinct or words in extra:
            continue
        if exhaustive and len(distinct) + len(extra) < limit:
            extra[words] = row
            continue
        if exhaustive:  # too many: keep one coalition per message structure from here on
            exhaustive = False
            for r in list(distinct.values()) + list(extra.values()):
                structures.setdefault(_structure(snapshot, policy, r), r)
        structures.setdefault(_structure(snapshot, policy, row), row)
    if exhaustive:
        return list(distinct.values()) + list(extra.values()), True
    chosen = dict(distinct)
    for row in structures.values():
        chosen.setdefault(PackedMask.from_bools(row).words, row)
    return list(chosen.values()), False


def check_game(
    renderer: ChatRenderer,
    snapshot: ConversationSnapshot,
    policy: AbsencePolicy,
    plan: Iterable[np.ndarray] | None,
    *,
    max_context: int,
    teacher_forced: bool = True,
    provisional: bool = False,
    exhaustive_limit: int = 4096,
) -> PreflightReport:
    """Render the coalitions a game needs with the model's chat template, before any model call.

    Args:
        renderer: the model's chat renderer (its tokenizer; no weights needed).
        snapshot: the conversation, its answer and players.
        policy: the absence policy.
        plan: the estimator's coalitions (``[n_players]`` bool rows, repeats allowed), or ``None``
            for the essential ones only (full, empty, leave-one-out).
        max_context: the model's context (tokens).
        teacher_forced: scoring prompts (the answer located in each coalition's full rendering)
            when True; generation prompts (messages + assistant header) when False.
        provisional: the snapshot's answer stands in for one still to be generated: only
            template refusals of the generation prompts are checked.
        exhaustive_limit: the most distinct coalitions rendered (module docs).

    Returns:
        A :class:`PreflightReport`.

    Raises:
        TemplateRefused: the template refuses the full conversation or a coalition, or changes
            the answer (one line naming the coalition, its roles, the template's words and the
            remedies).
        InputError: the conversation, or a coalition, does not fit the model's context (field
            ``messages``); prompt and answer tokens cannot be separated.
    """
    target: TargetTokens | None = None
    if not provisional:
        try:
            target = renderer.target_tokens(snapshot, policy)
        except TemplateRefused as exc:
            raise TemplateRefused(
                f"{exc.message}; the model cannot render the input as given (with the original "
                "conversation: every player present)",
                field=exc.field,
            ) from None
        total = len(target.full_prompt_ids) + len(target.ids)
        if total > max_context:
            raise InputError(
                f"the conversation renders to {total} tokens with its answer, more than the model's "
                f"context of {max_context}; shorten the conversation or use a longer-context model",
                field="messages",
            )
    rows, exhaustive = _needed(snapshot, policy, plan, exhaustive_limit)
    answer_tokens = len(target.ids) if target is not None else 0
    longest = 0
    for row in rows:
        messages = policy.render(snapshot, row)
        try:
            if teacher_forced and target is not None:
                text = renderer.scoring_prompt(messages, target)
            else:
                text = renderer.render_prompt(messages)
        except TemplateRefused as exc:
            raise refusal(snapshot, policy, row, messages, exc) from None
        if not provisional:
            n_tokens = len(renderer.encode(text)) + answer_tokens
            longest = max(longest, n_tokens)
            if n_tokens > max_context:
                raise InputError(
                    f"{describe_coalition(snapshot, row)} renders to {n_tokens} tokens with its answer, "
                    f"more than the model's context of {max_context}; use a shorter placeholder or "
                    "conversation, or a longer-context model",
                    field="messages",
                )
    return PreflightReport(target=target, coalitions=len(rows), exhaustive=exhaustive, longest=longest)
