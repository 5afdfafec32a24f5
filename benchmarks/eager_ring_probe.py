"""Host cost of an eager call whose row is ``triton.ring`` against the row it replaced, on the
shapes where it won a8w8 rows in session 21 (then not replayed: 194 µs a call), and with FP8
block scales against a split-K row of the block-scale table (issue 15).

Per kernel: the median wall time of an eager ``gemm_a8w8`` call over many calls, with a
synchronize only at the end of each block (what a CPU-bound eager decode step pays), beside the
CUDA-graph time of the same call.

    PYTHONPATH=src python3 benchmarks/eager_ring_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

from gemmtune import quant
from gemmtune.families.a8w8 import gemm_a8w8
from gemmtune.families.a8w8_blockscale import gemm_a8w8_blockscale
from gemmtune.measure.timing import graph_replay_us

CASES = ((16, 1280, 8192, "triton.splitk:BM16.BN32.BK256.SK6.W2.S4.P1"),
         (16, 1536, 7168, "cublaslt:id66.tile64x16.stages128xAUTO.sk1.red0.swz0.co7.cl1x1x1.in0"))
RING = {(1280, 8192): "triton.ring:BM16.BK256.S4.SK7", (1536, 7168): "triton.ring:BM16.BK256.S4.SK6"}
BLOCK_CASES = ((16, 1536, 7168, "triton.splitk:BM16.BN32.BK128.SK4.W1.S5.P1",
                "triton.ring:BM16.BK128.S8.SK6"),)


def eager_us(fn, calls: int = 200, blocks: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def main() -> None:
    for m, n, k, old in CASES:
        gen = torch.Generator(device="cuda").manual_seed(n)
        xq, xs = quant.per_token_fp8(torch.randn(m, k, device="cuda", generator=gen))
        wq, ws = quant.per_channel_fp8(torch.randn(n, k, device="cuda", generator=gen) / 64)
        xs, ws = xs.reshape(-1), ws.reshape(-1)
        for name in (old, RING[(n, k)]):
            def fn(name=name):
                return gemm_a8w8(xq, wq, xs, ws, kernel=name)

            eager = eager_us(fn)  # warms the call (compiled, planned) before the capture
            graph, _ = graph_replay_us(lambda _: fn(), [None], replays=50)
            print(f"{m}x{n}x{k} {name[:40]:40s} eager {eager:7.2f} us/call, graph {graph:6.2f} us",
                  flush=True)
    for m, n, k, *names in BLOCK_CASES:
        gen = torch.Generator(device="cuda").manual_seed(n)
        xq, xs = quant.per_block_fp8(torch.randn(m, k, device="cuda", generator=gen),
                                     quant.ACT_BLOCK)
        wq, ws = quant.per_block_fp8(torch.randn(n, k, device="cuda", generator=gen) / 64,
                                     quant.WEIGHT_BLOCK)
        for name in names:
            def fn(name=name):
                return gemm_a8w8_blockscale(xq, wq, xs, ws, kernel=name)

            eager = eager_us(fn)
            graph, _ = graph_replay_us(lambda _: fn(), [None], replays=50)
            print(f"block {m}x{n}x{k} {name[:40]:40s} eager {eager:7.2f} us/call, "
                  f"graph {graph:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
