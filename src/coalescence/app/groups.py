"""The settings groups that runs compose (:class:`~coalescence.app.settings.RunSettings`,
:class:`~coalescence.app.settings.ReplaySettings`, :class:`~coalescence.app.sweeps.SweepSettings`),
one concern each: the model and where it runs, the players and absence, the utility, the estimator,
the hierarchy, the archive, the execution (Ray workers), the outputs. Each field carries its
command-line option (:func:`~coalescence.app.options.option`); the CLI is generated from them, one
``--help`` section per group, and the choices and method lists are read from the registries when
the parser is built (:mod:`coalescence.app.choices`).

A group normalises its own given values before construction (its ``normalised`` classmethod:
:class:`~coalescence.normalised.NormalisedSettings`) and checks its own fields (its ``check_group``,
run by :func:`~coalescence.app.options.check_groups`); the rules between groups are one function,
:func:`~coalescence.app.settings.check_across`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..backends.base import DEFAULT_BATCH_SIZE, VLLM_BATCH_SIZE
from ..backends.settings import MAX_WORKERS, current_names  # MAX_WORKERS re-exported: the --workers help quotes it
from ..errors import ConfigError
from ..normalised import given_or_default
from ..utility import DEFAULT_UTILITY
from .choices import (  # re-exported: the settings and the CLI quote them
    INDEX_HELP,
    INDICES,
    INTERACTIONS_HELP,
    METHODS_HELP,
    SPAN_HELP,
    SUBSTRING_HELP,
    UTILITY_HELP,
    backend_choices,
    policy_choices,
    roles_help,
    unit_choices,
    method_list_help,
    methods_help,
    proxy_games,
    utility_kinds,
)
from .options import SettingsGroup, names, option, positive_float, positive_int
from .options import seed as seed_type

__all__ = (
    "INDEX_HELP",
    "INDICES",
    "INTERACTIONS_HELP",
    "MAX_WORKERS",
    "METHODS_HELP",
    "SPAN_HELP",
    "SUBSTRING_HELP",
    "UTILITY_HELP",
    "ArchiveSettings",
    "EstimatorSettings",
    "ExecutionSettings",
    "GameSettings",
    "HierarchySettings",
    "ModelSettings",
    "OutputSettings",
    "ProgressSettings",
    "RaySettings",
    "RunArchiveSettings",
    "UtilitySettings",
    "method_list_help",
    "methods_help",
    "proxy_games",
    "utility_kinds",
)


@dataclass(frozen=True, kw_only=True)
class ModelSettings(SettingsGroup):
    """The model and where it runs (every run)."""

    title: ClassVar[str] = "model"

    model: str | None = option(
        "smollm2-135m", help="model alias (smollm2-135m), local model directory, .gguf file or hub id (default: %(default)s)"
    )
    backend: str | None = option(
        None,
        choices=backend_choices,
        help="the model backend by name: hf (transformers, CPU or GPU), vllm (vLLM's engine in this process: pip install "
        "'coalescence[vllm]'; float32 on the CPU), vllm-server (a running `vllm serve`: give --server-url, which alone "
        "picks it; with --server-url a backend that loads the weights here is refused) (default: hf; vllm-server with "
        "--server-url)",
    )
    server_url: str | None = option(
        None,
        metavar="URL",
        aliases=("--vllm-url",),
        help="score against a running server at http://HOST:PORT instead of loading the weights here: a `vllm serve` "
        "(its OpenAI-compatible completions endpoint) or the server of another server backend (--backend); --model "
        "names the same model, whose tokenizer, chat template and context the server must match (checked before any "
        "coalition is scored); --vllm-url is its earlier name",
    )
    device: str = option("cpu", help="torch device (default: %(default)s)")
    dtype: str = option("float32", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: %(default)s)")
    batch_size: int | None = option(
        None,
        type=positive_int,
        help=f"rows per model call (default: the backend's own: hf {DEFAULT_BATCH_SIZE}, vllm {VLLM_BATCH_SIZE}, "
        "which vLLM schedules itself)",
    )

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``vllm_url`` taken as ``server_url``, its current name
        (:func:`~coalescence.backends.settings.current_names`).

        Raises:
            ConfigError: both given and different (naming both).
        """
        return super().normalised(current_names(given))


@dataclass(frozen=True, kw_only=True)
class GameSettings(SettingsGroup):
    """The players and how an absent one disappears (explain, sweep)."""

    title: ClassVar[str] = "players and absence"

    unit: str | None = option(
        None,
        choices=unit_choices,
        help="player unit: turn, paragraph, sentence, word, tool (a tool call and its results), "
        "exchange (a user turn and the reply to it; the last user turn stays), document (the input's "
        "declared players or RAG documents) (default: document when the input declares players, else turn)",
    )
    roles: tuple[str, ...] | str | None = option(None, help=roles_help)
    template: str | Path | None = option(
        None,
        metavar="JSON",
        help='RAG prompt template, a JSON file {"system", "user", "document", "separator"} (default: the one in docs/input.md)',
    )
    absence_policy: str = option(
        "drop",
        choices=policy_choices,
        help="how an absent player disappears: drop its text (a turn removes its message) or "
        "replace it with --placeholder (default: %(default)s)",
    )
    placeholder: str = option("[removed]", help="placeholder text (default: %(default)s)")
    system_absent: str = option(
        "removed",
        choices=("removed", "empty"),
        help="drop policy: a system message whose players are all absent is removed, or kept "
        "with empty content (default: %(default)s)",
    )
    empty_turns: str = option(
        "removed",
        choices=("removed", "empty"),
        help="drop policy: a message (any role) whose players are all absent is removed, or kept with "
        "empty content so every coalition keeps the conversation's sequence of roles, as templates "
        "that require alternating roles need for units finer than a turn (default: %(default)s)",
    )
    merge_adjacent: bool = option(
        False,
        switch=True,
        help="render adjacent messages of the same role (system, user, assistant) as one message, "
        "joined by a blank line, in every coalition: dropping a turn then never puts two user turns "
        "side by side (templates that require alternating roles)",
    )

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``roles`` as a tuple of names.

        Raises:
            ConfigError: no role named (``field="roles"``).
        """
        if given.get("roles") is not None:
            roles = names(given["roles"])
            if not roles:
                raise ConfigError("give at least one role, e.g. user,system", field="roles")
            given["roles"] = roles
        return super().normalised(given)

    def check_group(self) -> None:
        """The absence policy: an object's rules are its own; the placeholder's and the drop
        policy's options apply to their policy alone; the policy is made now (a bad rule refused).

        Raises:
            ConfigError: naming the option that does not apply.
        """
        if not isinstance(self.absence_policy, str):
            self._take_policy_object()
        elif self.absence_policy == "placeholder":
            for name in ("system_absent", "empty_turns"):
                if getattr(self, name) != "removed":
                    raise ConfigError("applies to the drop policy (placeholder removes no message)", field=name)
        elif self.placeholder != "[removed]":
            raise ConfigError(
                f"applies to the placeholder absence policy; absence policy {self.absence_policy} removes "
                "the text. Add --absence-policy placeholder or drop --placeholder",
                field="placeholder",
            )
        self.policy()  # a bad rule or placeholder is refused now

    def _take_policy_object(self) -> None:
        """``absence_policy`` given as an :class:`~coalescence.masking.policies.AbsencePolicy`
        object: the placeholder and drop rules are its own."""
        from ..masking.policies import AbsencePolicy

        if not isinstance(self.absence_policy, AbsencePolicy):
            raise ConfigError(f"must be a policy name or an AbsencePolicy object, got {type(self.absence_policy).__name__}", field="absence_policy")
        for name, default in (("placeholder", "[removed]"), ("system_absent", "removed"), ("empty_turns", "removed"), ("merge_adjacent", False)):
            if getattr(self, name) != default:
                raise ConfigError("is set by the AbsencePolicy object given as absence_policy; drop it", field=name)

    def policy(self) -> Any:
        """The absence policy: the object given, or the one named (see
        :func:`~coalescence.masking.policies.get_policy`)."""
        from ..masking.policies import get_policy

        if not isinstance(self.absence_policy, str):
            return self.absence_policy
        merge = {"merge_adjacent": True} if self.merge_adjacent else {}
        if self.absence_policy == "placeholder":
            return get_policy("placeholder", text=self.placeholder, **merge)
        rules = {"system_absent": self.system_absent, "empty_turns": self.empty_turns}
        return get_policy(self.absence_policy, **{k: v for k, v in rules.items() if v != "removed"}, **merge)


@dataclass(frozen=True, kw_only=True)
class UtilitySettings(SettingsGroup):
    """What v(S) measures (explain, sweep; see :mod:`coalescence.utility`)."""

    title: ClassVar[str] = "utility"

    utility: str | None = option(DEFAULT_UTILITY, choices=utility_kinds, help=UTILITY_HELP + " (default: %(default)s)")
    target_span: str | tuple[int, int] | None = option(None, metavar="START:END", help=SPAN_HELP)
    target_substring: str | None = option(None, metavar="TEXT", help=SUBSTRING_HELP)
    temperature: float = option(
        0.0, type=float, help="regenerate utilities: 0 decodes greedily, > 0 samples at this temperature (default: %(default)s)"
    )
    top_p: float = option(1.0, type=float, help="regenerate utilities: nucleus sampling mass (default: %(default)s)")
    num_samples: int = option(
        1,
        type=positive_int,
        help="regenerate utilities: sampled answers per coalition (at most 1024), similarities averaged; each "
        "sample's seed derives from --seed, the coalition and the sample index (default: %(default)s)",
    )
    max_new_tokens: int = option(
        64,
        type=positive_int,
        help="length limit when the answer is generated, and of each regenerated answer; with the prompt it must "
        "fit the model's context (default: %(default)s)",
    )


@dataclass(frozen=True, kw_only=True)
class EstimatorSettings(SettingsGroup):
    """The estimator and its sampling plan (explain)."""

    title: ClassVar[str] = "estimator"

    method: str | None = option(None, metavar="METHOD", help=methods_help)
    budget: int | None = option(
        None,
        type=positive_int,
        help="sampling methods (permutation, kernelshap, regression-msr, banzhaf, lasso, shapiq:NAME): the most distinct "
        "model evaluations (default: 32 x players); with the proxy game, exact ones (lasso and auto's surrogate take 8 "
        "with it, 16 without)",
    )
    seed: int | None = option(0, type=seed_type, help="seed of the sampling plan (default: %(default)s)")
    interactions: int | None = option(None, type=positive_int, metavar="ORDER", help=INTERACTIONS_HELP)
    index: str | None = option(None, choices=INDICES, help=INDEX_HELP)
    target_stderr: float | None = option(
        None,
        type=positive_float,
        metavar="NATS",
        help="permutation, kernelshap, regression-msr, banzhaf (and auto where it chooses regression-msr): sample in "
        "doubling rounds until every player's standard error is below NATS or --budget (distinct evaluations of all "
        "rounds together) is spent (the output says which)",
    )
    proxy_game: str = option(
        "auto",
        choices=proxy_games,
        help="the shared-KV proxy game that two-fidelity methods (auto, lasso, proxy-shapley, proxy-shapley-shrunk) use to reduce their "
        "variance: the full conversation's KV once, each coalition's tail masked (docs/proxy.md); the values are "
        "always the exact game's. auto: where the backend scores it (transformers), the utility is teacher-forced "
        "and the policy drops; none: exact rows only; or a tail rule (refused with any other method) (default: %(default)s)",
    )
    proxy_budget: int | None = option(
        None,
        type=positive_int,
        help="two-fidelity methods: distinct proxy coalitions, besides the exact ones (default: 16 x --budget, at least "
        "4 per player, at most 2^n; docs/proxy.md)",
    )

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The seed checked; no method: the one the other settings ask for (``default``; ``auto``
        with a budget; ``exact`` with a target standard error or interactions); an estimator
        object's budget, seed and interactions taken as the run's (:meth:`_estimator_object_settings`).

        Raises:
            ConfigError: a bad seed or estimator object (naming it).
        """
        from ..attribution.estimators.base import check_seed

        check_seed(given_or_default(cls, given, "seed"))
        method = given.get("method")
        if method is None:  # a budget asks for a sampling method: auto chooses it; none, the default plan
            plain = all(given.get(name) is None for name in ("budget", "target_stderr", "interactions", "index"))
            given["method"] = "default" if plain else "exact" if given.get("budget") is None else "auto"
        elif not isinstance(method, str):
            given |= cls._estimator_object_settings(given)
        return super().normalised(given)

    @classmethod
    def _estimator_object_settings(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``method`` given as an estimator object (e.g. ``KernelSHAP(budget=512, seed=3)``): its
        budget, seed and interactions, which become the run's (recorded in the manifest as a named
        method's would be); the same settings given apart must agree with it.

        Raises:
            ConfigError: not an estimator object; a setting given apart that disagrees with it.
        """
        from ..attribution.estimators.base import Estimator

        est = given["method"]
        if not isinstance(est, Estimator) or not isinstance(getattr(est, "name", None), str):
            raise ConfigError(
                f"must be a method name or an estimator object (name, capabilities, validate, plan, fit), got {type(est).__name__}",
                field="method",
            )
        taken: dict[str, Any] = {}
        for name, default in (("budget", None), ("seed", 0), ("interactions", None), ("index", None)):
            carried = getattr(est, name, None)
            value = given_or_default(cls, given, name)
            if value != default and value != carried:
                what = type(est).__name__
                raise ConfigError(
                    f"{value!r} disagrees with the estimator object's own {name}={carried!r} (an object's {name} is its "
                    f"constructor's, its default when not given): give it to the object, {what}(..., {name}={value!r}), "
                    f"and leave {name} out",
                    field=name,
                )
            taken[name] = carried if carried is not None or name != "seed" else value
        return taken

    def check_group(self) -> None:
        """The method with its budget, interactions, target standard error and proxy game.

        Raises:
            ConfigError: a setting the method does not take (naming it), a target standard error
                that is not positive.
        """
        from ..attribution.estimators import interaction_settings, methods_with

        capabilities = self.capabilities
        if (self.interactions is not None or self.index is not None) and isinstance(self.method, str):
            interaction_settings(self.method, self.interactions, self.index)
        if self.target_stderr is not None:
            if not capabilities.reports_stderr and not capabilities.chooses:  # a choice is checked once n is known
                raise ConfigError(
                    f"method {self.method_name} reports no standard errors; use one of {', '.join(methods_with(reports_stderr=True))}",
                    field="target_stderr",
                )
            if not self.target_stderr > 0:
                raise ConfigError(f"must be > 0, got {self.target_stderr!r}", field="target_stderr")
        if not capabilities.needs_budget and self.budget is not None:
            raise ConfigError(
                f"method {self.method_name} has a fixed number of evaluations; a budget applies to the sampling "
                f"methods ({', '.join(methods_with(needs_budget=True))}, shapiq:NAME)",
                field="budget",
            )
        self._check_proxy(capabilities)

    def _check_proxy(self, capabilities: Any) -> None:
        """Refuse a proxy setting that cannot apply (an unknown game, with the nearest name; a tail
        rule or a proxy budget for a method that fits the exact game alone; a proxy budget with the
        proxy game off). ``auto`` (the default) plays the game where it applies, and ``none`` turns it
        off, so neither contradicts a method that does not play it."""
        from ..attribution.estimators import methods_with
        from ..engine.proxy import proxy_game_of

        proxy_game_of(self.proxy_game)  # an unknown game is refused, with the nearest name
        if self.proxy_game not in ("auto", "none") and not capabilities.two_fidelity:
            raise ConfigError(
                f"method {self.method_name} fits the exact game alone; a proxy game ({self.proxy_game}) applies to the "
                f"two-fidelity methods ({', '.join(methods_with(two_fidelity=True))}). Drop it or choose one of those",
                field="proxy_game",
            )
        if self.proxy_budget is not None:
            if not capabilities.two_fidelity:
                raise ConfigError(
                    f"method {self.method_name} fits the exact game alone; a proxy budget applies to the two-fidelity "
                    f"methods ({', '.join(methods_with(two_fidelity=True))})",
                    field="proxy_budget",
                )
            if self.proxy_game == "none":
                raise ConfigError("the proxy game is off (proxy_game none); drop one of them", field="proxy_budget")

    @property
    def method_name(self) -> str:
        """The method's registered name (``method``'s, or the estimator object's ``name``)."""
        return self.method if isinstance(self.method, str) else self.method.name

    @property
    def capabilities(self) -> Any:
        """The method's :class:`~coalescence.attribution.estimators.base.Capabilities`."""
        from ..attribution.estimators import estimator_class

        return estimator_class(self.method).capabilities if isinstance(self.method, str) else self.method.capabilities


@dataclass(frozen=True, kw_only=True)
class HierarchySettings(SettingsGroup):
    """Hierarchical attribution: a coarse level, then detail where it matters (explain)."""

    title: ClassVar[str] = "hierarchy"

    hierarchy: tuple[str, str] | str | None = option(
        None,
        metavar="COARSE,FINE",
        help="hierarchical attribution: attribute at COARSE, then refine the --top-k coarse players "
        "at FINE with the rest held present (e.g. document,sentence)",
    )
    top_k: int | None = option(None, type=positive_int, help="--hierarchy: coarse players refined (default: 3)")

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``hierarchy`` given as ``"coarse,fine"``: a tuple of the two units.

        Raises:
            ConfigError: not two known units (``field="hierarchy"``).
        """
        from .hierarchy import parse_hierarchy

        if isinstance(given.get("hierarchy"), str):
            given["hierarchy"] = parse_hierarchy(given["hierarchy"])
        return super().normalised(given)

    def check_group(self) -> None:
        """``top_k`` applies to a hierarchy. Raises ConfigError (``field="top_k"``) without one."""
        if self.hierarchy is None and self.top_k is not None:
            raise ConfigError("applies to a hierarchy (coarse,fine units); add one or drop top_k", field="top_k")


@dataclass(frozen=True, kw_only=True)
class ArchiveSettings(SettingsGroup):
    """How the run archive is written (every run that evaluates)."""

    title: ClassVar[str] = "archive"

    flush_rows: int = option(4096, type=positive_int, help="rows per archive part (default: %(default)s)")
    flush_seconds: float = option(
        30.0, type=positive_float, help="longest time evaluated rows wait before a part is written (default: %(default)s)"
    )
    skip_corrupt: bool = option(
        False,
        switch=True,
        help="set aside archive parts that fail verification (moved to RUN_DIR/quarantine/; a run evaluates "
        "their coalitions again)",
    )


@dataclass(frozen=True, kw_only=True)
class RunArchiveSettings(ArchiveSettings):
    """Which run archive an explain run or a sweep writes."""

    archive: str | Path | bool | None = option(
        None,
        metavar="RUN_DIR",
        cli_default=True,  # the command line always keeps a run archive
        help="run archive directory: created if new, resumed if it holds this run (default: a new runs/<UTC time>-<snapshot id>)",
    )
    new_run: bool = option(False, switch=True, help="add a run with other settings to an existing --archive")

    def check_group(self) -> None:
        """A directory named is not empty. Raises ConfigError (``field="archive"``)."""
        if isinstance(self.archive, str) and not self.archive.strip():
            raise ConfigError("is empty; give a directory path for the run archive", field="archive")


@dataclass(frozen=True, kw_only=True)
class RaySettings(SettingsGroup):
    """Model workers on Ray (:mod:`coalescence.distributed`)."""

    title: ClassVar[str] = "execution"

    workers: int | None = option(
        None,
        type=positive_int,
        metavar="N",
        help="N model workers in Ray actors (pip install 'coalescence[ray]'; the driver plans, renders and archives, each "
        "worker holds one copy of the model and takes conversations whole): on a local Ray cluster started for the run, "
        "or on the --ray-address cluster (default: in this process; with --ray-address, one per GPU with "
        f"--gpus-per-worker, else 2); at most {MAX_WORKERS}, and on a local cluster at most this machine's CPUs (at least 2)",
    )
    ray_address: str | None = option(None, metavar="ADDR", help="join this Ray cluster (auto, HOST:PORT) instead of starting one")
    gpus_per_worker: float = option(
        0.0, type=float, metavar="G", help="accelerators each worker reserves (with --device cuda) (default: %(default)s)"
    )
    threads_per_worker: int | None = option(
        None, type=positive_int, metavar="T", help="torch threads per worker (default: its node's CPUs divided among the workers there)"
    )

    @property
    def distributed(self) -> bool:
        """Whether the model runs in Ray workers (``workers`` or ``ray_address`` given)."""
        return self.workers is not None or self.ray_address is not None


@dataclass(frozen=True, kw_only=True)
class ExecutionSettings(RaySettings):
    """How a run executes: conversations in flight, model workers."""

    max_conversations_in_flight: int = option(
        8,
        type=positive_int,
        metavar="N",
        help="a dataset (.jsonl, .parquet): conversations evaluated at once through one scheduler, their "
        "coalitions filling the same batches (bounds memory) (default: %(default)s)",
    )

    def check_group(self) -> None:
        """A positive number of conversations in flight. Raises ConfigError naming it."""
        n = self.max_conversations_in_flight
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"must be a positive integer, got {n!r}", field="max_conversations_in_flight")


@dataclass(frozen=True, kw_only=True)
class OutputSettings(SettingsGroup):
    """The files an explain run writes after its results (besides the archive)."""

    title: ClassVar[str] = "outputs"

    out: str | Path | None = option(None, metavar="JSON", help="write the explanation as JSON here")
    html: str | Path | None = option(
        None, metavar="PATH", help="write the HTML report of the explanation here after the run (as `coalescence report`)"
    )


@dataclass(frozen=True, kw_only=True)
class ProgressSettings(SettingsGroup):
    """What a command shows on stderr while it runs: the progress bar (or, off a terminal, a plain
    line at most every ``progress_every`` seconds) and the log."""

    title: ClassVar[str] = "progress and logging"

    no_progress: bool = option(False, switch=True, help="no progress bar on stderr")
    progress_every: float = option(
        30.0,
        type=positive_float,
        metavar="SECONDS",
        help="when stderr is not a terminal (a log file, CI): a plain progress line at most this often, "
        "never carriage returns (default: %(default)s)",
    )
    verbose: bool = option(False, short="-v", switch=True, help="log progress details to stderr")
