"""The run archive's layout and Parquet schema.

A run directory holds::

    RUN_DIR/
      manifest.json              schema version, runs (config, model, utility, absence policy),
                                 snapshots, package version, created/updated times
      .lock                      held (OS file lock) by the one process writing the run
      parts/part-000000.parquet  zstd Parquet, one row per evaluated coalition (ROW_SCHEMA)
      parts/part-000001.parquet  ...

A part is written whole under a temporary name (``parts/.part-NNNNNN.parquet.tmp``), flushed to
disk and renamed into place, so a reader never sees a half-written part; leftover temporary files
are crash debris and are discarded on resume. Each coalition key appears at most once in what a
reader returns (duplicates, possible only after a crash between writing a compacted part and
removing the parts it replaces, are dropped on read, first occurrence wins). The parts read as one
dataset with pyarrow, pandas or DuckDB (``pyarrow.dataset.dataset(RUN_DIR / "parts")``).
"""

from __future__ import annotations

import re

import pyarrow as pa

__all__ = (
    "LOCK_NAME",
    "MANIFEST_NAME",
    "PARTS_DIR",
    "PART_PATTERN",
    "REQUIRED_COLUMNS",
    "ROW_SCHEMA",
    "SCHEMA_VERSION",
    "part_index",
    "part_name",
)

SCHEMA_VERSION = 2
"""Version of the manifest and row schema; a reader refuses a newer one.

Version 2 added ``evaluation_key``, ``token_logprobs`` and ``generated_texts`` (replacing the
never-written ``generation_text``); parts of version 1 read with those columns null."""

MANIFEST_NAME = "manifest.json"
PARTS_DIR = "parts"
LOCK_NAME = ".lock"
PART_PATTERN = re.compile(r"^part-(\d{6,})\.parquet$")
"""Names of complete parts; nothing else under ``parts/`` is read."""

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
    ],
    metadata={"coalescence.schema_version": str(SCHEMA_VERSION)},
)
"""One row per evaluated coalition.

``coalition_key`` identifies the utility value (measurement and reduction: utility kind, answer
sub-span); ``evaluation_key`` identifies the model evaluation it was reduced from (the per-token
log-probabilities or the generated texts, which are stored with it), so rows of one evaluation
under other utilities are derived from it with no model call."""

REQUIRED_COLUMNS = frozenset(f.name for f in ROW_SCHEMA if not f.nullable)
"""Columns every readable part has (version 1 parts lack some nullable ones)."""


def part_name(index: int) -> str:
    """File name of part ``index``: ``part-NNNNNN.parquet``."""
    return f"part-{index:06d}.parquet"


def part_index(name: str) -> int | None:
    """The index of a complete part's file name, or ``None`` for any other name."""
    match = PART_PATTERN.match(name)
    return int(match.group(1)) if match else None
