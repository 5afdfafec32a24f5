"""One line per tuned fused-MoE shape: the winner, its time, and torch's time from the same run.

    python3 benchmarks/fmoe_tune_summary.py TUNED_CSV PROFILE_CSV

``us`` is the winner's end-to-end re-timing (routing preparation included, graph replay, cold
weights); ``torch`` is torch.moe's screen time from the profile of the same run (graph replay,
cold weights); ``GB/s`` is the row's ``bw`` (the bytes of
the experts a uniform routing reaches, plus activations).
"""

from __future__ import annotations

import csv
import sys


def main(tuned_path: str, profile_path: str) -> None:
    torch_us = {}
    with open(profile_path, newline="") as f:
        for rec in csv.DictReader(f):
            if rec["kernelName"] == "torch.moe" and rec["status"] == "ok":
                torch_us[int(rec["token"])] = float(rec["us"])
    print(f"{'token':>6} {'us':>9} {'torch':>9} {'speedup':>7} {'GB/s':>7} {'TF/s':>6} "
          f"{'block_m':>7} {'ksplit':>6}  winner")
    with open(tuned_path, newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["token"]))
    for r in rows:
        token, us = int(r["token"]), float(r["us"])
        ref = torch_us.get(token)
        speedup = f"{ref / us:7.2f}" if ref else f"{'-':>7}"
        winner = "+".join(filter(None, (r["kernelName1"], r["kernelName2"])))
        print(f"{token:>6} {us:9.2f} {ref or float('nan'):9.2f} {speedup} {float(r['bw']):7.0f} "
              f"{float(r['tflops']):6.1f} {r['block_m']:>7} {r['ksplit']:>6}  {winner}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
