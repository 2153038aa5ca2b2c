"""The run's record in the archive manifest, and what a resumed run must agree with in it.

:func:`run_record` is what an explain run writes into the manifest (its identity, configuration
and snapshots); a resumed run is refused when the archive's runs used other model content
(:func:`check_model_identity`), another engine (:func:`check_backend`: the archive holds one
engine's values, whatever its runs) or rendered dated templates on another day
(:func:`check_same_date`) or measured with another utility or absence policy
(:func:`check_measurement`, with the replay that needs no model where one can serve);
:func:`recorded_now` reads that day back, and the ``recorded_*``
functions read back what a run recorded of its configuration (budget, proxy game, seed,
interactions) for a fit from the archive.
"""

from __future__ import annotations

import logging
from datetime import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ArchiveError

__all__ = (
    "check_backend",
    "check_measurement",
    "check_model_identity",
    "recorded_backend",
    "check_same_date",
    "model_options",
    "recorded_budget",
    "recorded_interactions",
    "recorded_now",
    "recorded_proxy",
    "recorded_run_config",
    "recorded_seed",
    "run_record",
)

logger = logging.getLogger(__name__)


def recorded_now(run_dir: Path, value: Any) -> datetime:
    """A run's recorded ``template_now`` as a datetime.

    Raises:
        ArchiveError: not an ISO datetime string (naming the manifest).
    """
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return datetime.fromisoformat(value)
    except ValueError:
        raise ArchiveError(
            f"{run_dir / 'manifest.json'}: template_now must be an ISO datetime, got {str(value)[:40]!r}; the "
            "manifest was edited or damaged: restore it, or choose another archive",
            field="RUN_DIR",
        ) from None


_HOW_TO_GET = {
    "hf": "--backend hf",
    "vllm": "--backend vllm",
    "vllm-server": "--server-url of a server of the same model",
}


def recorded_backend(run: dict[str, Any]) -> tuple[dict[str, str] | None, bool]:
    """The backend that scored an archived run's rows: ``(identity, recorded)``.

    A run written before the backend was recorded is inferred where it can be (``dtype``
    ``server`` or a ``vllm_url``, the key those runs wrote: a ``vllm serve``), ``recorded`` then ``False``; ``None`` when it
    cannot be told (transformers and in-process vLLM record the same fields)."""
    backend = run.get("backend")
    if isinstance(backend, dict) and isinstance(backend.get("backend"), str):
        return {str(k): str(v) for k, v in backend.items()}, True
    if (run.get("model") or {}).get("dtype") == "server" or "vllm_url" in run:
        return {"backend": "vllm-server"}, False
    return None, False


def _describe(identity: dict[str, str]) -> str:
    served = identity.get("served_model")
    return identity["backend"] + (f" (serving {served!r})" if served else "")


def check_backend(run_dir: Path | None, identity: dict[str, str], *, names_only: bool = False) -> None:
    """Refuse to write into an archive whose runs another backend scored (``identity``: this
    run's :meth:`~coalescence.backends.base.ScoringBackend.identity`). Every run counts, with or
    without ``new_run``: the coalition keys do not name the backend, so a run is served the
    rows of every run in its archive. A run written before backends were recorded is checked
    by the backend inferred from it (:func:`recorded_backend`), else accepted with a warning.

    Args:
        names_only: compare the backends' names only (before the backend is started, when the
            server's model is not known yet).

    Raises:
        ArchiveError: another backend scored a run of the archive (one line naming both).
    """
    from ..archive.reader import read_manifest

    if run_dir is None or not (run_dir / "manifest.json").is_file():
        return
    unknown = 0
    for run in read_manifest(run_dir).get("runs") or []:
        theirs, recorded = recorded_backend(run)
        if theirs is None:
            unknown += 1
            continue
        same = theirs["backend"] == identity["backend"] if names_only or not recorded else theirs == identity
        if not same:
            raise ArchiveError(
                f"the archive's run {run.get('run_id', '?')} was scored by backend {_describe(theirs)}, this run by backend "
                f"{_describe(identity)}: one archive holds one engine's values (engines differ beyond float tolerance in "
                f"bfloat16, and so do their samplers); resume with {_HOW_TO_GET.get(theirs['backend'], 'that backend')}, "
                "or give another --archive",
                field="archive",
            )
    if unknown and not names_only:
        logger.warning(
            "the archive %s has %d run(s) written before coalescence recorded the backend; their rows are taken as "
            "%s's, and this run records it",
            run_dir, unknown, identity["backend"],
        )  # fmt: skip


def check_measurement(run_dir: Path | None, utility: Any, policy: Any, *, new_run: bool, method: str, hierarchy: bool) -> None:
    """Refuse, before the weights load, to resume an archive none of whose runs measured with
    ``utility`` (a :class:`~coalescence.utility.UtilitySpec`) and ``policy`` (the absence policy):
    both are part of a run's resume identity (:data:`~coalescence.archive.identity.IDENTITY_FIELDS`),
    so opening the archive would refuse it after the load. Where the archive's last run measured
    what ``utility`` needs (:func:`~coalescence.archive.identity.same_measurement`), the message
    gives the replay that serves it with no model (``method``; a ``hierarchy`` archive replays its
    coarse snapshot, ``--snapshot``).

    Raises:
        ArchiveError: another process writes the archive (naming it); no run of the archive has
            this utility and absence policy (without ``new_run``), naming the differences from
            the last run (field ``archive``).
    """
    import json

    from ..archive.identity import differences, same_measurement
    from ..archive.lock import RunLock
    from ..archive.reader import read_manifest

    if run_dir is None or not (run_dir / "manifest.json").is_file():
        return
    RunLock(run_dir).release()  # an archive another process writes is refused as such (naming it), and its manifest not read
    if new_run:
        return
    runs = read_manifest(run_dir).get("runs") or []
    # as the run record writes them (JSON), so that they compare with the manifest's
    mine = json.loads(json.dumps({"utility": utility.to_dict(), "absence_policy": {"id": policy.id, "params": policy.params()}}))
    if not runs or any(all(r.get(k) == v for k, v in mine.items()) for r in runs):
        return
    diffs = [line for line in differences(runs[-1], mine) if line.split(":", 1)[0] in mine]
    message = (
        "the archive holds a different run (" + "; ".join(diffs) + "); use the same settings to resume it, --new-run "
        "to add this run to the archive, or another --archive"
    )
    if any(line.startswith("utility:") for line in diffs) and same_measurement(run_dir, utility):
        ids = runs[-1].get("snapshot_ids") or []
        level = f" --snapshot {str(ids[0])[:16]}" if hierarchy and ids else ""  # a hierarchy replays level by level
        message += (
            f". For another utility of the same answer, `coalescence replay {run_dir} --method {method}{level} --utility "
            "...` (or --target-span/--target-substring) needs no model, and --new-run evaluates only what the "
            "archived measurements do not cover"
        )
    raise ArchiveError(message, field="archive")


def check_model_identity(run_dir: Path | None, model: dict[str, Any], *, new_run: bool) -> None:
    """Refuse to resume an archive whose runs used other model content (``model``: the identity
    :class:`~coalescence.engine.Engine` records: id, revision, dtype, sha256, template_now).

    Raises:
        ArchiveError: the archive's runs used another model (naming the differences).
    """
    from ..archive.reader import read_manifest

    if run_dir is None or new_run or not (run_dir / "manifest.json").is_file():
        return
    runs = read_manifest(run_dir).get("runs") or []
    if not runs or any(r.get("model") == model for r in runs):
        return
    old = runs[-1].get("model") or {}
    if not isinstance(old, dict) or "id" not in old:
        return  # not a model record this check can compare; opening the archive checks the run
    diffs = "; ".join(
        f"{k}: archive has {str(old.get(k))[:16]!r}, this run has {str(model.get(k))[:16]!r}"
        for k in sorted(set(old) | set(model))
        if old.get(k) != model.get(k)
    )
    changed = "sha256" in old and old.get("sha256") != model.get("sha256")
    raise ArchiveError(
        f"the archive's runs used another model ({diffs}"
        + (": the weight, tokenizer or template files changed" if changed else "")
        + "); use --new-run to add a run with this model, or another --archive",
        field="archive",
    )


def check_same_date(run_dir: Path | None, description: dict[str, Any], now: datetime) -> None:
    """Refuse to resume a run whose recorded date is not the one this session rendered with
    (an archive of several runs, resuming an earlier one than the last).

    Raises:
        ArchiveError: the dates differ (the message names the recorded one to pin).
    """
    from ..archive.reader import read_manifest
    from ..archive.writer import IDENTITY_FIELDS

    if run_dir is None or not (run_dir / "manifest.json").is_file() or not description.get("template_renders_date"):
        return
    for run in read_manifest(run_dir).get("runs") or []:
        if all(run.get(k) == description.get(k) for k in IDENTITY_FIELDS):
            recorded = run.get("template_now")
            if recorded is not None and recorded_now(run_dir, recorded) != now:
                raise ArchiveError(
                    f"the run was rendered with the date pinned to {recorded}, this session to "
                    f"{now.isoformat()}; resume it with COALESCENCE_TODAY={recorded}",
                    field="archive",
                )
            return


def _json_ready(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def model_options(settings: Any, *, batch_size: int) -> dict[str, Any]:
    """The model options a run records in its ``run_config``: every field of its
    :class:`~coalescence.backends.settings.BackendSettings` by name (``dataclasses.fields``, so an
    option added there is recorded with no list to keep; a value that is not a JSON scalar as its
    ``str``), the Ray workers' fields (those of :class:`~coalescence.app.groups.RaySettings`)
    under ``ray`` and only when the model runs in workers.

    Args:
        settings: the run's backend settings (a subclass's own fields are recorded too).
        batch_size: the engine's effective rows per model call, recorded as ``batch_size`` (the
            settings hold ``None`` for the backend's default).

    Returns:
        ``{field: value}`` (JSON-ready), with ``batch_size`` and, for workers, ``ray``; a server
        URL's password is not recorded (:func:`~coalescence.backends.settings.without_password`).
    """
    from dataclasses import fields

    from .groups import RaySettings

    ray = {f.name for f in fields(RaySettings)}
    options = {f.name: _json_ready(getattr(settings, f.name)) for f in fields(settings) if f.name not in ray}
    if isinstance(options.get("server_url"), str):
        from ..backends.settings import without_password

        options["server_url"] = without_password(options["server_url"])
    options["batch_size"] = batch_size
    if settings.distributed:  # every Ray setting, by the group's fields (a new one is recorded unlisted)
        options["ray"] = {f.name: _json_ready(getattr(settings, f.name)) for f in fields(settings) if f.name in ray}
    return options


def run_record(run: Any) -> dict[str, Any]:
    """An explain run's record in the archive manifest (identity, configuration, snapshots):
    ``run`` is an :class:`~coalescence.app.explain.ExplainRun` after its engine is loaded."""
    from .._version import __version__

    s, engine, policy = run.settings, run.engine, run.policy
    recorded = run.recorded
    fits = run.run_config()
    config: dict[str, Any] = {
        "command": fits.pop("command"),
        "input": str(run.source) if isinstance(run.source, (str, Path)) else "<in memory>",
        "unit": run.units[0] if len(set(run.units)) == 1 else run.units,
        "roles": list(s.roles) if s.roles is not None else None,
        **fits,
        **model_options(s.backend_settings(), batch_size=engine.batch_size),
        "max_new_tokens": s.max_new_tokens,
    }
    if s.template is not None:
        config["template"] = str(s.template)
    run = {
        "package_version": __version__,
        "snapshot_ids": [x.snapshot_id for x in recorded],
        "model": engine.model,
        "backend": dict(engine.backend.identity()),
        "utility": engine.utility.to_dict(),
        "absence_policy": {"id": policy.id, "params": policy.params()},
        "run_config": config,
        "template_injects_default_system": engine.renderer.injects_default_system,
        # special-token strings ("<|im_end|>"...) in the content: encoded as text, never as control tokens
        "special_token_text": {
            "handling": "encoded as text",
            "found": list(engine.renderer.special_text(
                t for x in recorded for t in (*(m.content for m in x.conversation.messages), x.target)
            )),
        },
        # one date per run: what templates that write today's date render, in every session and replay
        "template_now": engine.renderer.now.isoformat(),
        "template_renders_date": engine.renderer.renders_date,
        # what a user must know of a generated answer's tokens (cut inside a character, no round trip)
        "target_notes": {x.snapshot_id: list(engine.target_tokens(x, policy).notes()) for x in recorded},
        "target_token_ids": {x.snapshot_id: list(engine.target_tokens(x, policy).ids) for x in recorded},
        # per target token, its characters in the answer: answer sub-spans replay without a tokenizer
        "target_token_offsets": {x.snapshot_id: [list(o) for o in engine.target_tokens(x, policy).offsets] for x in recorded},
        # what the chat template writes around the answer (prompt, never scored): e.g. Qwen3's empty reasoning block
        "answer_rendering": {x.snapshot_id: engine.target_tokens(x, policy).to_dict() for x in recorded},
        "snapshots": [x.to_dict() for x in recorded],
    }
    injects = engine.renderer.injects_default_system
    keeps_system = "empty" in (policy.params().get("system_absent"), policy.params().get("empty_turns"))
    for record, snap in zip(run["snapshots"], recorded, strict=True):
        has_system = any(m.role == "system" for m in snap.conversation.messages)
        system_players = any(p.role == "system" for p in snap.players)
        record["template_injects_default_system"] = injects
        record["default_system_in_play"] = (
            "never" if not injects
            else "always" if not has_system
            else "when every system player is absent" if system_players and not keeps_system
            else "never"
        )  # fmt: skip
    return run


def recorded_run_config(run: Mapping[str, Any]) -> Mapping[str, Any]:
    """A manifest run's ``run_config`` (``{}`` when it records none)."""
    config = run.get("run_config")
    return config if isinstance(config, Mapping) else {}


def recorded_budget(run: Mapping[str, Any], method: str) -> int | None:
    """The sampling budget a run of one input (no hierarchy) recorded, when ``method`` is its
    method; else None (a budget recorded for a dataset run is its first conversation's)."""
    config = recorded_run_config(run)
    budget = config.get("budget")
    one_input = len(run.get("snapshot_ids") or ()) == 1 and not config.get("hierarchy")
    if one_input and method == config.get("method") and isinstance(budget, int) and not isinstance(budget, bool):
        return budget
    return None


def recorded_proxy(run: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """``(tail rule, proxy budget or None)`` of the proxy game a run played with a two-fidelity
    method, or ``None`` (an exact-only run, or one written before proxy games)."""
    proxy = recorded_run_config(run).get("proxy")
    if not isinstance(proxy, Mapping) or not isinstance(proxy.get("tail"), str):
        return None
    budget = proxy.get("budget")
    return proxy["tail"], budget if isinstance(budget, int) and not isinstance(budget, bool) else None


def recorded_seed(run: Mapping[str, Any]) -> int:
    """The plans' seed a run recorded (0 when it records none)."""
    seed = recorded_run_config(run).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def recorded_interactions(run: Mapping[str, Any], method: str) -> tuple[int | None, str | None]:
    """``(order, index)`` of the interactions a run recorded for ``method`` (its own method), or
    ``(None, None)``."""
    config = recorded_run_config(run)
    recorded = config.get("interactions")
    if config.get("method") != method or not isinstance(recorded, Mapping):
        return None, None
    order, index = recorded.get("order"), recorded.get("index")
    if isinstance(order, bool) or not isinstance(order, int) or not isinstance(index, str):
        raise ArchiveError(f"run {run.get('run_id')}: run_config.interactions must be {{order, index}}", field="archive")
    return order, index
