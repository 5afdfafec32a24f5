"""Per shape of a ``--challenge`` run (``scripts/retune_rows.py``) or a ``tune --kernels`` run
on new shapes: the row's kernel before, the fastest challenger and torch, all screened in the
same run, and which one the table keeps now. BEFORE_CSV: the table before, or the untuned file.

    python3 benchmarks/challenge_summary.py BEFORE_CSV PROFILE_CSV AFTER_CSV [--prefix triton.gemv]

Times are the screen's (graph replay, cold L2, median) from the profile, so the three columns
of a line are comparable; ``x`` is the old row's kernel over the best challenger (> 1: the
challenger is faster), or torch's where the shape had no row before. Geomeans of ``x`` per M at
the end.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict

from gemmtune.tune.engine import challenges

KEY_END = "libtype"  # a GEMM table's key columns come before it, after arch, cu_num, gpu


def _rows(path: str) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("profile")
    parser.add_argument("after")
    parser.add_argument("--prefix", default="triton.gemv",
                        help="the challengers, as tune --kernels names them (prefixes or "
                             "patterns with wildcards, comma-separated)")
    args = parser.parse_args()
    patterns = tuple(args.prefix.split(","))
    columns, before = _rows(args.before)
    # A tuned table's key columns; an untuned file (no kernels before) is all key.
    key_names = columns[3:columns.index(KEY_END)] if KEY_END in columns else columns

    def key(row: dict) -> tuple:
        return tuple(row[c] for c in key_names)

    profiled = _rows(args.profile)[1]
    # The row the probe's GPU looked up: the model that timed the shape's own row where the
    # table has one (a table may hold H100 and H200 rows of one shape), else another model's.
    probed_on = {key(r): r.get("gpu", "") for r in profiled}
    old = {}
    for own in (False, True):
        old.update({key(r): r["kernelName"] for r in before if r.get("kernelName")
                    and (r.get("gpu", "") == probed_on.get(key(r))) == own})
    new = {key(r): r["kernelName"] for r in _rows(args.after)[1]}
    timed: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in profiled:
        if r["status"] == "ok":
            timed[key(r)][r["kernelName"]] = float(r["us"])
    ratios = defaultdict(list)
    print(f"{'shape':<34} {'old µs':>8} {'best new µs':>11} {'torch µs':>9} {'x':>6}  kept")
    for k, times in timed.items():
        challengers = {n: t for n, t in times.items() if challenges(n, patterns)}
        torch_us = min((t for n, t in times.items() if n.startswith("torch.")), default=math.nan)
        if k in old and old[k] not in times:
            print(f"{'x'.join(k[:3]):<34} the old kernel {old[k]} has no passing time here")
            continue
        base = times[old[k]] if k in old else torch_us
        if not challengers or math.isnan(base):
            continue
        best = min(challengers, key=challengers.get)
        x = base / challengers[best]
        ratios[k[0]].append(x)
        kept = "challenger" if challenges(new.get(k, ""), patterns) else \
            ("old" if new.get(k) == old.get(k) else new.get(k, "?"))
        print(f"{'x'.join(k[:3]):<34} {base:>8.2f} {challengers[best]:>11.2f} "
              f"{torch_us:>9.2f} {x:>6.3f}  {kept}  ({best})")
    for m in sorted(ratios, key=int):
        xs = ratios[m]
        print(f"M={m}: {len(xs)} shapes, old/challenger geomean "
              f"{math.exp(sum(map(math.log, xs)) / len(xs)):.3f} (min {min(xs):.3f}, "
              f"max {max(xs):.3f}); challenger faster on {sum(x > 1 for x in xs)}")


if __name__ == "__main__":
    main()
