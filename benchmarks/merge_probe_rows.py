"""Copy a probe's tuned rows (``gpu_session.sh probe:...``'s ``tuned.csv``, tuned on one GPU
model) into a shipped table: each replaces the row of the same device (arch, SM count, GPU
model) and shape, or is added; the other rows are kept. The probe files are read as tables
(a bad row stops it, naming its file and line), the table rewritten under its lock.

    PYTHONPATH=src python3 benchmarks/merge_probe_rows.py a8w8-blockscale \\
        out/probe_blockscale_m64/tuned.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemmtune.families import get_family
from gemmtune.tables.sources import configs_dir
from gemmtune.tables.store import full_key, read_table, update_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", help="table family (bf16, a8w8, a8w8-blockscale, ...)")
    parser.add_argument("tuned", type=Path, nargs="+", help="the probes' tuned.csv files")
    parser.add_argument("--table", type=Path,
                        help="tuned table to update (default: the family's shipped table)")
    args = parser.parse_args(argv)
    schema = get_family(args.family).schema
    table = args.table or configs_dir() / schema.tuned_file
    probed = [row for path in args.tuned for row in read_table(path, schema).rows]
    before = {full_key(row) for row in read_table(table, schema).rows}
    update_table(table, schema, probed, replace=True)
    replaced = sum(full_key(row) in before for row in probed)
    print(f"{table}: {replaced} rows replaced, {len(probed) - replaced} added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
