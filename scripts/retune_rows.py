"""Tune again, in place, the rows of a tuned table whose kernel names start with a prefix
(``--kernel``; default every row) and whose M is one of ``--m`` (default any), on those rows'
shapes alone, so every other row of the table is kept as it is (the tuned rows move to the
table's end). Either with the backends given (``--libtype``: ``gemmtune tune --all``), or
against a new kernel (``--challenge PREFIX``: ``gemmtune tune --kernels PREFIX``, the rows'
own kernels re-timed beside that kernel's configs and torch's):

    python3 scripts/retune_rows.py bf16 --kernel torch. --libtype torch,cublaslt -- --mp 8
    python3 scripts/retune_rows.py bf16 --m 1,16 --challenge triton.gemv -- --mp 8

(flags after ``--`` go to ``gemmtune tune``).

What it is for: rows that won before a change to the tuner's choice (e.g. its tie order) and
that only some backends could now replace, or before a kernel existed. With ``--libtype`` the
rows' own backend must be among those given: their kernel competes again, so a row changes
only for one the tuner measures as fast (its tie rule deciding between equals). Resumable like
any ``--all`` run: the same command after an interruption skips the shapes it finished.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

from gemmtune.device import current_device
from gemmtune.families import get_family
from gemmtune.tables.sources import configs_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", help="table family (bf16, a8w8, a8w8-blockscale, ...)")
    parser.add_argument("--kernel", default="",
                        help="retune the rows whose kernelName starts with this (default: all)")
    parser.add_argument("--m", type=_ms, default=None, metavar="M,M",
                        help="only the rows of these M (default: every M)")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--libtype",
                     help="backends to try (gemmtune tune --libtype), the rows' own included")
    how.add_argument("--challenge", metavar="PREFIX,...",
                     help="kernel-name prefixes to try against the rows' own kernels "
                          "(gemmtune tune --kernels)")
    parser.add_argument("--table", type=Path,
                        help="tuned table to update (default: the family's shipped table)")
    parser.add_argument("--work", type=Path, default=Path("out/retune"),
                        help="folder for the shapes file and the profile (default out/retune)")
    argv = sys.argv[1:] if argv is None else argv
    ours, tune_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = parser.parse_args(ours)

    schema = get_family(args.family).schema
    table = args.table or configs_dir() / schema.tuned_file
    device = current_device()
    with open(table, newline="", encoding="utf-8") as f:
        chosen = [row for row in csv.DictReader(f)
                  if _names(row, schema, args.kernel) and _of(device, row)
                  and (args.m is None or int(row[schema.key_names[schema.m_index]]) in args.m)]
    keys = sorted({tuple(row[name] for name in schema.key_names) for row in chosen})
    missing = {row.get("libtype") or "?" for row in chosen} - set((args.libtype or "").split(","))
    if args.libtype and missing:
        parser.error(f"--libtype {args.libtype} lacks {', '.join(sorted(missing))}, the backend "
                     f"of rows to tune: each must be able to keep its own kernel")
    if not keys:
        print(f"{table}: no row of {device} names a kernel starting with {args.kernel!r}"
              f"{f' at M in {sorted(args.m)}' if args.m else ''}; nothing to do")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    shapes = args.work / f"{schema.family}_retune_shapes.csv"
    with open(shapes, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(schema.key_names)
        writer.writerows(keys)
    how = (["--all", "--libtype", args.libtype] if args.libtype
           else ["--kernels", args.challenge])
    print(f"{table}: {len(keys)} rows name {args.kernel or ''}*; tuning them with "
          f"{' '.join(how)}")
    return subprocess.call([
        sys.executable, "-m", "gemmtune.cli", "tune", args.family, "-i", str(shapes),
        "-o", str(table), "-o2", str(args.work / f"{schema.family}_retune_profile.csv"),
        *how, *tune_args])


def _ms(text: str) -> set[int]:
    try:
        return {int(v) for v in text.split(",") if v.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of M, e.g. 1,16")


def _names(row: dict, schema, prefix: str) -> bool:
    """Whether one of the row's kernel columns (kernelName; fmoe's kernelName1 and 2) starts
    with ``prefix``."""
    return any((row.get(column) or "").startswith(prefix) for column in schema.kernel_columns)


def _of(device, row: dict) -> bool:
    """Whether a table row was tuned on this GPU: its arch, CU count and name (rows of others,
    or of no name, are left alone: the tuner writes rows under this GPU's name, so tuning their
    shapes here would add rows, not replace them)."""
    return (row.get("arch") == device.arch and row.get("cu_num") == str(device.cu_num)
            and row.get("gpu", "") == device.gpu)


if __name__ == "__main__":
    sys.exit(main())
