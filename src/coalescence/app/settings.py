"""The settings of explain and replay runs (:class:`RunSettings`, :class:`ReplaySettings`), what a
run returns (:class:`RunResult`); a replay takes its defaults from what the run archive recorded of
its fit (``recorded_*`` in :mod:`~coalescence.app.record`).

Errors name the settings by their names here (``budget``, ``archive``); the CLI maps them to its
options (``--budget``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError
from ..userinput import did_you_mean
from .backend import BackendSettings
from .groups import (
    INDEX_HELP,
    INDICES,
    INTERACTIONS_HELP,
    SPAN_HELP,
    SUBSTRING_HELP,
    UTILITY_HELP,
    ArchiveSettings,
    EstimatorSettings,
    ExecutionSettings,
    GameSettings,
    HierarchySettings,
    ModelSettings,
    OutputSettings,
    RaySettings,
    RunArchiveSettings,
    UtilitySettings,
    utility_kinds,
    method_list_help,
)
from .options import check_groups, group_of, names, option, positive_int, spread_groups
from .options import seed as seed_type
from .record import recorded_budget, recorded_interactions, recorded_seed

__all__ = (
    "RUN_GROUPS",
    "EvaluateSettings",
    "ReplaySettings",
    "RunResult",
    "RunSettings",
    "check_across",
    "interaction_settings",
)


RUN_GROUPS: Mapping[str, type] = {
    "model": ModelSettings,
    "game": GameSettings,
    "utility": UtilitySettings,
    "estimator": EstimatorSettings,
    "hierarchy": HierarchySettings,
    "archive": RunArchiveSettings,
    "execution": ExecutionSettings,
    "output": OutputSettings,
}
"""The groups of :class:`RunSettings` by the keyword that takes each whole (``RunSettings(model=ModelSettings(...))``)."""


@dataclass(frozen=True, kw_only=True)
class RunSettings(
    ModelSettings, GameSettings, UtilitySettings, EstimatorSettings, HierarchySettings, RunArchiveSettings, ExecutionSettings, OutputSettings
):
    """Every setting of an explain run (the CLI's ``explain`` options, by their library names),
    composed of the settings groups of :mod:`coalescence.app.groups` (each field's help is its
    ``--help`` text; each group normalises its given values before construction: a method chosen
    when none is given, an estimator object's budget and seed, roles and hierarchy as tuples).

    Args:
        model: alias, local directory, ``.gguf`` file or hub id.
        backend: the backend by name (:data:`~coalescence.backends.registry.BACKENDS`); ``None``
            (default): ``hf``, or ``vllm-server`` with a ``server_url`` (which only a server backend takes).
        unit: player unit (default: ``document`` for an input with declared players, else ``turn``).
        roles: the roles whose messages are players (default: every role).
        method: the estimator (:data:`~coalescence.attribution.estimators.ESTIMATORS`); ``None``
            (default): ``default`` (exact Shapley values on at most 16 players, else ``auto`` at 8
            exact coalitions with the proxy game, 64 without:
            :class:`~coalescence.attribution.estimators.default.DefaultMethod`), ``auto`` (chosen by
            players and budget, :class:`~coalescence.attribution.estimators.auto.AutoMethod`) when
            a budget is given, ``exact`` with a target standard error or interactions.
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
        server_url: a running server (``vllm serve``, or a registered server kind's) to score
            against instead of loading the weights here; ``vllm_url``, its earlier name, is taken too.
        device, dtype, batch_size: where and how the model runs.
        archive: the run directory; ``True`` for a new ``runs/<UTC time>-<snapshot id>``;
            ``None`` for no archive (the Python API's default).
        new_run, flush_rows, flush_seconds, skip_corrupt: archive options.
        out, html: files written after the run (the ``--out`` document, the HTML report).
        max_conversations_in_flight: a dataset's conversations evaluated at once, through one
            scheduler and collator (their coalitions fill the same batches); bounds memory.
        proxy_game, proxy_budget: the shared-KV proxy game of the two-fidelity methods
            (``auto``: where it applies; ``none``; or a tail rule) and its distinct coalitions; a
            tail rule or a proxy budget with a method that fits the exact game alone is refused.
        workers: model workers on Ray (:mod:`coalescence.distributed`): a local Ray cluster with
            this many workers, or this many workers on the cluster at ``ray_address``; ``None``:
            the model runs in this process (unless ``ray_address`` is given); at most
            :data:`~coalescence.app.backend.MAX_WORKERS`, and locally this machine's CPUs.
        ray_address: join this Ray cluster (``auto``, ``HOST:PORT``) instead of starting one.
        gpus_per_worker: accelerators each Ray worker reserves (needs a ``cuda`` device).
        threads_per_worker: torch threads of each Ray worker (default: its node's CPUs divided
            among the workers there).

    The settings are also built from their groups, each given whole under its keyword
    (:data:`RUN_GROUPS`: ``model``, ``game``, ``utility``, ``estimator``, ``hierarchy``,
    ``archive``, ``execution``, ``output``; any subset, the rest flat or by default):
    ``RunSettings(model=ModelSettings(model="gpt2", device="cuda"), estimator=EstimatorSettings(budget=256))``
    equals ``RunSettings(model="gpt2", device="cuda", budget=256)``. Under ``model``, ``utility``,
    ``archive`` and ``hierarchy``, also fields of their own, a group object is recognised by its
    type. Each group is read back whole as ``model_settings``, ``game_settings``, ... (a
    :class:`~coalescence.app.groups.ModelSettings` object, ...), for a layer that takes one group.

    Raises:
        ConfigError: a setting that cannot work, alone (each group's ``check_group``) or with
            another (:func:`check_across`), naming it; a field set both by a group object and as a
            keyword of its own; checked on construction, before anything loads.
    """

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """Group objects given whole spread into their fields (:func:`~coalescence.app.options.spread_groups`),
        then each group's own normalising.

        Raises:
            ConfigError: a field set twice, a group under another group's keyword (naming it).
        """
        return super().normalised(spread_groups(cls, given, RUN_GROUPS))

    def __post_init__(self) -> None:
        check_groups(self)
        check_across(self)

    # -- each group, read whole ---------------------------------------------------------------
    @property
    def model_settings(self) -> ModelSettings:
        """The model and where it runs, whole (:class:`~coalescence.app.groups.ModelSettings`)."""
        return group_of(self, ModelSettings)

    @property
    def game_settings(self) -> GameSettings:
        """The players and the absence policy, whole (:class:`~coalescence.app.groups.GameSettings`)."""
        return group_of(self, GameSettings)

    @property
    def utility_settings(self) -> UtilitySettings:
        """What v(S) measures, whole (:class:`~coalescence.app.groups.UtilitySettings`)."""
        return group_of(self, UtilitySettings)

    @property
    def estimator_settings(self) -> EstimatorSettings:
        """The estimator and its plan, whole (:class:`~coalescence.app.groups.EstimatorSettings`)."""
        return group_of(self, EstimatorSettings)

    @property
    def hierarchy_settings(self) -> HierarchySettings:
        """The hierarchy, whole (:class:`~coalescence.app.groups.HierarchySettings`)."""
        return group_of(self, HierarchySettings)

    @property
    def archive_settings(self) -> RunArchiveSettings:
        """The run archive and how it is written, whole (:class:`~coalescence.app.groups.RunArchiveSettings`)."""
        return group_of(self, RunArchiveSettings)

    @property
    def execution_settings(self) -> ExecutionSettings:
        """Conversations in flight and Ray workers, whole (:class:`~coalescence.app.groups.ExecutionSettings`)."""
        return group_of(self, ExecutionSettings)

    @property
    def output_settings(self) -> OutputSettings:
        """The files written after the run, whole (:class:`~coalescence.app.groups.OutputSettings`)."""
        return group_of(self, OutputSettings)

    def backend_settings(self) -> BackendSettings:
        """How the model executes (:class:`~coalescence.app.backend.BackendSettings`), checked
        when the settings were made (:func:`check_across`) and kept."""
        return self._made[0]

    @cached_property
    def _made(self) -> tuple[BackendSettings, Any]:
        """What the settings make, built once (by :func:`check_across`, when the settings are
        made): the :class:`~coalescence.backends.settings.BackendSettings` and the
        :class:`~coalescence.utility.UtilitySpec` (a frozen dataclass keeps them in its
        ``__dict__``, as :class:`functools.cached_property` writes it)."""
        return BackendSettings.of(self), self._utility_spec()

    @property
    def proxy(self) -> Any:
        """The :class:`~coalescence.engine.proxy.ProxyGame` the engine plays (``auto``: the default
        tail rule where it pays), or ``None`` for exact rows only (:func:`~coalescence.engine.proxy.proxy_game_of`)."""
        from ..engine.proxy import proxy_game_of

        return proxy_game_of(self.proxy_game)

    # -- what the settings make -------------------------------------------------------------
    @property
    def top_k_or_default(self) -> int:
        """The coarse players a hierarchy refines (3 by default)."""
        return self.top_k if self.top_k is not None else 3

    def utility_spec(self) -> Any:
        """The utility (:class:`~coalescence.utility.UtilitySpec`): the object given as ``utility``,
        or the one named with its span and generation settings; built and checked when the
        settings were made (a regenerate utility's optional package too, with its install hint)."""
        return self._made[1]

    def _utility_spec(self) -> Any:
        """:meth:`utility_spec`, built.

        Raises:
            ConfigError: a span or generation setting given apart from a ``UtilitySpec`` object, or
                a generation setting for a teacher-forced utility.
        """
        from ..utility import REGENERATE_KINDS, GenerationConfig, UtilitySpec, get_utility, parse_span

        if isinstance(self.utility, UtilitySpec):
            for name, default in (("target_span", None), ("target_substring", None), ("temperature", 0.0), ("top_p", 1.0), ("num_samples", 1)):
                if getattr(self, name) != default:
                    raise ConfigError("is part of the UtilitySpec given as utility; drop it", field=name)
            if self.utility.generation is not None:
                self.utility.utility.load_similarity()  # its optional package, checked now
            return self.utility
        if not isinstance(self.utility, str):
            raise ConfigError(f"must be a utility name or a UtilitySpec, got {type(self.utility).__name__}", field="utility")
        span = self.target_span
        if isinstance(span, str):
            span = parse_span(span)
        generation = None
        kind = get_utility(self.utility)  # an unknown name is refused here
        if not kind.teacher_forced:
            generation = GenerationConfig(
                temperature=self.temperature,
                top_p=self.top_p,
                num_samples=self.num_samples,
                max_new_tokens=self.max_new_tokens,
                seed=self.seed,
            )
            kind.load_similarity()
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
        """The estimator for a game of ``n_players``: the object given, or the one named (its
        default budget when none is given)."""
        from ..attribution.estimators import make_estimator

        if not isinstance(self.method, str):
            return self.method
        budget = self.budget
        if budget is None:
            budget = self.capabilities.default_budget(n_players)
        proxy = {"proxy_budget": self.proxy_budget} if self.proxy_budget is not None else {}
        return make_estimator(self.method, budget=budget, seed=self.seed, interactions=self.interactions, index=self.index, **proxy)

    def estimator_for_budget(self) -> Any:
        """``budget -> estimator`` of the run's method at that budget (the rounds of ``target_stderr``)."""
        import dataclasses

        from ..attribution.estimators import make_estimator

        if not isinstance(self.method, str):
            est = self.method
            return lambda budget: dataclasses.replace(est, budget=budget)
        return lambda budget: make_estimator(self.method, budget=budget, seed=self.seed)

    def budget_for(self, n_players: int) -> int | None:
        """The budget recorded for a game of ``n_players`` (``None`` for a method without one)."""
        capabilities = self.capabilities
        if not capabilities.needs_budget:
            return None
        return self.budget if self.budget is not None else capabilities.default_budget(n_players)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What an explain run gives back.

    Attributes:
        explanations: one per input (a :class:`~coalescence.app.hierarchy.HierarchicalExplanation`
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


@dataclass(frozen=True, kw_only=True)
class ReplaySettings(ModelSettings, RaySettings, ArchiveSettings):
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
        model, backend, server_url, device, dtype, batch_size: a model to evaluate what the archive lacks.
        flush_rows, flush_seconds, skip_corrupt: archive options.
        out: the document written.

    Raises:
        ConfigError: no or an unknown method, a sub-span with ``whole_answer``.
    """

    title: ClassVar[str] = "replay"

    methods: tuple[str, ...] | str = option(flag="--method", metavar="METHOD[,METHOD...]", required=True, help=method_list_help)
    budget: int | None = option(
        None,
        type=positive_int,
        help="sampling methods: distinct evaluations (default: the run's, for the run's method in a one-input run; else 32 x players)",
    )
    seed: int | None = option(None, type=seed_type, help="seed of the sampling plans (default: the run's)")
    interactions: int | None = option(
        None, type=positive_int, metavar="ORDER", help=INTERACTIONS_HELP + " (default: the run's, for its method)"
    )
    index: str | None = option(None, choices=INDICES, help=INDEX_HELP)
    run_id: str | None = option(None, flag="--run", help="run id in the archive (default: the last run)")
    snapshot: str | None = option(None, help="snapshot id or prefix (default: every snapshot of the run)")
    utility: str | None = option(
        None,
        choices=utility_kinds,
        help=UTILITY_HELP + " (default: the run's). An archive with per-token scores serves every "
        "teacher-forced utility and sub-span, one with generated texts every similarity, with no model",
    )
    target_span: str | tuple[int, int] | None = option(None, metavar="START:END", help=SPAN_HELP)
    target_substring: str | None = option(None, metavar="TEXT", help=SUBSTRING_HELP)
    whole_answer: bool = option(
        False,
        switch=True,
        help="score every answer token, end-of-turn included, even if the run used a sub-span "
        "(by default replay keeps the run's --target-span/--target-substring unless new ones are given)",
    )
    model: str | None = option(
        None,
        section=ModelSettings.title,
        help="model alias (smollm2-135m), local model directory, .gguf file or hub id: evaluate the coalitions the "
        "archive lacks (default: none; every coalition a plan needs must be archived)",
    )
    out: str | Path | None = option(None, metavar="JSON", help='write {"run_dir", "run_id", "explanations": [...]} as JSON here')

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``methods`` as a tuple of names (checked on construction)."""
        if "methods" in given:
            given["methods"] = names(given["methods"])
        return super().normalised(given)

    def __post_init__(self) -> None:
        from ..attribution.estimators import ESTIMATORS, estimator_class, is_method
        from ..attribution.estimators.base import check_seed

        self.backend_settings()  # the Ray settings are checked with the model's
        if self.seed is not None:
            check_seed(self.seed)

        methods = self.methods
        unknown = [m for m in methods if not is_method(m)]
        if not methods or unknown:
            raise ConfigError(
                f"unknown method {unknown[0] if unknown else ''!r}{did_you_mean(unknown[0], ESTIMATORS) if unknown else ''}; use a comma-separated subset of {','.join(ESTIMATORS)} "
                "or shapiq:<Approximator>",
                field="method",
            )
        for m in methods:
            estimator_class(m)  # a shapiq approximator the installed shapiq lacks is refused now
        if self.interactions is not None or self.index is not None:
            for m in methods:
                interaction_settings(m, self.interactions, self.index)
        spanned = self.target_span is not None or self.target_substring is not None
        if self.whole_answer and spanned:
            raise ConfigError("scores every answer token, so it does not combine with a sub-span; drop one", field="whole_answer")

    def backend_settings(self) -> BackendSettings:
        """How the model executes (:class:`~coalescence.app.backend.BackendSettings`), checked."""
        return BackendSettings.of(self)

    def budget_for(self, n_players: int, method: str | None = None, run: Mapping[str, Any] | None = None) -> int:
        """The sampling budget for a game of ``n_players``: ``budget``; else the ``run``'s
        (:func:`~coalescence.app.record.recorded_budget`) for ``method``; else 32 x players."""
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


@dataclass(frozen=True, kw_only=True)
class EvaluateSettings(ModelSettings, RaySettings, ArchiveSettings):
    """The settings of ``coalescence evaluate`` (its options, by their library names; see
    :mod:`coalescence.app.evaluate`).

    Args:
        coalitions: held-out keep-half coalitions the LDS is computed over (10 to 4,096,
            :data:`~coalescence.attribution.faithfulness.MIN_COALITIONS` and ``MAX_COALITIONS``): distinct, none in a plan
            the archive holds; capped at those that exist.
        seed: the seed of the held-out coalitions, the random removals and the bootstrap.
        random_draws: random k-subsets removed per k, against the top k (>= 2).
        methods: run archive: the estimators fitted (default: the run's method); the explanations
            of an ``--out`` document are its own.
        budget, run_id: run archive: as ``replay`` (run_id also picks the run of a document's archive).
        conversation: which conversation of a batch (0-based; default: every one).
        archive: an ``--out`` document's run archive when it names none (or another copy).
        model, backend, server_url, device, dtype, batch_size: the model that evaluates the coalitions
            the archive lacks (default model: the run's).
        flush_rows, flush_seconds, skip_corrupt: archive options.
        out: the JSON document written.

    Raises:
        ConfigError: fewer than 10 coalitions or 2 random draws, an unknown method.
    """

    title: ClassVar[str] = "evaluate"

    coalitions: int = option(
        32,
        type=positive_int,
        help="held-out keep-half coalitions of the LDS: distinct, none in a plan the archive holds, 10 to 4096; capped "
        "at those that exist (default: %(default)s)",
    )
    seed: int = option(0, type=seed_type, help="seed of the held-out coalitions, the random removals and the bootstrap (default: %(default)s)")
    random_draws: int = option(
        8, type=positive_int, metavar="N", help="random k-player removals per k, the baseline of the top-k drop (default: %(default)s)"
    )
    methods: tuple[str, ...] | str | None = option(
        None, flag="--method", metavar="METHOD[,METHOD...]", help="run archive: comma-separated methods fitted and evaluated (default: the run's method)"
    )
    budget: int | None = option(
        None, type=positive_int, help="run archive: sampling methods' budget (default: the run's, for its method; else 32 x players)"
    )
    run_id: str | None = option(None, flag="--run", help="run id in the archive (default: the last run holding the conversation)")
    conversation: int | None = option(None, type=int, metavar="K", help="which conversation of a batch, from 0 (default: every one)")
    archive: str | Path | None = option(
        None, metavar="RUN_DIR", help="an --out document: its run archive, when it names none (default: the one it names)"
    )
    model: str | None = option(
        None,
        section=ModelSettings.title,
        help="model alias (smollm2-135m), local model directory, .gguf file or hub id: evaluates the coalitions the "
        "archive lacks (default: the run's model)",
    )
    out: str | Path | None = option(None, metavar="JSON", help="also write the evaluation as JSON here")

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``methods``, when given, as a tuple of names (checked on construction)."""
        if given.get("methods") is not None:
            given["methods"] = names(given["methods"])
        return super().normalised(given)

    def __post_init__(self) -> None:
        from ..attribution.estimators import ESTIMATORS, is_method
        from ..attribution.estimators.base import check_seed
        from ..attribution.faithfulness import MAX_COALITIONS, MIN_COALITIONS

        self.backend_settings()  # the Ray settings are checked with the model's
        check_seed(self.seed)
        if isinstance(self.coalitions, bool) or not isinstance(self.coalitions, int) or self.coalitions < MIN_COALITIONS:
            raise ConfigError(
                f"must be an integer >= {MIN_COALITIONS}, got {self.coalitions!r}: fewer held-out coalitions give no "
                "meaningful LDS interval (a bootstrap resample of a few holds two distinct ones, where Spearman's correlation is +1 or -1)",
                field="coalitions",
            )
        if self.coalitions > MAX_COALITIONS:
            raise ConfigError(
                f"must be at most {MAX_COALITIONS}, got {self.coalitions}: each held-out coalition is a model evaluation, "
                f"and at {MAX_COALITIONS} the LDS interval is already about +-0.03 wide",
                field="coalitions",
            )
        if isinstance(self.random_draws, bool) or not isinstance(self.random_draws, int) or self.random_draws < 2:
            raise ConfigError(f"must be an integer >= 2, got {self.random_draws!r}", field="random_draws")
        if self.conversation is not None and (isinstance(self.conversation, bool) or not isinstance(self.conversation, int) or self.conversation < 0):
            raise ConfigError(f"numbers conversations from 0; got {self.conversation!r}", field="conversation")
        if self.methods is not None:
            methods = self.methods
            unknown = [m for m in methods if not is_method(m)]
            if not methods or unknown:
                raise ConfigError(
                    f"unknown method {unknown[0] if unknown else ''!r}{did_you_mean(unknown[0], ESTIMATORS) if unknown else ''}; use a comma-separated subset of {','.join(ESTIMATORS)}",
                    field="method",
                )

    def backend_settings(self) -> BackendSettings:
        """How the model executes (:class:`~coalescence.app.backend.BackendSettings`), checked."""
        return BackendSettings.of(self)


def check_across(s: RunSettings) -> None:
    """The rules between an explain run's settings groups (each group checks its own fields first:
    its ``check_group``): a hierarchy sets the units and combines with neither interactions nor a
    target standard error; the model with its Ray workers (:meth:`RunSettings.backend_settings`);
    the utility with the seed of its samples (:meth:`RunSettings.utility_spec`).

    Raises:
        ConfigError: naming the setting to drop or change.
    """
    if s.hierarchy is not None:
        if s.unit is not None:
            raise ConfigError("the hierarchy sets the units; drop the unit", field="unit")
        if s.interactions is not None or s.index is not None:
            raise ConfigError("does not combine with a hierarchy; drop one", field="interactions")
        if s.target_stderr is not None:
            raise ConfigError("does not combine with a hierarchy; drop one", field="target_stderr")
    s._made  # the backend settings (the Ray settings checked with the model's) and the utility, built and kept


def interaction_settings(method: str, interactions: int | None, index: str | None) -> tuple[int | None, str | None]:
    """As :func:`coalescence.attribution.estimators.interaction_settings` (imported late)."""
    from ..attribution.estimators import interaction_settings as check

    return check(method, interactions, index)
