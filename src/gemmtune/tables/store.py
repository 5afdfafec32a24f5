"""Reading, validating, merging and atomically writing table files.

A bad row never silently turns into a wrong kernel: every value is parsed by its column's kind and
every problem is reported as ``path:line: what is wrong``. Writes go to a temporary file in the same
folder that is renamed over the target under a file lock, so a crash or a second writer can never
leave a half-written table or lose another writer's rows (``update_table`` re-reads under the lock).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import difflib
import hashlib
import io
import os
import stat
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from gemmtune import _env
from gemmtune.tables.schema import ARCH, CU_NUM, GPU, Column, Schema, format_value
from gemmtune.tables.values import BadValue


class TableError(ValueError):
    """A malformed table file or row; the message starts with ``path:line:``."""

    def __init__(self, path: str | os.PathLike, line: int, message: str):
        self.path = str(path)
        self.line = line
        super().__init__(f"{self.path}:{line}: {message}")


@dataclass(frozen=True)
class RowSource:
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Row:
    """One parsed row. ``key`` holds the shape columns (canonical values) as the family's key
    NamedTuple (``Schema.key_type``);
    ``results`` the parsed result columns (empty for untuned rows); ``extra`` unknown columns,
    kept verbatim so that rewriting a table never drops what another tool put there."""

    arch: str
    cu_num: int
    key: tuple
    results: Mapping[str, object] = field(default_factory=dict)
    extra: Mapping[str, str] = field(default_factory=dict)
    source: RowSource | None = None
    gpu: str = ""  # the GPU model it was measured on; "" for any model of this arch, cu_num

    @property
    def us(self) -> float:
        return float(self.results["us"])

    def kernel_names(self, schema: Schema) -> tuple[str, ...]:
        return tuple(str(self.results[c]) for c in schema.kernel_columns if self.results.get(c))


@dataclass
class TableRead:
    rows: list[Row]
    errors: list[TableError]


def _resolve_header(path, header: list[str], columns: Sequence[Column]):
    """Map each schema column to its index in ``header`` (or None when absent and defaulted)."""
    if not header or all(not h.strip() for h in header):
        raise TableError(path, 1, "empty header: the first line must name the columns")
    names = [h.strip() for h in header]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TableError(path, 1, f"column(s) {', '.join(dupes)} appear more than once")
    positions: dict[str, int | None] = {}
    missing = []
    for col in columns:
        found = next((names.index(n) for n in (col.name, *col.aliases) if n in names), None)
        if found is None and col.default is None:
            missing.append(col.name)
        positions[col.name] = found
    if missing:
        raise TableError(
            path, 1,
            f"missing required column(s) {', '.join(missing)}; the header has {', '.join(names)}",
        )
    known = {i for i in positions.values() if i is not None}
    extra = {names[i]: i for i in range(len(names)) if i not in known and names[i]}
    _warn_likely_misspellings(path, extra, [c for c in columns if positions[c.name] is None])
    return positions, extra


def _warn_likely_misspellings(path, extra: dict[str, int], defaulted: list[Column]) -> None:
    """An unknown column close to a column that took its default is most likely a misspelling
    (``out_dtype`` for ``outdtype``): say so, since the default is being used instead."""
    names = [c.name for c in defaulted]
    for unknown in extra:
        close = difflib.get_close_matches(unknown.lower(), [n.lower() for n in names], n=1,
                                          cutoff=0.75)
        if close:
            meant = next(n for n in names if n.lower() == close[0])
            warnings.warn(f"{path}:1: unknown column {unknown!r} is kept as an extra column and "
                          f"{meant!r} takes its default; rename it to {meant!r} if that is what "
                          f"it means", stacklevel=4)


def _columns(schema: Schema, untuned: bool) -> tuple[Column, ...]:
    if untuned:
        # Untuned tables (shapes to tune) have no device or result columns, but accept them.
        return (ARCH, dataclasses.replace(CU_NUM, default="0"), GPU) + schema.key
    return schema.tuned_columns


def parse_rows(text: str, path: str, schema: Schema, *, untuned: bool = False) -> TableRead:
    columns = _columns(schema, untuned)
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise TableError(path, 1, "the file is empty; a table needs at least a header line")
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    positions, extra_cols = _resolve_header(path, header, columns)
    rows: list[Row] = []
    errors: list[TableError] = []
    for cells in reader:
        line = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            errors.append(TableError(
                path, line, f"{len(cells)} values for {len(header)} columns; check for a missing "
                "or extra comma"))
            continue
        try:
            parsed = {}
            for col in columns:
                pos = positions[col.name]
                text_value = cells[pos] if pos is not None else col.default
                if text_value.strip() == "" and col.default is not None:
                    text_value = col.default
                try:
                    parsed[col.name] = col.parse(text_value)
                except BadValue as e:
                    raise TableError(path, line, f"column {col.name}: {e}") from None
            if not untuned:
                us = parsed["us"]
                if not (us >= 0.0 and us != float("inf")):
                    raise TableError(path, line, f"column us: {us!r} is not a finite time >= 0")
        except TableError as e:
            errors.append(e)
            continue
        rows.append(Row(
            arch=parsed["arch"],
            cu_num=parsed["cu_num"],
            gpu=parsed["gpu"],
            key=schema.make_key(parsed[n] for n in schema.key_names),
            results={c.name: parsed[c.name] for c in schema.result} if not untuned else {},
            extra={name: cells[i] for name, i in extra_cols.items()},
            source=RowSource(path, line),
        ))
    return TableRead(rows, errors)


def read_table(path: str | os.PathLike, schema: Schema, *, untuned: bool = False,
               strict: bool = True) -> TableRead:
    """Read one table. ``strict`` raises the first bad row; otherwise bad rows are collected in
    ``errors`` and the good rows returned (the tuner tunes what it can and reports the rest)."""
    path = str(path)
    try:
        # utf-8-sig: a byte-order mark from a spreadsheet export must not rename the first column.
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such table file") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder; expected a CSV table file") from None
    except UnicodeDecodeError as e:
        raise TableError(path, text_line_of(Path(path).read_bytes(), e.start),
                         f"not UTF-8 text (byte {e.start}); save the table as UTF-8 CSV") from None
    result = parse_rows(text, path, schema, untuned=untuned)
    if strict and result.errors:
        raise result.errors[0]
    return result


def check_writable(path: str | os.PathLike, what: str = "output") -> None:
    """ValueError naming ``path`` and the reason unless a file can be written there now: its
    folder exists or can be made, a file can be created in it, and an existing file is
    writable. Called before a long run, so that no work is lost to an unwritable output."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; name a file in it")
    _check_folder(path.parent, what, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {what} {path} (not writable); choose a writable place")


def check_writable_dir(path: str | os.PathLike, what: str = "output folder") -> None:
    """Like ``check_writable`` for a folder that files will be written into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; name a folder")
    _check_folder(path, what, path)


def _check_folder(folder: Path, what: str, named: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"cannot write {what} {named} ({e.strerror or e}); choose a writable "
                         f"place") from None


def text_line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def full_key(row: Row) -> tuple:
    """What makes a row unique in a table: its device (gpu included: one table may hold H100
    and H200 rows of one shape) and its key."""
    return (row.arch, row.cu_num, row.gpu) + row.key


@dataclass
class MergeResult:
    rows: list[Row]
    duplicates: list[tuple[Row, Row]]  # (kept, dropped)


def merge_rows(rows: Iterable[Row]) -> MergeResult:
    """Union of rows; on a duplicate key keep the lowest ``us`` (the first one on a tie).
    Untuned rows (no results) keep the first occurrence."""
    kept: dict[tuple, Row] = {}
    duplicates = []
    for row in rows:
        k = full_key(row)
        old = kept.get(k)
        if old is None:
            kept[k] = row
            continue
        if row.results and old.results and row.us < old.us:
            kept[k] = row
            duplicates.append((row, old))
        else:
            duplicates.append((old, row))
    return MergeResult(list(kept.values()), duplicates)


def warn_duplicates(duplicates: list[tuple[Row, Row]], what: str) -> None:
    """One warning for all duplicates of a merge, naming a few so the user can find them."""
    if not duplicates:
        return
    shown = "; ".join(
        f"{dropped.source} (us={dropped.results.get('us', '-')}) duplicates {kept.source} "
        f"(us={kept.results.get('us', '-')})" for kept, dropped in duplicates[:3])
    more = f" and {len(duplicates) - 3} more" if len(duplicates) > 3 else ""
    warnings.warn(
        f"{what}: {len(duplicates)} duplicate key(s), kept the lowest us: {shown}{more}",
        stacklevel=3,
    )


def _header(schema: Schema, rows: Sequence[Row], untuned: bool) -> list[str]:
    names = list(schema.key_names) if untuned else [c.name for c in schema.tuned_columns]
    for row in rows:
        for name in row.extra:
            if name not in names:
                names.append(name)
    return names


def render_rows(schema: Schema, rows: Sequence[Row], *, untuned: bool = False) -> str:
    header = _header(schema, rows, untuned)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    kinds = {c.name: c.kind for c in schema.tuned_columns}
    for row in rows:
        values = {"arch": row.arch, "cu_num": row.cu_num, "gpu": row.gpu,
                  **dict(zip(schema.key_names, row.key)),
                  **row.results}
        writer.writerow([
            format_value(kinds[n], values[n]) if n in values and n in kinds else row.extra.get(n, "")
            for n in header
        ])
    return out.getvalue()


def lock_for(path: str | os.PathLike) -> FileLock:
    """The lock every writer of ``path`` takes, kept in the lock folder (``_env.table_lock_dir``)
    rather than beside the file: named after the file's resolved path, so every process that
    writes the file finds the same lock."""
    real = os.path.realpath(path)
    digest = hashlib.sha1(real.encode()).hexdigest()[:16]
    folder = _env.table_lock_dir()
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user, like /tmp
            os.chmod(folder, 0o1777)
    return FileLock(folder / f"{digest}-{os.path.basename(real)}.lock", timeout=120, mode=0o666)


def _file_mode_for(path: Path) -> int:
    """The mode a written file gets: the file's own where it exists, else what a plain
    ``open`` would give (0o666 less the umask), never the 0o600 of a temporary file."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only
    be read by setting it, which another thread could see)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` by renaming a fully written temporary file over it; call under
    the path's lock. A reader sees the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), _file_mode_for(path))
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_table(path: str | os.PathLike, schema: Schema, rows: Sequence[Row], *,
                untuned: bool = False) -> None:
    with lock_for(path):
        atomic_write_text(path, render_rows(schema, rows, untuned=untuned))


def update_table(path: str | os.PathLike, schema: Schema, new_rows: Iterable[Row], *,
                 untuned: bool = False, replace: bool = True) -> list[Row]:
    """Add ``new_rows`` to the table at ``path`` under its lock and return the rows written.
    ``replace``: a new row replaces an existing one with the same key (a retune); otherwise the
    lower ``us`` wins. Rows written by other processes meanwhile are kept: the file is re-read
    under the lock."""
    path = Path(path)
    with lock_for(path):
        existing = read_table(path, schema, untuned=untuned).rows if path.exists() else []
        if replace:
            new = list(new_rows)
            new_keys = {full_key(r) for r in new}
            merged = [r for r in existing if full_key(r) not in new_keys] + new
        else:
            merged = merge_rows([*existing, *new_rows]).rows
        atomic_write_text(path, render_rows(schema, merged, untuned=untuned))
    return merged
