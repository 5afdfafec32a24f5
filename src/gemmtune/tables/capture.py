"""Shape capture: with ``GEMMTUNE_TUNE_GEMM=1`` every op records each new shape it meets.

Each process appends to its own shard file (``<capture dir>/<family>/<host>-<pid>.csv``), one line
per new shape, so there is no rewrite per call and no lost row with many processes.
``merge_captures`` folds the shards into each family's untuned CSV under the table's lock.
Recording happens on a dispatch-cache miss only, i.e. once per shape per process: with capture off
the hot path does not even read the variable.
"""

from __future__ import annotations

import csv
import io
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from gemmtune import _env
from gemmtune.tables.schema import Family, Schema, format_value, schema_for
from gemmtune.tables.store import TableError, Row, merge_rows, parse_rows, update_table


def _csv_line(values: list[str]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()


def shard_path(schema: Schema, capture_dir: Path | None = None) -> Path:
    base = capture_dir or _env.capture_dir()
    return base / schema.family.value / f"{socket.gethostname()}-{os.getpid()}.csv"


def record_shape(schema: Schema, key: tuple, capture_dir: Path | None = None) -> None:
    """Append one shape to this process's shard. A single ``O_APPEND`` write of one short line,
    so a crash can at worst truncate the last line, which the merge reports and skips."""
    path = shard_path(schema, capture_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds = [c.kind for c in schema.key]
    line = _csv_line([format_value(k, v) for k, v in zip(kinds, key)])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if os.fstat(fd).st_size == 0:
            line = _csv_line(list(schema.key_names)) + line
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclass
class MergeReport:
    family: Family
    output: Path
    shards: int
    new_shapes: int
    total_shapes: int
    errors: list[TableError]


def merge_captures(capture_dir: Path, out_dir: Path, *, remove_shards: bool = True
                   ) -> list[MergeReport]:
    """Fold every family's shards under ``capture_dir`` into ``out_dir/<untuned file>``, keeping
    the rows already there. Shards are removed only after the merged table is safely written."""
    reports = []
    if not capture_dir.is_dir():
        return reports
    for family_dir in sorted(p for p in capture_dir.iterdir() if p.is_dir()):
        try:
            schema = schema_for(family_dir.name)
        except ValueError:
            continue
        shards = sorted(family_dir.glob("*.csv"))
        rows: list[Row] = []
        errors: list[TableError] = []
        for shard in shards:
            text = shard.read_text(encoding="utf-8")
            if not text.strip():
                continue
            read = parse_rows(text, str(shard), schema, untuned=True)
            rows += read.rows
            errors += read.errors
        unique = merge_rows(rows).rows
        out = out_dir / schema.untuned_file
        before = _count_rows(out, schema)
        written = update_table(out, schema, unique, untuned=True, replace=False)
        if remove_shards:
            for shard in shards:
                shard.unlink(missing_ok=True)
        reports.append(MergeReport(schema.family, out, len(shards), len(written) - before,
                                   len(written), errors))
    return reports


def _count_rows(path: Path, schema: Schema) -> int:
    if not path.exists():
        return 0
    return len(parse_rows(path.read_text(encoding="utf-8"), str(path), schema, untuned=True).rows)
