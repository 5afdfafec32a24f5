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


STAGES = (("stage 1", "triton.moe1:"), ("stage 2", "triton.moe2:"))


def best_stages(records: list[dict]) -> None:
    """Per token count, the fastest screened config of each stage, plain and persistent (P1, P2):
    what the persistent stages gain where they are offered."""
    best: dict[tuple, tuple[float, str]] = {}
    for rec in records:
        name = rec["kernelName"]
        if rec["status"] != "ok" or "+" in name:
            continue
        for label, prefix in STAGES:
            if name.startswith(prefix):
                kind = "persistent" if name.endswith((".P1", ".P2")) else "plain"
                key = (int(rec["token"]), label, kind)
                if key not in best or float(rec["us"]) < best[key][0]:
                    best[key] = (float(rec["us"]), name)
    tokens = sorted({k[0] for k in best if k[2] == "persistent"})
    if not tokens:
        return
    print("fastest stage configs, plain against persistent (us):")
    for token in tokens:
        for label, _ in STAGES:
            plain, persistent = (best.get((token, label, kind)) for kind in ("plain",
                                                                             "persistent"))
            if plain and persistent:
                print(f"{token:>6} {label}: {plain[0]:9.2f} {persistent[0]:9.2f} "
                      f"({plain[0] / persistent[0]:.2f}x)  {plain[1]}  {persistent[1]}")


def main(tuned_path: str, profile_path: str) -> None:
    torch_us = {}
    with open(profile_path, newline="") as f:
        records = list(csv.DictReader(f))
    for rec in records:
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
    best_stages(records)


if __name__ == "__main__":
    main(*sys.argv[1:3])
