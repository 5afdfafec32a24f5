"""FP8 accumulation precision of the Triton kernels on Hopper, and what promoting it costs.

Hopper's FP8 tensor cores accumulate with reduced precision, and Triton lets a dot chain
accumulate that way over the whole K. ``promote_k`` (a config field of the three Triton kernels)
adds the partial sums into a true fp32 accumulator every ``promote_k`` elements of K instead.
For each shipped Triton FP8 row of the a8w8 table (and a few long-K decode shapes), this runs the
row's config as tuned (promote_k 0) and promoted every min(block_k, 128), next to
torch._scaled_mm (cuBLAS without fast accumulation): error against the dequantised fp32
reference, as the tuner's gate measures it (bf16 out, the rows' dtype) and with fp32 out (no
output rounding to hide the accumulation's error), and time (interleaved CUDA graphs, cold L2).

    PYTHONPATH=src python3 benchmarks/fp8_accumulation.py [--out DIR] [--limit N]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch

from gemmtune.kernels.triton import _checks, gemm_persistent, gemm_splitk, gemm_tile
from gemmtune.kernels.triton.gemm_persistent import PersistentConfig, launch_gemm_persistent
from gemmtune.kernels.triton.gemm_splitk import SplitKConfig
from gemmtune.kernels.triton.gemm_tile import TileConfig, launch_gemm_tile
from gemmtune.measure.accuracy import gate
from gemmtune.families._gemm_tuner import _rotating
from gemmtune.families.a8w8.op import REGISTRY, A8w8Key
from gemmtune.families.a8w8.tuner import A8w8Tuner
from gemmtune.measure.timing import interleaved_graph_us

TABLE = Path(__file__).resolve().parents[1] / "src/gemmtune/configs/a8w8_tuned_gemm.csv"
CONFIGS = {"triton.splitk": SplitKConfig, "triton.tile": TileConfig,
           "triton.persistent": PersistentConfig}
WHY_NOT_FITS = {"triton.splitk": gemm_splitk.why_not_fits, "triton.tile": gemm_tile.why_not_fits,
                "triton.persistent": gemm_persistent.why_not_fits}
FP8 = "torch.float8_e4m3fn"
# Long-K decode shapes beside the table's rows: the error of a fast accumulation grows with K.
# wgmma tiles (block_m 64, 4 warps): smaller split-K tiles run mma.sync, exact in fp32 already.
EXTRA = (("1", "5120", "25600", "triton.splitk:BM64.BN64.BK256.SK4.W4.S3"),
         ("64", "5120", "25600", "triton.splitk:BM64.BN64.BK256.SK1.W4.S3"),
         ("16", "8192", "28672", "triton.splitk:BM64.BN64.BK256.SK2.W4.S3"),
         # The swapped dot (M <= 64 rows): w's 64 rows are the wgmma's M.
         ("16", "5120", "25600", "triton.splitk:BM16.BN64.BK256.SK2.W4.S4.P1.PK0.SW1"),
         ("64", "4096", "14336", "triton.splitk:BM64.BN64.BK256.SK2.W4.S4.P1.PK0.SW1"),
         ("32", "1280", "8192", "triton.splitk:BM32.BN64.BK256.SK4.W4.S4.P1.PK0.SW1"))


def shipped_rows() -> list[tuple[str, str, str, str]]:
    with TABLE.open() as f:
        rows = [(r["M"], r["N"], r["K"], r["kernelName"]) for r in csv.DictReader(f)
                if r["kernelName"].startswith("triton.") and r["q_dtype_w"] == FP8]
    return list(EXTRA) + rows


def promoted(name: str, m: int, n: int, k: int):
    """The row's config with promote_k = min(block_k, 128), or why it cannot have it."""
    prefix = name.partition(":")[0]
    if prefix not in CONFIGS:  # the GEMV: CUDA cores, fp32 products and sums
        return None, "no tensor cores"
    config = CONFIGS[prefix].from_name(name)
    config = dataclasses.replace(config, promote_k=min(config.block_k, 128))
    why = WHY_NOT_FITS[prefix](config, m, n, k, torch.float8_e4m3fn)
    return (None, why) if why else (config.name, "")


def measure(family: A8w8Tuner, key: tuple, names: list[str]) -> list[dict]:
    prepared = family.prepare(key, seed=0)
    atol, rtol, bound = family.tolerance(key)
    xq, wq, bias, _, x_scale, w_scale = prepared.inputs
    ref = prepared.reference
    results = []
    for name in names:
        out = family.run(name, prepared)
        verdict = gate(out, ref, atol=atol, rtol=rtol, max_err_ratio=0.05, rel_bound=bound)
        out32 = REGISTRY.resolve(name)(xq, wq, bias, torch.float32, x_scale, w_scale)
        results.append({"kernel": name, "rel_err": verdict.rel_err,
                        "err_ratio": verdict.err_ratio,
                        "rel_err32": float((out32 - ref).norm() / ref.norm())})
    times = family.time_many(names, prepared, iters=50, warmup=3)
    for result, (us, spread) in zip(results, times):
        result.update(us=us, spread=spread)
    return results


def wide_tiles_unchecked(family: A8w8Tuner, rows: list) -> list[str]:
    """The wide-tile configs ``why_not_resources`` refuses promotion for (two accumulators of
    128 registers per thread), launched anyway past the checks: does the rule match ptxas?"""
    lines = []
    seen = set()
    for m, n, k, name in rows:
        prefix = name.partition(":")[0]
        if prefix not in ("triton.tile", "triton.persistent"):
            continue
        config = CONFIGS[prefix].from_name(name)
        if _checks.accumulator_registers(config) <= 64 or config in seen:
            continue
        seen.add(config)
        launch = launch_gemm_tile if prefix == "triton.tile" else launch_gemm_persistent
        key = A8w8Key(int(m), int(n), int(k), FP8)
        prepared = family.prepare(key, seed=0)
        xq, wq, _, out_dtype, sa, sb = prepared.inputs
        out = torch.empty(key.M, key.N, dtype=out_dtype, device=xq.device)
        variants = [config, dataclasses.replace(config, promote_k=min(config.block_k, 128))]
        try:
            errs = []
            for v in variants:
                launch(xq, wq, None, out, sa, sb, v)
                errs.append(float((out.float() - prepared.reference).norm() / prepared.reference.norm()))
            times = interleaved_graph_us(
                [lambda s, v=v: launch(s.x, s.w, None, out, sa, sb, v) for v in variants],
                _rotating(prepared))
        except Exception as e:  # a compile or launch failure is the answer for this config
            lines.append(f"{m}x{n}x{k} {name}: promoted fails: {type(e).__name__}: {e}")
            continue
        lines.append(f"{m}x{n}x{k} {name}: fast {times[0][0]:.1f} us err {errs[0]:.2e} | "
                     f"promoted {times[1][0]:.1f} us err {errs[1]:.2e} "
                     f"({times[1][0] / times[0][0]:.3f}x)")
        print(lines[-1], flush=True)
    return lines


FIELDS = ["M", "N", "K", "kernel", "promoted"] + [f"{who}_{what}" for who in (
    "torch", "fast", "promoted") for what in ("rel_err", "rel_err32", "err_ratio", "us")]


def measure_row(family: A8w8Tuner, m: str, n: str, k: str, name: str) -> dict | None:
    """One table row: torch, the row's config and its promoted twin; None (reported) if one of
    them fails."""
    key = A8w8Key(int(m), int(n), int(k), FP8)
    slow_name, why = promoted(name, key.M, key.N, key.K)
    names = ["torch.scaled_mm", name] + ([slow_name] if slow_name else [])
    try:
        torch_r, fast_r, *slow_r = measure(family, key, names)
    except Exception as e:  # a config that fails here is reported, not fatal to the run
        print(f"{m}x{n}x{k} {name}: failed: {type(e).__name__}: {e}", flush=True)
        return None
    rec = {"M": m, "N": n, "K": k, "kernel": name, "promoted": slow_name or why}
    for who, result in (("torch", torch_r), ("fast", fast_r), *(("promoted", r) for r in slow_r)):
        rec.update({f"{who}_{what}": result[what]
                    for what in ("rel_err", "rel_err32", "err_ratio", "us")})
    return rec


GROUPS = ("triton.gemv", "triton.splitk SW1", "triton.splitk", "triton.tile", "triton.persistent")


def group_of(name: str) -> str:
    prefix = name.partition(":")[0]
    return f"{prefix} SW1" if name.endswith(".SW1") else prefix


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--limit", type=int, default=0, help="first N rows only (0: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    family = A8w8Tuner()
    rows = shipped_rows()[:args.limit or None]
    print(f"{torch.cuda.get_device_name()}: {len(rows)} FP8 rows", flush=True)
    wide = wide_tiles_unchecked(family, rows)
    records = []
    t0 = time.monotonic()
    # Written row by row: a run cut off by its time limit keeps what it measured.
    with (args.out / "fp8_accumulation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for i, (m, n, k, name) in enumerate(rows, 1):
            rec = measure_row(family, m, n, k, name)
            if rec is None:
                continue
            records.append(rec)
            writer.writerow(rec)
            f.flush()
            slow = (f"promoted {rec['promoted_rel_err32']:.2e} {rec['promoted_us']:8.1f} us"
                    if "promoted_us" in rec else f"promoted n/a ({rec['promoted']})")
            print(f"[{i}/{len(rows)} {time.monotonic() - t0:5.0f} s] {m:>5}x{n}x{k} {name}: "
                  f"fp32-out err / us: torch {rec['torch_rel_err32']:.2e} {rec['torch_us']:8.1f} "
                  f"| fast {rec['fast_rel_err32']:.2e} {rec['fast_us']:8.1f} | {slow}",
                  flush=True)
    print("\nkernel family       rows  fp32-out rel err torch / fast / promoted (median, "
          "promoted rows)  bf16-out rel err the same  time promoted/fast (geomean)  fast/torch")
    for group in GROUPS:
        mine = [r for r in records if group_of(r["kernel"]) == group]
        both = [r for r in mine if "promoted_us" in r]  # the error medians: these rows only
        if not mine:
            continue
        med = lambda f, rs: statistics.median(r[f] for r in rs) if rs else math.nan  # noqa: E731
        print(f"{group:<19} {len(mine):>4}  {med('torch_rel_err32', both):.2e} / "
              f"{med('fast_rel_err32', both):.2e} / {med('promoted_rel_err32', both):.2e}  "
              f"{med('torch_rel_err', both):.2e} / "
              f"{med('fast_rel_err', both):.2e} / {med('promoted_rel_err', both):.2e}   "
              f"{geomean([r['promoted_us'] / r['fast_us'] for r in both]):.3f} ({len(both)} rows)"
              f"  {geomean([r['fast_us'] / r['torch_us'] for r in mine]):.3f}")
    print("wide tiles promoted past the register rule:", *wide, sep="\n  ")


if __name__ == "__main__":
    main()
