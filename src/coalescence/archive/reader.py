"""Reading a run archive back: manifest, verified rows, pools for the estimators, and a summary.

Every part is verified before its rows are used: its bytes against the SHA-256 in its name, then
its Parquet structure and its columns against :data:`~coalescence.archive.schema.ROW_SCHEMA`. A
part that fails is refused with one line naming it, or left out under ``skip_corrupt`` (its
coalitions are then evaluated again); its values are never used. Parts of archives written before
schema version 3 carry no digest: only their structure and schema can be checked.

Readers take no lock: a compaction that switches generations while a read is under way makes a
listed part disappear, and the read starts again on the new generation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ArchiveError
from ..masking.codec import PackedMask
from .layout import PartFile, live_dir, lock_holder, one_line, part_files
from .manifest import read_manifest
from .schema import PARTS_DIR, REQUIRED_COLUMNS, ROW_SCHEMA, schema_problem

__all__ = (
    "BadPart",
    "archive_info",
    "check_parts",
    "corrupt_parts",
    "dedupe_rows",
    "format_archive_info",
    "list_parts",
    "load_rows",
    "parts_of",
    "read_manifest",
    "read_pool",
    "read_rows",
    "read_utilities",
)

logger = logging.getLogger(__name__)

_ATTEMPTS = 5
"""Reads started again when a concurrent compaction removes a listed part."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BadPart:
    """A part that failed verification.

    Attributes:
        part: the part (path, index, recorded digest).
        reason: why, one line (e.g. "is corrupt: its bytes do not match the SHA-256 in its name").
    """

    part: PartFile
    reason: str

    def quarantine_record(self, now: str, run_id: str | None) -> dict[str, Any]:
        """What the manifest's ``quarantine`` list records of this part once it is moved there
        (``now``: ISO 8601, UTC; ``run_id``: the run that moved it, ``None`` for a compaction)."""
        return {"part": self.part.path.name, "reason": self.reason, "quarantined_at": now, "run_id": run_id}

    def message(self, *, hint: bool = True) -> str:
        """One line naming the part and what is wrong (with the ``--skip-corrupt`` hint)."""
        text = f"part {PARTS_DIR}/{self.part.path.name} {self.reason}"
        if hint:
            text += "; rerun with --skip-corrupt to set it aside (its coalitions are evaluated again)"
        return text


class _Unusable(Exception):
    """A part failed verification (internal; becomes a :class:`BadPart`)."""


def parts_of(run_dir: str | Path) -> list[PartFile]:
    """The live parts of a run with their recorded digests, by index (see :func:`list_parts`)."""
    directory = live_dir(Path(run_dir))
    return [] if directory is None else part_files(directory)


def list_parts(run_dir: str | Path) -> list[Path]:
    """The complete parts of a run, in index order.

    Only regular files named ``part-NNNNNN-<sha256>.parquet`` (``part-NNNNNN.parquet`` in an archive
    of version 2 or older) in the live generation count; hidden names (``.``, ``_``) are skipped.

    Raises:
        ArchiveError: the live directory holds anything else a plain dataset read would take for
            data, or ``parts`` is not a directory or a link to a generation of the run.
    """
    return [p.path for p in parts_of(run_dir)]


def _verify(part: PartFile, *, decode: bool) -> pa.Table | None:
    """Check one part: digest, Parquet footer, schema; decode it when ``decode``.

    Raises:
        _Unusable: the part fails a check (the reason, one line).
        FileNotFoundError: the part was removed (a concurrent compaction).
    """
    try:
        # Arrow-owned memory, not Python bytes: Arrow's worker threads may drop the last reference
        # to the buffer after the read returns, and freeing Python bytes takes the GIL, which a
        # thread can no longer take while the interpreter exits: that aborted about 3% of
        # commands at exit (std::terminate, exit 134) after their output was printed.
        with pa.OSFile(str(part.path)) as source:
            data = source.read_buffer()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _Unusable(f"cannot be read ({one_line(exc)})") from exc
    if part.digest is not None and hashlib.sha256(data).hexdigest() != part.digest:
        raise _Unusable("is corrupt: its bytes do not match the SHA-256 in its name")
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _Unusable(f"is corrupt or truncated (not a readable Parquet file: {one_line(exc)})") from exc
    problem = schema_problem(schema)
    if problem is not None:
        raise _Unusable(f"is not a coalescence part: {problem}")
    if not decode:
        return None
    try:
        table = parquet.read(columns=[n for n in ROW_SCHEMA.names if n in schema.names])
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _Unusable(f"is corrupt or truncated ({one_line(exc)})") from exc
    for name in sorted(REQUIRED_COLUMNS):
        if table.column(name).null_count:
            raise _Unusable(f"is not a coalescence part: its column {name} holds nulls")
    columns = [
        table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in ROW_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=ROW_SCHEMA)


def _refusal(bad: list[BadPart]) -> ArchiveError:
    more = f" ({len(bad)} parts in all)" if len(bad) > 1 else ""
    first = bad[0].message(hint=False)
    return ArchiveError(
        f"{first}{more}; rerun with --skip-corrupt to set it aside (its coalitions are evaluated again)",
        field="RUN_DIR",
    )


def check_parts(run_dir: str | Path, *, skip_corrupt: bool = False) -> list[BadPart]:
    """Verify every part's digest and schema without decoding its rows (cheap: one read and one hash).

    Args:
        run_dir: the run directory.
        skip_corrupt: return the parts that fail instead of refusing.

    Returns:
        The parts that fail (empty when all pass).

    Raises:
        ArchiveError: a part fails (unless ``skip_corrupt``), or the layout holds foreign entries.
    """
    for _ in range(_ATTEMPTS):
        bad = []
        try:
            for part in parts_of(run_dir):
                try:
                    _verify(part, decode=False)
                except _Unusable as exc:
                    bad.append(BadPart(part=part, reason=str(exc)))
        except FileNotFoundError:
            continue
        if bad and not skip_corrupt:
            raise _refusal(bad)
        return bad
    raise _changing(run_dir)


def _changing(run_dir: str | Path) -> ArchiveError:
    return ArchiveError(f"{run_dir} changed {_ATTEMPTS} times while it was read (compactions?); try again", field="RUN_DIR")


def corrupt_parts(run_dir: str | Path) -> list[str]:
    """Names of the parts that fail verification (digest, Parquet footer, schema)."""
    return [b.part.path.name for b in check_parts(run_dir, skip_corrupt=True)]


def load_rows(run_dir: str | Path, *, skip_corrupt: bool = False) -> tuple[pa.Table, list[BadPart]]:
    """Every row of every verified part, in part order (repeated keys kept), and the parts left out.

    Raises:
        ArchiveError: a part fails verification (unless ``skip_corrupt``), or foreign entries.
    """
    for _ in range(_ATTEMPTS):
        tables, bad = [], []
        try:
            for part in parts_of(run_dir):
                try:
                    tables.append(_verify(part, decode=True))
                except _Unusable as exc:
                    bad.append(BadPart(part=part, reason=str(exc)))
                    if not skip_corrupt:
                        raise _refusal(bad) from None  # the first is enough (check_parts counts them all)
        except FileNotFoundError:
            continue
        for b in bad:
            logger.warning("skipping %s", b.message(hint=False))
        table = pa.concat_tables(tables) if tables else ROW_SCHEMA.empty_table()
        return table, bad
    raise _changing(run_dir)


def dedupe_rows(table: pa.Table) -> pa.Table:
    """Keep the first row of each coalition key, in the original order."""
    if table.num_rows == 0 or pc.count_distinct(table["coalition_key"]).as_py() == table.num_rows:
        return table
    indexed = table.select(["coalition_key"]).append_column("_row", pa.array(np.arange(table.num_rows)))
    first = indexed.group_by("coalition_key", use_threads=False).aggregate([("_row", "min")])
    keep = np.sort(first["_row_min"].to_numpy())
    return table.take(pa.array(keep))


def read_rows(run_dir: str | Path, *, skip_corrupt: bool = False, dedupe: bool = True) -> pa.Table:
    """Every row of every verified part, in part order, each coalition key once.

    Args:
        run_dir: the run directory.
        skip_corrupt: leave out (with a warning) a part that fails verification instead of failing.
        dedupe: drop repeated coalition keys (first occurrence wins).

    Returns:
        A table with :data:`~coalescence.archive.schema.ROW_SCHEMA` (columns a part of an older
        schema version lacks are null).

    Raises:
        ArchiveError: a part fails verification (named, with the ``--skip-corrupt`` hint), or the
            run directory holds foreign entries where parts live.
    """
    table, _ = load_rows(run_dir, skip_corrupt=skip_corrupt)
    return dedupe_rows(table) if dedupe else table


def read_utilities(
    run_dir: str | Path, snapshot_id: str | None = None, *, skip_corrupt: bool = False
) -> list[tuple[str, float]]:
    """The ``(coalition key, utility)`` of every distinct archived coalition, in archive order: what
    a hot result store is filled with (:meth:`~coalescence.scheduler.store.ResultStore.fill`).

    Args:
        run_dir: the run directory.
        snapshot_id: only this snapshot's rows; ``None`` for every row.
        skip_corrupt: leave out (with a warning) a part that fails verification instead of failing.

    Returns:
        One pair per distinct coalition key (the first row of a repeated key), the utility a float
        in the utility's unit (nats for the default ``logprob``).

    Raises:
        ArchiveError: a part fails verification (unless ``skip_corrupt``).
    """
    table = read_rows(run_dir, skip_corrupt=skip_corrupt)
    if snapshot_id is not None:
        table = table.filter(pc.equal(table["snapshot_id"], snapshot_id))
    keys = table.column("coalition_key").to_pylist()
    utilities = table.column("utility").to_pylist()
    logger.debug("read %s coalition utilities from %s", len(keys), run_dir)
    return list(zip(keys, utilities, strict=True))


def read_pool(
    run_dir: str | Path, snapshot_id: str, *, skip_corrupt: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The evaluated coalitions of one snapshot as an estimator pool.

    Returns:
        ``masks`` ``[m, n_players]`` bool and ``utilities`` ``[m]`` float64 (nats), one row per
        distinct coalition key.

    Raises:
        ArchiveError: a part that fails verification (unless ``skip_corrupt``).
    """
    table = read_rows(run_dir, skip_corrupt=skip_corrupt)
    rows = table.filter(pc.equal(table["snapshot_id"], snapshot_id))
    if rows.num_rows == 0:
        return np.zeros((0, 0), dtype=bool), np.zeros(0, dtype=np.float64)
    masks = np.stack([PackedMask(w, n).to_bools() for w, n in zip(
        rows["mask"].to_pylist(), rows["n_bits"].to_pylist(), strict=True
    )])
    return masks, rows["utility"].to_numpy().astype(np.float64)


def archive_info(run_dir: str | Path, *, skip_corrupt: bool = False) -> dict[str, Any]:
    """A summary of a run directory (what ``coalescence archive info`` prints).

    Returns:
        A JSON-ready dict: schema version, runs (a run the manifest records as ``running`` whose
        writer is gone, killed before it could close, as ``interrupted`` with ``killed`` true: the
        lock dies with its process, :func:`~coalescence.archive.layout.lock_holder`), snapshots
        (id, rows), coalitions, rows per game
        (``{"exact": rows, "kv-proxy-compact:<tail>": rows}``: the proxy game's rows only reduce the variance
        of estimates of the exact game), cache-hit rate,
        tokens computed and reused, model time (seconds), first/last write (UTC ISO), parts (and
        how many carry no digest, written before schema version 3), parts skipped by this read
        (``skip_corrupt``), parts quarantined earlier, and bytes.

    Raises:
        ArchiveError: no manifest, a damaged one, a newer schema, foreign entries, or a part that
            fails verification (unless ``skip_corrupt``).
    """
    manifest = read_manifest(run_dir)
    parts = parts_of(run_dir)
    loaded, bad = load_rows(run_dir, skip_corrupt=skip_corrupt)
    table = dedupe_rows(loaded)
    n = table.num_rows
    per_snapshot: dict[str, int] = {}
    if n:
        counts = table.group_by("snapshot_id").aggregate([("coalition_key", "count")])
        per_snapshot = dict(
            zip(counts["snapshot_id"].to_pylist(), counts["coalition_key_count"].to_pylist(), strict=True)
        )
    # model time: one elapsed_ms per model call (batch), not per row
    model_seconds = 0.0
    if n:
        calls = table.filter(pc.invert(table["cache_hit"])).select(["run_id", "batch_id", "elapsed_ms", "batch_size"])
        if calls.num_rows:
            elapsed = calls["elapsed_ms"].to_numpy()
            sizes = np.maximum(calls["batch_size"].to_numpy(), 1)
            model_seconds = float((elapsed / sizes).sum() / 1e3)
    created = table["created_at"] if n else None
    # the two fidelities: rows of the exact game (null in parts written before proxy games) and of a proxy game
    games = pc.fill_null(table["game"], "exact").to_pylist() if n else []
    per_game = {g: games.count(g) for g in sorted(set(games), key=lambda g: (g != "exact", g))}
    return {
        "run_dir": str(run_dir),
        "schema_version": manifest["schema_version"],
        "package_version": manifest.get("package_version"),
        "runs": _runs(run_dir, manifest.get("runs") or []),
        "snapshots": [{"snapshot_id": sid, "coalitions": c} for sid, c in sorted(per_snapshot.items())],
        "coalitions": n,
        "games": per_game,
        "cache_hit_rate": float(pc.mean(table["cache_hit"].cast(pa.float64())).as_py()) if n else 0.0,
        "tokens_computed": int(pc.sum(table["tokens_computed"]).as_py() or 0) if n else 0,
        "tokens_reused": int(pc.sum(table["tokens_reused"]).as_py() or 0) if n else 0,
        "model_seconds": model_seconds,
        "first_write": pc.min(created).as_py().isoformat() if n else None,
        "last_write": pc.max(created).as_py().isoformat() if n else None,
        "parts": len(parts),
        "unverified_parts": sum(p.digest is None for p in parts),
        "skipped_parts": [b.part.path.name for b in bad],
        "quarantined_parts": [q["part"] for q in manifest.get("quarantine") or []],
        "bytes": sum(_size(p.path) for p in parts),
    }


def _runs(run_dir: str | Path, runs: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's runs as ``archive info`` shows them: a run recorded as ``running`` that no
    process runs (an earlier run, or the last one with the archive's lock free: its writer was
    killed before it could record how it ended) is ``interrupted``, with ``killed`` true."""
    out = []
    for k, r in enumerate(runs):
        run = {key: r.get(key) for key in ("run_id", "started_at", "model", "absence_policy", "utility", "status", "error")}
        killed = r.get("status") == "running" and (k < len(runs) - 1 or lock_holder(Path(run_dir)) is None)
        if killed:
            run["status"] = "interrupted"
        run["killed"] = killed
        out.append(run)
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def format_archive_info(info: Mapping[str, Any]) -> str:
    """:func:`archive_info`'s summary as the lines ``coalescence archive info`` prints."""
    lines: list[str] = []
    lines.append(f"run directory   {info['run_dir']} (schema version {info['schema_version']}, coalescence {info['package_version']})")
    for r in info["runs"]:
        model, policy, utility = (r.get(k) if isinstance(r.get(k), dict) else {} for k in ("model", "absence_policy", "utility"))
        kind = utility.get("kind")
        sha = f" (sha256 {model['sha256'][:12]})" if isinstance(model.get("sha256"), str) and model["sha256"] else ""
        lines.append(
            f"run             {r['run_id']} started {r.get('started_at')} "
            + (f"[{r.get('status')}: killed, no process holds the archive's lock; the same command resumes it]" if r.get("killed") else f"[{r.get('status')}]")
            + f" model {model.get('id')}{sha} "
            f"policy {policy.get('id')} utility {kind}"
        )
        if r.get("error"):
            lines.append(f"  error         {r['error']}")
    for s in info["snapshots"]:
        lines.append(f"snapshot        {s['snapshot_id'][:16]}  {s['coalitions']} coalitions")
    lines.append(f"coalitions      {info['coalitions']} in {info['parts']} parts, {info['bytes']} bytes")
    games = info.get("games") or {}
    if any(g != "exact" for g in games):
        lines.append(
            "games           "
            + ", ".join(f"{c} {g}" for g, c in games.items())
            + " (proxy rows only reduce the variance of the exact game's estimates)"
        )
    if info["unverified_parts"]:
        lines.append(
            f"unverified      {info['unverified_parts']} parts written before schema version 3 carry no digest; "
            "`coalescence archive compact` adds them"
        )
    if info["skipped_parts"]:
        lines.append(f"skipped         {len(info['skipped_parts'])} damaged parts: {', '.join(info['skipped_parts'])}")
    if info["quarantined_parts"]:
        lines.append(f"quarantined     {len(info['quarantined_parts'])} parts in quarantine/: {', '.join(info['quarantined_parts'])}")
    lines.append(f"cache-hit rate  {info['cache_hit_rate']:.3f} of the rows served with no model call (the result store)")
    lines.append(f"tokens          {info['tokens_computed']} computed, {info['tokens_reused']} read from a prefix's cached KV")
    lines.append(f"model time      {info['model_seconds']:.1f} s")
    lines.append(f"writes          first {info['first_write']}, last {info['last_write']}")
    return "\n".join(lines)
