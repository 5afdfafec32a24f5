"""``gemmtune bench bf16``: tuned vs torch vs the roofline, per shape, in one run on one device.

For every shape: torch's default (``F.linear``) and the tuned op (``gemm_a16w16`` through the
tables in force) are timed the same way, in alternation (CUDA-graph replay over weight copies
larger than L2, i.e. cold weights as in decode); the tuned output is checked against an fp32 reference; the floor is
max(FLOPs / peak, bytes / bandwidth) with both ceilings measured in the same run (bandwidth as a
streaming read, which a GEMM's weight read is; a copy's read+write rate would overstate the floor).
"""

from __future__ import annotations

import contextlib

import csv
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune.device import current_device
from gemmtune.kernels.torch_ref import gemm_a16w16_ref
from gemmtune.ops.gemm_a16w16 import DISPATCH, gemm_a16w16
from gemmtune.tune.families.bf16 import TOLERANCES
from gemmtune.tune.gpulock import GpuLock, gpu_label
from gemmtune.tune.timing import copies_to_exceed_l2, interleaved_graph_us



@dataclass(frozen=True)
class Ceilings:
    bytes_per_s: float  # streaming read
    flops_per_s: float  # large square GEMM in the benchmarked dtype


@dataclass
class BenchRow:
    name: str
    M: int
    N: int
    K: int
    torch_us: float
    tuned_us: float
    speedup: float
    floor_us: float
    efficiency: float  # floor / tuned
    torch_efficiency: float
    rule: str
    kernel: str
    rel_err: float
    ok: bool


def _device_time_us(fn, reps: int) -> float:
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def measure_ceilings(dtype: torch.dtype) -> Ceilings:
    """Bandwidth: sum over a buffer far larger than L2 (2 GiB on a GPU); peak: an 8192^3 GEMM
    (1024^3 on the CPU) on random data (zeros run faster than real data)."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    # The CPU has no fast bf16 reduction or GEMM: measure its ceilings in fp32 (rough numbers).
    buf_dtype, mm_dtype = (torch.bfloat16, dtype) if gpu else (torch.float32, torch.float32)
    nbytes = (2 << 30) if gpu else (256 << 20)
    buf = torch.randn(nbytes // buf_dtype.itemsize, device=device).to(buf_dtype)
    read_us = _device_time_us(lambda: buf.sum(dtype=torch.float32), 10 if gpu else 3)
    del buf
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device).to(mm_dtype)
    b = torch.randn(n, n, device=device).to(mm_dtype)
    mm_us = _device_time_us(lambda: a @ b, 10 if gpu else 2)
    return Ceilings(nbytes / (read_us * 1e-6), 2.0 * n ** 3 / (mm_us * 1e-6))


def floor_us(m: int, n: int, k: int, elem: int, c: Ceilings) -> float:
    nbytes = (m * k + n * k + m * n) * elem
    return max(2.0 * m * n * k / c.flops_per_s, nbytes / c.bytes_per_s) * 1e6


def _time_pair(x, w, dtype) -> tuple[float, float]:
    if not x.is_cuda:
        def wall(fn):
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

        return wall(lambda: F.linear(x, w)), wall(lambda: gemm_a16w16(x, w))
    sets = [(x, w.clone()) for _ in range(copies_to_exceed_l2(w.numel() * w.element_size()))]
    (torch_us, _), (tuned_us, _) = interleaved_graph_us(
        [lambda s: F.linear(*s), lambda s: gemm_a16w16(*s)], sets)
    return torch_us, tuned_us


def bench_shape(name: str, m: int, n: int, k: int, dtype: torch.dtype, ceilings: Ceilings,
                gen: torch.Generator) -> BenchRow:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    y = gemm_a16w16(x, w)
    ref = gemm_a16w16_ref(x, w, out_dtype=torch.float32)
    rel = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool(torch.isfinite(y).all()) and rel <= TOLERANCES[dtype][2]  # the tuner's own bound
    decision = DISPATCH.plans[(m, n, k, False, dtype, dtype, False, False, x.get_device())
                              ].decision
    torch_us, tuned_us = _time_pair(x, w, dtype)
    floor = floor_us(m, n, k, dtype.itemsize, ceilings)
    return BenchRow(name, m, n, k, torch_us, tuned_us, torch_us / tuned_us, floor,
                    floor / tuned_us, floor / torch_us, decision.rule.value, decision.kernel_name,
                    rel, ok)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


M_RANGES = (("M<=64", 1, 64), ("64<M<1024", 65, 1023), ("M>=1024", 1024, 1 << 62))


def summarize(rows: list[BenchRow]) -> list[str]:
    lines = []
    for label, lo, hi in M_RANGES:
        sel = [r for r in rows if lo <= r.M <= hi]
        if sel:
            lines.append(
                f"{label:<11} {len(sel):>4} shapes: speed-up geomean {geomean([r.speedup for r in sel]):.3f} "
                f"(min {min(r.speedup for r in sel):.3f}); efficiency tuned "
                f"{geomean([r.efficiency for r in sel]):.3f}, torch "
                f"{geomean([r.torch_efficiency for r in sel]):.3f}")
    return lines


def write_csv(rows: list[BenchRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows({k: format(v, ".6g") if isinstance(v, float) else v
                          for k, v in asdict(r).items()} for r in rows)


def plot(rows: list[BenchRow], path: Path, title: str) -> str | None:
    """Speed-up and roofline efficiency against M, one line per (N, K). Returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install gemmtune[plot]); no plot written"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for (n, k) in sorted({(r.N, r.K) for r in rows}):
        sel = sorted((r for r in rows if (r.N, r.K) == (n, k)), key=lambda r: r.M)
        ms = [r.M for r in sel]
        ax1.plot(ms, [r.speedup for r in sel], marker="o", label=f"N={n} K={k}")
        ax2.plot(ms, [r.efficiency for r in sel], marker="o", label=f"N={n} K={k}")
    for ax, ylabel in ((ax1, "speed-up over torch"), (ax2, "roofline efficiency (floor / time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_ylim(0, max(1.05, 1.05 * max(r.efficiency for r in rows)))
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _measure_all(shapes: list[tuple[str, int, int, int]], dtype: torch.dtype,
                 gpu: bool) -> list[BenchRow]:
    ceilings = measure_ceilings(dtype)
    print(f"ceilings measured now: {ceilings.bytes_per_s / 1e9:.0f} GB/s streaming read, "
          f"{ceilings.flops_per_s / 1e12:.1f} TFLOP/s"
          + ("" if gpu else " (CPU: fp32, rough; efficiencies are indicative only)"))
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    return [bench_shape(name, m, n, k, dtype, ceilings, gen) for name, m, n, k in shapes]


def run_bench(shapes: list[tuple[str, int, int, int]], dtype: torch.dtype, out_dir: Path,
              title: str) -> int:
    gpu = torch.cuda.is_available()
    dev = current_device()
    print(f"GPU: {torch.cuda.get_device_name()} ({dev})" if gpu else
          f"no GPU found: benchmarking on the CPU ({dev}); GPU table rows do not apply, times are "
          f"CPU wall times")
    # No tuner may time on this GPU meanwhile (nor this bench disturb one).
    with GpuLock(gpu_label(torch.cuda.current_device())) if gpu else contextlib.nullcontext():
        rows = _measure_all(shapes, dtype, gpu)
    csv_path, png_path = out_dir / "bench_bf16.csv", out_dir / "bench_bf16.png"
    write_csv(rows, csv_path)
    why_no_plot = plot(rows, png_path, title)
    print(f"{'shape':<14} {'M':>5} {'N':>6} {'K':>6} {'torch us':>9} {'tuned us':>9} "
          f"{'speedup':>7} {'floor us':>8} {'eff':>5} {'rule':<8} kernel")
    for r in rows:
        flag = "" if r.ok else "  WRONG"
        print(f"{r.name:<14} {r.M:>5} {r.N:>6} {r.K:>6} {r.torch_us:>9.2f} {r.tuned_us:>9.2f} "
              f"{r.speedup:>7.3f} {r.floor_us:>8.2f} {r.efficiency:>5.3f} {r.rule:<8} "
              f"{r.kernel}{flag}")
    for line in summarize(rows):
        print(line)
    print(f"wrote {csv_path}" + (f" and {png_path}" if why_no_plot is None else f"; {why_no_plot}"))
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"WRONG results: {', '.join(f'{r.name} M={r.M}' for r in bad)}")
    return 1 if bad else 0
