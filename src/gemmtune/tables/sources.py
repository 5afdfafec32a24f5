"""Which table files are in force for a family, and their merge.

Order: the shipped table (``configs/<tuned_file>``), then ``configs/model_configs/`` files of the
family, then the user's overlays from ``GEMMTUNE_CONFIG_<FAMILY>`` (colon-separated). Overlays
add to the shipped tables; an overlay path prefixed ``replace:`` (or ``GEMMTUNE_CONFIG_REPLACE=1``)
drops the shipped and model tables instead. Reading never writes: ``write_merged`` (what
``gemmtune tables`` calls) puts the merged table in the cache folder for inspection
(``$GEMMTUNE_CACHE_DIR/merged/``); sources are never rewritten.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gemmtune import _env
from gemmtune.tables.schema import Schema
from gemmtune.tables.store import (Row, atomic_write_text, lock_for, merge_rows, read_table,
                                   render_rows, warn_duplicates)

REPLACE_PREFIX = "replace:"


def configs_dir() -> Path:
    return Path(str(resources.files("gemmtune") / "configs"))


@dataclass(frozen=True)
class TableSources:
    paths: tuple[Path, ...]
    replaced_shipped: bool


def shipped_paths(schema: Schema) -> list[Path]:
    base = configs_dir()
    paths = [base / schema.tuned_file] if (base / schema.tuned_file).exists() else []
    model_dir = base / "model_configs"
    if model_dir.is_dir():
        paths += sorted(
            p for p in model_dir.iterdir()
            if fnmatch.fnmatch(p.name, schema.model_config_glob) and "untuned" not in p.name
        )
    return paths


def overlay_paths(schema: Schema) -> tuple[list[Path], bool]:
    """The user's overlay files and whether they replace the shipped tables."""
    value = _env.table_overlay(schema.env_names)
    replace = False
    paths = []
    for part in (value or "").split(":"):
        part = part.strip()
        if part == REPLACE_PREFIX[:-1]:
            # "replace:/path" split on ":" leaves a bare "replace" token before its path.
            replace = True
            continue
        if not part:
            continue
        path = Path(part).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"{schema.env_names[0]} names {path}, which does not exist; fix the variable "
                f"or create the table")
        paths.append(path)
    # GEMMTUNE_CONFIG_REPLACE=1 applies to the families that have an overlay: a family the user
    # gave no table for keeps its shipped rows rather than losing all of them.
    return paths, replace or (bool(paths) and _env.replace_shipped_tables())


def table_sources(schema: Schema) -> TableSources:
    overlays, replace = overlay_paths(schema)
    base = [] if replace else shipped_paths(schema)
    return TableSources(tuple(base + overlays), replace)


def load_merged(schema: Schema, paths: list[Path] | None = None) -> list[Row]:
    """All rows in force for the family (or in ``paths``, if given), duplicates resolved to the
    lowest ``us`` (one warning)."""
    rows: list[Row] = []
    for path in table_sources(schema).paths if paths is None else paths:
        rows += read_table(path, schema).rows
    merged = merge_rows(rows)
    warn_duplicates(merged.duplicates, f"{schema.family} tables")
    return merged.rows


def merged_cache_path(schema: Schema) -> Path:
    return _env.cache_dir() / "merged" / schema.tuned_file


def write_merged(schema: Schema) -> Path | None:
    """Write the family's merged table to the cache folder (atomically, under its lock) and
    return its path; None when no table is in force. OSError if the folder is not writable."""
    if not table_sources(schema).paths:
        return None
    path = merged_cache_path(schema)
    text = render_rows(schema, load_merged(schema))
    if not (path.exists() and path.read_text(encoding="utf-8") == text):
        with lock_for(path):
            atomic_write_text(path, text)
    return path
