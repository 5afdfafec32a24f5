"""Copy a probe's tuned rows (``gpu_session.sh probe:...``'s ``tuned.csv``, tuned on one GPU
model) into a shipped table: each replaces the row of the same GPU model and key, or is added
at the end; rows of other GPU models and keys are kept as they are.

    python3 benchmarks/merge_probe_rows.py a8w8-blockscale out/probe_blockscale_m64/tuned.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from gemmtune.families import get_family
from gemmtune.tables.sources import configs_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", help="table family (bf16, a8w8, a8w8-blockscale, ...)")
    parser.add_argument("tuned", type=Path, nargs="+", help="the probes' tuned.csv files")
    args = parser.parse_args(argv)
    schema = get_family(args.family).schema
    table = configs_dir() / schema.tuned_file
    key = ("gpu",) + schema.key_names
    with open(table, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = list(reader)
    index = {tuple(r[c] for c in key): i for i, r in enumerate(rows)}
    replaced = added = 0
    for path in args.tuned:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != header:
                sys.exit(f"{path}: its columns are not {table.name}'s; was it tuned for "
                         f"{args.family}?")
            for row in reader:
                k = tuple(row[c] for c in key)
                if k in index:
                    rows[index[k]] = row
                    replaced += 1
                else:
                    index[k] = len(rows)
                    rows.append(row)
                    added += 1
    tmp = table.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, header, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(table)
    print(f"{table}: {replaced} rows replaced, {added} added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
