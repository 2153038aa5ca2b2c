"""An explain run's checks before its weights load (the ``check`` and ``preflight`` phases of
:class:`~coalescence.app.explain.ExplainRun`): the date that templates render, and the preflight proper: the model's tokenizer, configuration and content
fingerprint, its identity and backend against the archive's runs, and every coalition the plans
need rendered with the chat template (each game through :func:`coalescence.preflight.check_game`).

Errors name the settings by their names (``utility``, ``archive``); the CLI maps them to its
options.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EstimatorError
from .record import check_backend, check_measurement, check_model_identity, recorded_now

if TYPE_CHECKING:
    import numpy as np

    from ..backends.settings import BackendSettings
    from .settings import RunSettings

__all__ = ("PROVISIONAL_ANSWER", "CheckedRun", "check_input_game", "pinned_now", "preflight_run", "refuse_fine_level")

PROVISIONAL_ANSWER = "\u2063answer\u2063"
"""The stand-in answer a conversation without one is rendered with before it is generated."""


class CheckedRun(Protocol):
    """What the preflight reads of a run whose inputs are checked
    (:class:`~coalescence.app.explain.ExplainRun` after its ``check``, a sweep's too)."""

    settings: RunSettings
    backend_settings: BackendSettings  # how the model executes, built from the settings by the check
    backend: Any  # a loaded ScoringBackend, or None: the model is loaded after the preflight
    now: datetime  # the instant dated templates render (pinned_now)
    run_dir: Path | None
    conversations: list[Any]
    units: list[str]
    is_batch: bool
    policy: Any
    utility: Any
    max_context: int  # tokens; set by preflight_run

    def plan(self, n_players: int) -> Iterable[np.ndarray]: ...


def pinned_now(run_dir: Path | None, *, new_run: bool) -> datetime:
    """The instant chat templates that write the date render in a run: the one the archive's
    last run recorded (``template_now``) when the archive at ``run_dir`` is resumed (no
    ``new_run``), else :func:`~coalescence.masking.render.template_now` (the clock, or
    ``COALESCENCE_TODAY``).

    Raises:
        ArchiveError: the recorded instant is not an ISO datetime (an edited manifest).
        ConfigError: ``COALESCENCE_TODAY`` is not an ISO date.
    """
    from ..archive.reader import read_manifest
    from ..masking.render import template_now

    if run_dir is not None and not new_run and (run_dir / "manifest.json").is_file():
        runs = read_manifest(run_dir).get("runs") or []
        recorded = [r.get("template_now") for r in runs if r.get("template_now") is not None]
        if recorded:
            return recorded_now(run_dir, recorded[-1])
    return template_now()


def preflight_run(run: CheckedRun) -> dict[str, Any]:
    """Load the tokenizer and configuration (or take the run's backend's), fingerprint the model,
    refuse a changed model or another backend for a resume, and render every coalition the run's
    plans need (``run.plan``); sets ``run.max_context``.

    Returns:
        What the weights load with (:func:`~coalescence.app.backend.load_model`): ``source``,
        ``tokenizer``, ``config`` and ``fingerprint``; ``{}`` when the run has its backend.

    Raises:
        TemplateRefused: the chat template refuses a coalition or changes the answer.
        InputError: a conversation or coalition longer than the context; a span that covers
            no answer token.
        ArchiveError: the archive's runs used other model content (without ``new_run``), or
            another backend.
        BackendUnavailable: the model cannot be found.
    """
    from ..inputs import on_line
    from ..masking.render import ChatRenderer

    s, backend = run.settings, run.backend
    loaded: dict[str, Any] = {}
    if backend is not None:
        tokenizer = backend.tokenizer
        max_context = int(backend.max_context)
        identity = {"id": backend.model_id, "revision": backend.revision, "dtype": backend.dtype, "sha256": str(backend.fingerprint or "")}
    else:
        from ..backends.registry import load_config, load_tokenizer, model_context, model_fingerprint, resolve_model

        source = resolve_model(s.model)
        tokenizer = load_tokenizer(source)
        config = load_config(source)
        max_context = model_context(config, tokenizer)
        fingerprint = model_fingerprint(source)
        # a server computes in its own dtype: its runs are keyed as dtype "server" (VLLMServerBackend.dtype)
        dtype = "server" if run.backend_settings.capabilities.remote_dtype else s.dtype
        identity = {"id": source.model_id, "revision": source.revision, "dtype": dtype, "sha256": fingerprint}
        loaded = {"source": source, "tokenizer": tokenizer, "config": config, "fingerprint": fingerprint}
    run.max_context = max_context
    renderer = ChatRenderer(tokenizer, now=run.now)
    if renderer.renders_date:  # as Engine.model: a dated template's day is part of the model's identity
        identity["template_now"] = renderer.now.isoformat()
    engine = backend.identity() if backend is not None else {"backend": run.backend_settings.backend_name}
    check_backend(run.run_dir, engine, names_only=True)  # before the weights load or the server is asked
    check_model_identity(run.run_dir, identity, new_run=s.new_run)
    check_measurement(run.run_dir, run.utility, run.policy, new_run=s.new_run, method=s.method_name, hierarchy=s.hierarchy is not None)
    for k, (conversation, unit) in enumerate(zip(run.conversations, run.units, strict=True)):
        on_line(k, run.is_batch, check_input_game, run, renderer, conversation, unit)
    return loaded


def check_input_game(run: CheckedRun, renderer: Any, conversation: Any, unit: str) -> None:
    """One input's game, with the tokenizer alone (see :mod:`coalescence.preflight`): every
    coalition of ``run.plan`` rendered, the answer's span located, a hierarchy's fine game too. A
    conversation without an answer is rendered with :data:`PROVISIONAL_ANSWER` (checked again
    once the answer is generated)."""
    from ..preflight import check_game
    from ..snapshot import ConversationSnapshot, fine_snapshot

    s = run.settings
    provisional = conversation.target is None
    if provisional:  # the answer is generated later; its prompts must render now
        conversation = conversation.with_target(PROVISIONAL_ANSWER, source="generated")
    snapshot = ConversationSnapshot.build(conversation, unit=unit, roles=s.roles)
    report = check_game(
        renderer,
        snapshot,
        run.policy,
        run.plan(snapshot.n_players),
        max_context=run.max_context,
        teacher_forced=run.utility.teacher_forced and not provisional,
        provisional=provisional,
    )
    if report.target is not None:
        run.utility.resolve(snapshot.target, report.target.offsets)  # a span that covers no token
    if s.hierarchy is not None:
        fine, parents = fine_snapshot(snapshot, s.hierarchy[1])
        refuse_fine_level(s, snapshot.n_players, parents)
        if not provisional:
            check_game(renderer, fine, run.policy, None, max_context=run.max_context, teacher_forced=run.utility.teacher_forced)


def refuse_fine_level(settings: RunSettings, n_coarse: int, parents: Sequence[int]) -> None:
    """Refuse a hierarchy whose fine level the method cannot play whichever coarse players it
    refines: the top ``top_k`` coarse players hold at least the ``top_k`` smallest counts of fine
    players (all of them when ``top_k`` covers every coarse player), and more than the method's
    player limit (exact: 16) is refused now, before the weights load, not after the coarse level ran.

    Args:
        settings: the run's settings (``hierarchy``, ``top_k``, the method's limit).
        n_coarse: the coarse players.
        parents: ``[n_fine]`` each fine player's coarse parent (:func:`~coalescence.snapshot.fine_snapshot`).

    Raises:
        EstimatorError: the fewest fine players the fine level can refine exceed the limit (field ``top_k``).
    """
    limit = settings.capabilities.max_players
    if limit is None:
        return
    k = min(settings.top_k_or_default, n_coarse)
    fewest = sum(sorted(list(parents).count(i) for i in range(n_coarse))[:k])
    if fewest > limit:
        coarse, fine = settings.hierarchy or ("coarse", "fine")
        every = "every one of the" if k == n_coarse else f"the top {k} of"
        raise EstimatorError(
            f"the fine level refines {every} {n_coarse} {coarse} players, at least {fewest} {fine} players, and method "
            f"{settings.method_name} allows at most {limit}; give a smaller --top-k, a coarser fine unit, or method "
            "regression-msr with a budget",
            field="top_k",
        )
