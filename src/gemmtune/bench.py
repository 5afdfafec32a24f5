"""``gemmtune bench bf16|a8w8|a8w8-blockscale``: tuned vs torch vs the roofline, per shape, in one run on one device.

For every shape: torch's default (``F.linear`` for bf16, ``torch._scaled_mm`` row-wise / ``_int_mm``
for a8w8, its block-wise mode for a8w8-blockscale) and the tuned op (through the tables in force) are timed the same way, in alternation
(CUDA-graph replay over weight copies larger than L2, i.e. cold weights as in decode); the tuned
output is checked against an fp32 reference; the floor is max(FLOPs / peak, bytes / bandwidth)
with both ceilings measured in the same run (bandwidth as a streaming read, which a GEMM's weight
read is; a copy's read+write rate would overstate the floor; peak as a large GEMM of the
benchmarked input dtype).
"""

from __future__ import annotations

import contextlib
import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune.device import current_device
from gemmtune.kernels.torch_ref import TORCH_LINEAR, gemm_a16w16_ref
from gemmtune.ops._dispatch import Decision
from gemmtune.ops.gemm_a8w8 import DISPATCH as A8W8_DISPATCH
from gemmtune.ops.gemm_a8w8 import (TORCH_SCALED_MM, gemm_a8w8, gemm_a8w8_ref, scaled_mm_torch,
                                    torch_fast_path)
from gemmtune.ops.gemm_a8w8_blockscale import DISPATCH as BLOCKSCALE_DISPATCH
from gemmtune.ops.gemm_a8w8_blockscale import (TORCH_BLOCKSCALE, blockscale_torch,
                                               cublas_block_wise, gemm_a8w8_blockscale,
                                               gemm_a8w8_blockscale_ref)
from gemmtune.ops.gemm_a16w16 import DISPATCH as A16W16_DISPATCH
from gemmtune.ops.gemm_a16w16 import gemm_a16w16
from gemmtune.tables.values import DTYPE_NAMES
from gemmtune.tune.families._gemm import TOLERANCES
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
    torch_is_reference: bool = False  # torch's column ran the fp32 reference, not cuBLAS
    # The tuned op dispatched to the torch backend itself: both columns ran one function, so the
    # speed-up is 1 but for the spread between two CUDA graphs of the same kernel.
    same_kernel: bool = False


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


def measure_ceilings(op: BenchOp) -> Ceilings:
    """Bandwidth: sum over a buffer far larger than L2 (2 GiB on a GPU); peak: ``op``'s own
    8192^3 GEMM through torch (1024^3 in fp32 on the CPU) on random data (zeros run faster)."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    # The CPU has no fast bf16 reduction or GEMM: measure its ceilings in fp32 (rough numbers).
    buf_dtype = torch.bfloat16 if gpu else torch.float32
    nbytes = (2 << 30) if gpu else (256 << 20)
    buf = torch.randn(nbytes // buf_dtype.itemsize, device=device).to(buf_dtype)
    read_us = _device_time_us(lambda: buf.sum(dtype=torch.float32), 10 if gpu else 3)
    del buf
    n = 8192 if gpu else 1024
    if gpu:
        args = op.inputs(n, n, n, torch.Generator(device=device).manual_seed(1))
        mm_us = _device_time_us(lambda: op.torch(args), 10)
    else:
        a, b = torch.randn(n, n), torch.randn(n, n)
        mm_us = _device_time_us(lambda: a @ b, 2)
    return Ceilings(nbytes / (read_us * 1e-6), 2.0 * n ** 3 / (mm_us * 1e-6))


def floor_us(m: int, n: int, k: int, op: BenchOp, c: Ceilings) -> float:
    nbytes = (m * k + n * k) * op.in_bytes + m * n * op.out_bytes
    return max(2.0 * m * n * k / c.flops_per_s, nbytes / c.bytes_per_s) * 1e6


@dataclass(frozen=True)
class BenchOp:
    """One op family as the bench runs it. ``inputs(m, n, k, gen)`` gives the call's arguments,
    ``w`` (the weight) at ``w_index``; ``torch``/``tuned``/``reference`` run on those arguments;
    ``table_key(m, n, k)`` is the key the tuned op looks up."""

    family: str
    in_bytes: int
    out_bytes: int
    w_index: int
    inputs: Callable[[int, int, int, torch.Generator], tuple]
    torch: Callable[[tuple], torch.Tensor]
    tuned: Callable[[tuple], torch.Tensor]
    reference: Callable[[tuple], torch.Tensor]
    table_key: Callable[[int, int, int], tuple]
    decide: Callable[[tuple], Decision]
    rel_bound: float
    # File stem of the CSV and PNG (family and, where it has several, dtype).
    label: str = ""
    # (M, N, K) -> True where the torch column runs the fp32 reference, not a fast kernel.
    torch_is_reference: Callable[[int, int, int], bool] = lambda m, n, k: False
    # The table's name for the torch backend, which runs what the torch column runs.
    torch_kernel: str = TORCH_LINEAR


def bf16_op(dtype: torch.dtype) -> BenchOp:
    def inputs(m, n, k, gen):
        device = gen.device
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
        return x, w

    name = DTYPE_NAMES[dtype]
    return BenchOp(
        "bf16", dtype.itemsize, dtype.itemsize, 1, inputs,
        torch=lambda a: F.linear(*a), tuned=lambda a: gemm_a16w16(*a),
        reference=lambda a: gemm_a16w16_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: (m, n, k, False, name, name, False, False),
        decide=A16W16_DISPATCH.decide, rel_bound=TOLERANCES[dtype][2])


def a8w8_op_for(q_dtype: torch.dtype) -> BenchOp:
    """Per-token activations x per-channel weights, bf16 output: FP8/INT8 serving's layout."""
    from gemmtune import quant

    per_token, per_channel = quant.token_channel_quantisers(q_dtype)

    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = per_token(torch.randn(m, k, generator=gen, device=device))
        wq, ws = per_channel(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
        return xq, wq, xs.reshape(-1), ws.reshape(-1)

    def torch_call(a):
        return scaled_mm_torch(a[0], a[1], None, torch.bfloat16, a[2], a[3])

    name = DTYPE_NAMES[q_dtype]
    gpu = torch.cuda.is_available()
    return BenchOp(
        "a8w8", 1, 2, 1, inputs, torch=torch_call, tuned=lambda a: gemm_a8w8(*a),
        reference=lambda a: gemm_a8w8_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: (m, n, k, name), torch_kernel=TORCH_SCALED_MM,
        decide=A8W8_DISPATCH.decide, rel_bound=TOLERANCES[torch.bfloat16][2],
        label="a8w8" if q_dtype == torch.float8_e4m3fn else "a8w8_int8",
        torch_is_reference=lambda m, n, k: not torch_fast_path(m, n, k, q_dtype, gpu))


def a8w8_blockscale_op() -> BenchOp:
    """FP8 with DeepSeek-style block scales (x per 1x128, w per 128x128), bf16 output."""
    from gemmtune import quant

    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = quant.per_block_fp8(torch.randn(m, k, generator=gen, device=device),
                                     quant.ACT_BLOCK)
        wq, ws = quant.per_block_fp8(torch.randn(n, k, generator=gen, device=device) / k ** 0.5,
                                     quant.WEIGHT_BLOCK)
        return xq, wq, xs, ws

    return BenchOp(
        "a8w8_blockscale", 1, 2, 1, inputs,
        torch=lambda a: blockscale_torch(a[0], a[1], None, torch.bfloat16, a[2], a[3]),
        tuned=lambda a: gemm_a8w8_blockscale(*a),
        reference=lambda a: gemm_a8w8_blockscale_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: (m, n, k), torch_kernel=TORCH_BLOCKSCALE,
        decide=BLOCKSCALE_DISPATCH.decide, rel_bound=TOLERANCES[torch.bfloat16][2],
        torch_is_reference=lambda m, n, k: not (torch.cuda.is_available()
                                                 and cublas_block_wise(n, k)))


def _time_pair(op: BenchOp, args: tuple) -> tuple[float, float]:
    if not args[0].is_cuda:
        def wall(fn):
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

        return wall(lambda: op.torch(args)), wall(lambda: op.tuned(args))
    w = args[op.w_index]
    sets = [args[:op.w_index] + (w.clone(),) + args[op.w_index + 1:]
            for _ in range(copies_to_exceed_l2(w.numel() * w.element_size()))]
    (torch_us, _), (tuned_us, _) = interleaved_graph_us([op.torch, op.tuned], sets)
    return torch_us, tuned_us


def bench_shape(name: str, m: int, n: int, k: int, op: BenchOp, ceilings: Ceilings,
                gen: torch.Generator) -> BenchRow:
    args = op.inputs(m, n, k, gen)
    y = op.tuned(args)
    ref = op.reference(args)
    rel = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool(torch.isfinite(y).all()) and rel <= op.rel_bound  # the tuner's own bound
    decision = op.decide(op.table_key(m, n, k))
    torch_us, tuned_us = _time_pair(op, args)
    floor = floor_us(m, n, k, op, ceilings)
    return BenchRow(name, m, n, k, torch_us, tuned_us, torch_us / tuned_us, floor,
                    floor / tuned_us, floor / torch_us, decision.rule.value, decision.kernel_name,
                    rel, ok, op.torch_is_reference(m, n, k),
                    same_kernel=decision.kernel_name == op.torch_kernel)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


M_RANGES = (("M<=64", 1, 64), ("64<M<1024", 65, 1023), ("M>=1024", 1024, 1 << 62))
# The issues' floor for every shape: the tuned op at least this fraction of torch's speed.
SLOWER_THAN_TORCH = 0.98


def summarize(rows: list[BenchRow]) -> list[str]:
    """Per M range: speed-up and efficiency geomeans. Shapes whose torch column ran the fp32
    reference are left out of the speed-up and of torch's efficiency (neither says anything
    about cuBLAS there) and counted apart. Last, if any: the shapes below 0.98x torch."""
    lines = []
    for label, lo, hi in M_RANGES:
        sel = [r for r in rows if lo <= r.M <= hi]
        if not sel:
            continue
        fast = [r for r in sel if not r.torch_is_reference]
        against = (f"speed-up geomean {geomean([r.speedup for r in fast]):.3f} "
                   f"(min {min(r.speedup for r in fast):.3f})" if fast
                   else "no shape with a fast torch kernel")
        apart = (f"; {len(sel) - len(fast)} with torch = reference left out of speed-up and "
                 f"torch efficiency" if len(fast) < len(sel) else "")
        torch_eff = f"{geomean([r.torch_efficiency for r in fast]):.3f}" if fast else "n/a"
        lines.append(
            f"{label:<11} {len(sel):>4} shapes: {against}; efficiency tuned "
            f"{geomean([r.efficiency for r in sel]):.3f}, torch {torch_eff}{apart}")
    slower = [r for r in rows if r.speedup < SLOWER_THAN_TORCH and not r.torch_is_reference]
    if slower:
        noise = sum(r.same_kernel for r in slower)
        lines.append(f"below {SLOWER_THAN_TORCH}x torch: {len(slower)} shape(s), "
                     + ", ".join(f"{r.name} {r.M}x{r.N}x{r.K} {r.speedup:.3f}"
                                 + (" (torch's own kernel in both columns)" if r.same_kernel
                                    else "") for r in slower)
                     + (f"; {noise} of them measurement spread" if noise else ""))
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


def _measure_all(shapes: list[tuple[str, int, int, int]], op: BenchOp,
                 gpu: bool) -> list[BenchRow]:
    ceilings = measure_ceilings(op)
    print(f"ceilings measured now: {ceilings.bytes_per_s / 1e9:.0f} GB/s streaming read, "
          f"{ceilings.flops_per_s / 1e12:.1f} TFLOP/s"
          + ("" if gpu else " (CPU: fp32, rough; efficiencies are indicative only)"))
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    return [bench_shape(name, m, n, k, op, ceilings, gen) for name, m, n, k in shapes]


def run_bench(shapes: list[tuple[str, int, int, int]], op: BenchOp, out_dir: Path,
              title: str) -> int:
    gpu = torch.cuda.is_available()
    dev = current_device()
    print(f"GPU: {torch.cuda.get_device_name()} ({dev})" if gpu else
          f"no GPU found: benchmarking on the CPU ({dev}); GPU table rows do not apply, times are "
          f"CPU wall times")
    # No tuner may time on this GPU meanwhile (nor this bench disturb one).
    with GpuLock(gpu_label(torch.cuda.current_device())) if gpu else contextlib.nullcontext():
        rows = _measure_all(shapes, op, gpu)
    slow = [f"{r.M}x{r.N}x{r.K}" for r in rows if r.torch_is_reference]
    if slow:
        print(f"torch column = the dequantised fp32 reference (no fast torch kernel takes the "
              f"shape; speed-ups there are not against cuBLAS): {', '.join(slow)}")
    stem = op.label or op.family
    csv_path = out_dir / f"bench_{stem}.csv"
    png_path = out_dir / f"bench_{stem}.png"
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
