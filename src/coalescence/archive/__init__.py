"""The Parquet run archive: one row per evaluated coalition, a manifest, resume and replay."""

from .reader import archive_info, list_parts, read_manifest, read_pool, read_rows, read_utilities
from .schema import ROW_SCHEMA, SCHEMA_VERSION
from .writer import RunArchive, compact

__all__ = (
    "ROW_SCHEMA",
    "SCHEMA_VERSION",
    "RunArchive",
    "archive_info",
    "compact",
    "list_parts",
    "read_manifest",
    "read_pool",
    "read_rows",
    "read_utilities",
)
