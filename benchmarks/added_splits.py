"""From a tune profile: per shape, the best time of the split configs whose splits add their
partials (``.R1``) against the best of the same kernel's split configs that sum them in order,
for ``triton.ring`` and ``triton.frag`` (issue 15: what the cheaper split sum buys).

    python3 benchmarks/added_splits.py PROFILE_CSV [PROFILE_CSV ...]
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict


def main() -> None:
    best: dict[tuple, dict[str, float]] = defaultdict(dict)
    for path in sys.argv[1:]:
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                name = row["kernelName"]
                if row["status"] != "ok" or not name.startswith(("triton.ring:", "triton.frag:")):
                    continue
                fields = name.split(":", 1)[1].split(".")
                split = next(int(f[2:]) for f in fields if f.startswith("SK"))
                if split == 1:
                    continue
                way = "added" if "R1" in fields[-1:] else "ordered"
                shape = (row["M"], row["N"], row["K"], name.split(":")[0])
                us = float(row["us"])
                best[shape][way] = min(best[shape].get(way, math.inf), us)
    ratios = defaultdict(list)
    print(f"{'shape':<28} {'kernel':<12} {'ordered µs':>10} {'added µs':>9} {'x':>6}")
    for (m, n, k, kernel), ways in sorted(best.items(), key=lambda kv: (int(kv[0][0]),
                                                                         int(kv[0][1]))):
        if len(ways) < 2:
            continue
        x = ways["ordered"] / ways["added"]
        ratios[(m, kernel)].append(x)
        print(f"{m}x{n}x{k:<18} {kernel:<12} {ways['ordered']:>10.2f} {ways['added']:>9.2f} "
              f"{x:>6.3f}")
    for (m, kernel), xs in sorted(ratios.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        print(f"M={m} {kernel}: {len(xs)} shapes, ordered/added geomean "
              f"{math.exp(sum(map(math.log, xs)) / len(xs)):.3f} (min {min(xs):.3f}, "
              f"max {max(xs):.3f})")


if __name__ == "__main__":
    main()
