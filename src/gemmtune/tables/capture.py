"""Shape capture: with ``GEMMTUNE_TUNE_GEMM=1`` every op records each new shape it meets.

Each process appends to its own shard file (``<capture dir>/<family>/<host>-<pid>.csv``), one line
per new shape, so there is no rewrite per call and no lost row with many processes.
``merge_captures`` folds the shards into each family's untuned CSV under the table's lock.
Recording happens on a dispatch-cache miss only, i.e. once per shape per process: with capture off
the hot path does not even read the variable.
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from gemmtune import _env
from collections.abc import Mapping

from gemmtune.tables.schema import Schema, format_value
from gemmtune.tables.store import TableError, Row, merge_rows, parse_rows, update_table


def _csv_line(values: list[str]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()


def shard_path(schema: Schema, capture_dir: Path | None = None) -> Path:
    base = capture_dir or _env.capture_dir()
    return base / schema.family / f"{socket.gethostname()}-{os.getpid()}.csv"


_append_lock = threading.Lock()


def record_shape(schema: Schema, key: tuple, capture_dir: Path | None = None) -> None:
    """Append one shape to this process's shard: one ``O_APPEND`` write of one short line (a
    crash can at worst truncate the last line, which the merge reports and skips).

    A merge renames shards away while processes may still append. The writer therefore holds an
    ``flock`` on the shard while it writes and checks, under the lock, that the file it opened is
    still the one at the shard's path; the merge takes the same lock after renaming, so it reads
    only once any write into the renamed file has finished. The thread lock keeps two threads of
    one process from both writing the header of a new shard."""
    path = shard_path(schema, capture_dir)
    kinds = [c.kind for c in schema.key]
    line = _csv_line([format_value(k, v) for k, v in zip(kinds, key)])
    with _append_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not _is_current(fd, path):
                    continue  # renamed by a merge between open and lock: open the new shard
                text = line if os.fstat(fd).st_size else _csv_line(list(schema.key_names)) + line
                os.write(fd, text.encode())
                return
            finally:
                os.close(fd)  # also releases the flock


def _is_current(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_when_no_writer(shard: Path) -> str:
    with open(shard, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        return f.read().decode("utf-8", errors="replace")


@dataclass
class MergeReport:
    family: str
    output: Path
    shards: int
    new_shapes: int
    total_shapes: int
    errors: list[TableError]


def merge_captures(capture_dir: Path, out_dir: Path, schemas: Mapping[str, Schema], *,
                   remove_shards: bool = True) -> list[MergeReport]:
    """Fold the shards under ``capture_dir`` of every family in ``schemas`` (by name) into
    ``out_dir/<untuned file>``, keeping the rows already there. Shards are removed only after the
    merged table is safely written; folders of families not in ``schemas`` are left alone."""
    reports = []
    if not capture_dir.is_dir():
        return reports
    for family_dir in sorted(p for p in capture_dir.iterdir() if p.is_dir()):
        schema = schemas.get(family_dir.name)
        if schema is None:
            continue
        # Take each shard out of its writer's way first: a process still capturing reopens its
        # shard by name and starts a new one, so no line is appended between read and delete.
        # Files left ".merging" by an interrupted merge are picked up here too.
        for shard in family_dir.glob("*.csv"):
            shard.rename(shard.with_name(f"{shard.name}.{os.getpid()}.merging"))
        shards = sorted(family_dir.glob("*.merging"))
        if not shards:
            continue
        rows: list[Row] = []
        errors: list[TableError] = []
        for shard in shards:
            text = _read_when_no_writer(shard)
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
