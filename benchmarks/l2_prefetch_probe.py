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
  4 KB chunk a thread: a few µs of issue on a few SMs);
- ``window`` and ``window + prefetch``: the window alone, and with the side stream's prefetch
  (it must not lengthen the window);
- ``hot``: the GEMM alone on one weight replayed (all of it in L2 where it fits): the ceiling.

The GEMM's cost in the step is (``cold`` or ``prefetched``) less ``window``. One CUDA graph per
variant, replayed in alternation; µs per call, medians. The prefetched GEMM's output is checked
against the cold one's (within 1e-2: split sums added in arrival order may differ in the last
bits).

    PYTHONPATH=src python3 benchmarks/l2_prefetch_probe.py [--windows 5,20] [--budget-mb 40]
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
THREADS = 128  # a program's chunks


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
            t.view(torch.uint8), n_chunks, CHUNK_BYTES=CHUNK, BLOCK=THREADS, num_warps=4)
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
    """``torch.cuda._sleep``'s cycles per µs on this GPU (its clock under load)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1000.0)


def probe(name: str, n: int, k: int, window_us: float, cycles_per_us: float, budget: int,
          side: torch.cuda.Stream) -> dict:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    copies = copies_to_exceed_l2((n * k // 2) + n * (k // 32))
    sets = [(w,) for w in weights(n, k, copies)]
    spin = int(window_us * cycles_per_us)

    def gemm(w: Weight) -> torch.Tensor:
        return gemmtune.gemm_a16w4(x, w.codes, w.scales, packed=True)

    def side_prefetch(w: Weight) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            left = budget - prefetch(w.codes, budget)
            prefetch(w.scales, left)
        torch.cuda._sleep(spin)
        main.wait_stream(side)

    def cold(inp):
        torch.cuda._sleep(spin)
        return gemm(inp[0])

    def prefetched(inp):
        side_prefetch(inp[0])
        return gemm(inp[0])

    def window(inp):
        torch.cuda._sleep(spin)

    def window_prefetch(inp):
        side_prefetch(inp[0])

    a, b = prefetched(sets[0]).float(), cold(sets[0]).float()
    # Split sums added in arrival order may move the last bits; a wrong result moves them all
    if float((a - b).norm() / b.norm()) > 1e-2:
        raise RuntimeError(f"{name}: the prefetched GEMM's output differs from the cold one's")
    (c, _), (p, _), (wi, _), (wp, _) = interleaved_graph_us(
        [cold, prefetched, window, window_prefetch], sets)
    hot, _ = interleaved_graph_us([lambda inp: gemm(inp[0])], sets[:1])[0]
    return {"shape": name, "N": n, "K": k, "window_us": window_us, "cold": c,
            "prefetched": p, "window": wi, "window_prefetch": wp, "hot": hot,
            "gemm_cold": c - wi, "gemm_prefetched": p - wi,
            "gain": (c - wi) / (p - wi) if p > wi else float("inf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", default="5,20", help="window lengths, µs")
    parser.add_argument("--budget-mb", type=float, default=40.0,
                        help="bytes prefetched per weight at most (L2 is 50 MB)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    cycles_per_us = spin_cycles_per_us()
    side = torch.cuda.Stream()
    budget = int(args.budget_mb * 2**20)
    rows = [probe(name, *SHAPES[name], float(w), cycles_per_us, budget, side)
            for name in args.shapes.split(",") for w in args.windows.split(",")]
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "l2_prefetch.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{torch.cuda.get_device_name()}; spin {cycles_per_us:.0f} cycles/µs; prefetch budget "
          f"{args.budget_mb:g} MB; µs per call")
    print(f"{'shape':8s} {'window':>6s} {'window':>7s} {'+pref':>7s} {'GEMM cold':>9s} "
          f"{'prefetched':>10s} {'hot':>7s} {'gain':>6s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['window_us']:6.0f} {r['window']:7.2f} {r['window_prefetch']:7.2f}"
              f" {r['gemm_cold']:9.2f} {r['gemm_prefetched']:10.2f} {r['hot']:7.2f}"
              f" {r['gain']:6.3f}")


if __name__ == "__main__":
    main()
