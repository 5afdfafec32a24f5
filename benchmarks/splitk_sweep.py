"""Split-K kernel on decode shapes: torch F.linear vs gemm_splitk, with and without PDL.

For each (N, K) and M in 1, 16, 32, 64 (bf16), CUDA-graph replay over input copies larger than
2x L2 (cold weights, as in decode): F.linear; a screen of every ``candidates`` config with
programmatic dependent launch and L2 prefetch of w (``PDL_PREFETCH``), then the best few re-timed
in all three launch modes (``PDL_OFF``, ``PDL_WAIT``, ``PDL_PREFETCH``) interleaved with torch.
A graph of back-to-back GEMMs is what a model's consecutive projections look like to PDL; the
"after torch" columns put a torch elementwise kernel on x before every GEMM (a predecessor that
never triggers its dependents early), so PDL can only save the launch gap there.
Roofline floor = max(2MNK / 790 TFLOP/s, bytes / 3.08 TB/s), bytes = 2 (MK + NK + MN). Writes
CSV to $OUT (or ./out) and prints a table last.

    PYTHONPATH=src python3 benchmarks/splitk_sweep.py --precompile-only --jobs 14   # fill the cache
    PYTHONPATH=src python3 benchmarks/splitk_sweep.py --deadline 150
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import dataclasses
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune.kernels.triton.gemm_splitk import (
    PDL_OFF,
    PDL_PREFETCH,
    PDL_WAIT,
    SplitKConfig,
    candidates,
    default_config,
    launch_gemm_splitk,
)
from gemmtune.measure.timing import copies_to_exceed_l2, graph_replay_us, interleaved_graph_us

SHAPES = [(576, 7168), (1536, 7168), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336),
          (1280, 8192), (8192, 1024), (7168, 2048)]  # (N, K)
MS = (1, 16, 32, 64)
DTYPE = torch.bfloat16
PEAK_FLOPS = 790e12  # bf16 through cuBLAS on large squares, H100 SXM (docs/DESIGN.md)
PEAK_BYTES = 3.08e12  # streaming read, H100 SXM


def floor_us(m: int, n: int, k: int) -> float:
    return max(2 * m * n * k / PEAK_FLOPS, 2 * (m * k + n * k + m * n) / PEAK_BYTES) * 1e6


MODES = {"off": PDL_OFF, "wait": PDL_WAIT, "prefetch": PDL_PREFETCH}


def compile_key(cfg: SplitKConfig) -> tuple:
    # M and SPLIT_K are not specialised by the kernel, so a binary depends on the tile shape,
    # whether the workspace path is on, and the launch mode.
    return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.split_k > 1,
            cfg.pdl)


def _compile_worker(keys: list[tuple]) -> list[str]:
    """Run each compile key once on a small problem of the same specialisation, filling Triton's
    on-disk cache for the timing process. Returns the failures."""
    from triton.runtime.errors import OutOfResources

    failed = []
    m, n, k = 16, 512, 1024
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    for bm, bn, bk, warps, stages, split, pdl in keys:
        cfg = SplitKConfig(bm, bn, bk, 2 if split else 1, warps, stages, pdl)
        try:
            launch_gemm_splitk(x, w, None, out, None, None, cfg)
        except OutOfResources as exc:
            failed.append(f"{cfg.name}: {exc}")
    torch.cuda.synchronize()
    return failed


def _configs(m: int, n: int, k: int) -> list[SplitKConfig]:
    return candidates(m, n, k, DTYPE, pdl=PDL_PREFETCH) + [
        dataclasses.replace(default_config(m, n, k, DTYPE), pdl=PDL_PREFETCH)]


def precompile(jobs: int) -> None:
    keys = {compile_key(c) for n, k in SHAPES for m in MS for c in _configs(m, n, k)}
    # The re-timed finalists also run without PDL and with PDL but no prefetch.
    keys = sorted(keys | {key[:-1] + (mode,) for key in keys for mode in (PDL_OFF, PDL_WAIT)})
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


def _splitk(cfg: SplitKConfig, after_torch: bool = False):
    def call(s):
        if after_torch:
            s[0].mul_(1.0)
        launch_gemm_splitk(s[0], s[1], None, s[2], None, None, cfg)
    return call


def _torch(after_torch: bool = False):
    def call(s):
        if after_torch:
            s[0].mul_(1.0)
        torch.mm(s[0], s[1].T, out=s[2])
    return call


def rel_err(cfg: SplitKConfig, s: tuple) -> float:
    x, w, out = s
    out.fill_(float("nan"))
    launch_gemm_splitk(x, w, None, out, None, None, cfg)
    ref = x.float() @ w.float().T
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return err if math.isfinite(err) else math.inf


def sweep(deadline_s: float, top: int) -> tuple[list[dict], list[dict]]:
    """One row per shape, and one per screened candidate (the profile)."""
    t_start = time.time()
    rows, profile = [], []
    for n, k in SHAPES:
        for m in MS:
            sets = _sets(m, n, k)
            configs = _configs(m, n, k)
            screened = []
            for cfg in configs:
                if time.time() - t_start > deadline_s and screened:
                    break
                screened.append((graph_replay_us(_splitk(cfg), sets, 3)[0], cfg))
            profile += [dict(M=m, N=n, K=k, config=cfg.name, screen_us=us) for us, cfg in screened]
            screened.sort(key=lambda t: t[0])
            finalists = [cfg for _, cfg in screened[:top]]
            variants = [dataclasses.replace(c, pdl=mode) for c in finalists
                        for mode in MODES.values()]
            timed = interleaved_graph_us([_torch()] + [_splitk(c) for c in variants], sets)
            torch_us = timed[0][0]
            by_mode = {}
            for cfg, (us, _) in zip(variants, timed[1:]):
                label = next(k for k, v in MODES.items() if v == cfg.pdl)
                if label not in by_mode or us < by_mode[label][0]:
                    by_mode[label] = (us, cfg)
            best_us, best = by_mode["prefetch"]
            after = interleaved_graph_us([_torch(True), _splitk(best, True)], sets)
            fl = floor_us(m, n, k)
            row = dict(M=m, N=n, K=k, floor_us=fl, torch_us=torch_us,
                       off_us=by_mode["off"][0], wait_us=by_mode["wait"][0],
                       prefetch_us=best_us, best_cfg=best.name,
                       after_torch_torch_us=after[0][0], after_torch_splitk_us=after[1][0],
                       candidates=len(configs), timed=len(screened),
                       best_err=max(rel_err(c, sets[0]) for c in variants),
                       eff_torch=fl / torch_us, eff_off=fl / by_mode["off"][0],
                       eff_wait=fl / by_mode["wait"][0], eff_prefetch=fl / best_us)
            rows.append(row)
            print(f"{m:>3} {n:>6} {k:>6}  torch {torch_us:6.2f}  off {row['off_us']:6.2f}  wait "
                  f"{row['wait_us']:6.2f}  prefetch {best_us:6.2f} {best.name} "
                  f"({len(screened)}/{len(configs)})  [{time.time() - t_start:.0f} s]", flush=True)
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
    print(f"{'M':>3} {'N':>6} {'K':>6} | {'floor':>6} {'torch':>6} | {'off':>6} {'wait':>6} "
          f"{'prefetch':>8} {'x torch':>7} | {'after torch: torch':>18} {'splitk':>6} | "
          f"{'best config':<44}")
    for r in rows:
        print(f"{r['M']:>3} {r['N']:>6} {r['K']:>6} | {r['floor_us']:6.2f} {r['torch_us']:6.2f} | "
              f"{r['off_us']:6.2f} {r['wait_us']:6.2f} {r['prefetch_us']:8.2f} "
              f"{r['torch_us'] / r['prefetch_us']:7.2f} | {r['after_torch_torch_us']:18.2f} "
              f"{r['after_torch_splitk_us']:6.2f} | {r['best_cfg']:<44}")
    for label, key in [("torch", "eff_torch"), ("split-K, no PDL", "eff_off"),
                       ("split-K, PDL", "eff_wait"), ("split-K, PDL + prefetch", "eff_prefetch")]:
        print(f"geomean roofline efficiency, {label}: {geomean(r[key] for r in rows):.3f}")
    print(f"geomean speed-up over torch: PDL + prefetch "
          f"{geomean(r['torch_us'] / r['prefetch_us'] for r in rows):.3f}, no PDL "
          f"{geomean(r['torch_us'] / r['off_us'] for r in rows):.3f}, after a torch kernel "
          f"{geomean(r['after_torch_torch_us'] / r['after_torch_splitk_us'] for r in rows):.3f}")
    print(f"worst rel. error of split-K: {max(r['best_err'] for r in rows):.2e}")


if __name__ == "__main__":
    main()
