"""Per shape of a ``w4_probe.py --all-times`` CSV, or of a tuner's profile (``gemmtune tune
-o2``), the best time of each value of one config field (e.g. ``W``, a w4frag program's warps;
``A``, w4deq's PTX decode; ``H``, the bytes L2 fetches a miss): which value of the field wins
where, and by how much, beside ``F.linear`` where the probe timed it.

    python3 benchmarks/probe_best_by.py w4probe_w4frag_warps_all.csv --field W --default 4 \
        --kernel triton.w4frag
    python3 benchmarks/probe_best_by.py profile.csv --field H --default 0 --kernel triton.frag
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import defaultdict


def field_value(config: str, field: str, default: str) -> str:
    """The value of ``field`` in a kernel name's dotted fields (``BM8.BK128...W2``), else
    ``default`` (a field left at its default is not written)."""
    fields = config.split(":", 1)[-1].split(".")
    for part in fields:
        match = re.fullmatch(rf"{re.escape(field)}(\d+)", part)
        if match:
            return match.group(1)
    return default


def best_by(rows, field: str, default: str, kernel: str):
    """{(M, N, K, x): ({value: (us, config)}, linear_us or nan)} over the rows of ``kernel``: a
    probe's (config, x, linear_us) or a tuner profile's (kernelName, dtype; its failed
    candidates left out)."""
    best = defaultdict(dict)
    linear = {}
    for row in rows:
        config = row.get("config") or row.get("kernelName") or ""
        if not config.startswith(kernel) or row.get("status", "ok") != "ok":
            continue
        shape = (int(row["M"]), int(row["N"]), int(row["K"]), row.get("x") or row.get("dtype", ""))
        value = field_value(config, field, default)
        us = float(row["us"])
        linear[shape] = float(row.get("linear_us") or "nan")
        if value not in best[shape] or us < best[shape][value][0]:
            best[shape][value] = (us, config)
    return {shape: (values, linear[shape]) for shape, values in best.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--field", required=True)
    parser.add_argument("--default", required=True, help="the field's value when not written")
    parser.add_argument("--kernel", default="", help="only configs whose names start so")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        table = best_by(csv.DictReader(f), args.field, args.default, args.kernel)
    values = sorted({v for found, _ in table.values() for v in found}, key=int)
    print("M x N x K (x) | F.linear | " + " | ".join(f"best {args.field}{v}" for v in values)
          + f" | best / best {args.field}{args.default}")
    for shape, (found, linear) in sorted(table.items()):
        cells = [f"{found[v][0]:.2f}" if v in found else "-" for v in values]
        best = min(us for us, _ in found.values())
        base = found.get(args.default, (float("nan"),))[0]
        print(f"{shape[0]} x {shape[1]} x {shape[2]} ({shape[3]}) | {linear:.2f} | "
              + " | ".join(cells) + f" | {best / base:.3f}")


if __name__ == "__main__":
    main()
