"""The Parquet run archive: one row per evaluated coalition, plus a manifest."""

from .reader import read_manifest, read_pool, read_rows
from .schema import ROW_SCHEMA, SCHEMA_VERSION
from .writer import RunArchive

__all__ = ("ROW_SCHEMA", "SCHEMA_VERSION", "RunArchive", "read_manifest", "read_pool", "read_rows")
