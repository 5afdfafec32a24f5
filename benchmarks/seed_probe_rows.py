"""Seed a probe's scratch table with the shipped rows this GPU looks up exactly for the probe's
shapes (its own model's rows), so that ``tune --kernels`` challenges each row: the row's own
kernel is timed beside the challengers even where the candidates no longer offer its config
(the engine's incumbent). Shapes without such a row are left to the probe's old-kernel list.
Does nothing if OUT exists (a resumed probe keeps its rows).

    PYTHONPATH=src python3 benchmarks/seed_probe_rows.py a8w8-blockscale \\
        benchmarks/probe_shapes/blockscale_m64.csv out/probe_blockscale_m64/tuned.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemmtune.device import current_device
from gemmtune.families import get_family
from gemmtune.tables.sources import configs_dir
from gemmtune.tables.store import read_table, write_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family")
    parser.add_argument("shapes", type=Path, help="the probe's untuned file")
    parser.add_argument("out", type=Path, help="the probe's scratch table (not overwritten)")
    parser.add_argument("--table", type=Path, help="default: the family's shipped table")
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"{args.out}: exists, kept")
        return 0
    schema = get_family(args.family).schema
    table = args.table or configs_dir() / schema.tuned_file
    device = current_device()
    wanted = {row.key for row in read_table(args.shapes, schema, untuned=True).rows}
    seeded = [row for row in read_table(table, schema).rows
              if (row.arch, row.cu_num, row.gpu) == (device.arch, device.cu_num, device.gpu)
              and row.key in wanted]
    if seeded:
        write_table(args.out, schema, seeded)
    print(f"{args.out}: {len(seeded)} of {len(wanted)} shapes seeded with {device}'s rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
