"""Host cost per call of gemm_a16w16's dispatch against plain F.linear, on the GPU.

A decode GEMM takes 5-20 µs on the GPU; the dispatch must add next to nothing on the host. This
times many back-to-back eager calls (host-bound for small shapes) of F.linear and of gemm_a16w16
whose table row names torch (so only the dispatch differs), and also the kernel time of each
backend under CUDA-graph replay. Then, on one shape whose GPU time is below every call's host
time, the op through a row of each backend against F.linear, in interleaved rounds (the host's
speed drifts between runs). Writes CSV to $OUT (or ./out) and prints the tables last.

    PYTHONPATH=src python benchmarks/dispatch_overhead.py
"""

from __future__ import annotations

import csv
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.kernels.triton.gemm_tile import TileConfig, default_config
from gemmtune.measure.timing import copies_to_exceed_l2, graph_replay_us, host_us_per_call

# Host-bound: a few µs of GPU time for every backend, below any call's host time.
BACKEND_SHAPE = (16, 256, 256)
BACKENDS = ["torch.linear", "triton.tile:BM16.BN64.BK128.G8.W4.S4",
            "triton.splitk:BM16.BN64.BK128.SK1.W4.S4", "triton.splitk:BM16.BN64.BK64.SK4.W4.S4",
            "triton.persistent:BM64.BN64.BK64.G8.W4.S3"]
ROUNDS = 7
SHAPES = [(1, 576, 7168), (16, 576, 7168), (16, 4096, 4096), (128, 4096, 4096),
          (1024, 4096, 4096), (4096, 4096, 4096)]


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


def _cublaslt_backend(m: int, n: int, k: int) -> list[str]:
    """cuBLASLt's heuristic pick for the shape, where nvmath is installed (else none)."""
    from gemmtune.kernels import cublaslt

    if cublaslt.nvmath_missing():
        print(f"no cuBLASLt row: {cublaslt.INSTALL_HINT}")
        return []
    return [cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)[0].name]


def backend_host_costs() -> list[dict]:
    """Host µs per eager call of F.linear and of the op forced to each backend (``kernel=``: a
    plan per backend, side by side), on BACKEND_SHAPE: the median over ROUNDS rounds, each
    timing every one in turn. Each backend's result is checked first."""
    m, n, k = BACKEND_SHAPE
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    ref = x.float() @ w.float().t()
    calls = {"F.linear": lambda: F.linear(x, w)}
    for name in BACKENDS + _cublaslt_backend(m, n, k):
        y = gemmtune.gemm_a16w16(x, w, kernel=name)  # plan, compile, record
        err = float((y.float() - ref).norm() / ref.norm())
        if err > 1e-2:
            raise RuntimeError(f"{name}: relative error {err:.1e}")
        calls[name] = lambda name=name: gemmtune.gemm_a16w16(x, w, kernel=name)
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            times[name].append(host_us_per_call(fn, calls=1000, loops=1))
    base = statistics.median(times["F.linear"])
    return [dict(backend=name, host_us=round(statistics.median(t), 2),
                 vs_linear=round(statistics.median(t) / base, 3)) for name, t in times.items()]


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        inputs = [(x.clone(), w.clone()) for _ in range(copies_to_exceed_l2(w.numel() * 2))]
        install_rows(m, n, k, "torch.linear")
        linear_host = host_us_per_call(lambda: F.linear(x, w))
        tuned_host = host_us_per_call(lambda: gemmtune.gemm_a16w16(x, w))
        x3 = x.view(1, m, k)  # models call with (batch, tokens, hidden): reshape + view cost
        tuned_host_3d = host_us_per_call(lambda: gemmtune.gemm_a16w16(x3, w))
        torch_gpu = graph_replay_us(lambda a: F.linear(*a), inputs)[0]
        tile: TileConfig = default_config(m, n, k, torch.bfloat16)
        install_rows(m, n, k, tile.name)
        y = gemmtune.gemm_a16w16(x, w)
        err = ((y.float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()).item()
        tile_host = host_us_per_call(lambda: gemmtune.gemm_a16w16(x, w))
        tile_gpu = graph_replay_us(lambda a: gemmtune.gemm_a16w16(*a), inputs)[0]
        results.append(dict(M=m, N=n, K=k, linear_host_us=linear_host, dispatch_host_us=tuned_host,
                            host_ratio=tuned_host / linear_host,
                            dispatch_host_3d_us=tuned_host_3d, torch_graph_us=torch_gpu,
                            triton_default=tile.name, triton_host_us=tile_host,
                            triton_graph_us=tile_gpu,
                            triton_rel_err=err))
    backends = backend_host_costs()
    with open(out_dir / "dispatch_overhead_backends.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(backends[0]))
        writer.writeheader()
        writer.writerows(backends)
    with open(out_dir / "dispatch_overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'M':>5} {'N':>5} {'K':>5} | {'F.linear host':>13} {'dispatch host':>13} {'ratio':>5} {'3-D x':>11} |"
          f" {'triton host':>11} | {'torch graph':>11} {'triton default':>14} {'err':>7}")
    for r in results:
        print(f"{r['M']:>5} {r['N']:>5} {r['K']:>5} | {r['linear_host_us']:>10.2f} us "
              f"{r['dispatch_host_us']:>10.2f} us {r['host_ratio']:>5.2f} "
              f"{r['dispatch_host_3d_us']:>8.2f} us | "
              f"{r['triton_host_us']:>8.2f} us | "
              f"{r['torch_graph_us']:>8.2f} us {r['triton_graph_us']:>11.2f} us "
              f"{r['triton_rel_err']:>7.1e}")

    m, n, k = BACKEND_SHAPE
    print(f"host µs per eager call at {m}x{n}x{k}, median of {ROUNDS} interleaved rounds:")
    for r in backends:
        print(f"  {r['backend']:<45} {r['host_us']:8.2f}  {r['vs_linear']:.3f}x F.linear")


if __name__ == "__main__":
    main()
