"""Do two `gemmtune bench` runs of the same shapes agree within noise? (before/after a change)

    python benchmarks/compare_benches.py BEFORE.csv AFTER.csv [--label NAME]

Per M range: the geometric mean of after/before for the tuned op's time and for torch's (torch
runs the same code in both runs, so its ratio is the run-to-run noise the tuned ratio is judged
against), the largest deviation of each, the speed-up geomeans of both runs, and the shapes
whose dispatched kernel differs (a change that should not change behaviour has none). Then,
per M range and M, the attainable efficiency (floor / time, each capped at 1.0 as the bench
counts it) of the tuned op before and after: geomean (min).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics

M_RANGES = (("M<=64", 1, 64), ("64<M<1024", 65, 1023), ("M>=1024", 1024, 1 << 62))


def read(path: str) -> dict[tuple, dict]:
    with open(path, newline="") as f:
        return {(r["name"], int(r["M"]), int(r["N"]), int(r["K"])): r for r in csv.DictReader(f)}


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def _speedup(run: dict[tuple, dict], shapes: list[tuple]) -> str:
    """Speed-up geomean over the shapes where torch ran a fast kernel (as the bench reports)."""
    fast = [float(run[s]["speedup"]) for s in shapes if run[s]["torch_is_reference"] != "True"]
    return f"{geomean(fast):.3f}" if fast else "n/a"


def _efficiency(run: dict[tuple, dict], shapes: list[tuple]) -> str:
    """Attainable efficiency of the tuned op, geomean (min), each capped at 1.0."""
    eff = [min(1.0, float(run[s]["attainable_efficiency"])) for s in shapes]
    return f"{geomean(eff):.3f} ({min(eff):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--label", default="")
    args = p.parse_args()
    before, after = read(args.before), read(args.after)
    shared = sorted(set(before) & set(after), key=lambda s: (s[1], s[2], s[3]))
    missing = set(before) ^ set(after)
    print(f"{'preset':<16} {'M range':<10} {'shapes':>6} {'tuned a/b':>9} {'(max dev)':>9} "
          f"{'torch a/b':>9} {'(max dev)':>9} {'speed-up b':>10} {'speed-up a':>10} "
          f"{'kernel differs':>14}")
    for label, lo, hi in M_RANGES:
        sel = [s for s in shared if lo <= s[1] <= hi]
        if not sel:
            continue
        tuned = [float(after[s]["tuned_us"]) / float(before[s]["tuned_us"]) for s in sel]
        torch = [float(after[s]["torch_us"]) / float(before[s]["torch_us"]) for s in sel]
        differs = [s for s in sel if after[s]["kernel"] != before[s]["kernel"]]
        print(f"{args.label:<16} {label:<10} {len(sel):>6} {geomean(tuned):>9.3f} "
              f"{max(abs(t - 1) for t in tuned):>9.3f} {geomean(torch):>9.3f} "
              f"{max(abs(t - 1) for t in torch):>9.3f} "
              f"{_speedup(before, sel):>10} {_speedup(after, sel):>10} {len(differs):>14}")
        for s in differs:
            print(f"    kernel differs at {s}: {before[s]['kernel']} -> {after[s]['kernel']}")
    print(f"{'':<16} {'M':<10} {'shapes':>6} {'efficiency before':>19} {'after':>15}")
    ranges = [(label, lo, hi) for label, lo, hi in M_RANGES] + \
        [(f"M={m}", m, m) for m in sorted({s[1] for s in shared if s[1] <= 64})]
    for label, lo, hi in ranges:
        sel = [s for s in shared if lo <= s[1] <= hi]
        if sel:
            print(f"{args.label:<16} {label:<10} {len(sel):>6} {_efficiency(before, sel):>19} "
                  f"{_efficiency(after, sel):>15}")
    bad = [s for s in shared if after[s]["ok"] != "True"]
    if missing or bad:
        print(f"    shapes in one run only: {sorted(missing)}; wrong after: {bad}")


if __name__ == "__main__":
    main()
