"""Host cost per call of gemm_a16w16's dispatch against plain F.linear, on the GPU.

A decode GEMM takes 5-20 µs on the GPU; the dispatch must add next to nothing on the host. This
times many back-to-back eager calls (host-bound for small shapes) of F.linear and of gemm_a16w16
whose table row names torch (so only the dispatch differs), and also the kernel time of each
backend under CUDA-graph replay. Writes CSV to $OUT (or ./out) and prints a table last.

    PYTHONPATH=src python benchmarks/dispatch_overhead.py
"""

from __future__ import annotations

import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.kernels.triton.gemm_tile import TileConfig, default_config

SHAPES = [(1, 576, 7168), (16, 576, 7168), (16, 4096, 4096), (128, 4096, 4096),
          (1024, 4096, 4096), (4096, 4096, 4096)]
CALLS = 2000


def host_us_per_call(fn) -> float:
    """Median over 5 loops of CALLS eager calls, synchronised at the end of each loop."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(loops)


def graph_us(fn, inputs) -> float:
    """Kernel time under CUDA-graph replay, rotating over input copies larger than L2 (cold)."""
    fn(inputs[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inp in inputs:
            fn(inp)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return statistics.median(times)


def install_rows(m, n, k, kernel) -> None:
    dev = gemmtune.current_device()
    path = Path(tempfile.mkdtemp()) / "rows.csv"
    path.write_text(
        "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
        "kernelName,err_ratio,tflops,bw\n"
        f"{dev.arch},{dev.cu_num},{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,False,"
        f"x,0,0,1.0,{kernel},0,0,0\n")
    os.environ["GEMMTUNE_CONFIG_BF16"] = f"replace:{path}"
    gemmtune.reset()


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    l2 = 50 * 2**20
    results = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        copies = max(2, -(-2 * l2 // (w.numel() * 2)))
        inputs = [(x.clone(), w.clone()) for _ in range(min(copies, 64))]
        install_rows(m, n, k, "torch.linear")
        linear_host = host_us_per_call(lambda: F.linear(x, w))
        tuned_host = host_us_per_call(lambda: gemmtune.gemm_a16w16(x, w))
        torch_gpu = graph_us(lambda a: F.linear(*a), inputs)
        tile: TileConfig = default_config(m, n, k, torch.bfloat16)
        install_rows(m, n, k, tile.name)
        y = gemmtune.gemm_a16w16(x, w)
        err = ((y.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()).item()
        tile_gpu = graph_us(lambda a: gemmtune.gemm_a16w16(*a), inputs)
        results.append(dict(M=m, N=n, K=k, linear_host_us=linear_host, dispatch_host_us=tuned_host,
                            host_ratio=tuned_host / linear_host, torch_graph_us=torch_gpu,
                            triton_default=tile.name, triton_graph_us=tile_gpu,
                            triton_rel_err=err))
    with open(out_dir / "dispatch_overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'M':>5} {'N':>5} {'K':>5} | {'F.linear host':>13} {'dispatch host':>13} {'ratio':>5} |"
          f" {'torch graph':>11} {'triton default':>14} {'err':>7}")
    for r in results:
        print(f"{r['M']:>5} {r['N']:>5} {r['K']:>5} | {r['linear_host_us']:>10.2f} us "
              f"{r['dispatch_host_us']:>10.2f} us {r['host_ratio']:>5.2f} | "
              f"{r['torch_graph_us']:>8.2f} us {r['triton_graph_us']:>11.2f} us "
              f"{r['triton_rel_err']:>7.1e}")


if __name__ == "__main__":
    main()
