"""Compare explanations of one conversation side by side: several methods fitted from one archive,
or several runs and ``--out`` documents.

Each explanation is a column of values and ranks over the same players (the same snapshot: same
conversation, answer and player spans); the agreement of every column with the first is its
Spearman rank correlation (scipy's ``spearmanr``: Pearson's correlation of the ranks, ties
averaged) and its top-k overlap (the share of the first's k highest-valued players among its own k
highest); where an ``exact`` column is among them, each other column's error against it is given
as the largest absolute difference and the root-mean-square difference, in the values' unit.

Explanations in different units (a log-probability run and a token-F1 run of one conversation) are
refused: one table, one scale and one error against exact need one unit. Where a column's values
are all equal (or fewer than two players have values in both), its ranks are all tied and Spearman's
correlation is undefined (0/0): it is ``None`` with the reason (``spearman_undefined``), never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError, InputError
from .options import SettingsGroup, names, option, positive_int
from .options import seed as seed_type

__all__ = ("Column", "CompareSettings", "Comparison", "compare", "compare_files")


@dataclass(frozen=True, slots=True, kw_only=True)
class Column:
    """One explanation's values, as compared.

    Attributes:
        name: how the column is headed (the method, with the source when there are several).
        method: the estimator's name.
        values: ``[n_players]`` values in the unit of the comparison (``None``: unknown).
        stderr: ``[n_players]`` standard errors, or ``None`` for a method without them.
        spearman: Spearman's rank correlation with the first column (1.0 for the first), or
            ``None`` where it is undefined (``spearman_undefined`` says why).
        top_overlap: the share of the first column's top k players among this one's top k.
        max_error, rmse: the largest and the root-mean-square absolute difference from the exact
            column, or ``None`` (no exact column, or this is it).
        spearman_undefined: why there is no rank correlation (a column whose values are all
            equal, fewer than two players with values in both), or ``None``.
    """

    name: str
    method: str
    values: tuple[float | None, ...]
    stderr: tuple[float | None, ...] | None
    spearman: float | None
    top_overlap: float
    spearman_undefined: str | None = None
    max_error: float | None = None
    rmse: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Explanations of one snapshot side by side (module docs).

    Attributes:
        labels, texts: the players, in player order.
        unit: the values' unit.
        top_k: the k of the top-k overlap.
        columns: the explanations compared, the first the reference of the agreement.
    """

    labels: tuple[str, ...]
    texts: tuple[str, ...]
    unit: str
    top_k: int
    columns: tuple[Column, ...]

    def format(self, *, snippet: int = 40) -> str:
        """A table of values by player (rows in the first column's rank order), then agreement."""
        first = self.columns[0].values
        order = sorted(range(len(self.labels)), key=lambda i: (-(first[i] if first[i] is not None else -math.inf), i))
        width = max(12, *(len(c.name) for c in self.columns))
        head = f"{'player':<14}" + "".join(f" {c.name:>{width}}" for c in self.columns) + "  text"
        lines = [f"values ({self.unit}), players in the order of {self.columns[0].name}", head]
        for i in order:
            cells = "".join(f" {_num(c.values[i]):>{width}}" for c in self.columns)
            text = " ".join(self.texts[i].split())
            lines.append(f"{self.labels[i]:<14}{cells}  {text[:snippet]}{'…' if len(text) > snippet else ''}")
        lines.append("")
        lines.append(f"agreement with {self.columns[0].name}: Spearman rank correlation, top-{self.top_k} overlap" + (", error against exact" if any(c.max_error is not None for c in self.columns) else ""))
        for k, c in enumerate(self.columns):
            error = f", max |error| {c.max_error:.4f}, RMSE {c.rmse:.4f} {self.unit}" if c.max_error is not None and c.rmse is not None else ""
            if k == 0 and not error:
                continue  # the reference agrees with itself
            rho = f"Spearman {c.spearman:+.3f}" if c.spearman is not None else f"no Spearman correlation ({c.spearman_undefined})"
            agreement = "(the reference)" if k == 0 else f"{rho}, top-{self.top_k} overlap {c.top_overlap:.2f}"
            lines.append(f"  {c.name}: {agreement}{error}")
        return "\n".join(lines)

    def to_html(self, *, scale: str = "robust") -> str:
        """The comparison as one self-contained HTML page: values and ranks side by side, the
        agreement (and the error against exact), one bar chart per explanation on one scale
        (:func:`coalescence.report.comparison.render_comparison`).

        Args:
            scale: the colour scale, ``robust`` or ``linear``.

        Raises:
            BackendUnavailable: matplotlib is not installed (with the install command).
        """
        from ..report.comparison import render_comparison

        return render_comparison(self.to_dict(), scale=scale)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: players, value_unit (the values' unit), top_k and one record per column."""
        return {
            "players": [{"label": label, "text": text} for label, text in zip(self.labels, self.texts, strict=True)],
            "value_unit": self.unit,  # as an explanation document names it
            "top_k": self.top_k,
            "columns": [
                {
                    "name": c.name,
                    "method": c.method,
                    "values": list(c.values),
                    "stderr": None if c.stderr is None else list(c.stderr),
                    "spearman": c.spearman,
                    "spearman_undefined": c.spearman_undefined,
                    "top_overlap": c.top_overlap,
                    "max_error": c.max_error,
                    "rmse": c.rmse,
                }
                for c in self.columns
            ],
        }


def compare(
    sources: str | Path | Mapping[str, Any] | Sequence[str | Path | Mapping[str, Any]],
    *,
    methods: str | Sequence[str] | None = None,
    budget: int | None = None,
    seed: int | None = None,
    top_k: int = 3,
    snapshot: int = 0,
    run_id: str | None = None,
) -> Comparison:
    """Compare the explanations of ``sources`` (module docs).

    Args:
        sources: ``--out`` documents (paths or parsed), or run archive directories (fitted with
            ``methods``, default the run's own, as ``coalescence report``); one archive with several
            ``methods`` compares the methods. One source may be given alone.
        methods: for archives: method names, or one comma-separated string (``"exact,loo"``).
        budget, seed: for archives, as ``coalescence report``.
        top_k: the k of the top-k overlap (>= 1).
        snapshot: which conversation of a batch or an archive of several (0-based; an archive fits
            that one alone).
        run_id: archives: which run (default: the last one).

    Raises:
        InputError: fewer than two explanations, explanations of different snapshots or in
            different units (naming them).
        ConfigError: ``top_k`` < 1.
        ArchiveError, EstimatorError: as :func:`~coalescence.app.report.report_source`.
    """
    from scipy.stats import spearmanr

    from ..attribution.estimators import is_exact
    from ..report.sources import from_document
    from .report import report_source

    if isinstance(sources, str | Path | Mapping):
        sources = [sources]
    if top_k < 1:
        raise ConfigError(f"must be at least 1, got {top_k}", field="top_k")
    if snapshot < 0:
        raise ConfigError(f"numbers conversations from 0; got {snapshot}", field="conversation")
    documents: list[tuple[str, Mapping[str, Any]]] = []
    for source in sources:
        if isinstance(source, Mapping):
            report = from_document(source, "")
            where = "document"
        elif Path(source).is_dir():  # an archive: fit the chosen conversation alone
            report = report_source(source, methods=methods, budget=budget, seed=seed, run_id=run_id, conversation=snapshot)
            where = Path(source).name
            documents += [(where, e.document) for e in report.entries]
            continue
        else:
            report = report_source(source)
            where = Path(source).name
        entries = [e.document for e in report.entries]
        ids = list(dict.fromkeys(str(d.get("snapshot_id")) for d in entries))
        if snapshot >= len(ids):
            raise InputError(f"{where} holds {len(ids)} conversation(s), numbered from 0; got {snapshot}", field="conversation")
        documents += [(where, d) for d in entries if str(d.get("snapshot_id")) == ids[snapshot]]
    if len(documents) < 2:
        raise InputError("give at least two explanations: two or more sources, or one archive with --method a,b", field="SOURCE")
    first = documents[0][1]
    for where, doc in documents[1:]:
        if doc.get("snapshot_id") != first.get("snapshot_id"):
            raise InputError(
                f"{where} explains snapshot {str(doc.get('snapshot_id'))[:12]}, not {str(first.get('snapshot_id'))[:12]}: "
                "compare explanations of one conversation (the same players)",
                field="SOURCE",
            )
    unit = str(first.get("value_unit") or "nats")
    for k, (where, doc) in enumerate(documents[1:], start=2):
        if str(doc.get("value_unit") or "nats") != unit:
            raise InputError(
                f"{where}'s values are in {doc.get('value_unit')}, {documents[0][0]}'s in {unit}: compare explanations "
                "of one utility (one unit), e.g. each utility's runs on their own",
                field="SOURCE" if len(sources) > 1 else "method",
            )
    several = len({where for where, _ in documents}) > 1
    names = [f"{doc.get('method')}" + (f"@{where}" if several else "") for where, doc in documents]
    names = [n if names.count(n) == 1 else f"{n}#{k}" for k, n in enumerate(names)]
    players = first["players"]
    n = len(players)
    k = min(top_k, n)
    rows = [[p.get("value") for p in doc["players"]] for _, doc in documents]
    reference = rows[0]
    exact = next((r for (_, doc), r in zip(documents, rows, strict=True) if is_exact(doc.get("method"))), None)

    def top(values: Sequence[float | None]) -> set[int]:
        return set(sorted(range(n), key=lambda i: (-(values[i] if values[i] is not None else -math.inf), i))[:k])

    columns = []
    for (where, doc), name, values in zip(documents, names, rows, strict=True):
        pairs = [(a, b) for a, b in zip(reference, values, strict=True) if a is not None and b is not None]
        rho, undefined = None, None
        if len(pairs) < 2:
            undefined = "fewer than two players have values in both"
        elif len({b for _, b in pairs}) == 1 or len({a for a, _ in pairs}) == 1:
            constant = name if len({b for _, b in pairs}) == 1 else names[0]
            undefined = f"{constant} has the same value for every player, so its ranks are all tied"
        else:
            rho = float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic)
        errors = None
        if exact is not None and not is_exact(doc.get("method")):
            diffs = [abs(a - b) for a, b in zip(exact, values, strict=True) if a is not None and b is not None]
            errors = (max(diffs), math.sqrt(sum(d * d for d in diffs) / len(diffs))) if diffs else None
        se = [p.get("stderr") for p in doc["players"]]
        columns.append(
            Column(
                name=name,
                method=str(doc.get("method")),
                values=tuple(values),
                stderr=tuple(se) if any(s is not None for s in se) else None,
                spearman=rho,
                spearman_undefined=undefined,
                top_overlap=len(top(reference) & top(values)) / k,
                max_error=None if errors is None else errors[0],
                rmse=None if errors is None else errors[1],
            )
        )
    messages = first["messages"]
    return Comparison(
        labels=tuple(p["label"] for p in players),
        texts=tuple(messages[p["message_index"]]["content"][p["start"] : p["end"]] for p in players),
        unit=unit,
        top_k=k,
        columns=tuple(columns),
    )


@dataclass(frozen=True, kw_only=True)
class CompareSettings(SettingsGroup):
    """The settings of ``coalescence compare`` (its options; ``method``, ``budget``, ``seed`` and
    ``run`` apply to run archives, as :func:`compare`).

    Args:
        method: comma-separated methods fitted (default: the run's).
        budget, seed, run: the sampling budget, the plans' seed and the run id (default: the run's).
        top_k: the k of the top-k overlap.
        conversation: which conversation of a batch (0-based).
        out: the comparison written as JSON, or ``None``.
        html: the comparison written as one HTML page, or ``None``.
        scale: the page's colour scale, ``robust`` or ``linear``.
    """

    title: ClassVar[str] = "compare"

    method: str | None = option(None, help="run archives: comma-separated methods fitted (default: the run's method)")
    budget: int | None = option(None, type=positive_int, help="run archives: sampling budget (default: the run's, else 32 x players)")
    seed: int | None = option(None, type=seed_type, help="run archives: seed of the sampling plans (default: the run's)")
    run: str | None = option(None, help="run archives: run id (default: the last run)")
    top_k: int = option(3, type=positive_int, help="k of the top-k overlap (default: %(default)s)")
    conversation: int = option(0, type=int, metavar="K", help="which conversation of a batch, from 0 (default: 0)")
    out: str | Path | None = option(None, metavar="JSON", help="also write the comparison as JSON here")
    html: str | Path | None = option(
        None,
        metavar="PATH",
        help="also write the comparison as one self-contained HTML page here: values and ranks side by side, the "
        "agreement, one bar chart per explanation on one scale",
    )
    scale: str = option(
        "robust", choices=("robust", "linear"), help="--html: colour scale of the values (as coalescence report) (default: %(default)s)"
    )


def compare_files(sources: Sequence[str | Path], settings: CompareSettings) -> Comparison:
    """``coalescence compare``: :func:`compare` of ``sources`` as ``settings`` asks, written to
    ``settings.out`` (JSON) and ``settings.html`` (one page) when given, every path checked first.

    Returns:
        The comparison.

    Raises:
        ConfigError: an output that is a directory, unwritable, or would overwrite a source or a run
            archive; archive options where every source is a document; as :func:`compare`.
        InputError, ArchiveError, EstimatorError: as :func:`compare`.
        BackendUnavailable: ``html`` without the report's optional packages.
        ReportError: the page could not be drawn.
        RunFailed: ``out`` could not be written.
    """
    from ..archive.writer import write_json_atomic
    from ..report import write_report
    from .lifecycle import write_after_run
    from .outputs import html_path, output_path, refuse_overwrite
    from .report import drawn

    s = settings
    out, html = output_path(s.out, "out"), html_path(s.html, "html")
    refuse_overwrite(
        {"out": out, "html": html},
        sources={f"SOURCE {k + 1}": x for k, x in enumerate(sources) if not Path(x).is_dir()},
        run_dirs={f"SOURCE {k + 1}": x for k, x in enumerate(sources) if (Path(x) / "manifest.json").is_file()},
    )
    documents = [x for x in sources if not Path(x).is_dir()]
    given = [name for name, value in (("method", s.method), ("budget", s.budget is not None), ("seed", s.seed is not None), ("run", s.run)) if value]
    if documents and len(documents) == len(sources) and given:
        raise ConfigError("applies to run archive directories; every SOURCE here is an --out document", field=given[0])
    methods = names(s.method) if s.method is not None else None
    comparison = compare(list(sources), methods=methods, budget=s.budget, seed=s.seed, top_k=s.top_k, snapshot=s.conversation, run_id=s.run)
    if out is not None:
        write_after_run(lambda: write_json_atomic(out, comparison.to_dict(), field="out"), out)
    if html is not None:
        write_report(html, drawn(lambda: comparison.to_html(scale=s.scale), "html"), field="html")
    return comparison


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:+.4f}"
