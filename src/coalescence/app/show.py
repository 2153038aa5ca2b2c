"""See a coalition as the model sees it: the rendered prompt of one masked conversation, chat
template applied and special tokens spelled out, and the answer tokens it is scored on.

A coalition is named by ``full``, ``empty``, ``without:LABEL`` (every player but one: the
leave-one-out coalition of LABEL), ``only:LABEL`` (that player alone), or a string of ``0`` and
``1`` with one character per player in player order (``1``: present). The conversation comes from an
input (a JSON, JSONL or Parquet file, segmented by the settings' unit and roles, rendered with the
settings' absence policy and model) or from a run archive (its snapshots, its absence policy, its
model and its recorded date, exactly as the run rendered them). Only the tokenizer is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError, InputError
from .options import Options, SettingsGroup, option
from .settings import RunSettings

__all__ = ("RENDER_OPTIONS", "ShowSettings", "ShownCoalition", "parse_coalition", "show_coalition")


@dataclass(frozen=True, kw_only=True)
class ShowSettings(SettingsGroup):
    """What ``coalescence show`` renders (:func:`show_coalition`'s ``coalition`` and ``index``).

    Args:
        coalition: the coalition spec (module docs).
        conversation: which conversation of a dataset, or snapshot of an archive (0-based).
    """

    title: ClassVar[str] = "show"

    coalition: str = option(
        "full",
        metavar="SPEC",
        help="full, empty, without:LABEL (every player but LABEL), only:LABEL, or one 0/1 per player in order (default: %(default)s)",
    )
    conversation: int = option(0, type=int, metavar="K", help="which conversation of a dataset or snapshot of an archive, from 0 (default: 0)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShownCoalition:
    """One coalition's prompt as the model reads it.

    Attributes:
        name: the coalition as asked for (``"without user[1].s2"``).
        present: ``[n_players]`` bool, in player order.
        labels: every player's label, in player order.
        prompt: the text the answer is scored after (chat template applied, special tokens as text).
        answer: the text of the scored answer tokens (the answer, then the end-of-turn token).
        n_prompt_tokens: the prompt's token count.
        n_answer_tokens: the scored answer tokens.
    """

    name: str
    present: tuple[bool, ...]
    labels: tuple[str, ...]
    prompt: str
    answer: str
    n_prompt_tokens: int
    n_answer_tokens: int

    def format(self) -> str:
        """The coalition, its counts, then the prompt and the answer verbatim between rulers."""
        absent = [label for label, here in zip(self.labels, self.present, strict=True) if not here]
        lines = [
            f"coalition: {self.name} ({sum(self.present)} of {len(self.present)} players present"
            + (f"; absent: {', '.join(absent)}" if absent and len(absent) <= 12 else "")
            + ")",
            f"prompt: {self.n_prompt_tokens} tokens; the answer: {self.n_answer_tokens} tokens scored after it",
            "----- prompt, as the model reads it -----",
            self.prompt,
            "----- the scored answer -----",
            self.answer,
            "-----",
        ]
        return "\n".join(lines)


_LABEL_UNITS = ((r"\.s\d+$", "sentence"), (r"\.p\d+$", "paragraph"), (r"\.w\d+$", "word"), (r"^[a-z]+\[\d+\]$", "turn"))
"""A label's form -> the unit whose players are labelled so (``user[1].s2``: a sentence)."""


def _unit_hint(label: str, labels: Sequence[str]) -> str:
    """`` (LABEL names a sentence: ...)`` when ``label`` has the form of another unit's labels."""
    def unit_of(text: str) -> str | None:
        return next((unit for pattern, unit in _LABEL_UNITS if re.search(pattern, text)), None)

    unit, here = unit_of(label), {unit_of(x) for x in labels}
    if unit is None or unit in here:
        return ""
    return f" ({label} names a {unit}: render the input with the unit {unit}, --unit {unit})"


def parse_coalition(spec: str, labels: Sequence[str]) -> tuple[str, np.ndarray]:
    """``(name, present)`` of a coalition spec (module docs) over players ``labels``.

    Raises:
        ConfigError: an unknown label, a bit string of another length or with other characters, an
            unknown form (field ``coalition``, naming the labels or the forms).
    """
    n = len(labels)
    text = spec.strip()
    if text == "full":
        return "full", np.ones(n, dtype=bool)
    if text == "empty":
        return "empty", np.zeros(n, dtype=bool)
    for prefix, alone in (("without:", False), ("only:", True)):
        if text.startswith(prefix):
            label = text[len(prefix) :]
            if label not in labels:
                shown = ", ".join(labels[:12]) + (", ..." if n > 12 else "")
                raise ConfigError(f"no player {label!r}{_unit_hint(label, labels)}; the players are {shown}", field="coalition")
            present = np.zeros(n, dtype=bool) if alone else np.ones(n, dtype=bool)
            present[list(labels).index(label)] = alone
            return f"{prefix.rstrip(':')} {label}", present
    if text and set(text) <= {"0", "1"}:
        if len(text) != n:
            raise ConfigError(f"a bit string needs one 0 or 1 per player: {n} here, got {len(text)}", field="coalition")
        return text, np.array([c == "1" for c in text], dtype=bool)
    raise ConfigError(
        f"unknown coalition {spec!r}; give full, empty, without:LABEL, only:LABEL or a string of {n} 0s and 1s",
        field="coalition",
    )


def show_coalition(source: Any, coalition: str = "full", *, settings: RunSettings | None = None, index: int = 0, **options: Any) -> ShownCoalition:
    """Render one coalition of an input or of a run archive's snapshot (module docs).

    Args:
        source: an input (path, input dict, messages; see :func:`coalescence.inputs.read_source`)
            or a run archive directory.
        coalition: the coalition spec (module docs).
        settings: an input's :class:`~coalescence.app.settings.RunSettings` (model, unit, roles,
            absence policy, template); ignored for an archive, which carries its own.
        index: which conversation of a dataset, or which snapshot of the archive's last run (0-based).
        **options: settings by name, as :func:`coalescence.explain` takes them (``model``, ``unit``,
            ``roles``, ``absence_policy``...), over ``settings``.

    Returns:
        The :class:`ShownCoalition`.

    Raises:
        InputError: bad input, an index past the end, an input whose answer the model must
            generate first (run ``explain``: the archive then holds it).
        ConfigError: a bad coalition spec or setting.
        TemplateRefused: the chat template refuses the coalition.
        ArchiveError: a damaged archive.
        BackendUnavailable: the model's tokenizer cannot be found.
    """
    from ..backends.registry import load_tokenizer, resolve_model
    from ..masking.render import ChatRenderer

    if index < 0:
        raise ConfigError(f"numbers conversations from 0; got {index}", field="conversation")
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        given = _rendering_options(settings, options)
        if given:
            raise ConfigError(
                "applies to an input; a run archive is shown as its run rendered it (its model, players and policy)",
                field=given[0],
            )
        snapshot, policy, model, now = _from_archive(Path(source), index)
    else:
        from ..snapshot import ConversationSnapshot
        from .explain import ExplainRun

        import dataclasses

        # the rendering's settings alone: no estimator limits a conversation shown
        base = settings if settings is not None else RunSettings()
        if options:
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RunSettings)})
            if unknown:
                raise ConfigError(f"unknown option {unknown[0]!r}; give settings by their names (model, unit, roles, absence_policy, ...)", field=unknown[0])
            base = dataclasses.replace(base, **options)
        base = dataclasses.replace(base, method="loo", budget=None, target_stderr=None, interactions=None, index=None, out=None, html=None, archive=None)
        if _is_out_document(source):
            raise InputError(
                "is an explanation document (--out); show takes an input, or the run archive the explanation names",
                field="SOURCE",
            )
        run = ExplainRun(source, base)
        if not index < len(run.conversations):
            raise InputError(f"the input holds {len(run.conversations)} conversation(s), numbered from 0; got {index}", field="conversation")
        conversation = run.conversations[index]
        if conversation.target is None:
            raise InputError(
                "the conversation has no answer yet (the model generates it in explain); show the run archive "
                "explain writes, whose snapshot holds the generated answer",
                field="input",
            )
        snapshot = ConversationSnapshot.build(conversation, unit=run.units[index], roles=run.settings.roles)
        policy, model, now = run.policy, run.settings.model, run.now
    renderer = ChatRenderer(load_tokenizer(resolve_model(model)), now=now)
    labels = tuple(p.label for p in snapshot.players)
    name, present = parse_coalition(coalition, labels)
    target = renderer.target_tokens(snapshot, policy)
    prompt = renderer.scoring_prompt(policy.render(snapshot, present), target)
    return ShownCoalition(
        name=name,
        present=tuple(bool(b) for b in present),
        labels=labels,
        prompt=prompt,
        answer=target.text,
        n_prompt_tokens=len(renderer.encode(prompt)),
        n_answer_tokens=len(target.ids),
    )


_RENDERING = ("model", "unit", "roles", "template", "absence_policy", "placeholder", "system_absent", "empty_turns", "merge_adjacent")

RENDER_OPTIONS = Options(
    cls=RunSettings, exclude=tuple(f.name for f in fields(RunSettings) if f.name not in (*_RENDERING, "proxy_game", "proxy_budget"))
)
"""The explain run's options that ``coalescence show`` takes: the rendering ones (and the proxy
game's, accepted and unused)."""


def _rendering_options(settings: RunSettings | None, options: dict[str, Any]) -> list[str]:
    """The rendering settings given other than their defaults (an archive has its own)."""
    default = RunSettings()
    given = [name for name in _RENDERING if settings is not None and getattr(settings, name) != getattr(default, name)]
    return given + sorted(options)


def _is_out_document(source: Any) -> bool:
    """Whether ``source`` is an explanation document written by ``--out`` (not an input)."""
    import json

    if not isinstance(source, (str, Path)) or not str(source).endswith(".json") or not Path(source).is_file():
        return False
    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("snapshot_id" in data or "explanations" in data or "hierarchy" in data)


def _from_archive(run_dir: Path, index: int) -> tuple[Any, Any, str, Any]:
    """The archive's last run: its ``index``-th snapshot, its absence policy, its model, its date."""
    from ..archive.reader import read_manifest
    from ..masking.policies import get_policy
    from ..snapshot import ConversationSnapshot
    from .record import recorded_now

    manifest = read_manifest(run_dir)
    runs = manifest.get("runs") or []
    if not runs:
        raise InputError(f"{run_dir} records no run", field="RUN_DIR")
    run = runs[-1]
    ids = list(run.get("snapshot_ids") or ())
    if not 0 <= index < len(ids):
        raise InputError(f"the run holds {len(ids)} conversation(s), numbered from 0; got {index}", field="conversation")
    records = {r["snapshot_id"]: r for r in manifest.get("snapshots") or []}
    snapshot = ConversationSnapshot.from_dict(records[ids[index]])
    policy_record = run.get("absence_policy") or {}
    policy = get_policy(policy_record.get("id", "drop"), **(policy_record.get("params") or {}))
    now = recorded_now(run_dir, run["template_now"]) if run.get("template_now") else None
    return snapshot, policy, str((run.get("model") or {}).get("id")), now
