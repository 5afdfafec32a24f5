"""Issue 16's end to end: would the next GEMM's weight, prefetched into L2 while the decode
step's other kernels run, make the MXFP4 GEMMs faster in the step?

The Llama decode step at batch 1 spends 0.62 ms (H200, session 41) in kernels other than its
GEMMs: norms, rotary embedding, attention, adds, about 20 µs between one GEMM and the next,
during which the memory is nearly idle. The MXFP4 GEMMs read their weights cold, at about 0.6
of the streaming rate. Here each of the step's weights (llama3-8b, siblings fused, packed, M = 1)
is timed through ``gemm_a16w4`` and the shipped table, behind a stand-in for those kernels (a
one-thread spin of ``WINDOW`` µs, ``torch.cuda._sleep``):

- ``cold``: the window, then the GEMM on a weight not in L2 (copies rotated past L2's size);
- ``prefetched``: the same, with the weight's first ``--budget-mb`` MB (codes, then scales)
  prefetched into L2 by a side stream while the window runs (``cp.async.bulk.prefetch.L2``, one
  4 KB chunk a thread, a warp a program: spread over many SMs);
- ``window`` and ``window + prefetch``: the window alone, and with the side stream's prefetch
  (it must not lengthen the window);
- ``hot``: the window, then the GEMM on one weight every call (all of it in L2 where it fits):
  the ceiling.

A GEMM's cost in the step is its variant's time less ``window``. One CUDA graph per
variant, replayed in alternation; µs per call, medians. The prefetched GEMM's output is checked
against the cold one's (within 1e-2: split sums added in arrival order may differ in the last
bits).

On an H200 the answer was no: hot took 0.94-1.00 of cold's time, prefetched 0.95-1.08
(docs/benchmarks.md, session 42); the decode kernels are not waiting on DRAM.

    PYTHONPATH=src python3 benchmarks/l2_prefetch_probe.py [--windows 5,20] [--budget-mb 16,40]
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import gemmtune
from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

# llama3-8b's decode GEMMs with the siblings fused: qkv, o, gate_up, down, lm_head (N, K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
CHUNK = 4096  # bytes a thread prefetches (one bulk prefetch instruction)
THREADS = 32  # a program's chunks: one warp, so that even a small weight's spread over SMs


@triton.jit
def _prefetch_l2(ptr, n_chunks, CHUNK_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    """Chunks of ``CHUNK_BYTES`` from ``ptr`` into L2, one a thread; threads past the last
    chunk repeat it (a prefetch has no mask)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.minimum(idx, n_chunks - 1).to(tl.int64) * CHUNK_BYTES
    tl.inline_asm_elementwise(
        f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK_BYTES};\nmov.u32 $0, 0;", "=r,l",
        [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, budget: int) -> int:
    """Launch the prefetch of ``t``'s first ``budget`` bytes (whole chunks); the bytes it
    covers."""
    n_chunks = min(t.numel() * t.element_size(), budget) // CHUNK
    if n_chunks:
        _prefetch_l2[(triton.cdiv(n_chunks, THREADS),)](
            t.view(torch.uint8), n_chunks, CHUNK_BYTES=CHUNK, BLOCK=THREADS, num_warps=1)
    return n_chunks * CHUNK


class Weight(NamedTuple):
    codes: torch.Tensor  # packed (mxfp4.prepack)
    scales: torch.Tensor


def weights(n: int, k: int, copies: int) -> list[Weight]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    codes, scales = gemmtune.quant.mxfp4(w)
    packed, scales = gemmtune.quant.prepack_mxfp4(codes, scales)
    return [Weight(packed.clone(), scales.clone()) for _ in range(copies)]


def spin_cycles_per_us() -> float:
    """``torch.cuda._sleep``'s cycles per µs on this GPU, timed alone (the windows' lengths
    are nominal; each variant's ``window`` time is measured beside it)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1000.0)


def probe(name: str, n: int, k: int, windows_us: list[float], budgets: list[int],
          cycles_per_us: float, side: torch.cuda.Stream) -> list[dict]:
    """The rows of one weight: a row per window length and prefetch budget."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    copies = copies_to_exceed_l2((n * k // 2) + n * (k // 32))
    sets = [(w,) for w in weights(n, k, copies)]

    def gemm(w: Weight) -> torch.Tensor:
        return gemmtune.gemm_a16w4(x, w.codes, w.scales, packed=True)

    rows = []
    for window_us in windows_us:
        spin = int(window_us * cycles_per_us)
        for budget in budgets:
            def side_prefetch(w: Weight, spin=spin, budget=budget) -> None:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w.scales, budget - prefetch(w.codes, budget))
                torch.cuda._sleep(spin)
                main.wait_stream(side)

            def cold(inp, spin=spin):
                torch.cuda._sleep(spin)
                return gemm(inp[0])

            def prefetched(inp, side_prefetch=side_prefetch):
                side_prefetch(inp[0])
                return gemm(inp[0])

            def window(inp, spin=spin):
                torch.cuda._sleep(spin)

            def window_prefetch(inp, side_prefetch=side_prefetch):
                side_prefetch(inp[0])

            def hot(inp, spin=spin):  # one copy every call: in L2 where it fits
                torch.cuda._sleep(spin)
                return gemm(sets[0][0])

            a, b = prefetched(sets[0]).float(), cold(sets[0]).float()
            # Split sums added in arrival order may move the last bits; a wrong result all
            if float((a - b).norm() / b.norm()) > 1e-2:
                raise RuntimeError(f"{name}: the prefetched GEMM's output differs from the "
                                   "cold one's")
            (c, _), (p, _), (wi, _), (wp, _), (h, _) = interleaved_graph_us(
                [cold, prefetched, window, window_prefetch, hot], sets)
            rows.append({"shape": name, "N": n, "K": k, "window_us": window_us,
                         "budget_mb": budget / 2**20, "cold": c, "prefetched": p, "window": wi,
                         "window_prefetch": wp, "hot": h, "gemm_cold": c - wi,
                         "gemm_prefetched": p - wi, "gemm_hot": h - wi,
                         "gain": (c - wi) / (p - wi) if p > wi else float("inf")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default="5,20", help="window lengths, µs")
    parser.add_argument("--budget-mb", default="16,40",
                        help="bytes prefetched per weight at most, MB (L2: 50 MB in two halves)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    cycles_per_us = spin_cycles_per_us()
    side = torch.cuda.Stream()
    windows = [float(w) for w in args.windows.split(",")]
    budgets = [int(float(b) * 2**20) for b in args.budget_mb.split(",")]
    rows = [row for name in args.shapes.split(",")
            for row in probe(name, *SHAPES[name], windows, budgets, cycles_per_us, side)]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "l2_prefetch.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{torch.cuda.get_device_name()}; spin {cycles_per_us:.0f} cycles/µs; µs per call; "
          "a GEMM's µs = its row's time less the window's")
    print(f"{'shape':8s} {'window':>6s} {'MB':>4s} {'window':>7s} {'+pref':>7s} {'cold':>7s} "
          f"{'prefetched':>10s} {'hot':>7s} {'gain':>6s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['window_us']:6.0f} {r['budget_mb']:4.0f} {r['window']:7.2f} "
              f"{r['window_prefetch']:7.2f} {r['gemm_cold']:7.2f} {r['gemm_prefetched']:10.2f} "
              f"{r['gemm_hot']:7.2f} {r['gain']:6.3f}")


if __name__ == "__main__":
    main()
