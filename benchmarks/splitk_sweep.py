"""Split-K kernel on decode shapes: torch F.linear vs gemm_splitk's default and best candidate.

For each (N, K) and M in 1, 16, 32, 64 (bf16): CUDA-graph replay over input copies larger than
2x L2 (cold weights, as in decode) of F.linear, of ``default_config``, and of every config of
``candidates`` (a quick screen, then the best few re-timed; every screen time goes to
splitk_profile.csv). Each split-K config is timed as the launcher runs it (tile counters zeroed
by a memset per call) and, for the default and the best, also with caller-owned counters (no
memset) to show what that memset costs. Roofline floor =
max(2MNK / 790 TFLOP/s, bytes / 3.08 TB/s), bytes = 2 (MK + NK + MN). Writes CSV to $OUT (or
./out) and prints a table last.

    PYTHONPATH=src python3 benchmarks/splitk_sweep.py --precompile-only --jobs 14   # fill the cache
    PYTHONPATH=src python3 benchmarks/splitk_sweep.py --deadline 150
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune.kernels.triton.gemm_splitk import (
    SplitKConfig,
    candidates,
    default_config,
    launch_gemm_splitk,
    num_tiles,
)
from gemmtune.tune.timing import copies_to_exceed_l2, graph_replay_us

SHAPES = [(576, 7168), (1536, 7168), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336),
          (1280, 8192), (8192, 1024), (7168, 2048)]  # (N, K)
MS = (1, 16, 32, 64)
DTYPE = torch.bfloat16
PEAK_FLOPS = 790e12  # bf16 through cuBLAS on large squares, H100 SXM (docs/DESIGN.md)
PEAK_BYTES = 3.08e12  # streaming read, H100 SXM


def floor_us(m: int, n: int, k: int) -> float:
    return max(2 * m * n * k / PEAK_FLOPS, 2 * (m * k + n * k + m * n) / PEAK_BYTES) * 1e6


def compile_key(cfg: SplitKConfig) -> tuple:
    # M and SPLIT_K are not specialised by the kernel, so a binary depends on the tile shape and
    # whether the workspace path is on; all shapes here have N, K and strides divisible by 16.
    return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k > 1)


def _compile_worker(keys: list[tuple]) -> list[str]:
    """Run each compile key once on a small problem of the same specialisation, filling Triton's
    on-disk cache for the timing process. Returns the failures."""
    from triton.runtime.errors import OutOfResources

    failed = []
    m, n, k = 16, 512, 1024
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    for bm, bn, bk, warps, stages, split in keys:
        cfg = SplitKConfig(bm, bn, bk, 2 if split else 1, warps, stages)
        try:
            launch_gemm_splitk(x, w, None, out, None, None, cfg)
        except OutOfResources as exc:
            failed.append(f"{cfg.name}: {exc}")
    torch.cuda.synchronize()
    return failed


def precompile(jobs: int) -> None:
    keys = sorted({compile_key(c) for n, k in SHAPES for m in MS
                   for c in candidates(m, n, k, DTYPE) + [default_config(m, n, k, DTYPE)]})
    t0 = time.time()
    chunks = [keys[i::jobs] for i in range(jobs)]
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        failed = [f for part in pool.map(_compile_worker, chunks) for f in part]
    print(f"precompiled {len(keys)} kernels in {time.time() - t0:.0f} s with {jobs} processes; "
          f"{len(failed)} failed", flush=True)
    for f in failed:
        print("  ", f)


def _sets(m: int, n: int, k: int) -> list[tuple]:
    copies = copies_to_exceed_l2(2 * (n * k + m * k))
    return [(torch.randn(m, k, device="cuda", dtype=DTYPE),
             torch.randn(n, k, device="cuda", dtype=DTYPE) / math.sqrt(k),
             torch.empty(m, n, device="cuda", dtype=DTYPE)) for _ in range(copies)]


def time_splitk(cfg: SplitKConfig, sets: list[tuple], replays: int, owned: bool = False) -> float:
    counters = None
    if owned:
        m, n = sets[0][2].shape
        counters = torch.zeros(num_tiles(cfg, m, n), dtype=torch.int32, device="cuda")
    return graph_replay_us(
        lambda s: launch_gemm_splitk(s[0], s[1], None, s[2], None, None, cfg, counters),
        sets, replays)[0]


def rel_err(cfg: SplitKConfig, s: tuple) -> float:
    x, w, out = s
    out.fill_(float("nan"))
    launch_gemm_splitk(x, w, None, out, None, None, cfg)
    ref = x.float() @ w.float().T
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep(deadline_s: float, top: int) -> tuple[list[dict], list[dict]]:
    """One row per shape, and one per screened candidate (the profile)."""
    t_start = time.time()
    rows, profile = [], []
    for n, k in SHAPES:
        for m in MS:
            sets = _sets(m, n, k)
            torch_us = graph_replay_us(lambda s: F.linear(s[0], s[1]), sets, 20)[0]
            torch_err = ((F.linear(sets[0][0], sets[0][1]).float()
                          - sets[0][0].float() @ sets[0][1].float().T).norm()
                         / (sets[0][0].float() @ sets[0][1].float().T).norm()).item()
            dflt = default_config(m, n, k, DTYPE)
            dflt_us = time_splitk(dflt, sets, 20)
            dflt_owned_us = time_splitk(dflt, sets, 20, owned=True)
            cands = candidates(m, n, k, DTYPE)
            screened = []
            for cfg in cands:
                if time.time() - t_start > deadline_s:
                    break
                screened.append((time_splitk(cfg, sets, 3), cfg))
            profile += [dict(M=m, N=n, K=k, config=cfg.name, screen_us=us) for us, cfg in screened]
            screened.sort(key=lambda t: t[0])
            finals = [(time_splitk(cfg, sets, 20), cfg) for _, cfg in screened[:top]]
            best_us, best = min(finals + [(dflt_us, dflt)], key=lambda t: t[0])
            best_owned_us = time_splitk(best, sets, 20, owned=True)
            fl = floor_us(m, n, k)
            row = dict(M=m, N=n, K=k, floor_us=fl, torch_us=torch_us, default_cfg=dflt.name,
                       default_us=dflt_us, default_owned_us=dflt_owned_us, best_cfg=best.name,
                       best_us=best_us, best_owned_us=best_owned_us,
                       candidates=len(cands), timed=len(screened),
                       torch_err=torch_err, default_err=rel_err(dflt, sets[0]),
                       best_err=rel_err(best, sets[0]),
                       eff_torch=fl / torch_us, eff_default=fl / dflt_us, eff_best=fl / best_us,
                       eff_best_owned=fl / best_owned_us)
            rows.append(row)
            print(f"{m:>3} {n:>6} {k:>6}  torch {torch_us:6.2f}  default {dflt_us:6.2f}  best "
                  f"{best_us:6.2f} {best.name} ({len(screened)}/{len(cands)})  "
                  f"[{time.time() - t_start:.0f} s]", flush=True)
            del sets
    return rows, profile


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds after which no further candidates are screened")
    parser.add_argument("--top", type=int, default=3, help="candidates re-timed accurately")
    args = parser.parse_args()
    if args.precompile_only:
        precompile(args.jobs)
        return
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, profile = sweep(args.deadline, args.top)
    for name, table in (("splitk_sweep.csv", rows), ("splitk_profile.csv", profile)):
        with open(out_dir / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}  (µs per call, CUDA-graph replay, cold w)")
    print(f"{'M':>3} {'N':>6} {'K':>6} | {'floor':>6} {'torch':>6} | {'default':>7} "
          f"{'no-memset':>9} | {'best':>6} {'no-memset':>9} {'best config':<42} {'timed':>7} | "
          f"{'eff torch':>9} {'eff best':>8}")
    for r in rows:
        print(f"{r['M']:>3} {r['N']:>6} {r['K']:>6} | {r['floor_us']:6.2f} {r['torch_us']:6.2f} | "
              f"{r['default_us']:7.2f} {r['default_owned_us']:9.2f} | {r['best_us']:6.2f} "
              f"{r['best_owned_us']:9.2f} {r['best_cfg']:<42} "
              f"{r['timed']:>3}/{r['candidates']:<3} | {r['eff_torch']:9.2f} {r['eff_best']:8.2f}")
    for label, key in [("torch", "eff_torch"), ("default", "eff_default"),
                       ("best", "eff_best"), ("best, no memset", "eff_best_owned")]:
        print(f"geomean roofline efficiency, {label}: {geomean(r[key] for r in rows):.3f}")
    print(f"worst rel. error: torch {max(r['torch_err'] for r in rows):.2e}, split-K "
          f"{max(max(r['default_err'], r['best_err']) for r in rows):.2e}")


if __name__ == "__main__":
    main()
