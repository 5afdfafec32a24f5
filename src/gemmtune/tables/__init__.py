"""Table formats (schema), files (store), their merge (sources), look-up and shape capture."""

from gemmtune.tables.lookup import Rule, TableIndex, coarse_m, padded_m
from gemmtune.tables.schema import Column, Kind, Schema
from gemmtune.tables.store import Row, TableError, read_table, update_table, write_table

__all__ = [
    "Column", "Kind", "Schema", "Row", "TableError", "read_table", "write_table", "update_table",
    "Rule", "TableIndex", "padded_m", "coarse_m",
]
