"""Each shipped row's Triton kernel that has a PDL field (``.P``) against its twin launched the
other way (with programmatic dependent launch, or without), one interleaved run a row (cold
operands, CUDA graphs of back-to-back calls: ``named_probe.time_shape``), the twin's output
checked against the row's kernel's (issue 15; docs/benchmarks.md, session 38).

    PYTHONPATH=src python3 benchmarks/pdl_twins.py --family a8w8-blockscale \\
        --kernels triton.ring --max-m 64 --gpu H100 --csv out.csv

Prints a line a row (µs without and with PDL), then the geometric mean of without / with and
the rows where either is faster by more than 2%. ``--deadline``: seconds after which no row
starts (what ran is still summed up).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import time
from typing import NamedTuple

import torch

from gemmtune.families import get_family
from gemmtune.kernels.triton._splits import PDL_OFF, PDL_WAIT
from gemmtune.kernels.triton.dispatchable import TritonKernel
from gemmtune.tables.sources import configs_dir
from gemmtune.tables.store import read_table
from named_probe import OPS, call, operands, time_shape

NOISE = 0.02  # a side faster by more than this counts as a win


class Row(NamedTuple):
    shape: tuple[int, int, int]
    gpu: str
    plain: str  # the row's config without PDL
    with_pdl: str  # and with it


def twins(family: str, kernels: list[str], max_m: int, gpu: str) -> list[Row]:
    """The family's shipped rows (M <= max_m, of GPUs whose name starts ``gpu``) whose kernel is
    one of ``kernels`` and has a PDL field that is off or waits, as (plain, with PDL) names;
    each (shape, config) once."""
    schema = get_family(family).schema
    found = {}
    for r in read_table(configs_dir() / schema.tuned_file, schema).rows:
        name = str(r.results["kernelName"])
        if (name.split(":", 1)[0] not in kernels or r.key.M > max_m
                or not r.gpu.startswith(gpu)):
            continue
        config = TritonKernel(name).config
        if getattr(config, "pdl", None) not in (PDL_OFF, PDL_WAIT):
            continue
        # Without PDL, nothing loads before a wait (triton.wsring's w_ahead needs PDL)
        plain = dataclasses.replace(config, pdl=PDL_OFF, **(
            {"w_ahead": 0} if hasattr(config, "w_ahead") else {}))
        row = Row((r.key.M, r.key.N, r.key.K), r.gpu, plain.name,
                  dataclasses.replace(config, pdl=PDL_WAIT).name)
        found.setdefault((row.shape, row.plain), row)
    return list(found.values())


def why_not_same_output(family: str, row: Row) -> str | None:
    """Why the twins' outputs on one set of operands differ beyond FP8's (or bf16's) step-wise
    rounding (PDL changes when a kernel starts, not what it computes), or why either cannot
    run; None where they agree."""
    s = operands(family, *row.shape)
    try:
        plain = call(family, s, row.plain).float()
        with_pdl = call(family, s, row.with_pdl).float()
        scale = plain.abs().max().item() or 1.0
        torch.testing.assert_close(with_pdl, plain, rtol=1e-2, atol=1e-2 * scale)
    except (ValueError, RuntimeError, AssertionError) as e:
        return str(e).split("\n")[0][:200]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(OPS), required=True)
    parser.add_argument("--kernels", nargs="+", default=["triton.ring"],
                        help="kernel prefixes (triton.ring, triton.gemv, ...)")
    parser.add_argument("--max-m", type=int, default=64)
    parser.add_argument("--gpu", default="", help="rows of GPUs whose name starts so")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--deadline", type=float, default=float("inf"))
    parser.add_argument("--csv", help="write every row's times here too")
    args = parser.parse_args()
    stop = time.monotonic() + args.deadline
    rows = twins(args.family, args.kernels, args.max_m, args.gpu)
    print(f"{len(rows)} rows of {args.family} ({', '.join(args.kernels)}, M <= {args.max_m})")
    out = open(args.csv, "w", newline="") if args.csv else None
    table = csv.writer(out) if out else None
    if table:
        table.writerow(["gpu", "M", "N", "K", "kernelName", "plain_us", "pdl_us"])
    ratios = []
    for row in rows:
        if time.monotonic() > stop:
            print(f"deadline: the rows from {row.shape} {row.plain} on not run")
            break
        problem = why_not_same_output(args.family, row)
        if problem is not None:
            print(f"{row.shape} {row.with_pdl}: not timed: {problem}", flush=True)
            continue
        (_, plain, why), (_, with_pdl, why_pdl) = time_shape(
            args.family, row.shape, [row.plain, row.with_pdl], args.rounds)
        if plain is None or with_pdl is None:
            print(f"{row.shape} {row.plain}: not run ({why or why_pdl})")
            continue
        ratios.append(plain / with_pdl)
        print(f"{row.gpu[:4]} {'x'.join(map(str, row.shape))} {row.plain}: {plain:.2f} "
              f"with PDL {with_pdl:.2f} ({plain / with_pdl:.3f})", flush=True)
        if table:  # each row kept should the stage's time limit stop the run
            table.writerow([row.gpu, *row.shape, row.plain, f"{plain:.3f}", f"{with_pdl:.3f}"])
            out.flush()
    if out:
        out.close()
    if ratios:
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"without / with PDL: geomean {mean:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
              f"over {len(ratios)} rows; with PDL faster by > {NOISE:.0%}: "
              f"{sum(r > 1 + NOISE for r in ratios)}, slower: "
              f"{sum(r < 1 - NOISE for r in ratios)}")


if __name__ == "__main__":
    main()
