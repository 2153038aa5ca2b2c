"""Benchmark sweeps: many estimators, budgets and seeds fitted from one coalition pool per conversation.

A sweep (:func:`sweep_run`, the ``coalescence sweep`` command, :func:`coalescence.sweep`) is
an explain run (:class:`~coalescence.app.explain.ExplainRun`) given the sweep's phases
(:class:`SweepPhases`: what it plans and fits), with every other phase the same: the same input
checks, preflight (the tokenizer renders every coalition of every plan before any weights load),
model loading, archive (created or resumed) and conversations in flight through one engine. What
differs is what it fits:

* the *cells*: every (method, budget, seed) of the settings; a method without a budget (exact,
  loo) is one cell with budget and seed null. A cell whose estimator refuses a conversation's
  number of players (a budget below the method's minimum, exact over 16 players) is a recorded
  skip with the estimator's reason, not an error;
* per conversation, the union of the cells' plans is evaluated once through the engine (each
  distinct coalition once, deduplicated against the archive), then every cell is fitted on exactly
  the distinct coalitions of its own plan, in its plan's first-seen order: the values a
  one-method ``coalescence explain`` run with that method, budget and seed gives (up to the float
  rounding of other batch compositions);
* the results table ``OUT/results.parquet`` (:data:`RESULT_SCHEMA`, one row per conversation and
  cell, list columns per player), written atomically, and a printed summary per method and
  budget (:func:`summarize`).

A finished conversation's rows are recorded in the archive's ``results.jsonl``: the same command
again restores them (no planning, no model call; identical rows, fit times included), and a
conversation cut short by an interruption is fitted again from the coalitions the archive holds.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError, EstimatorError
from ..normalised import given_or_default
from ..userinput import did_you_mean
from ..attribution.estimators import is_exact
from .lifecycle import run_blocking
from .explain import ExplainRun, closing_run
from .phases import PhasedRun
from .options import Options, SettingsGroup, int_list, option
from .groups import RaySettings, method_list_help
from .settings import RunSettings

__all__ = (
    "EXPLAIN_ONLY", "RESULT_SCHEMA", "RUN_OPTIONS", "Cell", "SweepPhases", "SweepResult", "SweepSettings", "agreement", "summarize", "sweep_run",
)  # fmt: skip

RESULTS_NAME = "results.parquet"
"""The results table in the output directory."""

TOP_K = 3
"""The k of the top-k agreement column (``top3``)."""


def _result_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("conversation", pa.int64(), nullable=False),  # the input's position (0-based)
            pa.field("snapshot_id", pa.string(), nullable=False),
            pa.field("n_players", pa.int64(), nullable=False),
            pa.field("players", pa.list_(pa.string()), nullable=False),  # player labels, in player order
            pa.field("method", pa.string(), nullable=False),
            pa.field("budget", pa.int64()),  # null for a method without a budget (exact, loo)
            pa.field("seed", pa.int64()),  # null for a method without a budget
            pa.field("status", pa.string(), nullable=False),  # "ok" or "skipped"
            pa.field("reason", pa.string()),  # why a cell was skipped (the estimator's words)
            pa.field("values", pa.list_(pa.float64())),  # [n_players], the utility's unit (nats)
            pa.field("stderr", pa.list_(pa.float64())),  # [n_players] or null; null entries: too few samples
            pa.field("v_empty", pa.float64()),
            pa.field("v_full", pa.float64()),
            pa.field("n_evaluations", pa.int64()),  # distinct coalitions of the cell's plan
            pa.field("model_seconds", pa.float64()),  # model time of those coalitions' first evaluation
            pa.field("fit_seconds", pa.float64()),  # the estimator's fit
            pa.field("rel_l2", pa.float64()),  # ||values - exact|| / ||exact||, null without exact
            pa.field("top1", pa.float64()),  # 1.0 when the top player is exact's, else 0.0
            pa.field("top3", pa.float64()),  # |top-3 & exact's top-3| / 3 (k = min(3, n))
            pa.field("spearman", pa.float64()),  # Spearman rank correlation with exact's values
        ]
    )


RESULT_SCHEMA = _result_schema()
"""The results table: one row per (conversation, method, budget, seed), per-player list columns.

``model_seconds`` sums, over the distinct coalitions of the cell's plan, each coalition's share of
the model call that first evaluated it (its archive row's ``elapsed_ms / batch_size``; 0 for a row
derived with no model call), so a coalition shared by several cells counts in each, and a resumed
session, which serves coalitions from the archive, reports the same times. The error columns
compare a cell's values with the ``exact`` cell of the same conversation (null when the sweep has
no exact cell, for the exact cell itself, and for skipped cells): ranking players by decreasing
value, ties in player order (as the explain table ranks them), ``top1`` is whether both rank the
same player first, ``top3`` the share of exact's top ``min(3, n)`` players among the cell's top
``min(3, n)``, ``spearman`` :func:`scipy.stats.spearmanr` of the values (null when either is
constant or n < 2), ``rel_l2`` null when exact's values are all zero."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One estimator configuration of a sweep: a method, its budget and seed (``None`` for a
    method without a budget)."""

    method: str
    budget: int | None
    seed: int | None

    def estimator(self) -> Any:
        """The estimator of this cell."""
        from ..attribution.estimators import make_estimator

        return make_estimator(self.method, budget=self.budget, seed=self.seed if self.seed is not None else 0)


@dataclass(frozen=True, kw_only=True)
class SweepSettings(SettingsGroup):
    """The settings of a sweep (the ``coalescence sweep`` options, by their library names).

    Args:
        methods: the estimators (comma-separated string or names).
        budgets: the budgets of the sampling methods (positive integers); needed when a sampling
            method is among ``methods``.
        seeds: the sampling seeds (non-negative integers; default ``0``).
        out: the output directory: ``results.parquet`` and, by default, the run archive ``archive/``.
        run: everything else, as an explain run's settings (model, backend, unit, absence policy,
            utility, batch size, conversations in flight, ``archive`` ...); its own method, budget,
            seed, target standard error, hierarchy, ``out`` and ``html`` do not apply, nor the proxy
            game: a sweep fits every cell from the exact game's rows alone (what an explain run with
            ``proxy_game="none"`` fits).

    Raises:
        ConfigError: no or an unknown method, a budget or seed that is not an integer of the
            range, a sampling method without budgets, budgets with no sampling method, an
            explain-only setting in ``run`` (naming the setting).
    """

    title: ClassVar[str] = "sweep"

    methods: tuple[str, ...] | str = option(required=True, help=method_list_help)
    budgets: tuple[int, ...] | str = option(
        (),
        cli_default="",
        help="comma-separated budgets of the sampling methods (permutation, kernelshap, regression-msr, banzhaf, lasso): "
        "the most distinct model evaluations, e.g. 64,128,256; a budget a method refuses for a "
        "conversation's number of players is a recorded skip",
    )
    seeds: tuple[int, ...] | str = option((0,), cli_default="0", help="comma-separated seeds of the sampling plans (default: %(default)s)")
    out: str | Path = option(
        metavar="DIR", required=True, help="output directory: results.parquet, and the run archive DIR/archive by default"
    )
    run: RunSettings = field(default_factory=RunSettings)

    @classmethod
    def normalised(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``methods``, ``budgets``, ``seeds`` as tuples (repeats dropped, in order); a ``run``
        without an archive keeps it in ``OUT/archive``. Raises ConfigError: a bad method, budget or seed."""
        from ..attribution.estimators import ESTIMATORS, estimator_class, is_method

        if "methods" not in given:
            return super().normalised(given)  # refused by the constructor: a required setting
        raw = given["methods"].split(",") if isinstance(given["methods"], str) else list(given["methods"])
        methods: list[str] = []
        for name in (m.strip() if isinstance(m, str) else m for m in raw):
            if name == "":
                continue
            if not is_method(name):
                raise ConfigError(
                    f"unknown method {name!r}{did_you_mean(name, ESTIMATORS)}; use a comma-separated subset of "
                    f"{','.join(ESTIMATORS)} or shapiq:<Approximator>",
                    field="methods",
                )
            estimator_class(name)  # a shapiq approximator the installed shapiq lacks is refused now
            if name not in methods:
                methods.append(name)
        if not methods:
            raise ConfigError(f"give at least one method, a comma-separated subset of {','.join(ESTIMATORS)}", field="methods")
        given["methods"] = tuple(methods)
        given["budgets"] = int_list(given.get("budgets", ()), "budgets", minimum=1, what="positive integers")
        given["seeds"] = int_list(given_or_default(cls, given, "seeds"), "seeds", minimum=0, what="non-negative integers")
        run, out = given_or_default(cls, given, "run"), given.get("out")
        if isinstance(run, RunSettings) and (run.archive is None or run.archive is True) and isinstance(out, (str, Path)) and str(out).strip():
            given["run"] = replace(run, archive=Path(out) / "archive")  # a sweep always keeps its archive, in OUT by default
        return super().normalised(given)

    def __post_init__(self) -> None:
        from ..attribution.estimators import estimator_class

        sampling = [m for m in self.methods if estimator_class(m).capabilities.needs_budget]
        if sampling and not self.budgets:
            raise ConfigError(f"methods {','.join(sampling)} sample within a budget; give budgets, e.g. 64,128", field="budgets")
        if self.budgets and not sampling:
            raise ConfigError(f"applies to the sampling methods; {','.join(self.methods)} take none. Drop it", field="budgets")
        if sampling and not self.seeds:
            raise ConfigError("give at least one seed, e.g. 0,1,2", field="seeds")
        if not isinstance(self.out, (str, Path)) or not str(self.out).strip():
            raise ConfigError("give an output directory", field="out")
        run = self.run
        default = RunSettings()
        for name in EXPLAIN_ONLY:
            if getattr(run, name) != getattr(default, name):
                raise ConfigError("does not apply to a sweep (its methods, budgets and seeds are the sweep's)", field=name)
        for name in ("proxy_game", "proxy_budget"):  # every cell is fitted from the one pool of exact rows
            if getattr(run, name) != getattr(default, name):
                raise ConfigError("does not apply to a sweep (it fits every cell from the exact game's rows alone)", field=name)
        if run.archive is False:
            raise ConfigError("a sweep keeps its coalitions in a run archive; give a directory or leave the default", field="archive")

    def cells(self) -> list[Cell]:
        """Every cell, methods in the given order, then budgets, then seeds."""
        from ..attribution.estimators import estimator_class

        out: list[Cell] = []
        for method in self.methods:
            if estimator_class(method).capabilities.needs_budget:
                out += [Cell(method, b, s) for b in self.budgets for s in self.seeds]
            else:
                out.append(Cell(method, None, None))
        return out

    def describe(self) -> dict[str, Any]:
        """The sweep's grid as the manifest records it (and as finished conversations are keyed)."""
        return {"methods": list(self.methods), "budgets": list(self.budgets), "seeds": list(self.seeds)}


EXPLAIN_ONLY = ("method", "budget", "seed", "interactions", "index", "target_stderr", "hierarchy", "top_k", "out", "html")
"""The explain run's settings that do not apply to a sweep (its methods, budgets and seeds are the sweep's)."""

RUN_OPTIONS = Options(
    cls=RunSettings,
    exclude=EXPLAIN_ONLY + tuple(f.name for f in fields(RaySettings)),
    help={
        "archive": "run archive directory (default: DIR/archive); resumed if it holds this run",
        "max_conversations_in_flight": "conversations evaluated at once through one scheduler, their coalitions "
        "filling the same batches (bounds memory) (default: %(default)s)",
    },
    defaults={"archive": None},  # no --archive: None, the sweep's default (OUT/archive)
)
"""The explain run's options that ``coalescence sweep`` takes (:attr:`SweepSettings.run`): not the
explain-only ones, nor Ray's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    """What a sweep gives back.

    Attributes:
        rows: the results table's rows (dicts of :data:`RESULT_SCHEMA`'s columns).
        path: the results table's file.
        run_dir: the run archive.
        summary: the printed summary (:func:`summarize`).
        model_evaluations: coalitions this session evaluated with the model (0 for a finished
            sweep run again).
        restored_conversations: conversations restored from the archive, not fitted again.
        conversations: conversations of the sweep.
    """

    rows: tuple[dict[str, Any], ...]
    path: Path
    run_dir: Path
    summary: str
    model_evaluations: int
    restored_conversations: int
    conversations: int

    def format(self) -> str:
        """The summary, then the conversations and model evaluations, then where the results are
        (what ``coalescence sweep`` prints)."""
        return (
            f"{self.summary}\nconversations {self.conversations} ({self.restored_conversations} restored from the archive)   "
            f"model evaluations this session {self.model_evaluations}\nresults: {self.path}   archive: {self.run_dir}"
        )

    def to_arrow(self) -> Any:
        """The results as a ``pyarrow.Table``."""
        import pyarrow as pa

        return pa.Table.from_pylist(list(self.rows), schema=RESULT_SCHEMA)

    def to_pandas(self) -> Any:
        """The results as a ``pandas.DataFrame`` (needs the notebook extra)."""
        return self.to_arrow().to_pandas()


def _finite(x: Any) -> float | None:
    """A float, or ``None`` for NaN and infinities (JSON and Parquet nulls)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _order(values: np.ndarray) -> list[int]:
    """Player indices by decreasing value, ties in player order (the explain table's ranking)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def agreement(values: Sequence[float], exact: Sequence[float]) -> dict[str, float | None]:
    """The error columns of ``values`` against ``exact`` (see :data:`RESULT_SCHEMA`).

    Returns:
        ``{"rel_l2", "top1", "top3", "spearman"}``, ``None`` where undefined.
    """
    from scipy.stats import spearmanr

    phi, ref = np.asarray(values, dtype=np.float64), np.asarray(exact, dtype=np.float64)
    norm = float(np.linalg.norm(ref))
    rel = float(np.linalg.norm(phi - ref)) / norm if norm > 0 else None
    mine, theirs = _order(phi), _order(ref)
    k = min(TOP_K, len(ref))
    rho = None
    if len(ref) >= 2 and np.ptp(phi) > 0 and np.ptp(ref) > 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rho = _finite(spearmanr(phi, ref).statistic)
    return {
        "rel_l2": _finite(rel),
        "top1": 1.0 if mine[0] == theirs[0] else 0.0,
        "top3": len(set(mine[:k]) & set(theirs[:k])) / k,
        "spearman": rho,
    }


class SweepPhases:
    """A sweep's phases (:class:`~coalescence.app.phases.RunPhases`), given to an
    :class:`~coalescence.app.explain.ExplainRun` of the sweep's ``settings.run``: every cell's plan
    evaluated once per conversation, every cell fitted on its own plan; :meth:`write` the table.

    Args:
        settings: the sweep's settings (``model_evaluations``: coalitions the model evaluated so far).
    """

    def __init__(self, settings: SweepSettings) -> None:
        self.sweep = settings
        self.cells = settings.cells()
        self.model_evaluations = 0

    def player_limit(self, run: PhasedRun) -> int | None:
        """No limit: a method's limit (exact: 16) makes a recorded skip."""
        return None

    def fine_game(self, run: PhasedRun, snapshot: Any) -> None:
        """None: a sweep plays no hierarchy (refused with its settings)."""
        return None

    def validate_game(self, run: PhasedRun, n_players: int, *, refused: str | None) -> None:
        """Nothing is refused: a cell whose estimator refuses the game is a recorded skip."""

    def estimators(self, n_players: int) -> list[tuple[Cell, Any, str | None]]:
        """Each cell with its estimator for a game of ``n_players``, or ``None`` and the reason it
        refuses the game."""
        out: list[tuple[Cell, Any, str | None]] = []
        for cell in self.cells:
            estimator = cell.estimator()
            try:
                estimator.validate(n_players)
            except (ConfigError, EstimatorError) as exc:
                out.append((cell, None, exc.message))
                continue
            out.append((cell, estimator, None))
        return out

    def plan(self, run: PhasedRun, n_players: int) -> Iterable[np.ndarray]:
        """The union of the cells' plans (repeats folded by the engine)."""
        return itertools.chain.from_iterable(e.plan(n_players) for _, e, _ in self.estimators(n_players) if e is not None)

    def outputs(self, run: PhasedRun) -> tuple[Path | None, Path | None]:
        """The output directory: a directory (or nothing yet) in a writable place; no HTML.
        Raises ConfigError: ``out`` is a file."""
        from .outputs import output_path

        directory = Path(self.sweep.out)
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{str(directory)!r} is a file; give a directory", field="out")
        return output_path(directory / RESULTS_NAME, "out"), None

    def run_config(self, run: PhasedRun) -> dict[str, Any]:
        """The manifest's ``run_config``: command ``sweep`` and the grid."""
        return {"command": "sweep", **self.sweep.describe()}

    def _result_key(self, snap: Any) -> str:
        return json.dumps({"snapshot_id": snap.snapshot_id, "sweep": self.sweep.describe()}, sort_keys=True)

    def restored(self, run: PhasedRun, snap: Any) -> Any:
        """The cells' rows of ``snap`` an earlier session recorded, or ``None``."""
        if run.archive is None:
            return None
        document = run.archive.results.get(self._result_key(snap))
        cells = document.get("cells") if isinstance(document, Mapping) else None
        if not isinstance(cells, list) or len(cells) != len(self.cells):
            return None
        return [dict(c) for c in cells]

    def record(self, run: PhasedRun, snap: Any, result: Any) -> None:
        """Record a finished conversation's rows (``result``) in the archive."""
        if run.archive is not None:
            run.archive.record_result(self._result_key(snap), {"cells": result})

    async def explain_one(self, run: PhasedRun, k: int, snap: Any) -> list[dict[str, Any]]:
        """Evaluate the union of the cells' plans once, then fit every cell on its own plan."""
        from ..engine import counting_evaluations
        from ..masking.codec import PackedMask

        engine, policy, archive, n = run.engine, run.policy, run.archive, snap.n_players
        jobs = []
        for cell, estimator, reason in self.estimators(n):
            plan: dict[bytes, np.ndarray] = {}
            if estimator is not None:
                for row in estimator.plan(n):
                    row = np.asarray(row, dtype=bool)
                    plan.setdefault(PackedMask.from_bools(row).words, row)
            jobs.append((cell, estimator, reason, plan))
        pool: dict[bytes, float] = {}
        if any(plan for *_, plan in jobs):
            union = itertools.chain.from_iterable(plan.values() for *_, plan in jobs)
            with counting_evaluations() as executed:
                masks, utilities = await engine.evaluate(snap, policy, union)
            self.model_evaluations += executed[0]
            pool = {PackedMask.from_bools(m).words: float(u) for m, u in zip(masks, utilities, strict=True)}
        seconds: dict[bytes, float] = {}

        def model_seconds(words: bytes) -> float:
            if words not in seconds:
                found = archive.model_seconds(engine.key(snap, policy, PackedMask(words, n))) if archive is not None else None
                seconds[words] = found or 0.0
            return seconds[words]

        base = {"snapshot_id": snap.snapshot_id, "n_players": n, "players": [p.label for p in snap.players]}
        rows: list[dict[str, Any]] = []
        for cell, estimator, reason, plan in jobs:
            row = base | {"method": cell.method, "budget": cell.budget, "seed": cell.seed, "status": "skipped", "reason": reason}
            if estimator is not None:
                cell_masks = np.array(list(plan.values()), dtype=bool).reshape(len(plan), n)
                cell_utilities = np.array([pool[w] for w in plan], dtype=np.float64)
                t0 = time.perf_counter()
                try:
                    estimate = estimator.fit(cell_masks, cell_utilities)
                except (ConfigError, EstimatorError) as exc:
                    row["reason"] = f"fit: {exc.message}"
                else:
                    row |= {
                        "status": "ok",
                        "reason": None,
                        "values": [_finite(v) for v in estimate.values],
                        "stderr": None if estimate.stderr is None else [_finite(v) for v in estimate.stderr],
                        "v_empty": _finite(estimate.v_empty),
                        "v_full": _finite(estimate.v_full),
                        "n_evaluations": len(plan),
                        "model_seconds": sum(model_seconds(w) for w in plan),
                        "fit_seconds": time.perf_counter() - t0,
                    }
            rows.append(row)
        exact = next((r for r in rows if is_exact(r["method"]) and r["status"] == "ok"), None)
        for row in rows:
            if exact is not None and row is not exact and row["status"] == "ok" and None not in row["values"] and None not in exact["values"]:
                row |= agreement(row["values"], exact["values"])
        return rows

    # -- the table ----------------------------------------------------------------------------------
    def table_rows(self, results: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """The results table's rows: every conversation's cells, in input then cell order."""
        columns = RESULT_SCHEMA.names
        return [{c: row.get(c) for c in columns} | {"conversation": k} for k, rows in enumerate(results) for row in rows]

    def write(self, run: PhasedRun, results: Sequence[Sequence[Mapping[str, Any]]]) -> SweepResult:
        """Write ``OUT/results.parquet`` (``run.out_path``) atomically (a temporary file, then a rename).

        Args:
            run: the sweep's run, evaluated.
            results: the rows of each conversation's cells, in input order (``run.evaluate``'s).

        Returns:
            The :class:`SweepResult`.

        Raises:
            ArchiveWriteError, ArchiveError: the table cannot be written.
        """
        import os

        import pyarrow as pa
        import pyarrow.parquet as pq

        from ..archive.layout import os_error

        rows = self.table_rows(results)
        table = pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)
        path = run.out_path
        assert path is not None
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise os_error(exc, f"cannot write {path}", field="out") from exc
        return SweepResult(
            rows=tuple(rows),
            path=path,
            run_dir=Path(run.run_dir) if run.run_dir is not None else Path(self.sweep.out) / "archive",
            summary=summarize(rows),
            model_evaluations=self.model_evaluations,
            restored_conversations=run.restored_conversations,
            conversations=len(results),
        )


def summarize(rows: Sequence[Mapping[str, Any]]) -> str:
    """The printed summary: per method and budget, over conversations and seeds, the median and
    90th percentile of the relative L2 error against exact, the mean top-1 and top-3 agreement and
    Spearman correlation, the mean model evaluations and model seconds per cell, and the cells
    fitted and skipped."""
    groups: dict[tuple[str, int | None], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["budget"]), []).append(row)

    def mean(xs: list[float]) -> float | None:
        return float(np.mean(xs)) if xs else None

    def fmt(x: float | None, digits: int = 3) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    head = ("method", "budget", "cells", "skipped", "relL2 med", "relL2 p90", "top-1", "top-3", "spearman", "evals", "model s")
    lines = [head]
    for (method, budget), members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        rel = [r["rel_l2"] for r in ok if r.get("rel_l2") is not None]
        pick = lambda name: [r[name] for r in ok if r.get(name) is not None]  # noqa: E731
        lines.append(
            (
                method,
                "-" if budget is None else str(budget),
                str(len(ok)),
                str(len(members) - len(ok)),
                fmt(float(np.median(rel)) if rel else None),
                fmt(float(np.percentile(rel, 90)) if rel else None),
                fmt(mean(pick("top1")), 2),
                fmt(mean(pick("top3")), 2),
                fmt(mean(pick("spearman")), 2),
                fmt(mean(pick("n_evaluations")), 1),
                fmt(mean(pick("model_seconds")), 2),
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    text = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths, strict=True))) for line in lines]
    reasons = sorted({(r["method"], r["budget"], r["reason"]) for r in rows if r["status"] != "ok"}, key=str)
    notes = [f"skipped {m} budget {b}: {why}" for m, b, why in reasons]
    legend = (
        "per method and budget over conversations and seeds: relL2 = ||phi - phi_exact|| / ||phi_exact|| "
        "(median, 90th percentile), top-1/top-3 agreement and spearman against exact (means), evals = "
        "distinct coalitions per fit (mean), model s = their model time per fit (mean, first evaluation)"
    )
    return "\n".join([*text, *notes, legend])


def sweep_run(source: Any, settings: SweepSettings, *, backend: Any = None, progress: Any = None) -> SweepResult:
    """Every phase of a sweep, synchronously (its own event loop).

    Args:
        source: a dataset path, an input file, an input dict or a list of messages.
        settings: the sweep's settings.
        backend: a loaded backend (else ``settings.run.model`` is loaded).
        progress: progress callbacks.

    Returns:
        The :class:`SweepResult`.
    """

    phases = SweepPhases(settings)
    run = ExplainRun(source, settings.run, backend=backend, phases=phases)
    run.preflight()
    run.load(progress=progress)
    run.open_archive()
    results = closing_run(run, lambda: run_blocking(run.evaluate))
    return phases.write(run, results)
