"""Where the bf16 tuner's time per candidate goes: the family's phases, in one process.

For one (N, K) over a list of M: every candidate of ``Bf16Tuner`` is built (``precompile``),
run once and checked against the fp32 reference (``run`` + the gate), and screen-timed
(``time``), each phase on its own clock; sums per phase and backend are printed, and every
candidate's phases go to tune_cost.csv under $OUT (or ./out). The tuner adds worker round trips
and the re-timing of finalists on top; compare its wall time per shape with the sum here.

    PYTHONPATH=src python3 benchmarks/tune_cost.py --nk 4096,4096 --M 1,16,32,64,128,256,512,1024
"""

from __future__ import annotations

import argparse
import csv
import os
import secrets
import time
from collections import defaultdict
from pathlib import Path

from gemmtune.measure.accuracy import gate
from gemmtune.families.bf16.op import Bf16Key
from gemmtune.families.bf16.tuner import Bf16Tuner
from gemmtune.tune.family import TuneOptions

PHASES = ("precompile", "check", "time")


def measure(n: int, k: int, ms: list[int]) -> list[dict]:
    family = Bf16Tuner()
    options = TuneOptions()
    rows = []
    for m in ms:
        key = Bf16Key(m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False)
        t0 = time.perf_counter()
        candidates = family.candidates(key, frozenset())
        t1 = time.perf_counter()
        prepared = family.prepare(key, secrets.randbits(31))
        t2 = time.perf_counter()
        print(f"M={m}: {len(candidates)} candidates listed in {t1 - t0:.2f} s, inputs in "
              f"{t2 - t1:.2f} s", flush=True)
        atol, rtol, bound = family.tolerance(key)
        for c in candidates:
            row = dict(M=m, N=n, K=k, name=c.name, libtype=c.libtype, us=float("nan"), ok=False)
            try:
                start = time.perf_counter()
                family.precompile(c.name, prepared)
                built = time.perf_counter()
                out = family.run(c.name, prepared)
                row["ok"] = gate(out, prepared.reference, atol=atol, rtol=rtol,
                                 max_err_ratio=options.err_ratio, rel_bound=bound).ok
                checked = time.perf_counter()
                row["us"] = family.time(c.name, prepared, options.iters, options.warmup)[0]
                timed = time.perf_counter()
                row.update(precompile=built - start, check=checked - built, time=timed - checked)
            except Exception as e:  # a failing candidate costs what it cost; say why
                row.update(precompile=0.0, check=0.0, time=0.0, error=f"{type(e).__name__}: {e}")
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nk", default="4096,4096", help="N,K")
    parser.add_argument("--M", default="1,16,32,64,128,256,512,1024")
    args = parser.parse_args()
    n, k = (int(v) for v in args.nk.split(","))
    ms = [int(v) for v in args.M.split(",")]
    rows = measure(n, k, ms)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["M", "N", "K", "name", "libtype", "ok", "us", *PHASES, "error"]
    with open(out_dir / "tune_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in rows:
        t = totals[(r["M"], r["libtype"])]
        t[0] += 1
        for i, phase in enumerate(PHASES, 1):
            t[i] += r[phase]
    print(f"\n{n}x{k}: seconds per phase, summed over candidates (one process, no workers)")
    print(f"{'M':>5} {'backend':<9} {'cands':>5} {'precompile':>10} {'check':>7} {'time':>7} "
          f"{'per cand':>8}")
    for (m, lib), (count, *secs) in sorted(totals.items()):
        print(f"{m:>5} {lib:<9} {count:>5} {secs[0]:10.2f} {secs[1]:7.2f} {secs[2]:7.2f} "
              f"{sum(secs) / count:8.3f}")
    print(f"total {sum(sum(t[1:]) for t in totals.values()):.1f} s for {len(rows)} candidates; "
          f"failed: {sum(1 for r in rows if not r['ok'])}")


if __name__ == "__main__":
    main()
