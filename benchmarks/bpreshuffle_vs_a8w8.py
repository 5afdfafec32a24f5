"""gemm_a8w8_bpreshuffle beside gemm_a8w8 on the same FP8 weights, one run (issue 15: the
pre-shuffled op should reach 1.1x the a8w8 row of the same shape, geometric mean at M <= 64).

Per preset (N, K) (the shipped bf16 table's) and M: ``gemm_a8w8`` through its table, the
pre-shuffled op through its table (``GEMMTUNE_CONFIG_A8W8_BPRESHUFFLE`` adds a freshly tuned
one), and the pre-shuffled op forced to the a8w8 row's own kernel where that kernel reads the
tiles (``same_config``: the layout the only difference). Per-token x per-channel scales, bf16
out. Each result is checked against the fp32 reference first; times are CUDA-graph replays over
weight copies exceeding L2, interleaved.

    PYTHONPATH=src python3 benchmarks/bpreshuffle_vs_a8w8.py [--m 1,16,32,64] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

from gemmtune import quant
from gemmtune.families.a8w8.op import DISPATCH as A8W8, A8w8Key, gemm_a8w8
from gemmtune.families.a8w8_bpreshuffle.op import (DISPATCH as BPRESHUFFLE, REGISTRY,
                                                   BpreshuffleKey, gemm_a8w8_bpreshuffle,
                                                   problem_of)
from gemmtune.kernels.torch_ref import gemm_a8w8_ref
from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

FP8 = "torch.float8_e4m3fn"
BF16_TABLE = Path(__file__).resolve().parent.parent / "src/gemmtune/configs/bf16_tuned_gemm.csv"


def preset_nk() -> list[tuple[int, int]]:
    with open(BF16_TABLE) as f:
        return sorted({(int(r["N"]), int(r["K"])) for r in csv.DictReader(f)})


def tiled_twin(name: str, key: BpreshuffleKey) -> str | None:
    """``name`` if the pre-shuffled family's kernels can run it on ``key``, else None."""
    return name if REGISTRY.can_run(name, problem_of(key)) else None


def close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(torch.isfinite(y).all()) and float((y.float() - ref).norm() / ref.norm()) < 1e-2


def geomean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,16,32,64", help="token counts (default 1,16,32,64)")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, k in preset_nk():
        gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        wq, ws = quant.per_channel_fp8(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5)
        ws = ws.reshape(-1)
        copies = [(wq, quant.shuffle_weight(wq))]
        copies += [(a.clone(), b.clone()) for a, b in copies * (copies_to_exceed_l2(2 * n * k) - 1)]
        for m in ms:
            xq, xs = quant.per_token_fp8(torch.randn(m, k, generator=gen, device="cuda"))
            xs = xs.reshape(-1)
            ref = gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32)
            a8w8_kernel = A8W8.decide(A8w8Key(m, n, k, FP8)).kernel_name
            bp_key = BpreshuffleKey(m, n, k, FP8)
            bp_kernel = BPRESHUFFLE.decide(bp_key).kernel_name
            same = tiled_twin(a8w8_kernel, bp_key)
            fns = {"a8w8": lambda c: gemm_a8w8(xq, c[0], xs, ws),
                   "bpreshuffle": lambda c: gemm_a8w8_bpreshuffle(xq, c[1], xs, ws)}
            if same is not None:
                fns["same_config"] = lambda c: gemm_a8w8_bpreshuffle(xq, c[1], xs, ws,
                                                                     kernel=same)
            bad = [label for label, fn in fns.items() if not close(fn(copies[0]), ref)]
            if bad:
                print(f"{m}x{n}x{k}: {', '.join(bad)} wrong against the reference; skipped",
                      flush=True)
                continue
            times = interleaved_graph_us(list(fns.values()), copies, rounds=9, replays=2)
            rec = {"M": m, "N": n, "K": k, "a8w8_kernel": a8w8_kernel,
                   "bpreshuffle_kernel": bp_kernel, "same_config_kernel": same or ""}
            rec.update({f"{label}_us": t for label, (t, _) in zip(fns, times)})
            rows.append(rec)
            print(f"{m:>4}x{n}x{k}: a8w8 {rec['a8w8_us']:7.2f} us | bpreshuffle "
                  f"{rec['bpreshuffle_us']:7.2f} ({rec['a8w8_us'] / rec['bpreshuffle_us']:.3f}x)"
                  + (f" | same config {rec['same_config_us']:7.2f} "
                     f"({rec['a8w8_us'] / rec['same_config_us']:.3f}x)" if same else ""),
                  flush=True)
    fields = ["M", "N", "K", "a8w8_us", "bpreshuffle_us", "same_config_us", "a8w8_kernel",
              "bpreshuffle_kernel", "same_config_kernel"]
    with open(args.out / "bpreshuffle_vs_a8w8.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print("\nspeed-up of the pre-shuffled op over gemm_a8w8 (a8w8 time / pre-shuffled time)")
    for m in ms:
        sel = [r for r in rows if r["M"] == m]
        tuned = [r["a8w8_us"] / r["bpreshuffle_us"] for r in sel]
        same = [r["a8w8_us"] / r["same_config_us"] for r in sel if "same_config_us" in r]
        if tuned:
            print(f"  M={m:<4} tuned: geomean {geomean(tuned):.3f} (min {min(tuned):.3f}, max "
                  f"{max(tuned):.3f}, {len(tuned)} shapes); same config: geomean "
                  f"{geomean(same):.3f} ({len(same)} shapes)")
    small = [r["a8w8_us"] / r["bpreshuffle_us"] for r in rows if r["M"] <= 64]
    print(f"  M<=64 tuned: geomean {geomean(small):.3f} over {len(small)} shapes")


if __name__ == "__main__":
    main()
