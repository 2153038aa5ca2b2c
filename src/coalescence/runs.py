"""The application layer: explain and replay runs, one code path under the CLI and the Python API.

An explain run (:class:`ExplainRun`) goes through its phases in order; each is a method, so a caller
(the CLI, :func:`explain_run`, the notebook API) can put its own output and signal handling around
them:

1. :meth:`~ExplainRun.check` the inputs and settings, nothing loaded (bad input refused here);
2. :meth:`~ExplainRun.preflight`: the model's tokenizer and configuration, its content fingerprint,
   and every coalition the plan needs rendered with its chat template (:mod:`coalescence.preflight`),
   before any weights load;
3. :meth:`~ExplainRun.load`: the weights (unless a backend is given), the snapshots (a missing
   answer generated), their scored target tokens;
4. :meth:`~ExplainRun.open_archive`: the run archive created, or resumed after its identity is
   checked (nothing is written before this phase);
5. :meth:`~ExplainRun.evaluate` (async): plan, evaluate, fit, for every input;
6. :meth:`~ExplainRun.close` the archive with the run's status, then :meth:`~ExplainRun.write`
   the ``--out`` and ``--html`` documents.

A sweep (:class:`coalescence.sweeps.SweepRun`) is an explain run with other plans and fits: it
overrides the hooks :meth:`~ExplainRun.player_limit`, :meth:`~ExplainRun.validate_game`,
:meth:`~ExplainRun.plan`, :meth:`~ExplainRun.check_outputs`, :meth:`~ExplainRun.run_config` and
the per-conversation steps of :meth:`~ExplainRun.evaluate`, and keeps every other phase.

A replay (:func:`replay_run`) fits estimators from an archive: with no model when the archive
covers their plans (:class:`ArchiveFit`, also the report's source of a run directory), else it
evaluates the missing coalitions with the run's model through an engine, recording them in the
archive.

Errors name the settings by their names here (``budget``, ``archive``); the CLI maps them to its
options (``--budget``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from .backends.base import DEFAULT_BATCH_SIZE
from .errors import ArchiveError, CoalescenceError, ConfigError, EstimatorError, InputError, ReportError

__all__ = (
    "ArchiveFit",
    "ExplainRun",
    "ReplaySettings",
    "RunResult",
    "RunSettings",
    "explain_run",
    "explain_run_async",
    "fit_archive",
    "replay_run",
)

PROVISIONAL_ANSWER = "\u2063answer\u2063"
"""The stand-in answer a conversation without one is checked with before its answer is generated."""


def _writable_parent(path: Path, name: str) -> None:
    """Refuse a path whose nearest existing ancestor is not a writable directory."""
    import os

    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{str(parent)!r} is a file, not a directory; give another path", field=name)
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"{str(parent)!r} is not writable; give another path", field=name)
            return


def output_path(value: str | Path | None, name: str) -> Path | None:
    """An output file's path, checked before any work: not a directory, in a writable place.

    Raises:
        ConfigError: a directory, or a place that cannot be written (field ``name``).
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{str(value)!r} is a directory; give a file path", field=name)
    _writable_parent(path, name)
    return path


def html_path(value: str | Path | None, name: str = "html") -> Path | None:
    """The HTML report's path (see :func:`output_path`), its optional dependency checked too.

    Raises:
        ConfigError: as :func:`output_path`.
        BackendUnavailable: the report's optional packages are missing (with the install command).
    """
    path = output_path(value, name)
    if path is not None:
        from .report import check_available

        check_available()
    return path


def on_line(k: int, is_batch: bool, check: Callable[..., Any], *args: Any) -> Any:
    """Run ``check(*args)``; in a JSONL batch an input error names the input's line (``line N: FIELD``)."""
    try:
        return check(*args)
    except InputError as exc:
        if not is_batch:
            raise
        raise InputError(exc.message, field=f"line {k + 1}: {exc.field}" if exc.field else f"line {k + 1}") from None


def _check_ray(s: Any) -> None:
    """Refuse Ray settings that cannot work (``workers``, ``ray_address``, ``gpus_per_worker``,
    ``threads_per_worker`` of a :class:`RunSettings` or :class:`ReplaySettings`)."""
    for name in ("workers", "threads_per_worker"):
        value = getattr(s, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
    if s.ray_address is not None and (not isinstance(s.ray_address, str) or not s.ray_address.strip()):
        raise ConfigError("is empty; give a Ray cluster address (auto, HOST:PORT)", field="ray_address")
    g = s.gpus_per_worker
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
        raise ConfigError(f"must be a number >= 0, got {g!r}", field="gpus_per_worker")
    if not s.distributed:
        for name in ("gpus_per_worker", "threads_per_worker"):
            if getattr(s, name):
                raise ConfigError("applies to Ray workers; add --workers N or --ray-address ADDR", field=name)
    elif g > 0 and s.device == "cpu" and s.backend != "vllm":
        raise ConfigError(
            "reserves accelerators for workers that would compute on --device cpu; add --device cuda (or --backend vllm, "
            "which uses the GPUs it sees)",
            field="gpus_per_worker",
        )


def _ray_backend(s: Any, source: Any, **preloaded: Any) -> Any:
    """The settings' model in Ray workers (:func:`~coalescence.distributed.start_ray_backend`)."""
    from .distributed import start_ray_backend

    return start_ray_backend(
        source,
        workers=s.workers,
        ray_address=s.ray_address,
        gpus_per_worker=float(s.gpus_per_worker),
        threads_per_worker=s.threads_per_worker,
        backend=s.backend,
        device=s.device,
        dtype=s.dtype,
        max_batch_size=s.batch_size,
        tokenizer=preloaded.get("tokenizer"),
        config=preloaded.get("config"),
        fingerprint=preloaded.get("fingerprint"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """Every setting of an explain run (the CLI's ``explain`` options, by their library names).

    Args:
        model: alias, local directory, ``.gguf`` file or hub id.
        backend: the backend by name (:data:`~coalescence.backends.registry.BACKENDS`).
        unit: player unit (default: ``document`` for an input with declared players, else ``turn``).
        roles: the roles whose messages are players (default: every role).
        method: the estimator (:data:`~coalescence.attribution.estimators.ESTIMATORS`); ``None``
            (default): ``exact``, or ``auto`` (chosen by players and budget,
            :class:`~coalescence.attribution.estimators.auto.AutoMethod`) when a budget is given.
        budget: sampling methods: the most distinct model evaluations (default 32 x players).
        seed: seed of the sampling plan (and of sampled regenerations).
        interactions: also compute interactions of sets of 2 .. this many players (``--method
            exact`` or a shapiq interaction approximator); ``None`` for values only.
        index: the interaction index with ``interactions`` (``SII``, ``k-SII``, ``FSII``,
            ``STII``; default ``k-SII``).
        target_stderr: sample in doubling rounds until every standard error is below this (nats).
        hierarchy: ``(coarse, fine)`` units, or ``"coarse,fine"``.
        top_k: coarse players refined (default 3).
        absence_policy, placeholder, system_absent, empty_turns, merge_adjacent: how an absent
            player disappears (see :mod:`coalescence.masking.policies`).
        utility, target_span, target_substring, temperature, top_p, num_samples, max_new_tokens:
            the utility (see :mod:`coalescence.utility`).
        template: the RAG prompt template file.
        device, dtype, batch_size: where and how the model runs.
        archive: the run directory; ``True`` for a new ``runs/<UTC time>-<snapshot id>``;
            ``None`` for no archive (the Python API's default).
        new_run, flush_rows, flush_seconds, skip_corrupt: archive options.
        out, html: files written after the run (the ``--out`` document, the HTML report).
        max_conversations_in_flight: a dataset's conversations evaluated at once, through one
            scheduler and collator (their coalitions fill the same batches); bounds memory.
        workers: model workers on Ray (:mod:`coalescence.distributed`): a local Ray cluster with
            this many workers, or this many workers on the cluster at ``ray_address``; ``None``:
            the model runs in this process (unless ``ray_address`` is given).
        ray_address: join this Ray cluster (``auto``, ``HOST:PORT``) instead of starting one.
        gpus_per_worker: accelerators each Ray worker reserves (needs a ``cuda`` device).
        threads_per_worker: torch threads of each Ray worker (default: its node's CPUs divided
            among the workers there).

    Raises:
        ConfigError: a setting that cannot work, alone or with another (naming it); checked on
            construction, before anything loads.
    """

    model: str = "smollm2-135m"
    backend: str = "hf"
    unit: str | None = None
    roles: tuple[str, ...] | None = None
    method: str | None = None
    budget: int | None = None
    seed: int = 0
    interactions: int | None = None
    index: str | None = None
    target_stderr: float | None = None
    hierarchy: tuple[str, str] | str | None = None
    top_k: int | None = None
    absence_policy: str = "drop"
    placeholder: str = "[removed]"
    system_absent: str = "removed"
    empty_turns: str = "removed"
    merge_adjacent: bool = False
    utility: str = "logprob"
    target_span: str | tuple[int, int] | None = None
    target_substring: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1
    max_new_tokens: int = 64
    template: str | Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = DEFAULT_BATCH_SIZE
    archive: str | Path | bool | None = None
    new_run: bool = False
    flush_rows: int = 4096
    flush_seconds: float = 30.0
    skip_corrupt: bool = False
    out: str | Path | None = None
    html: str | Path | None = None
    max_conversations_in_flight: int = 8
    workers: int | None = None
    ray_address: str | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int | None = None

    def __post_init__(self) -> None:
        from .attribution.estimators import estimator_class, methods_with
        from .attribution.hierarchy import parse_hierarchy
        from .attribution.estimators.base import check_seed

        check_seed(self.seed)
        if self.method is None:  # a budget asks for a sampling method: auto chooses it
            object.__setattr__(self, "method", "exact" if self.budget is None else "auto")

        if self.roles is not None:
            roles = tuple(r.strip() for r in ((self.roles.split(",")) if isinstance(self.roles, str) else self.roles) if r.strip())
            if not roles:
                raise ConfigError("give at least one role, e.g. user,system", field="roles")
            object.__setattr__(self, "roles", roles)
        if isinstance(self.hierarchy, str):
            object.__setattr__(self, "hierarchy", parse_hierarchy(self.hierarchy))
        if self.hierarchy is None and self.top_k is not None:
            raise ConfigError("applies to a hierarchy (coarse,fine units); add one or drop top_k", field="top_k")
        if self.hierarchy is not None and self.unit is not None:
            raise ConfigError("the hierarchy sets the units; drop the unit", field="unit")
        capabilities = estimator_class(self.method).capabilities
        if self.interactions is not None or self.index is not None:
            if self.hierarchy is not None:
                raise ConfigError("does not combine with a hierarchy; drop one", field="interactions")
            interaction_settings(self.method, self.interactions, self.index)
        if self.target_stderr is not None:
            if not capabilities.reports_stderr:
                raise ConfigError(
                    f"method {self.method} reports no standard errors; use one of {', '.join(methods_with(reports_stderr=True))}",
                    field="target_stderr",
                )
            if not self.target_stderr > 0:
                raise ConfigError(f"must be > 0, got {self.target_stderr!r}", field="target_stderr")
            if self.hierarchy is not None:
                raise ConfigError("does not combine with a hierarchy; drop one", field="target_stderr")
        if not capabilities.needs_budget and self.budget is not None:
            raise ConfigError(
                f"method {self.method} has a fixed number of evaluations; a budget applies to the sampling "
                f"methods ({', '.join(methods_with(needs_budget=True))}, shapiq:NAME)",
                field="budget",
            )
        if self.absence_policy == "placeholder":
            for name in ("system_absent", "empty_turns"):
                if getattr(self, name) != "removed":
                    raise ConfigError("applies to the drop policy (placeholder removes no message)", field=name)
        elif self.placeholder != "[removed]":
            raise ConfigError(
                f"applies to the placeholder absence policy; absence policy {self.absence_policy} removes "
                "the text. Add --absence-policy placeholder or drop --placeholder",
                field="placeholder",
            )
        if isinstance(self.max_conversations_in_flight, bool) or not isinstance(self.max_conversations_in_flight, int) or self.max_conversations_in_flight < 1:
            raise ConfigError(f"must be a positive integer, got {self.max_conversations_in_flight!r}", field="max_conversations_in_flight")
        if isinstance(self.archive, str) and not self.archive.strip():
            raise ConfigError("is empty; give a directory path for the run archive", field="archive")
        _check_ray(self)
        self.policy()  # a bad rule or placeholder is refused now
        self.utility_spec()

    # -- what the settings make -------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Whether the model runs in Ray workers (``workers`` or ``ray_address`` given)."""
        return self.workers is not None or self.ray_address is not None

    @property
    def top_k_or_default(self) -> int:
        """The coarse players a hierarchy refines (3 by default)."""
        return self.top_k if self.top_k is not None else 3

    def policy(self) -> Any:
        """The absence policy (see :func:`~coalescence.masking.policies.get_policy`)."""
        from .masking.policies import get_policy

        merge = {"merge_adjacent": True} if self.merge_adjacent else {}
        if self.absence_policy == "placeholder":
            return get_policy("placeholder", text=self.placeholder, **merge)
        rules = {"system_absent": self.system_absent, "empty_turns": self.empty_turns}
        return get_policy(self.absence_policy, **{k: v for k, v in rules.items() if v != "removed"}, **merge)

    def utility_spec(self) -> Any:
        """The utility (:class:`~coalescence.utility.UtilitySpec`); a regenerate utility's optional
        package is checked now, with its install hint."""
        from .utility import REGENERATE_KINDS, GenerationConfig, UtilitySpec, parse_span

        span = self.target_span
        if isinstance(span, str):
            span = parse_span(span)
        generation = None
        if self.utility in REGENERATE_KINDS:
            generation = GenerationConfig(
                temperature=self.temperature,
                top_p=self.top_p,
                num_samples=self.num_samples,
                max_new_tokens=self.max_new_tokens,
                seed=self.seed,
            )
            from .similarity import get_similarity

            get_similarity(self.utility)
        else:
            for name, default in (("temperature", 0.0), ("top_p", 1.0), ("num_samples", 1)):
                if getattr(self, name) != default:
                    raise ConfigError(
                        f"applies to the regenerate utilities ({', '.join(REGENERATE_KINDS)}); utility "
                        f"{self.utility} scores the fixed answer. Drop {name} or choose one of those",
                        field=name,
                    )
        return UtilitySpec(kind=self.utility, span=span, substring=self.target_substring, generation=generation)

    def estimator(self, n_players: int) -> Any:
        """The estimator for a game of ``n_players`` (its default budget when none is given)."""
        from .attribution.estimators import estimator_class, make_estimator

        budget = self.budget
        if budget is None:
            budget = estimator_class(self.method).capabilities.default_budget(n_players)
        return make_estimator(self.method, budget=budget, seed=self.seed, interactions=self.interactions, index=self.index)

    def budget_for(self, n_players: int) -> int | None:
        """The budget recorded for a game of ``n_players`` (``None`` for a method without one)."""
        from .attribution.estimators import estimator_class

        capabilities = estimator_class(self.method).capabilities
        if not capabilities.needs_budget:
            return None
        return self.budget if self.budget is not None else capabilities.default_budget(n_players)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What an explain run gives back.

    Attributes:
        explanations: one per input (a :class:`~coalescence.attribution.hierarchy.HierarchicalExplanation`
            for a hierarchy run), in input order.
        snapshots: the inputs' snapshots (the coarse ones for a hierarchy).
        run_dir: the run archive, or ``None`` without one.
        is_batch: whether the input was a JSONL batch.
        document: the ``--out`` document (a single explanation's, or the batch's).
        resumed_coalitions: coalitions served from an archive that was resumed (0 for a new one).
    """

    explanations: tuple[Any, ...]
    snapshots: tuple[Any, ...]
    run_dir: Path | None
    is_batch: bool
    document: dict[str, Any]
    resumed_coalitions: int = 0


class ExplainRun:
    """One explain run, phase by phase (module docs).

    Args:
        source: the input: a path (``.json``, or ``.jsonl`` with one input per line), an input
            dict (any input form: messages, declared players, RAG), a list of messages, or a list of
            input dicts (a dataset, as the lines of a JSONL file).
        settings: the run's settings.
        backend: a loaded backend to use (its tokenizer, context and fingerprint too) instead of
            loading ``settings.model``.

    Raises:
        InputError, ConfigError: from :meth:`check`, which the constructor runs.
    """

    def __init__(self, source: Any, settings: RunSettings, *, backend: Any = None) -> None:
        self.source = source
        self.settings = settings
        self.backend = backend
        self.engine: Any = None
        self.archive: Any = None
        self.snapshots: list[Any] = []
        self.fines: list[Any] = []
        self.run_dir: Path | None = None
        self.resumed_coalitions = 0
        self.restored_conversations = 0
        self._loaded: dict[str, Any] = {}
        if backend is not None and settings.distributed:
            raise ConfigError("a loaded backend runs in this process; drop workers/ray_address or the backend", field="workers")
        self.check()

    # -- 1. inputs and settings ---------------------------------------------------------------
    def check(self) -> None:
        """Read the inputs and check everything the settings and the inputs alone can reveal.

        Raises:
            InputError: bad input (naming the field, and the line of a JSONL batch).
            ConfigError: bad settings; an output path that cannot be written.
            EstimatorError: a game the method cannot run (e.g. exact on more than 16 players,
                counted only up to 17).
            ArchiveError: an archive that is not a run directory, is damaged, or holds a corrupt part.
        """
        from .archive.reader import check_parts, read_manifest
        from .inputs import conversation_from_input, load_inputs, load_template
        from .segmentation import count_players

        s = self.settings
        template = load_template(s.template)
        if isinstance(self.source, (str, Path)):
            self.conversations, self.is_batch = load_inputs(self.source, template)
        elif isinstance(self.source, Mapping):
            self.conversations, self.is_batch = [conversation_from_input(self.source, template)], False
        elif isinstance(self.source, Sequence) and self.source and all(
            isinstance(item, Mapping) and ("messages" in item or "documents" in item) for item in self.source
        ):  # a list of inputs: a dataset, as a JSONL file's lines
            self.conversations, self.is_batch = [], True
            for k, item in enumerate(self.source):
                try:
                    self.conversations.append(conversation_from_input(item, template))
                except InputError as exc:
                    raise InputError(exc.message, field=f"input {k}: {exc.field}" if exc.field else f"input {k}") from exc
        elif isinstance(self.source, Sequence):
            self.conversations, self.is_batch = [conversation_from_input({"messages": list(self.source)}, template)], False
        else:
            raise InputError(
                f"must be a path, an input dict or a list of messages, got {type(self.source).__name__}", field="input"
            )
        self.policy = s.policy()
        self.utility = s.utility_spec()
        for k, conversation in enumerate(self.conversations):
            if conversation.target is not None:  # a generated target is checked once it exists
                on_line(k, self.is_batch, self.utility.locate, conversation.target)
        # an estimator's player limit (exact: 16) stops the count early: a long text is refused
        # after a few sentences, not after segmenting all of it
        at_most = self.player_limit()
        self.units: list[str] = []
        for k, conversation in enumerate(self.conversations):
            unit = s.hierarchy[0] if s.hierarchy else s.unit or ("document" if conversation.declared else "turn")
            self.units.append(unit)
            n_players = on_line(k, self.is_batch, lambda c=conversation, u=unit: count_players(c, unit=u, roles=s.roles, at_most=at_most))
            if at_most is not None and n_players > at_most:
                raise EstimatorError(
                    f"{f'input line {k + 1}: ' if self.is_batch else ''}--unit {unit} gives at least {n_players} players "
                    f"(counting stopped there), and --method {s.method} allows at most {at_most}; use a coarser "
                    "--unit, or --method regression-msr with --budget N, or --method loo",
                    field="method",
                )
            self.validate_game(n_players)
        self.check_outputs()
        if isinstance(s.archive, (str, Path)):
            run_dir = Path(s.archive)
            if run_dir.exists() and (not run_dir.is_dir() or (any(run_dir.iterdir()) and not (run_dir / "manifest.json").is_file())):
                raise ConfigError(
                    f"{str(s.archive)!r} exists and is not a run directory; choose a new path or delete it",
                    field="archive",
                )
            if (run_dir / "manifest.json").is_file():
                read_manifest(run_dir)  # a damaged manifest or a newer schema is refused before the model loads
                check_parts(run_dir, skip_corrupt=s.skip_corrupt)  # so is a part that fails its digest or schema
            _writable_parent(run_dir, "archive")
            self.run_dir = run_dir
        self.now = self.pinned_now()

    def pinned_now(self) -> datetime:
        """The instant chat templates that write the date render in this run: the one the archive's
        last run recorded (``template_now``) when the archive is resumed (no ``new_run``), else
        :func:`~coalescence.masking.render.template_now` (the clock, or ``COALESCENCE_TODAY``).

        Raises:
            ArchiveError: the recorded instant is not an ISO datetime (an edited manifest).
            ConfigError: ``COALESCENCE_TODAY`` is not an ISO date.
        """
        from .archive.reader import read_manifest
        from .masking.render import template_now

        if self.run_dir is not None and not self.settings.new_run and (self.run_dir / "manifest.json").is_file():
            runs = read_manifest(self.run_dir).get("runs") or []
            recorded = [r.get("template_now") for r in runs if r.get("template_now") is not None]
            if recorded:
                return _recorded_now(self.run_dir, recorded[-1])
        return template_now()

    # the parts a run of another kind (a sweep, :mod:`coalescence.sweeps`) changes -------------------
    def player_limit(self) -> int | None:
        """The most players an input may have (the method's limit, e.g. exact: 16), or ``None``."""
        from .attribution.estimators import estimator_class

        return estimator_class(self.settings.method).capabilities.max_players

    def validate_game(self, n_players: int) -> None:
        """Refuse a game of ``n_players`` the run's estimator cannot play (before any model call).

        Raises:
            EstimatorError, ConfigError: as the estimator's ``validate``.
        """
        self.settings.estimator(n_players).validate(n_players)

    def plan(self, n_players: int) -> Iterable[np.ndarray]:
        """Every coalition the run evaluates for a game of ``n_players`` (rendered by :meth:`preflight`)."""
        return self.settings.estimator(n_players).plan(n_players)

    def check_outputs(self) -> None:
        """Check the output files' paths (``out``, ``html``) before any work."""
        self.out_path = output_path(self.settings.out, "out")
        self.html_path = html_path(self.settings.html, "html")

    def run_config(self) -> dict[str, Any]:
        """What the run fits, as the manifest's ``run_config`` records it."""
        s = self.settings
        config: dict[str, Any] = {
            "command": "explain",
            "method": s.method,
            "budget": s.budget_for(self.snapshots[0].n_players),
            "seed": s.seed,
        }
        if s.interactions is not None:
            config["interactions"] = {"order": s.interactions, "index": interaction_settings(s.method, s.interactions, s.index)[1]}
        if s.hierarchy is not None:
            config["hierarchy"] = {"units": list(s.hierarchy), "top_k": s.top_k_or_default}
        return config

    # -- 2. what the tokenizer and template reveal, no weights --------------------------------------
    def preflight(self) -> None:
        """Load the tokenizer and configuration (or take the backend's), fingerprint the model,
        refuse a changed model for a resume, and render every coalition the plans need.

        Raises:
            TemplateRefused: the chat template refuses a coalition or changes the answer.
            InputError: a conversation or coalition longer than the context; a span that covers
                no answer token.
            ArchiveError: the archive's runs used other model content (without ``new_run``).
            BackendUnavailable: the model cannot be found.
        """
        from .masking.render import ChatRenderer

        s = self.settings
        if self.backend is not None:
            tokenizer = self.backend.tokenizer
            max_context = int(self.backend.max_context)
            identity = {
                "id": self.backend.model_id,
                "revision": self.backend.revision,
                "dtype": self.backend.dtype,
                "sha256": str(self.backend.fingerprint or ""),
            }
        else:
            from .backends.registry import load_config, load_tokenizer, model_context, model_fingerprint, resolve_model

            source = resolve_model(s.model)
            tokenizer = load_tokenizer(source)
            config = load_config(source)
            max_context = model_context(config, tokenizer)
            fingerprint = model_fingerprint(source)
            identity = {"id": source.model_id, "revision": source.revision, "dtype": s.dtype, "sha256": fingerprint}
            self._loaded = {"source": source, "tokenizer": tokenizer, "config": config, "fingerprint": fingerprint}
        self.max_context = max_context
        renderer = ChatRenderer(tokenizer, now=self.now)
        if renderer.renders_date:  # as Engine.model: a dated template's day is part of the model's identity
            identity["template_now"] = renderer.now.isoformat()
        self._check_model_identity(identity)
        for k, (conversation, unit) in enumerate(zip(self.conversations, self.units, strict=True)):
            on_line(k, self.is_batch, self._check_game, renderer, conversation, unit)

    def _check_model_identity(self, model: dict[str, Any]) -> None:
        """Refuse to resume an archive whose runs used other model content."""
        from .archive.reader import read_manifest

        run_dir = self.run_dir
        if run_dir is None or self.settings.new_run or not (run_dir / "manifest.json").is_file():
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

    def _check_game(self, renderer: Any, conversation: Any, unit: str) -> None:
        """One input's game, with the tokenizer alone (see :mod:`coalescence.preflight`)."""
        from .attribution.hierarchy import fine_snapshot
        from .conversation import ConversationSnapshot
        from .preflight import check_game

        s = self.settings
        provisional = conversation.target is None
        if provisional:  # the answer is generated later; its prompts must render now
            conversation = conversation.with_target(PROVISIONAL_ANSWER, source="generated")
        snapshot = ConversationSnapshot.build(conversation, unit=unit, roles=s.roles)
        plan = self.plan(snapshot.n_players)
        report = check_game(
            renderer,
            snapshot,
            self.policy,
            plan,
            max_context=self.max_context,
            teacher_forced=self.utility.teacher_forced and not provisional,
            provisional=provisional,
        )
        if report.target is not None:
            self.utility.resolve(snapshot.target, report.target.offsets)  # a span that covers no token
        if s.hierarchy is not None and not provisional:
            fine, _ = fine_snapshot(snapshot, s.hierarchy[1])
            check_game(renderer, fine, self.policy, None, max_context=self.max_context, teacher_forced=self.utility.teacher_forced)

    # -- 3. the model, snapshots and targets ---------------------------------------------------------
    def load(self, *, progress: Any = None, loader: Callable[..., Any] | None = None) -> Any:
        """Load the weights (unless a backend was given), make the engine, the snapshots and their
        target tokens; a missing answer is generated (greedily) and its game checked again.

        Args:
            progress: the engine's progress callbacks (e.g. a tqdm bar).
            loader: loads the weights: ``loader(source, tokenizer=, config=, fingerprint=)``
                (default: :func:`~coalescence.backends.registry.load_backend` with the settings'
                backend, device, dtype and batch size); the CLI passes its own, which prints.

        Returns:
            The :class:`~coalescence.engine.Engine`.
        """
        from .engine import Engine

        s = self.settings
        owned = self.backend is None  # loaded here: a backend that owns processes ends with the run
        if owned:
            if loader is None or s.distributed:
                loader = self.default_loader
            self.backend = loader(
                self._loaded["source"],
                tokenizer=self._loaded["tokenizer"],
                config=self._loaded["config"],
                fingerprint=self._loaded["fingerprint"],
            )
        try:
            self.engine = Engine(self.backend, progress=progress, batch_size=s.batch_size, utility=self.utility, now=self.now)
            self._snapshots()
        except BaseException:
            if owned and self.backend.shutdown_with_engine:  # e.g. the Ray workers this run started
                self.backend.shutdown()
            raise
        return self.engine

    def _snapshots(self) -> None:
        """The snapshots (a missing answer generated) and their targets and utilities, checked."""
        from .attribution.hierarchy import fine_snapshot

        s = self.settings
        for k, (conversation, unit) in enumerate(zip(self.conversations, self.units, strict=True)):
            snapshot = self.engine.prepare(conversation, unit=unit, roles=s.roles, max_new_tokens=s.max_new_tokens)
            self.validate_game(snapshot.n_players)
            if conversation.target is None:  # checked with a stand-in answer before; now with the real one
                on_line(k, self.is_batch, self._check_game, self.engine.renderer, snapshot.conversation, unit)
            self.snapshots.append(snapshot)
            if s.hierarchy is not None:
                self.fines.append(fine_snapshot(snapshot, s.hierarchy[1]))
        for k, snap in enumerate(self.snapshots):
            on_line(k, self.is_batch, self.engine.resolved_utility, snap, self.policy)
        for snap in self.recorded:
            self.engine.resolved_utility(snap, self.policy)

    def default_loader(self, source: Any, **preloaded: Any) -> Any:
        """Load ``source`` with the settings' backend, device, dtype and batch size: in this
        process, or in Ray workers (:func:`~coalescence.distributed.start_ray_backend`; the
        driver keeps the tokenizer and loads no weights)."""
        from .backends.registry import load_backend

        s = self.settings
        if s.distributed:
            return _ray_backend(s, source, **preloaded)
        return load_backend(source, backend=s.backend, device=s.device, dtype=s.dtype, max_batch_size=s.batch_size, **preloaded)

    @property
    def recorded(self) -> list[Any]:
        """Every snapshot the archive records: the inputs', then a hierarchy's fine ones."""
        return self.snapshots + [f for f, _ in self.fines]

    # -- 4. the archive --------------------------------------------------------------------------------
    def description(self) -> dict[str, Any]:
        """The run's record in the archive manifest (identity, configuration, snapshots)."""
        from ._version import __version__

        s, engine, policy = self.settings, self.engine, self.policy
        recorded = self.recorded
        fits = self.run_config()
        config: dict[str, Any] = {
            "command": fits.pop("command"),
            "input": str(self.source) if isinstance(self.source, (str, Path)) else "<in memory>",
            "unit": self.units[0] if len(set(self.units)) == 1 else self.units,
            "roles": list(s.roles) if s.roles is not None else None,
            **fits,
            "device": s.device,
            "batch_size": s.batch_size,
            "max_new_tokens": s.max_new_tokens,
        }
        if s.template is not None:
            config["template"] = str(s.template)
        if s.distributed:
            config["ray"] = {
                "workers": s.workers,
                "ray_address": s.ray_address,
                "gpus_per_worker": s.gpus_per_worker,
                "threads_per_worker": s.threads_per_worker,
            }
        run = {
            "package_version": __version__,
            "snapshot_ids": [x.snapshot_id for x in recorded],
            "model": engine.model,
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

    def open_archive(self) -> Any:
        """Create the run archive, or resume the run it holds after checking its identity; attach
        it to the engine (its coalitions are then served with no model call).

        Returns:
            The :class:`~coalescence.archive.writer.RunArchive`, or ``None`` (no archive).

        Raises:
            ArchiveError: the archive holds another run (naming the differences), is locked by
                another writer, or cannot be written.
        """
        from .archive.writer import RunArchive

        s = self.settings
        if s.archive is None or s.archive is False:
            return None
        if self.run_dir is None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            self.run_dir = Path("runs") / f"{stamp}-{self.snapshots[0].snapshot_id[:12]}"
        description = self.description()
        self._check_same_date(description)
        try:
            archive = RunArchive.open(
                self.run_dir,
                description,
                new_run=s.new_run,
                skip_corrupt=s.skip_corrupt,
                flush_rows=s.flush_rows,
                flush_seconds=s.flush_seconds,
            )
        except ArchiveError as exc:
            if "utility:" in exc.message and not s.new_run and self._same_measurement():
                raise ArchiveError(
                    exc.message + f". For another utility of the same answer, `coalescence replay {self.run_dir} --method "
                    f"{s.method} --utility ...` (or --target-span/--target-substring) needs no model, and "
                    "--new-run evaluates only what the archived measurements do not cover",
                    field=exc.field,
                ) from None
            raise
        self.archive = archive
        self.resumed_coalitions = self.engine.attach_archive(archive) if archive.resumed else 0
        if not archive.resumed:
            self.engine.attach_archive(archive)
        return archive

    def _check_same_date(self, description: dict[str, Any]) -> None:
        """Refuse to resume a run whose recorded date is not the one this session rendered with
        (an archive of several runs, resuming an earlier one than the last)."""
        from .archive.reader import read_manifest
        from .archive.writer import IDENTITY_FIELDS

        if self.run_dir is None or not (self.run_dir / "manifest.json").is_file() or not description.get("template_renders_date"):
            return
        for run in read_manifest(self.run_dir).get("runs") or []:
            if all(run.get(k) == description.get(k) for k in IDENTITY_FIELDS):
                recorded = run.get("template_now")
                if recorded is not None and _recorded_now(self.run_dir, recorded) != self.now:
                    raise ArchiveError(
                        f"the run was rendered with the date pinned to {recorded}, this session to "
                        f"{self.now.isoformat()}; resume it with COALESCENCE_TODAY={recorded}",
                        field="archive",
                    )
                return

    def _same_measurement(self) -> bool:
        """Whether the archive's last run measured what this utility needs (so replay can reduce it)."""
        from .archive.reader import read_manifest
        from .utility import UtilitySpec

        try:
            last = UtilitySpec.from_dict(read_manifest(self.run_dir)["runs"][-1].get("utility") or {})
        except (CoalescenceError, KeyError, IndexError, TypeError, ValueError):
            return False
        return last.teacher_forced == self.utility.teacher_forced and last.generation == self.utility.generation

    # -- 5. the run ------------------------------------------------------------------------------------
    async def evaluate(self) -> list[Any]:
        """Plan, evaluate and fit every input (async: the engine's event loop).

        Up to ``max_conversations_in_flight`` conversations are evaluated at once through the one
        engine (their coalitions share batches; each value is what a one-at-a-time run gives, up
        to float rounding). A conversation an earlier session of a resumed run finished, with the
        same method, budget, seed and target standard error, is restored from the archive, not
        planned again.

        Returns:
            One explanation per input, in input order (hierarchical for a hierarchy run).

        Raises:
            BatchFailed: a model call failed.
        """
        import anyio

        results: list[Any] = [None] * len(self.snapshots)
        todo = []
        for k, snap in enumerate(self.snapshots):
            restored = self._restored(snap)
            if restored is not None:
                results[k] = restored
            else:
                todo.append((k, snap))
        self.restored_conversations = len(self.snapshots) - len(todo)
        pending = iter(todo)

        async def worker() -> None:
            for k, snap in pending:  # shared: each worker takes the next conversation
                results[k] = await self._explain_one(k, snap)
                self._record(snap, results[k])

        width = max(1, min(self.settings.max_conversations_in_flight, len(todo)))
        if width == 1:
            await worker()
            return results
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(width):
                    tg.start_soon(worker)
        except BaseExceptionGroup as group:  # one conversation's error stops the others: raise it as it is
            raise _first_error(group) from None
        return results

    async def _explain_one(self, k: int, snap: Any) -> Any:
        from .attribution.hierarchy import explain_hierarchical

        s, engine, policy = self.settings, self.engine, self.policy
        if s.target_stderr is not None:
            return await engine.explain_until(
                snap, s.method, policy, budget=s.budget_for(snap.n_players), target_stderr=s.target_stderr, seed=s.seed
            )
        if s.hierarchy is None:
            return await engine.explain(snap, s.estimator(snap.n_players), policy)
        fine, parents = self.fines[k]
        return await explain_hierarchical(
            engine, snap, fine, parents, estimator_for=s.estimator, policy=policy, top_k=s.top_k_or_default
        )

    def _result_key(self, snap: Any) -> str:
        import json

        s = self.settings
        fit = {"method": s.method, "budget": s.budget_for(snap.n_players), "seed": s.seed, "target_stderr": s.target_stderr}
        if s.interactions is not None:
            fit["interactions"] = [s.interactions, s.index]
        return json.dumps({"snapshot_id": snap.snapshot_id, "fit": fit}, sort_keys=True)

    def _restored(self, snap: Any) -> Any:
        """The explanation of ``snap`` an earlier session finished, or ``None``."""
        from .attribution.explanation import Explanation

        if self.archive is None or self.settings.hierarchy is not None:
            return None
        document = self.archive.results.get(self._result_key(snap))
        if document is None:
            return None
        try:
            return Explanation.from_dict(document, snap, notes=("restored from the archive: finished in an earlier session of this run",))
        except InputError:
            return None  # not restorable: evaluated again (its coalitions are in the archive)

    def _record(self, snap: Any, explanation: Any) -> None:
        """Record a finished conversation's explanation for a resume (hierarchies are not)."""
        if self.archive is not None and self.settings.hierarchy is None and len(self.snapshots) > 1:
            self.archive.record_result(self._result_key(snap), explanation.to_dict())

    # -- 6. close and write ------------------------------------------------------------------------------
    def close(self, status: str) -> None:
        """Close the engine and its archive, recording ``status`` (``complete``, ``interrupted``,
        ``failed``).

        Raises:
            ArchiveError: the archive's last part or manifest cannot be written.
        """
        if self.engine is not None:
            self.engine.close(status=status)

    def document(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """The ``--out`` document: one explanation's, or ``{"archive", "explanations"}`` for a batch."""
        where = {"archive": str(self.run_dir)} if self.archive is not None else {}
        documents = [e.to_dict() | where for e in explanations]
        if self.is_batch:
            return {"archive": str(self.run_dir) if self.archive is not None else None, "explanations": documents}
        return documents[0]

    def write(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document and the ``html`` report (each atomically) when asked for.

        Returns:
            The ``--out`` document.

        Raises:
            ArchiveWriteError, ArchiveError: a file cannot be written.
        """
        payload = self.write_out(explanations)
        self.write_html(payload)
        return payload

    def write_out(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document (atomically) when asked for; returns it.

        Raises:
            ArchiveWriteError, ArchiveError: the file cannot be written.
        """
        from .archive.writer import write_json_atomic

        payload = self.document(explanations)
        if self.out_path is not None:
            write_json_atomic(self.out_path, payload, field="out")
        return payload

    def write_html(self, payload: dict[str, Any]) -> None:
        """Draw and write the ``html`` report of ``payload`` (the ``--out`` document) when asked for.

        The run's results are written by then: any failure here, drawing or writing, is a
        :class:`~coalescence.errors.ReportError`, never taken for a failure of the run.

        Raises:
            ReportError: the page cannot be drawn or written (the message says why and how to make
                it again from the archive).
        """
        if self.html_path is None:
            return
        from .report import render_report, write_report

        again = f"; the results are kept: make it again with `coalescence report {self.run_dir} -o PATH`" if self.archive is not None else ""
        try:
            write_report(self.html_path, render_report(payload), field="html")
        except CoalescenceError as exc:
            raise ReportError(f"the HTML report was not written: {exc.message}{again}", field="html") from exc
        except Exception as exc:  # a drawing library's failure must not read as the run's
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ReportError(f"the HTML report could not be drawn ({type(exc).__name__}: {first}){again}", field="html") from exc

    def result(self, explanations: Sequence[Any], payload: dict[str, Any]) -> RunResult:
        """The run's :class:`RunResult`."""
        return RunResult(
            explanations=tuple(explanations),
            snapshots=tuple(self.snapshots),
            run_dir=self.run_dir if self.archive is not None else None,
            is_batch=self.is_batch,
            document=payload,
            resumed_coalitions=self.resumed_coalitions,
        )


def _recorded_now(run_dir: Path, value: Any) -> datetime:
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


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first error of a task group's, depth first, that is not the cancellation it caused."""
    import anyio

    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        found = _first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(found, cancelled):
            return found
    return group.exceptions[0]


def explain_run(source: Any, settings: RunSettings, *, backend: Any = None, progress: Any = None) -> RunResult:
    """Every phase of an explain run, synchronously (its own event loop).

    Args:
        source: a path, an input dict or a list of messages (see :class:`ExplainRun`).
        settings: the run's settings.
        backend: a loaded backend (else ``settings.model`` is loaded).
        progress: progress callbacks.

    Returns:
        The :class:`RunResult`.

    Raises:
        CoalescenceError: as the phases raise; the archive is closed with status ``failed`` (or
            ``interrupted`` on a KeyboardInterrupt) before the error propagates.
    """
    import anyio

    run = ExplainRun(source, settings, backend=backend)
    run.preflight()
    run.load(progress=progress)
    run.open_archive()
    explanations = _closing(run, lambda: anyio.run(run.evaluate))
    return run.result(explanations, run.write(explanations))


async def explain_run_async(source: Any, settings: RunSettings, *, backend: Any = None, progress: Any = None) -> RunResult:
    """:func:`explain_run` for code already in an event loop (asyncio or trio): the blocking
    phases (tokenizer, weights, archive) run in a worker thread, the evaluation in the caller's loop."""
    import anyio

    def prepare() -> ExplainRun:
        run = ExplainRun(source, settings, backend=backend)
        run.preflight()
        run.load(progress=progress)
        run.open_archive()
        return run

    run = await anyio.to_thread.run_sync(prepare)
    status = "interrupted"
    try:
        explanations = await run.evaluate()
        status = "complete"
    except CoalescenceError:
        status = "failed"
        raise
    finally:
        await anyio.to_thread.run_sync(run.close, status)
    payload = await anyio.to_thread.run_sync(run.write, explanations)
    return run.result(explanations, payload)


def _closing(run: ExplainRun, evaluate: Callable[[], list[Any]]) -> list[Any]:
    status = "interrupted"
    try:
        explanations = evaluate()
        status = "complete"
        return explanations
    except CoalescenceError:
        status = "failed"
        raise
    finally:
        run.close(status)


# -- replay: fit from an archive ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySettings:
    """The settings of a replay (the CLI's ``replay`` options, by their library names).

    Args:
        methods: the estimators fitted (registered names or ``shapiq:<Approximator>``).
        budget: sampling methods' budget (default: the run's for the run's method in a one-input
            run, else 32 x players).
        seed: the plans' seed (default: the run's).
        interactions, index: interactions to compute (as :class:`RunSettings`); default: the
            run's, for the run's method.
        run_id: which run of the archive (default the last).
        snapshot: a snapshot id or prefix (default every snapshot of the run).
        utility, target_span, target_substring, whole_answer: the utility replayed (default the
            run's; another teacher-forced kind or answer sub-span is reduced from the archived
            per-token scores with no model).
        model, backend, device, dtype, batch_size: a model to evaluate what the archive lacks.
        flush_rows, flush_seconds, skip_corrupt: archive options.
        out: the document written.

    Raises:
        ConfigError: no or an unknown method, a sub-span with ``whole_answer``.
    """

    methods: tuple[str, ...]
    budget: int | None = None
    seed: int | None = None
    interactions: int | None = None
    index: str | None = None
    run_id: str | None = None
    snapshot: str | None = None
    utility: str | None = None
    target_span: str | tuple[int, int] | None = None
    target_substring: str | None = None
    whole_answer: bool = False
    model: str | None = None
    backend: str = "hf"
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = DEFAULT_BATCH_SIZE
    flush_rows: int = 4096
    flush_seconds: float = 30.0
    skip_corrupt: bool = False
    out: str | Path | None = None
    workers: int | None = None
    ray_address: str | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int | None = None

    @property
    def distributed(self) -> bool:
        """Whether the model runs in Ray workers (``workers`` or ``ray_address`` given)."""
        return self.workers is not None or self.ray_address is not None

    def __post_init__(self) -> None:
        from .attribution.estimators import ESTIMATORS, estimator_class, is_method
        from .attribution.estimators.base import check_seed

        _check_ray(self)
        if self.seed is not None:
            check_seed(self.seed)

        methods = tuple(m.strip() for m in ((self.methods.split(",")) if isinstance(self.methods, str) else self.methods) if m.strip())
        unknown = [m for m in methods if not is_method(m)]
        if not methods or unknown:
            raise ConfigError(
                f"unknown method {unknown[0] if unknown else ''!r}; use a comma-separated subset of {','.join(ESTIMATORS)} "
                "or shapiq:<Approximator>",
                field="method",
            )
        for m in methods:
            estimator_class(m)  # a shapiq approximator the installed shapiq lacks is refused now
        if self.interactions is not None or self.index is not None:
            for m in methods:
                interaction_settings(m, self.interactions, self.index)
        object.__setattr__(self, "methods", methods)
        spanned = self.target_span is not None or self.target_substring is not None
        if self.whole_answer and spanned:
            raise ConfigError("scores every answer token, so it does not combine with a sub-span; drop one", field="whole_answer")

    def budget_for(self, n_players: int, method: str | None = None, run: Mapping[str, Any] | None = None) -> int:
        """The sampling budget for a game of ``n_players``: ``budget``; else the ``run``'s
        (:func:`recorded_budget`) for ``method``; else 32 x players."""
        if self.budget is not None:
            return self.budget
        recorded = None if run is None or method is None else recorded_budget(run, method)
        return recorded if recorded is not None else 32 * n_players

    def seed_for(self, run: Mapping[str, Any] | None = None) -> int:
        """The plans' seed: ``seed``, else the ``run``'s recorded seed, else 0."""
        if self.seed is not None:
            return self.seed
        return 0 if run is None else recorded_seed(run)

    def interactions_for(self, method: str, run: Mapping[str, Any]) -> tuple[int | None, str | None]:
        """``(order, index)`` of the interactions fitted with ``method``: the settings', else the
        run's when ``method`` is the run's method, else none."""
        if self.interactions is not None or self.index is not None:
            return interaction_settings(method, self.interactions, self.index)
        return recorded_interactions(run, method)


class ArchiveFit:
    """Fits estimators on one run's archived coalitions, with no model (replay and the report).

    Args:
        run_dir: the run directory.
        run: the run's manifest record.
        records: the manifest's snapshot records by id.
        utility: the utility replayed (default: the run's).
        skip_corrupt: skip unreadable parts instead of refusing.

    Raises:
        ArchiveError: the run's utility cannot be replayed by this version; a part is corrupt.
    """

    def __init__(
        self,
        run_dir: str | Path,
        run: Mapping[str, Any],
        records: Mapping[str, Any],
        *,
        utility: Any = None,
        skip_corrupt: bool = False,
        rows: Any = None,
    ) -> None:
        from .archive.reader import read_rows
        from .engine import fill_measurements, fill_store
        from .masking.policies import get_policy
        from .scheduler.store import ResultStore
        from .utility import UtilitySpec

        self.run_dir = Path(run_dir)
        self.run = dict(run)
        self.records = dict(records)
        if utility is None:
            try:
                utility = UtilitySpec.from_dict(run.get("utility") or {})
            except (CoalescenceError, TypeError, ValueError) as exc:
                raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot replay", field="archive") from exc
        self.utility = utility
        self.policy = get_policy(run["absence_policy"]["id"], **run["absence_policy"]["params"])
        self.store = ResultStore()
        self.measurements: dict[str, Any] = {}
        rows = rows if rows is not None else read_rows(self.run_dir, skip_corrupt=skip_corrupt)
        fill_store(self.store, rows)
        fill_measurements(self.measurements, rows)

    def resolved(self, snap: Any) -> Any:
        """The utility fixed for ``snap``'s answer from the recorded token offsets.

        Raises:
            ArchiveError: a sub-span asked of an archive that predates recorded offsets.
        """
        offsets = (self.run.get("target_token_offsets") or {}).get(snap.snapshot_id)
        if offsets is None:
            n = len((self.run.get("target_token_ids") or {}).get(snap.snapshot_id, []))
            if self.utility.span is not None or self.utility.substring is not None:
                raise ArchiveError(
                    "this archive does not record the target tokens' characters (it predates answer "
                    f"sub-spans); replay it with `--model {self.run['model']['id']}` to align the span with the tokenizer",
                    field="archive",
                )
            offsets = [(0, 0)] * n
        return self.utility.resolve(snap.target, [tuple(o) for o in offsets])

    def missing(self, snap: Any, rows: Iterable[np.ndarray]) -> int:
        """How many distinct coalitions of ``rows`` the archive lacks under the utility."""
        from .engine import pool_from_store

        return pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=self.resolved(snap), measurements=self.measurements
        )[2]

    def pool(self, snap: Any, rows: Iterable[np.ndarray], resolved: Any, method: str) -> tuple[np.ndarray, np.ndarray]:
        """The archived utilities of ``rows``.

        Raises:
            EstimatorError: the archive lacks some (naming the replay command that evaluates them).
        """
        from .engine import pool_from_store

        masks, utilities, missing = pool_from_store(
            self.store, snap, self.policy, self.run["model"], rows, utility=resolved, measurements=self.measurements
        )
        if missing:
            raise EstimatorError(
                f"the archive lacks {missing} of the coalitions {method} plans for snapshot {snap.snapshot_id[:12]} "
                f"under utility {self.utility.kind}; evaluate them with `coalescence replay {self.run_dir} "
                f"--method {method} --model {self.run['model']['id']}` (same --budget and --seed)",
                field="method",
            )
        return masks, utilities

    def answer_tokens(self, snap: Any, resolved: Any, full: np.ndarray, empty: np.ndarray) -> Any:
        """The answer's tokens with their log-probabilities in the full and the empty coalition
        (from the archived per-token scores), or ``None`` when they are not archived."""
        from .attribution.explanation import answer_tokens
        from .engine import key_for
        from .masking.codec import PackedMask

        offsets = (self.run.get("target_token_offsets") or {}).get(snap.snapshot_id)
        if not resolved.spec.teacher_forced or offsets is None:
            return None
        ekey = resolved.evaluation_utility()
        measured = [
            self.measurements.get(key_for(snap, self.policy, self.run["model"], PackedMask.from_bools(r), utility=ekey))
            for r in (full, empty)
        ]
        if any(m is None or isinstance(m, tuple) or len(m) != len(offsets) for m in measured):
            return None
        rendering = (self.run.get("answer_rendering") or {}).get(snap.snapshot_id) or {}
        return answer_tokens(
            snap.target, [tuple(o) for o in offsets], measured[0], measured[1],
            lead=str(rendering.get("lead") or ""), tail=str(rendering.get("tail") or ""),
        )  # fmt: skip

    def notes(self, snap: Any, resolved: Any) -> tuple[str, ...]:
        """The notes of a replayed explanation: the utility's, the template's default system
        prompt, and where the values came from."""
        record = self.records.get(snap.snapshot_id) or {}
        notes = tuple(resolved.notes())
        when = record.get("default_system_in_play")
        if isinstance(when, str) and when != "never":
            notes += (f"the chat template injects its own default system prompt ({when})",)
        target_notes = (self.run.get("target_notes") or {}).get(snap.snapshot_id)
        if isinstance(target_notes, list):
            notes += tuple(str(n) for n in target_notes)
        now = self.run.get("template_now")
        if self.run.get("template_renders_date") is True and isinstance(now, str):
            notes += (f"the template renders a date: pinned to {now[:10]}",)
        executed = (self.run.get("statistics") or {}).get("executed")
        run_note = f"replayed from run {self.run['run_id']} of the archive: no model call"
        if isinstance(executed, int) and not isinstance(executed, bool):
            run_note += f"; the run evaluated {executed} coalitions with the model"
        return (*notes, run_note)

    def explain(
        self, snap: Any, method: str, budget: int | None, seed: int, *, interactions: int | None = None, index: str | None = None
    ) -> Any:
        """Fit ``method`` on ``snap`` from the archive (with interactions of orders 2..``interactions``
        of ``index`` when given).

        Raises:
            EstimatorError: the archive lacks coalitions of the plan.
        """
        from .attribution.estimators import make_estimator

        t0 = time.perf_counter()
        estimator = make_estimator(method, budget=budget, seed=seed, interactions=interactions, index=index)
        estimator.validate(snap.n_players)
        resolved = self.resolved(snap)
        masks, utilities = self.pool(snap, estimator.plan(snap.n_players), resolved, method)
        n = snap.n_players
        tokens = self.answer_tokens(snap, resolved, np.ones(n, dtype=bool), np.zeros(n, dtype=bool))
        return self._explanation(snap, estimator.fit(masks, utilities), resolved, t0, self.notes(snap, resolved), tokens)

    def _explanation(self, snap: Any, estimate: Any, resolved: Any, t0: float, notes: tuple[str, ...], tokens: Any) -> Any:
        from .attribution.explanation import Explanation
        from .engine import utility_detail

        return Explanation(
            snapshot=snap,
            estimate=estimate,
            model_id=self.run["model"]["id"],
            model_revision=self.run["model"]["revision"],
            absence_policy=self.policy.id,
            absence_params=self.policy.params(),
            utility=self.utility.kind,
            utility_unit=self.utility.unit,
            utility_detail=utility_detail(resolved),
            utility_description=resolved.describe(),
            target_token_count=len((self.run.get("target_token_ids") or {}).get(snap.snapshot_id, [])),
            n_evaluations=0,
            wall_seconds=time.perf_counter() - t0,
            notes=(*notes, *estimate.notes),
            answer_tokens=tokens,
        )

    def hierarchical(
        self, coarse_snap: Any, coarse: Any, hierarchy: Mapping[str, Any], method: str, budget_for: Any, seed: int, ids: list[str]
    ) -> Any:
        """Both levels of a hierarchy run, as :func:`~coalescence.attribution.hierarchy.explain_hierarchical`
        computed them, from the archive (the fine game: the top-k coarse players' fine players,
        every other fine player present).

        Returns:
            A :class:`~coalescence.attribution.hierarchy.HierarchicalExplanation`.
        """
        from .attribution.estimators import make_estimator
        from .attribution.hierarchy import HierarchicalExplanation, fine_snapshot
        from .conversation import ConversationSnapshot

        units = hierarchy.get("units") or []
        top_k = hierarchy.get("top_k")
        if not (isinstance(units, list) and len(units) == 2 and isinstance(top_k, int) and not isinstance(top_k, bool)):
            raise ArchiveError(f"run {self.run['run_id']}: run_config.hierarchy must be {{units: [coarse, fine], top_k}}", field="archive")
        fine, parents = fine_snapshot(coarse_snap, units[1])
        if fine.snapshot_id not in ids:
            raise ArchiveError(f"run {self.run['run_id']} does not hold the fine snapshot of {coarse_snap.snapshot_id[:12]}", field="archive")
        values = coarse.values
        order = sorted(range(coarse_snap.n_players), key=lambda i: (-abs(float(values[i])), i))
        refined = tuple(order[: min(int(top_k), coarse_snap.n_players)])
        sel = np.array([k for k, parent in enumerate(parents) if parent in set(refined)], dtype=np.intp)
        result = HierarchicalExplanation(coarse=coarse, fine=None, fine_snapshot=fine, refined=refined, top_k=int(top_k))
        if sel.size:
            t0 = time.perf_counter()
            estimator = make_estimator(method, budget=budget_for(int(sel.size)), seed=seed)
            estimator.validate(int(sel.size))

            def lifted(plan: Any) -> Any:
                for row in plan:
                    full = np.ones(fine.n_players, dtype=bool)
                    full[sel] = row
                    yield full

            resolved = self.resolved(fine)
            masks, utilities = self.pool(fine, lifted(estimator.plan(int(sel.size))), resolved, method)
            empty = np.ones(fine.n_players, dtype=bool)
            empty[sel] = False
            tokens = self.answer_tokens(fine, resolved, np.ones(fine.n_players, dtype=bool), empty)
            view = ConversationSnapshot(
                conversation=fine.conversation,
                unit=fine.unit,
                players=tuple(replace(fine.players[int(k)], index=j) for j, k in enumerate(sel)),
            )
            others = fine.n_players - int(sel.size)
            note = (
                f"fine level: {int(sel.size)} of {fine.n_players} fine players refined; "
                f"{'the other one is' if others == 1 else f'the other {others} are'} held present"
            )
            fine_explanation = self._explanation(
                view, estimator.fit(masks[:, sel], utilities), resolved, t0, (*coarse.notes, note), tokens
            )
            result = replace(result, fine=fine_explanation)
        return result


def interaction_settings(method: str, interactions: int | None, index: str | None) -> tuple[int | None, str | None]:
    """As :func:`coalescence.attribution.estimators.interaction_settings` (imported late)."""
    from .attribution.estimators import interaction_settings as check

    return check(method, interactions, index)


def _run_config(run: Mapping[str, Any]) -> Mapping[str, Any]:
    """A manifest run's ``run_config`` (``{}`` when it records none)."""
    config = run.get("run_config")
    return config if isinstance(config, Mapping) else {}


def recorded_budget(run: Mapping[str, Any], method: str) -> int | None:
    """The sampling budget a run of one input (no hierarchy) recorded, when ``method`` is its
    method; else None (a budget recorded for a dataset run is its first conversation's)."""
    config = _run_config(run)
    budget = config.get("budget")
    one_input = len(run.get("snapshot_ids") or ()) == 1 and not config.get("hierarchy")
    if one_input and method == config.get("method") and isinstance(budget, int) and not isinstance(budget, bool):
        return budget
    return None


def recorded_seed(run: Mapping[str, Any]) -> int:
    """The plans' seed a run recorded (0 when it records none)."""
    seed = _run_config(run).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def recorded_interactions(run: Mapping[str, Any], method: str) -> tuple[int | None, str | None]:
    """``(order, index)`` of the interactions a run recorded for ``method`` (its own method), or
    ``(None, None)``."""
    config = _run_config(run)
    recorded = config.get("interactions")
    if config.get("method") != method or not isinstance(recorded, Mapping):
        return None, None
    order, index = recorded.get("order"), recorded.get("index")
    if isinstance(order, bool) or not isinstance(order, int) or not isinstance(index, str):
        raise ArchiveError(f"run {run.get('run_id')}: run_config.interactions must be {{order, index}}", field="archive")
    return order, index


def _select_run(manifest: Mapping[str, Any], run_id: str | None) -> dict[str, Any]:
    runs = manifest.get("runs") or []
    if not runs:
        raise ArchiveError("the archive records no run", field="archive")
    run = next((r for r in runs if r["run_id"] == run_id), None) if run_id else runs[-1]
    if run is None:
        raise ConfigError(f"no run {run_id!r}; the archive has {[r['run_id'] for r in runs]}", field="run")
    return run


def fit_archive(
    run_dir: str | Path,
    *,
    methods: Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Fit estimators from the coalitions a run archive holds, with no model (the report's source).

    Every snapshot of the run is fitted with every method; a hierarchy run is fitted level by level
    (the coarse values choose the refined players, as the run did). The run's utility is used as
    recorded.

    Args:
        run_dir: the run directory.
        methods: estimator names (default: the run's method).
        budget: sampling budget (default: the run's, for a run of one input with that method; else
            32 x players).
        seed: plan seed (default: the run's).
        run_id: the run (default: the last).

    Returns:
        A replay-form document ``{"run_dir", "run_id", "explanations": [...]}``.

    Raises:
        ArchiveError: a damaged or foreign archive, or a run that cannot be replayed.
        ConfigError: an unknown method, or no method given for a run that records none.
        EstimatorError: the archive lacks coalitions a plan needs.
    """
    from .archive.manifest import check_replayable, read_manifest
    from .attribution.estimators import ESTIMATORS, is_method
    from .conversation import ConversationSnapshot

    manifest = read_manifest(run_dir)
    run = _select_run(manifest, run_id)
    check_replayable(run_dir, manifest, run)
    config = _run_config(run)
    if not methods:
        if not is_method(config.get("method")):
            raise ConfigError(f"run {run['run_id']} does not record its method; give one of {','.join(ESTIMATORS)}", field="method")
        methods = [config["method"]]
    unknown = [m for m in methods if not is_method(m)]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}; use a comma-separated subset of {','.join(ESTIMATORS)}", field="method")
    fit = ArchiveFit(run_dir, run, {s["snapshot_id"]: s for s in manifest["snapshots"]})
    seed = seed if seed is not None else recorded_seed(run)
    hierarchy = config.get("hierarchy") if isinstance(config.get("hierarchy"), Mapping) else None
    ids = list(run["snapshot_ids"])
    n_inputs = len(ids) // 2 if hierarchy else len(ids)
    try:
        snapshots = [ConversationSnapshot.from_dict(fit.records[i]) for i in ids[:n_inputs]]
    except InputError as exc:
        raise ArchiveError(f"run {run['run_id']}: {exc.message}", field="archive") from exc
    explanations: list[dict[str, Any]] = []
    for snap in snapshots:
        for method in methods:

            def budget_for(n: int, method: str = method) -> int:
                if budget is not None:
                    return budget
                recorded = recorded_budget(run, method)
                return recorded if recorded is not None else 32 * n

            order, index = recorded_interactions(run, method)
            coarse = fit.explain(snap, method, budget_for(snap.n_players), seed, interactions=order, index=index)
            if hierarchy is None:
                explanations.append(coarse.to_dict() | {"archive": str(run_dir)})
            else:
                explanations.append(fit.hierarchical(snap, coarse, hierarchy, method, budget_for, seed, ids).to_dict() | {"archive": str(run_dir)})
    return {"run_dir": str(run_dir), "run_id": run["run_id"], "explanations": explanations}


class ReplayRun:
    """A replay, phase by phase: :meth:`check` (the archive and the plans, no model);
    :meth:`fit` (no model) when nothing is missing, else :meth:`load`, :meth:`open_archive`,
    :meth:`evaluate` (async) and :meth:`close`; then :meth:`write`.

    Args:
        run_dir: the run directory.
        settings: the replay's settings.

    Raises:
        as :meth:`check`.
    """

    def __init__(self, run_dir: str | Path, settings: ReplaySettings) -> None:
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.engine: Any = None
        self.archive: Any = None
        self.check()

    def check(self) -> None:
        """Read the archive, fix the utility replayed, and count what the plans lack.

        Raises:
            ArchiveError: no run, a damaged archive, a run this version cannot replay.
            ConfigError: an unknown run or snapshot, a utility the archive holds no measurement for.
            InputError: a sub-span outside an answer.
        """
        from .archive.manifest import check_replayable
        from .archive.reader import read_manifest
        from .conversation import ConversationSnapshot
        from .utility import REGENERATE_KINDS, TEACHER_FORCED_KINDS, UtilitySpec, parse_span

        s = self.settings
        span = parse_span(s.target_span) if isinstance(s.target_span, str) else s.target_span
        self.out_path = output_path(s.out, "out")
        manifest = read_manifest(self.run_dir)
        run = _select_run(manifest, s.run_id)
        check_replayable(self.run_dir, manifest, run)
        self.run = run
        try:
            run_utility = UtilitySpec.from_dict(run.get("utility") or {})
        except (ConfigError, TypeError, ValueError) as exc:
            raise ArchiveError(f"run {run['run_id']} used utility {run.get('utility')}, which this version cannot replay", field="archive") from exc
        kind = s.utility or run_utility.kind
        if kind in REGENERATE_KINDS and run_utility.kind in TEACHER_FORCED_KINDS:
            raise ConfigError(
                f"run {run['run_id']} scored the fixed answer ({run_utility.kind}); it holds no regenerated "
                f"answers to compare, so utility {kind} needs a new explain run",
                field="utility",
            )
        if kind in TEACHER_FORCED_KINDS and run_utility.kind in REGENERATE_KINDS:
            raise ConfigError(
                f"run {run['run_id']} regenerated answers ({run_utility.kind}); it holds no per-token scores, "
                f"so utility {kind} needs a new explain run",
                field="utility",
            )
        keep = span is None and s.target_substring is None and not s.whole_answer
        self.utility = UtilitySpec(
            kind=kind,
            span=run_utility.span if keep else span,
            substring=run_utility.substring if keep else s.target_substring,
            generation=run_utility.generation,
        )
        self.records = {r["snapshot_id"]: r for r in manifest.get("snapshots", [])}
        ids = [i for i in run["snapshot_ids"] if s.snapshot is None or i.startswith(s.snapshot)]
        if not ids:
            raise ConfigError(f"no snapshot of run {run['run_id']} starts with {s.snapshot!r}", field="snapshot")
        self.snapshots = [ConversationSnapshot.from_dict(self.records[i]) for i in ids]
        self.fit_ = ArchiveFit(self.run_dir, run, self.records, utility=self.utility, skip_corrupt=s.skip_corrupt)
        self.aligned: dict[str, Any] = {}
        offsets = run.get("target_token_offsets") or {}
        for snap in self.snapshots:
            if offsets.get(snap.snapshot_id) is None and (self.utility.span is not None or self.utility.substring is not None):
                if s.model is None:
                    raise ConfigError(
                        "this archive does not record the target tokens' characters (it predates answer "
                        f"sub-spans); pass --model {run['model']['id']} to align the span with the tokenizer",
                        field="target_span" if self.utility.span is not None else "target_substring",
                    )
                continue  # the engine aligns it with the model's tokenizer
            self.aligned[snap.snapshot_id] = self.fit_.resolved(snap)
        self.jobs = []
        for snap in self.snapshots:
            for method in s.methods:
                from .attribution.estimators import make_estimator

                order, index = s.interactions_for(method, run)
                budget = s.budget_for(snap.n_players, method, run)
                estimator = make_estimator(method, budget=budget, seed=s.seed_for(run), interactions=order, index=index)
                estimator.validate(snap.n_players)
                self.jobs.append((snap, estimator))
        self.missing = [
            self.fit_.missing(snap, e.plan(snap.n_players)) if snap.snapshot_id in self.aligned else 1 for snap, e in self.jobs
        ]

    @property
    def needs_model(self) -> bool:
        """Whether some plan needs coalitions the archive lacks."""
        return any(self.missing)

    def fit(self) -> list[Any]:
        """Fit every (snapshot, method) from the archive, with no model.

        Raises:
            EstimatorError: the archive lacks coalitions (pass a model to evaluate them).
        """
        if self.needs_model:
            k = next(i for i, m in enumerate(self.missing) if m)
            snap, estimator = self.jobs[k]
            raise EstimatorError(
                f"the archive lacks {self.missing[k]} of the coalitions {estimator.name} plans for snapshot "
                f"{snap.snapshot_id[:12]} under utility {self.utility.kind}; pass --model {self.run['model']['id']} "
                "to evaluate them",
                field="method",
            )
        return [
            self.fit_.explain(
                snap, e.name, getattr(e, "budget", None), self.settings.seed_for(self.run),
                interactions=getattr(e, "interactions", None), index=getattr(e, "index", None),
            )  # fmt: skip
            for snap, e in self.jobs
        ]

    def load(self, *, progress: Any = None, loader: Callable[..., Any] | None = None) -> Any:
        """Load the run's model to evaluate what the archive lacks.

        Args:
            progress: the engine's progress callbacks.
            loader: ``loader(source) -> backend`` (default: the settings' backend, device, dtype).

        Raises:
            ConfigError: no model given.
            InputError: a model other than the run's (its identity differs).
        """
        from .backends.registry import load_backend, resolve_model
        from .engine import Engine

        s = self.settings
        if s.model is None:
            raise ConfigError(f"the archive lacks coalitions; pass --model {self.run['model']['id']} to evaluate them", field="model")
        source = resolve_model(s.model)
        if s.distributed:
            from .backends.registry import load_config, load_tokenizer

            backend = _ray_backend(s, source, tokenizer=load_tokenizer(source), config=load_config(source))
        elif loader is None:
            backend = load_backend(source, backend=s.backend, device=s.device, dtype=s.dtype, max_batch_size=s.batch_size)
        else:
            backend = loader(source)
        recorded_now = self.run.get("template_now")  # one date per run: a replay renders the run's
        now = _recorded_now(self.run_dir, recorded_now) if recorded_now is not None else None
        engine = Engine(backend, store=self.fit_.store, progress=progress, batch_size=s.batch_size, utility=self.utility, now=now)
        engine.measurements.update(self.fit_.measurements)
        if engine.model != self.run["model"]:
            if backend.shutdown_with_engine:
                backend.shutdown()
            raise InputError(
                f"the model is {engine.model}, but the run was evaluated with {self.run['model']}; give the run's model",
                field="model",
            )
        for snap in self.snapshots:
            engine.resolved_utility(snap, self.fit_.policy)
        self.engine = engine
        return engine

    def open_archive(self) -> Any:
        """Open the archive for the evaluated coalitions (a new run when the utility differs)."""
        from .archive.writer import RunArchive

        s, run = self.settings, self.run
        description = {k: v for k, v in run.items() if k not in ("run_id", "started_at", "status", "resumed_at", "statistics")}
        description |= {"utility": self.utility.to_dict(), "snapshots": [self.records[i] for i in run["snapshot_ids"]]}
        self.archive = RunArchive.open(
            self.run_dir,
            description,
            new_run=self.utility.to_dict() != run.get("utility"),
            skip_corrupt=s.skip_corrupt,
            flush_rows=s.flush_rows,
            flush_seconds=s.flush_seconds,
        )
        self.engine.attach_archive(self.archive)
        return self.archive

    async def evaluate(self) -> list[Any]:
        """Evaluate what the archive lacks and fit every (snapshot, method)."""
        return [await self.engine.explain(snap, e, self.fit_.policy) for snap, e in self.jobs]

    def close(self, status: str) -> None:
        """Close the engine and archive with ``status``."""
        if self.engine is not None:
            self.engine.close(status=status)

    def document(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """The replay's ``--out`` document."""
        documents = [e.to_dict() | {"archive": str(self.run_dir)} for e in explanations]
        return {"run_dir": str(self.run_dir), "run_id": self.run["run_id"], "explanations": documents}

    def write(self, explanations: Sequence[Any]) -> dict[str, Any]:
        """Write the ``out`` document when asked for; returns it."""
        from .archive.writer import write_json_atomic

        payload = self.document(explanations)
        if self.out_path is not None:
            write_json_atomic(self.out_path, payload, field="out")
        return payload


def replay_run(run_dir: str | Path, settings: ReplaySettings, *, progress: Any = None) -> list[Any]:
    """A whole replay, synchronously: fitted with no model when the archive covers the plans,
    else the missing coalitions evaluated with ``settings.model`` (and archived).

    Returns:
        The explanations, one per (snapshot, method).
    """
    import anyio

    replay = ReplayRun(run_dir, settings)
    if not replay.needs_model:
        explanations = replay.fit()
    else:
        replay.load(progress=progress)
        replay.open_archive()
        status = "interrupted"
        try:
            explanations = anyio.run(replay.evaluate)
            status = "complete"
        except CoalescenceError:
            status = "failed"
            raise
        finally:
            replay.close(status)
    replay.write(explanations)
    return explanations

