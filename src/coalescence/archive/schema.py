"""The run archive's layout and Parquet schema.

A run directory holds::

    RUN_DIR/
      manifest.json                  schema version, runs (config, model, utility, absence policy, status,
                                     error), snapshots, quarantined parts, package version, times
      .lock                          held (OS file lock) by the one process writing the run
      parts -> .parts-000001         a symbolic link to the live generation of parts
      .parts-000001/part-000000-<sha256>.parquet
                                     zstd Parquet, one row per evaluated coalition (ROW_SCHEMA); the
                                     name carries the SHA-256 of the file's bytes
      quarantine/                    parts found damaged and moved aside under --skip-corrupt

Every read verifies each part: its bytes against the SHA-256 in its name (a flipped bit anywhere,
data page or footer, is caught), then its columns against :data:`ROW_SCHEMA`. A part is written
whole under a hidden temporary name, fsynced and renamed into place, so it appears complete or not
at all. Compaction writes a new generation directory and switches the ``parts`` link to it with one
``rename``; so at every instant a plain ``pyarrow.dataset`` read of ``RUN_DIR/parts`` sees one
complete generation, each coalition key once (hidden names, ``.`` or ``_`` first, are skipped by
pyarrow and by us).

Archives of schema version 2 and older have a real ``parts/`` directory of ``part-NNNNNN.parquet``
files with no digest: they are read as they are (verified by their Parquet structure and schema
only), and the first writer that opens one (a resume, ``archive compact``) hard-links its parts into
a generation directory under digest names and switches ``parts`` to it.
"""

from __future__ import annotations

import re

import pyarrow as pa

__all__ = (
    "GENERATION_PATTERN",
    "LEGACY_COLUMNS",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "NEXT_LINK",
    "PARTS_DIR",
    "PART_PATTERN",
    "QUARANTINE_DIR",
    "REQUIRED_COLUMNS",
    "ROW_SCHEMA",
    "SCHEMA_VERSION",
    "generation_name",
    "hidden",
    "parse_part_name",
    "part_index",
    "part_name",
    "schema_problem",
)

SCHEMA_VERSION = 3
"""Version of the manifest, layout and row schema; a reader refuses a newer one.

Version 2 added ``evaluation_key``, ``token_logprobs`` and ``generated_texts`` (replacing the
never-written ``generation_text``); parts of version 1 read with those columns null. Version 3
keeps the rows of version 2 and changes the layout: digests in part names, ``parts`` a link to a
generation directory, ``quarantine/`` (an older coalescence would see no parts in it, so it is
refused there by the version check)."""

MANIFEST_NAME = "manifest.json"
PARTS_DIR = "parts"
LOCK_NAME = ".lock"
RESULTS_NAME = "results.jsonl"
"""Finished explanations, one JSON line each ``{"run_id", "key", "document"}``, appended once the
rows they were fitted from are flushed: a resumed dataset run restores them instead of planning
those conversations again (a torn last line, from a crash, is ignored)."""
QUARANTINE_DIR = "quarantine"
NEXT_LINK = ".parts.next"
"""The link to a new generation, made before it replaces ``parts`` (crash debris otherwise)."""
GENERATION_PATTERN = re.compile(r"^\.parts-(\d{6,})$")
"""Names of generation directories (hidden: a plain dataset read of ``RUN_DIR`` skips them)."""
PART_PATTERN = re.compile(r"^part-(\d{6,})(?:-([0-9a-f]{64}))?\.parquet$")
"""Names of complete parts: ``part-NNNNNN-<sha256 of the file>.parquet``, or ``part-NNNNNN.parquet``
for a part written before version 3 (no digest)."""

ROW_SCHEMA = pa.schema(
    [
        pa.field("snapshot_id", pa.string(), nullable=False),
        pa.field("coalition_key", pa.string(), nullable=False),  # 64 hex chars, SHA-256
        pa.field("mask", pa.binary(), nullable=False),  # PackedMask.words, little-endian bits
        pa.field("n_bits", pa.int32(), nullable=False),  # number of players
        pa.field("absence_policy", pa.string(), nullable=False),  # policy id
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("utility", pa.float64(), nullable=False),  # in the run's utility unit (default nats)
        pa.field("evaluation_key", pa.string(), nullable=True),  # 64 hex chars: the measurement's key
        pa.field("token_logprobs", pa.list_(pa.float32()), nullable=True),  # [n_target] nats, teacher forcing
        pa.field("generated_texts", pa.list_(pa.string()), nullable=True),  # [num_samples] regenerated answers
        pa.field("elapsed_ms", pa.float64(), nullable=False),  # model time of the row's batch
        pa.field("cache_hit", pa.bool_(), nullable=False),
        pa.field("batch_size", pa.int32(), nullable=False),  # rows in the model call
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("tokens_computed", pa.int64(), nullable=True),  # positions run through the model
        pa.field("tokens_reused", pa.int64(), nullable=True),  # positions served from a prefix cache
        pa.field("batch_id", pa.int64(), nullable=True),  # model call that produced the row
        pa.field("run_id", pa.string(), nullable=True),  # the run (manifest "runs") that wrote it
        pa.field("game", pa.string(), nullable=True),  # "exact" or the proxy game ("kv-proxy-compact:<tail>"); null: exact
    ],
    metadata={"coalescence.schema_version": str(SCHEMA_VERSION)},
)
"""One row per evaluated coalition.

``coalition_key`` identifies the utility value (measurement and reduction: utility kind, answer
sub-span); ``evaluation_key`` identifies the model evaluation it was reduced from (the per-token
log-probabilities or the generated texts, which are stored with it), so rows of one evaluation
under other utilities are derived from it with no model call. ``game`` keeps the two fidelities apart:
``"exact"`` (or null, in parts written before proxy games) for the game whose values are reported,
``"kv-proxy-compact:<tail rule>"`` for rows of the shared-KV proxy game, which are only ever used to reduce
the variance of estimates of the exact game (their keys are the proxy game's own)."""

REQUIRED_COLUMNS = frozenset(f.name for f in ROW_SCHEMA if not f.nullable)
"""Columns every readable part has (version 1 parts lack some nullable ones)."""

LEGACY_COLUMNS = {"generation_text": pa.string()}
"""Columns that parts of older versions may hold besides ROW_SCHEMA's (dropped on read)."""


def part_name(index: int, digest: str | None = None) -> str:
    """File name of part ``index``: ``part-NNNNNN-<digest>.parquet`` (``part-NNNNNN.parquet`` without one)."""
    return f"part-{index:06d}-{digest}.parquet" if digest else f"part-{index:06d}.parquet"


def parse_part_name(name: str) -> tuple[int, str | None] | None:
    """``(index, sha256 hex or None)`` of a complete part's file name, or ``None`` for any other name."""
    match = PART_PATTERN.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def part_index(name: str) -> int | None:
    """The index of a complete part's file name, or ``None`` for any other name."""
    parsed = parse_part_name(name)
    return parsed[0] if parsed else None


def generation_name(number: int) -> str:
    """Name of generation directory ``number``: ``.parts-NNNNNN``."""
    return f".parts-{number:06d}"


def hidden(name: str) -> bool:
    """Whether pyarrow's dataset discovery skips ``name`` (it starts with ``.`` or ``_``)."""
    return name.startswith((".", "_"))


def schema_problem(schema: pa.Schema) -> str | None:
    """What makes a part's Arrow schema unreadable as archive rows, or ``None`` when it reads.

    Every column must be one of :data:`ROW_SCHEMA` (or :data:`LEGACY_COLUMNS`) with the same type,
    and every required column must be there: a foreign Parquet file with, say, integer coalition
    keys is refused rather than cast.
    """
    names = set(schema.names)
    missing = sorted(REQUIRED_COLUMNS - names)
    if missing:
        return f"it lacks the column(s) {', '.join(missing)}"
    for field in schema:
        want = ROW_SCHEMA.field(field.name).type if field.name in ROW_SCHEMA.names else LEGACY_COLUMNS.get(field.name)
        if want is None:
            return f"it has a column {field.name!r} that archive rows do not have"
        if not field.type.equals(want):
            return f"its column {field.name} is {field.type}, not {want}"
    return None
