"""A short table of an Nsight Compute raw-page CSV (``ncu --import R --csv --page raw``): per
profiled launch its time, DRAM read rate and share of peak, issue-slot use, achieved
occupancy, registers, and the largest stall reasons (warps stalled per issued instruction).

    python3 benchmarks/ncu_summary.py report.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from typing import NamedTuple

STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# (label, metric) columns of the table, as the raw page names them
COLUMNS = (
    ("us", "gpu__time_duration.sum"),
    ("dram%", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("sm%", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("l2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("regs", "launch__registers_per_thread"),
    ("cyc/inst", "smsp__average_warp_latency_per_inst_issued.ratio"),
)
DRAM_READ = "dram__bytes_read.sum"
TIME_SCALE_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                    "msecond": 1e3}
BYTES_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6,
               "GB": 1e9}


class Launch(NamedTuple):
    kernel: str
    grid: str
    values: dict  # metric -> (value, unit)


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_launches(path: str) -> list[Launch]:
    """The profiled launches of a raw-page CSV: a header of metric names, a row of units, then
    a row a launch (lines before the header, such as ncu's own messages, skipped)."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f)]
    start = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Kernel Name' header: not an ncu raw-page CSV")
    names, units = rows[start], rows[start + 1]
    launches = []
    for row in rows[start + 2:]:
        if len(row) != len(names):
            continue
        cells = dict(zip(names, zip(row, units)))
        launches.append(Launch(cells["Kernel Name"][0], cells.get("Grid Size", ("", ""))[0],
                               {n: (number(v), u) for n, (v, u) in cells.items()}))
    return launches


def time_us(launch: Launch) -> float | None:
    value, unit = launch.values.get("gpu__time_duration.sum", (None, ""))
    return None if value is None else value * TIME_SCALE_TO_US.get(unit, float("nan"))


def dram_read_gbs(launch: Launch) -> float | None:
    value, unit = launch.values.get(DRAM_READ, (None, ""))
    us = time_us(launch)
    if value is None or not us:
        return None
    return value * BYTES_SCALE.get(unit, float("nan")) / (us * 1e3)


def tensor_pct(launch: Launch) -> float | None:
    """The busiest tensor pipe's share of its peak (ComputeWorkloadAnalysis's pipe metrics:
    the warpgroup MMA's on Hopper), where the report has one."""
    shares = [v for n, (v, _) in launch.values.items()
              if "pipe_tensor" in n and n.endswith("pct_of_peak_sustained_active") and v is not None]
    return max(shares, default=None)


def top_stalls(launch: Launch, count: int = 4) -> str:
    stalls = sorted(((v, STALL.match(n).group(1)) for n, (v, _) in launch.values.items()
                     if STALL.match(n) and v), reverse=True)
    return " ".join(f"{name} {value:.1f}" for value, name in stalls[:count])


def table(launches: list[Launch]) -> list[str]:
    def cell(value):
        return "-" if value is None else f"{value:.1f}"
    lines = [" | ".join(["kernel", "grid", "us", "GB/s"] + [c for c, _ in COLUMNS[1:]]
                        + ["tensor%", "largest stalls (warps per issue)"])]
    for launch in launches:
        kernel = launch.kernel if len(launch.kernel) <= 40 else launch.kernel[:37] + "..."
        lines.append(" | ".join(
            [kernel, launch.grid, cell(time_us(launch)), cell(dram_read_gbs(launch))]
            + [cell(launch.values.get(metric, (None, ""))[0]) for _, metric in COLUMNS[1:]]
            + [cell(tensor_pct(launch)), top_stalls(launch)]))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    args = parser.parse_args(argv)
    sys.stdout.write("\n".join(table(read_launches(args.csv))) + "\n")


if __name__ == "__main__":
    main()
