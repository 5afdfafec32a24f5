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
# Whole solutions by kind: the two stages paired, each one-launch kernel, torch's grouped GEMM.
KINDS = (("pair", "+"), ("1stage", "triton.moe_1stage:"), ("stream", "triton.moe_stream:"),
         ("gmm", "triton.moe_gmm"))


def _kind(name: str) -> str | None:
    for kind, mark in KINDS:
        if (mark in name) if mark == "+" else name.startswith(mark):
            return kind
    return None


def best_whole(records: list[dict]) -> None:
    """Per token count, the fastest timed solution of each kind (pairs at their end-to-end
    re-timing): which kind wins where, and by how much."""
    best: dict[tuple, tuple[float, str]] = {}
    for rec in records:
        kind = _kind(rec["kernelName"])
        if rec["status"] == "ok" and kind:
            key = (int(rec["token"]), kind)
            if key not in best or float(rec["us"]) < best[key][0]:
                best[key] = (float(rec["us"]), rec["kernelName"])
    kinds = [kind for kind, _ in KINDS if any(k[1] == kind for k in best)]
    if not kinds:
        return
    print("fastest solution of each kind (us):")
    print(f"{'token':>6} " + " ".join(f"{kind:>9}" for kind in kinds) + "  fastest stream")
    for token in sorted({k[0] for k in best}):
        times = " ".join(f"{best[(token, kind)][0]:9.2f}" if (token, kind) in best
                         else f"{'-':>9}" for kind in kinds)
        stream = best.get((token, "stream"), (0, ""))[1]
        print(f"{token:>6} {times}  {stream}")


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
    best_whole(records)
    best_stages(records)


if __name__ == "__main__":
    main(*sys.argv[1:3])
