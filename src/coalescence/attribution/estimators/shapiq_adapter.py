"""shapiq's approximators as coalescence methods (``--method shapiq:<Approximator>``), and exact
interaction indices; the only module that imports shapiq.

shapiq (Muschalik, Fumagalli et al., "shapiq: Shapley Interactions for Machine Learning", NeurIPS
2024 Datasets and Benchmarks; PyPI ``shapiq``) implements the field's approximators of Shapley values
and Shapley interactions: KernelSHAP (Lundberg & Lee 2017), Unbiased KernelSHAP (Covert & Lee 2021),
SVARM and SVARM-IQ (Kolpaczki et al. 2024), SHAP-IQ (Fumagalli et al. 2023), KernelSHAP-IQ
(Fumagalli et al. 2024), k-additive SHAP (Pelegrina et al. 2023), permutation sampling (Castro et al.
2009; Tsai et al. 2023 for STII), stratified and Owen sampling, SPEX and ProxySPEX (Kang et al. 2025;
Butler et al. 2025), regression FSII (Faith-Shap, Tsai et al. 2023).

**How an approximator plays on the engine.** coalescence's estimators plan their coalitions before
the model runs, then fit from the pool (:mod:`.base`). A shapiq approximator asks for coalitions
through a game callback; every approximator of the pinned shapiq draws its coalitions from its
sampler, seeded by ``random_state``, whatever the game answers. So:

1. :meth:`ShapiqEstimator.plan` runs the approximator once on a stand-in game (a fixed synthetic
   value per coalition, no model) with ``random_state = seed`` and yields the coalitions it asked
   for, the empty and the grand coalition first. The engine evaluates them like any plan: batched
   with prefix sharing, deduplicated, archived; a run resumes after a crash and replays from the
   archive with no model, because the same seed gives the same plan.
2. :meth:`ShapiqEstimator.fit` runs the approximator again from the start with the same
   ``random_state``, answering every game call from the pool. An approximator that asked for a
   coalition outside its plan (one whose sampling depended on the answers) is refused with an
   :class:`~coalescence.errors.EstimatorError` instead of being given a wrong value.

**Budget.** shapiq's budget counts game evaluations; ours counts distinct coalitions. The plan is
drawn with shapiq's budget equal to ``budget``, lowered until the distinct coalitions (empty and
grand coalition included) fit in ``budget``; the shapiq budget used is recorded in the estimate's
diagnostics (``shapiq_budget``).

**Values and interactions.** Without interactions the approximator runs for Shapley values
(index ``SV``, order 1 where it takes those parameters). With ``interactions=k`` it runs for the
interaction index asked (``SII``, ``k-SII``, ``FSII``, ``STII``) up to order k; the estimate's
``values`` are then the index's order-1 terms (Shapley values for SII; the index's own main
effects for k-SII, FSII and STII, which with the higher orders sum to v(N) - v(empty)) and its
``interactions`` the terms of orders 2..k, and the efficiency gap of an efficient index (k-SII,
FSII, STII) is that of all its terms. shapiq reports no standard errors: ``stderr`` is
``None`` (unknown), so these methods do not take ``--target-stderr``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import logging
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ...errors import BackendUnavailable, ConfigError, EstimatorError
from .base import Capabilities, Estimate, check_budget_seed, check_interactions, check_n_players, check_pool, library_seed, pool_lookup, row_keys

__all__ = (
    "INTERACTION_INDICES",
    "PREFIX",
    "approximator_estimator",
    "approximator_names",
    "exact_interactions",
    "external_shapiq",
    "ExternalShapiq",
    "shapiq_version",
    "ShapiqEstimator",
)

logger = logging.getLogger(__name__)

PREFIX = "shapiq:"
"""The method-name prefix of shapiq's approximators (``shapiq:KernelSHAP``)."""

INTERACTION_INDICES: tuple[str, ...] = ("SII", "k-SII", "FSII", "STII")
"""The interaction indices ``--index`` takes: the Shapley interaction index (Grabisch & Roubens
1999), its k-additive aggregation k-SII (Bordt & von Luxburg 2023), Faith-Shap FSII (Tsai, Yeh &
Ravikumar 2023) and the Shapley-Taylor index STII (Sundararajan, Dhamdhere & Agarwal 2020)."""

EFFICIENT_INDICES: frozenset[str] = frozenset({"k-SII", "FSII", "STII"})
"""The indices whose terms of every order up to k sum to v(N) - v(empty); with them the estimate's
``values`` are order-1 terms and its efficiency gap counts the interactions too."""

INSTALL = "pip install -c constraints.txt 'coalescence[shapiq]'"

# approximators whose order-1 output is not a Shapley value unless they are asked for order 1
_ORDER_ONE_FOR_VALUES = frozenset({"KernelSHAPIQ", "InconsistentKernelSHAPIQ", "SVARMIQ", "SHAPIQ", "PermutationSamplingSII", "RegressionFSII", "SPEX", "ProxySPEX", "ProxySHAP"})


def _shapiq() -> Any:
    """The shapiq module, or a one-line error naming the install command."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import shapiq
    except ImportError:
        raise BackendUnavailable(f"the shapiq methods need the shapiq extra: {INSTALL}") from None
    return shapiq


def shapiq_version() -> str:
    """The installed shapiq's version string (from the package metadata).

    Raises:
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    from importlib.metadata import version

    _shapiq()
    return version("shapiq")


def approximator_names() -> tuple[str, ...]:
    """The shapiq approximators a method can name, sorted: every Shapley-value and interaction
    approximator of the shapiq installed here, and those only an external shapiq
    (:func:`external_shapiq`) has.

    Raises:
        BackendUnavailable: shapiq is not installed here and no external shapiq is set up (with
            the install command).
    """
    names = set(_InProcess.names()) if _in_process_available() else set()
    external = external_shapiq()
    if external is not None:
        names |= set(external.names())
    if not names:
        _shapiq()  # raises with the install command
    return tuple(sorted(names))


def _in_process_available() -> bool:
    try:
        _shapiq()
    except BackendUnavailable:
        return False
    return True


@functools.cache
def approximator_estimator(method: str) -> type:
    """The estimator class of ``method`` (``"shapiq:<Approximator>"``), made once per name: run by
    the shapiq installed here when it has the approximator, else by the external shapiq
    (:func:`external_shapiq`).

    Raises:
        ConfigError: not a shapiq method name, or an approximator no available shapiq has
            (``field="method"``, listing the ones there are, and for shapiq's newer approximators
            how to set up an external shapiq).
        BackendUnavailable: shapiq is not installed and no external shapiq is set up (with the
            install command); the external shapiq does not start or answer.
    """
    if not isinstance(method, str) or not method.startswith(PREFIX):
        raise ConfigError(f"{method!r} is not a shapiq method; write shapiq:<Approximator>", field="method")
    name, _, option_text = method[len(PREFIX) :].partition(":")
    runtime: _InProcess | ExternalShapiq | None = None
    if _in_process_available() and name in _InProcess.names():
        runtime = _InProcess()
    else:
        external = external_shapiq()
        if external is not None and name in external.names():
            runtime = external
    if runtime is None:
        names = approximator_names()
        hint = ""
        if name in NEWER_APPROXIMATORS and external_shapiq() is None:
            import sys

            hint = (
                f" ({name} is in shapiq 1.5 and later, which need Python 3.12 or newer; this Python is "
                f"{sys.version_info.major}.{sys.version_info.minor}: set {ENV_PYTHON} to a Python >= 3.12 that has "
                f"shapiq, e.g. the one `make install` sets up in .venv-shapiq)"
            )
        if not hint:
            from ...userinput import did_you_mean

            hint = did_you_mean(name, names, prefix="shapiq:")
        raise ConfigError(f"shapiq has no approximator {name!r}{hint}; choose one of: {', '.join(names)}", field="method")
    valid, params = runtime.describe(name)
    fixed = _parse_options(method, name, option_text, params)
    indices = tuple(i for i in INTERACTION_INDICES if i in valid)
    capabilities = Capabilities(needs_budget=True, reports_stderr=False, interaction_indices=indices)
    return type(
        f"Shapiq{name}",
        (ShapiqEstimator,),
        {
            "name": method,
            "approximator": name,
            "runtime": runtime,
            "fixed_options": fixed,
            "capabilities": capabilities,
            "__slots__": (),
        },
    )


_SET_BY_THE_ADAPTER = frozenset({"self", "n", "random_state", "index", "max_order", "kwargs", "_args", "_kwargs", "args"})


def _parse_options(method: str, name: str, text: str, params: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """The constructor options written after the approximator's name, ``key=value`` separated by
    ``:`` (``shapiq:RegressionMSR:proxy_model=linear:k_folds=5``): values ``true``/``false``/
    ``none``, integers and floats as such, anything else a string.

    Raises:
        ConfigError: a malformed option, or a name that is not a constructor parameter the method
            may set (``field="method"``, naming the ones it may).
    """
    if not text:
        return ()
    allowed = [p for p in params if p not in _SET_BY_THE_ADAPTER]
    options: dict[str, Any] = {}
    for item in text.split(":"):
        key, eq, raw = item.partition("=")
        if not eq or not key or not raw:
            raise ConfigError(f"{method}: write options as {PREFIX}{name}:KEY=VALUE[:KEY=VALUE], got {item!r}", field="method")
        if key not in allowed:
            raise ConfigError(f"{method}: {name} takes no option {key!r}; it takes {', '.join(allowed) or 'none'}", field="method")
        lowered = raw.lower()
        value: Any = {"true": True, "false": False, "none": None}.get(lowered, raw)
        if value is raw:
            for convert in (int, float):
                try:
                    value = convert(raw)
                    break
                except ValueError:
                    continue
        options[key] = value
    return tuple(sorted(options.items()))


_PLANS: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
"""Drawn plans by (runtime, approximator, n, budget, seed, interactions, index): read-only arrays."""


@functools.lru_cache(maxsize=32)
def _pristine(name: str, n: int, seed: int, options: tuple[tuple[str, Any], ...]) -> Any:
    """An approximator never run, to copy from (construction is deterministic in its arguments)."""
    cls = getattr(_shapiq().approximator, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(n=n, random_state=library_seed(seed), **dict(options))


def _standin_values(rows: np.ndarray) -> np.ndarray:
    """A fixed synthetic utility per coalition (no model): an additive part and pairwise terms
    from a generator seeded by n, so the approximator's regressions are well posed while it
    draws its plan. (``_shapiq_worker.standin`` is the same formula.)"""
    n = rows.shape[1]
    rng = np.random.default_rng(n)
    weights = rng.normal(size=n)
    pairs = rng.normal(size=(n, n)) / max(n, 1)
    x = rows.astype(np.float64)
    return x @ weights + np.einsum("ki,ij,kj->k", x, pairs, x)


_Run = tuple[np.ndarray, np.ndarray, tuple[tuple[tuple[int, ...], float], ...]]
"""One approximator run: (coalitions asked ``[m, n]`` bool, order-1 terms ``[n]`` float64,
terms of orders 2..k)."""


class _InProcess:
    """shapiq imported in this process."""

    key = "here"

    @staticmethod
    @functools.cache
    def names() -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
        """name -> (valid indices, constructor parameters) of every approximator of this shapiq."""
        approximators = _shapiq().approximator
        classes = {*approximators.SV_APPROXIMATORS, *approximators.SI_APPROXIMATORS}
        return {
            cls.__name__: (frozenset(getattr(cls, "valid_indices", ())), tuple(inspect.signature(cls.__init__).parameters))
            for cls in classes
            if not inspect.isabstract(cls)
        }

    def describe(self, name: str) -> tuple[frozenset[str], tuple[str, ...]]:
        return self.names()[name]

    def version(self) -> str:
        return f"shapiq {shapiq_version()} (this Python)"

    def run(self, est: ShapiqEstimator, n: int, budget: int, lookup: dict[bytes, float] | None) -> _Run:
        approximator = copy.deepcopy(_pristine(est.approximator, n, est.seed, tuple(sorted(est._options(n).items()))))
        asked: list[np.ndarray] = []

        def game(coalitions: np.ndarray) -> np.ndarray:
            rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
            asked.append(rows.copy())
            if lookup is None:
                return _standin_values(rows)
            keys = row_keys(rows)
            out = np.fromiter((lookup.get(k, np.nan) for k in keys), dtype=np.float64, count=len(keys))
            if not np.isfinite(out).all():
                raise EstimatorError(_outside(est.name))
            return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = approximator.approximate(budget=budget, game=game)
            except EstimatorError:
                raise
            except (ValueError, TypeError, ZeroDivisionError, np.linalg.LinAlgError) as exc:
                raise _cannot_run(est, n, str(exc)) from exc
        rows = np.concatenate(asked) if asked else np.zeros((0, n), bool)
        values = np.array([float(result[(i,)]) for i in range(n)], dtype=np.float64)
        terms = _terms(result, n, est.interactions) if est.interactions is not None else ()
        return rows, values, terms


def _outside(method: str) -> str:
    return (
        f"{method} asked for a coalition outside its plan or with a non-finite utility; "
        "its sampling depends on the values, which this adapter cannot replay"
    )


def _cannot_run(est: ShapiqEstimator, n: int, why: str) -> ConfigError:
    return ConfigError(f"{est.name} cannot run at budget {est.budget} on {n} players: {why}; try a larger budget", field="budget")


ENV_PYTHON = "COALESCENCE_SHAPIQ_PYTHON"
"""Environment variable: the path of a Python interpreter whose shapiq runs the approximators the
shapiq installed here lacks (:func:`external_shapiq`)."""

LINK_NAME = "coalescence-shapiq-python"
"""Without :data:`ENV_PYTHON`, an interpreter (or a link to one) of this name beside this Python's
executable is the external shapiq's (``make install`` links ``.venv-shapiq``'s Python there)."""

NEWER_APPROXIMATORS = frozenset({"RegressionMSR", "ProxySHAP", "LeverageSHAP", "PolySHAP", "OddSHAP"})
"""Approximators of shapiq 1.5 and later (Python >= 3.12), not in 1.4.1, the newest shapiq for Python 3.11."""


def external_shapiq() -> ExternalShapiq | None:
    """The external shapiq: a Python interpreter, named by :data:`ENV_PYTHON` or found as
    :data:`LINK_NAME` beside this Python's executable, that runs shapiq in a worker process
    (``_shapiq_worker.py``). It lets a Python 3.11 install (this project's torch build) use the
    approximators of shapiq 1.5+ (RegressionMSR, ProxySHAP, LeverageSHAP, ...), which need Python
    3.12: the adapter only needs shapiq to draw a plan from a stand-in game and to replay it on the
    pool, both plain numbers, so the model never leaves this process.

    Returns:
        the worker's handle (one per interpreter path per process, started on first use), or
        ``None`` when none is set up.

    Raises:
        BackendUnavailable: :data:`ENV_PYTHON` names no executable file.
    """
    import os
    import sys
    from pathlib import Path

    path = os.environ.get(ENV_PYTHON, "").strip()
    if path:
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            raise BackendUnavailable(f"{ENV_PYTHON}={path} is not an executable Python; point it at a Python >= 3.12 that has shapiq")
    else:
        link = Path(sys.executable).parent / LINK_NAME
        if not link.exists():
            return None
        path = str(link)
    return _external(path)


@functools.cache
def _external(path: str) -> ExternalShapiq:
    return ExternalShapiq(path)


class ExternalShapiq:
    """shapiq in another interpreter: a worker process (``_shapiq_worker.py``) answering one JSON
    line per request on its standard input and output; started on first use, restarted after a
    fork, ended with this process (its input closes).

    Args:
        python: the interpreter's path.

    Raises (from its methods):
        BackendUnavailable: the worker does not start, dies, or lacks shapiq (with its last
            error line).
    """

    def __init__(self, python: str) -> None:
        import threading

        self.python = python
        self.key = f"external:{python}"
        self._proc: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        self._described: dict[str, Any] | None = None

    def _start(self) -> Any:
        import os
        import subprocess
        import tempfile
        from pathlib import Path

        worker = Path(__file__).with_name("_shapiq_worker.py")
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        try:
            proc = subprocess.Popen(
                [self.python, "-I", str(worker)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                env=env,
                start_new_session=True,  # the user's Ctrl-C is this process's to handle; EOF ends it
            )
        except OSError as exc:
            raise BackendUnavailable(f"{ENV_PYTHON}: cannot start {self.python}: {exc.strerror}") from None
        if not self._pid:
            import atexit

            atexit.register(self.close)
        self._pid = os.getpid()
        return proc

    def close(self) -> None:
        """End the worker (its input closes, it exits); the next request starts another."""
        import os
        import subprocess

        proc, self._proc = self._proc, None
        if proc is None or self._pid != os.getpid():
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()
        self._stderr.close()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        import json
        import os

        with self._lock:
            if self._proc is None or self._pid != os.getpid() or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                self._proc.wait(timeout=10)
                self._stderr.seek(0)
                last = [ln for ln in self._stderr.read().splitlines() if ln.strip()][-1:] or ["no output"]
                self._stderr.close()
                for stream in (self._proc.stdin, self._proc.stdout):
                    try:
                        stream.close()
                    except OSError:  # a broken pipe's unflushed line
                        pass
                self._proc = None
                raise BackendUnavailable(
                    f"the external shapiq ({self.python}) stopped: {last[0].strip()}; it needs a Python >= 3.12 with shapiq "
                    f"(set {ENV_PYTHON}, or run `make install`)"
                )
            return json.loads(line)

    def _describe(self) -> dict[str, Any]:
        if self._described is None:
            answer = self._ask({"op": "describe"})
            if "error" in answer:
                raise BackendUnavailable(f"the external shapiq ({self.python}) failed: {answer['error']}")
            self._described = answer
        return self._described

    def names(self) -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
        """name -> (valid indices, constructor parameters) of the external shapiq's approximators."""
        return {name: (frozenset(d["valid_indices"]), tuple(d["params"])) for name, d in self._describe()["approximators"].items()}

    def describe(self, name: str) -> tuple[frozenset[str], tuple[str, ...]]:
        return self.names()[name]

    def version(self) -> str:
        d = self._describe()
        return f"shapiq {d['version']} (Python {d['python']}, {self.python})"

    def run(self, est: ShapiqEstimator, n: int, budget: int, lookup: dict[bytes, float] | None) -> _Run:
        pool = None
        if lookup is not None:
            pool = {}
            for key, value in lookup.items():
                if len(key) * 8 >= n and np.isfinite(value):
                    bits = np.unpackbits(np.frombuffer(key, dtype=np.uint8), bitorder="little")[:n]
                    pool["".join("1" if b else "0" for b in bits)] = float(value)
        answer = self._ask(
            {
                "op": "run",
                "name": est.approximator,
                "n": n,
                "seed": library_seed(est.seed),
                "options": est._options(n),
                "budget": budget,
                "order": est.interactions,
                "pool": pool,
            }
        )
        if "error" in answer:
            if answer["kind"] == "config":
                raise _cannot_run(est, n, answer["error"])
            if answer["kind"] == "outside":
                raise EstimatorError(_outside(est.name))
            raise EstimatorError(f"{est.name} failed in the external shapiq: {answer['error']}")
        rows = np.array([[c == "1" for c in b] for b in answer["asked"]], dtype=bool).reshape(-1, n)
        values = np.asarray(answer["values"], dtype=np.float64)
        terms = tuple((tuple(players), float(value)) for players, value in answer["terms"])
        return rows, values, terms


class ShapiqEstimator:
    """A shapiq approximator through the engine (module docs: plan by a stand-in run, fit by a
    replay from the pool).

    Made per approximator by :func:`approximator_estimator`; ``name`` is ``"shapiq:<Approximator>"``.

    Args:
        budget: the most distinct coalitions (model evaluations), empty and grand coalition
            included.
        seed: shapiq's ``random_state``: the plan is a function of (approximator, n, budget, seed,
            interactions, index) and nothing else.
        interactions: the highest interaction order k (2 or more), or ``None`` for Shapley values.
        index: the interaction index with ``interactions`` (:data:`INTERACTION_INDICES`; default
            ``"k-SII"``).

    Raises:
        ConfigError: a bad budget or seed, an order below 2, or an index the approximator does not
            compute (``field`` names the setting).
    """

    name: ClassVar[str] = PREFIX
    approximator: ClassVar[str] = ""
    runtime: ClassVar[Any] = None  # _InProcess or ExternalShapiq, set by approximator_estimator
    fixed_options: ClassVar[tuple[tuple[str, Any], ...]] = ()  # written after the name (shapiq:NAME:KEY=VALUE)
    capabilities: ClassVar[Capabilities] = Capabilities(needs_budget=True, reports_stderr=False)
    __slots__ = ("budget", "seed", "interactions", "index")

    def __init__(self, *, budget: int, seed: int = 0, interactions: int | None = None, index: str | None = None) -> None:
        check_budget_seed(budget, seed)
        self.budget = budget
        self.seed = seed
        interactions, index = check_interactions(self.name, interactions, index, self.capabilities.interaction_indices)
        if interactions is None:
            valid = set(self.runtime.describe(self.approximator)[0]) or {"SV"}
            if not valid & {"SV", "SII", "k-SII", "kADD-SHAP"}:  # order-1 SII (and k-SII of order 1) is SV
                indices = ", ".join(self.capabilities.interaction_indices)
                raise ConfigError(
                    f"{self.name} computes interactions only ({indices}), not Shapley values alone; add --interactions 2 "
                    f"--index {self.capabilities.interaction_indices[0]}, or choose a Shapley-value approximator",
                    field="method",
                )
        self.interactions = interactions
        self.index = index

    # -- the approximator ----------------------------------------------------------------------
    def _options(self, n: int) -> dict[str, Any]:
        valid, params = self.runtime.describe(self.approximator)
        options: dict[str, Any] = dict(self.fixed_options)
        if self.interactions is not None:
            if "index" in params:
                options["index"] = self.index
            if "max_order" in params:
                options["max_order"] = self.interactions
        else:
            if "index" in params and "SV" in valid:
                options["index"] = "SV"
            if "max_order" in params and self.approximator in _ORDER_ONE_FOR_VALUES:
                options["max_order"] = 1
        return options

    def _plan(self, n: int) -> tuple[int, np.ndarray]:
        """(shapiq budget, distinct planned rows ``[m, n]`` bool: empty and grand coalition first);
        drawn once per configuration in this process (a run asks for its plan in several phases)."""
        key = (self.runtime.key, self.name, n, self.budget, self.seed, self.interactions, self.index)
        if key in _PLANS:
            return _PLANS[key]
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = self._draw(n)
        return _PLANS[key]

    def _draw(self, n: int) -> tuple[int, np.ndarray]:
        shapiq_budget = self.budget
        for _ in range(8):
            asked, _, _ = self.runtime.run(self, n, shapiq_budget, None)
            rows = np.concatenate([np.zeros((1, n), bool), np.ones((1, n), bool), asked])
            keys = row_keys(rows)
            first = {k: r for r, k in reversed(list(enumerate(keys)))}  # key -> first row index
            distinct = rows[sorted(first.values())]
            excess = distinct.shape[0] - self.budget
            if excess <= 0:
                distinct.setflags(write=False)
                return shapiq_budget, distinct
            shapiq_budget -= excess
            if shapiq_budget < 2:
                break
        raise ConfigError(
            f"{self.name} cannot keep to a budget of {self.budget} distinct coalitions on {n} players; give a larger budget",
            field="budget",
        )

    # -- the Estimator protocol ----------------------------------------------------------------
    def validate(self, n_players: int) -> None:
        """Refuse a game the approximator cannot play at this budget (drawing the plan, no model).

        Raises:
            EstimatorError: no players.
            ConfigError: an interaction order above n, or a budget the approximator refuses or
                cannot keep to (``field`` names the setting).
        """
        n = check_n_players(n_players)
        if self.interactions is not None and self.interactions > n:
            raise ConfigError(f"order {self.interactions} needs at least {self.interactions} players; this game has {n}", field="interactions")
        self._plan(n)

    def plan(self, n_players: int) -> Iterator[np.ndarray]:
        """Yield the coalitions the approximator asks for with ``random_state = seed`` (empty and
        grand coalition first), as read-only ``[n_players]`` bool rows; at most ``budget`` rows.

        Raises:
            as :meth:`validate`, at the call.
        """
        self.validate(n_players)
        _, rows = self._plan(int(n_players))
        return iter(rows)

    def fit(self, masks: np.ndarray, utilities: np.ndarray) -> Estimate:
        """Run the approximator again with every game call answered from the pool.

        Args:
            masks: ``[m, n_players]`` bool coalitions (the plan's, and any others).
            utilities: ``[m]`` float64 utilities (nats).

        Returns:
            an :class:`Estimate`: ``values`` ``[n_players]`` float64 (nats; order-1 terms, module
            docs), ``stderr=None``, ``interactions`` (orders 2..k with ``interactions=k``),
            ``n_evaluations`` = the plan's distinct coalitions, diagnostics ``shapiq_budget``.

        Raises:
            EstimatorError: the pool misses planned coalitions, holds non-finite utilities, or the
                approximator asked for a coalition outside its plan.
            MaskError: ``masks`` is not a 2-D bool array.
        """
        masks, utilities = check_pool(masks, utilities)
        n = masks.shape[1]
        self.validate(n)
        shapiq_budget, planned = self._plan(n)
        lookup = pool_lookup(masks, utilities)
        missing = sum(1 for k in row_keys(planned) if k not in lookup)
        if missing:
            raise EstimatorError(
                f"the pool misses {missing} of the {planned.shape[0]} coalitions planned by {self.name}; "
                "evaluate the whole plan before fitting"
            )

        _, values, interactions = self.runtime.run(self, n, shapiq_budget, lookup)
        empty, full = row_keys(np.stack([np.zeros(n, bool), np.ones(n, bool)]))
        v_empty, v_full = lookup[empty], lookup[full]
        return Estimate.from_values(
            method=self.name,
            values=values,
            v_empty=v_empty,
            v_full=v_full,
            n_evaluations=int(planned.shape[0]),
            diagnostics={"shapiq_budget": float(shapiq_budget)},
            interactions=interactions,
            interaction_index=self.index,
            interactions_share_total=self.index in EFFICIENT_INDICES,  # order-1 terms and interactions share v(N) - v(empty)
        )


def exact_interactions(masks: np.ndarray, utilities: np.ndarray, *, order: int, index: str) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Exact interaction values of orders 2..``order`` from a pool holding all 2^n coalitions, by
    shapiq's ``ExactComputer`` (the index's definition summed over every coalition).

    Args:
        masks: ``[m, n]`` bool, every coalition at least once.
        utilities: ``[m]`` float64 (nats).
        order: the highest order (2 .. n).
        index: one of :data:`INTERACTION_INDICES`.

    Returns:
        ``((players, value), ...)``: each set of 2..order players (ascending indices) with its
        value in the utilities' unit.

    Raises:
        EstimatorError: the pool misses coalitions.
        BackendUnavailable: shapiq is not installed (with the install command).
    """
    masks, utilities = check_pool(masks, utilities)
    n = masks.shape[1]
    lookup = pool_lookup(masks, utilities)

    def game(coalitions: np.ndarray) -> np.ndarray:
        rows = np.atleast_2d(np.asarray(coalitions, dtype=bool))
        keys = row_keys(rows)
        if any(k not in lookup for k in keys):
            raise EstimatorError("exact interactions need every coalition in the pool; evaluate all 2^n first")
        return np.fromiter((lookup[k] for k in keys), dtype=np.float64, count=len(keys))

    shapiq = _shapiq()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = shapiq.ExactComputer(n_players=n, game=game)(index, order)
    return _terms(result, n, order)


def _terms(result: Any, n: int, order: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Every set of 2..``order`` of the ``n`` players with its value in shapiq's result (zero for
    a set shapiq left out of its sparse result), by size, then lexicographically."""
    return tuple(
        (players, float(result[players]))
        for size in range(2, order + 1)
        for players in itertools.combinations(range(n), size)
    )
