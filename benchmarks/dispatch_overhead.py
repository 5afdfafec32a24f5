"""Host cost per call of gemm_a16w16's dispatch against plain F.linear, on the GPU.

A decode GEMM takes 5-20 µs on the GPU; the dispatch must add next to nothing on the host. This
times many back-to-back eager calls (host-bound for small shapes) of F.linear and of gemm_a16w16
whose table row names torch (so only the dispatch differs), and also the kernel time of each
backend under CUDA-graph replay. Then, on one shape whose GPU time is below every call's host
time, each op (gemm_a16w16, gemm_a8w8, gemm_a8w8_blockscale) through each backend against
F.linear and against the raw torch call its torch backend makes, in interleaved rounds (the
host's speed drifts between runs). Writes CSV to $OUT (or ./out) and prints the tables last.

    PYTHONPATH=src python benchmarks/dispatch_overhead.py
"""

from __future__ import annotations

import copy
import csv
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import quant
from gemmtune.kernels.triton.gemm_tile import TileConfig, default_config
from gemmtune.measure.timing import copies_to_exceed_l2, graph_replay_us, host_us_per_call

# Host-bound: a few µs of GPU time for every backend, below any call's host time. Block
# scales take K = 512: cuBLAS's block-wise GEMM needs K/128 a multiple of 4.
BACKEND_SHAPES = {"gemm_a16w16": (16, 256, 256), "gemm_a8w8": (16, 256, 256),
                  "gemm_a8w8_blockscale": (16, 256, 512)}
# Per op, the backends timed (forced with ``kernel=``); cuBLASLt's heuristic pick is added
# where nvmath is installed.
OP_BACKENDS = {
    "gemm_a16w16": ["torch.linear", "triton.tile:BM16.BN64.BK128.G8.W4.S4",
                    "triton.splitk:BM16.BN64.BK128.SK1.W4.S4",
                    "triton.splitk:BM16.BN64.BK64.SK4.W4.S4",
                    "triton.persistent:BM64.BN64.BK64.G8.W4.S3"],
    "gemm_a8w8": ["torch.scaled_mm", "triton.tile:BM16.BN64.BK128.G8.W4.S4",
                  "triton.splitk:BM16.BN64.BK128.SK1.W4.S4",
                  "triton.splitk:BM16.BN64.BK64.SK4.W4.S4",
                  "triton.persistent:BM64.BN64.BK128.G8.W4.S3"],
    "gemm_a8w8_blockscale": ["torch.scaled_mm_blockwise", "triton.tile:BM16.BN64.BK128.G8.W4.S4",
                             "triton.splitk:BM16.BN64.BK128.SK1.W4.S4",
                             "triton.splitk:BM16.BN64.BK128.SK2.W4.S4"],
}
ROUNDS = 15
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


def _cublaslt_backend(op: str, m: int, n: int, k: int) -> list[str]:
    """cuBLASLt's heuristic pick for the shape, where the op has a cuBLASLt backend and nvmath
    is installed (else none)."""
    from gemmtune.kernels import cublaslt

    if op == "gemm_a8w8_blockscale":
        return []
    if cublaslt.nvmath_missing():
        print(f"no cuBLASLt row: {cublaslt.INSTALL_HINT}")
        return []
    if op == "gemm_a16w16":
        return [cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)[0].name]
    return [cublaslt.heuristic_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                                     scaling="outer")[0].name]


def _op_calls(op: str, m: int, n: int, k: int):
    """F.linear's call, the torch call the op's torch backend wraps (made ready as a user
    would), ``call(name, bound=False)``: the op's call forcing a kernel by name (made, or with
    ``bound`` given as a function of no arguments, as the F.linear line is), and the fp32
    reference."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    linear = ("F.linear", lambda: F.linear(x, w))
    if op == "gemm_a16w16":
        def call(name, bound=False):
            fn = lambda: gemmtune.gemm_a16w16(x, w, kernel=name)  # noqa: E731
            return fn if bound else fn()

        return [linear], call, x.float() @ w.float().t()
    if op == "gemm_a8w8":
        xq, xs = quant.per_token_fp8(x)
        wq, ws = quant.per_channel_fp8(w)
        wq_t, ws_row = wq.t(), ws.view(1, n)
        raw = ("torch._scaled_mm (row-wise)", lambda: torch._scaled_mm(
            xq, wq_t, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16))
        ref = (xq.float() @ wq.float().t()) * xs * ws.view(1, n)
        def call(name, bound=False):
            fn = lambda: gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel=name)  # noqa: E731
            return fn if bound else fn()

        return [linear, raw], call, ref
    xq, xs = quant.per_block_fp8(x, (1, 128))
    wq, ws = quant.per_block_fp8(w, (128, 128))
    xs_m_major, ws_t = xs.t().contiguous().t(), ws.t()
    raw = ("torch._scaled_mm (block-wise)", lambda: torch._scaled_mm(
        xq, wq.t(), scale_a=xs_m_major, scale_b=ws_t, out_dtype=torch.bfloat16))
    ref = quant.dequant_per_block(xq, xs, (1, 128)) @ quant.dequant_per_block(
        wq, ws, (128, 128)).t()
    def call(name, bound=False):
        fn = lambda: gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws, kernel=name)  # noqa: E731
        return fn if bound else fn()

    return [linear, raw], call, ref


def backend_host_costs(op: str) -> list[dict]:
    """Host µs per eager call of F.linear, of the raw torch call the op's torch backend makes,
    and of the op forced to each backend (``kernel=``: a plan per backend, side by side), on
    the op's BACKEND_SHAPES: the median over ROUNDS rounds, each timing every one in turn. Each backend's
    result is checked first; a backend that cannot run the shape is reported and left out."""
    m, n, k = BACKEND_SHAPES[op]
    references, op_call, ref = _op_calls(op, m, n, k)
    calls = dict(references)
    for name in OP_BACKENDS[op] + _cublaslt_backend(op, m, n, k):
        try:
            y = op_call(name)  # plan, compile, record
        except ValueError as e:
            print(f"{op} {name}: cannot run {m}x{n}x{k}: {e}")
            continue
        err = float((y.float() - ref).norm() / ref.norm())
        if err > 3e-2:
            raise RuntimeError(f"{op} {name}: relative error {err:.1e}")
        calls[name] = op_call(name, bound=True)
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            times[name].append(host_us_per_call(fn, calls=500, loops=1))
    raw_name = references[-1][0]

    def ratio(t: list[float], base: list[float]) -> float:
        # Each round's ratio to the reference timed beside it: the host drifts between rounds.
        return statistics.median(a / b for a, b in zip(t, base))

    return [dict(op=op, backend=name, host_us=round(statistics.median(t), 2),
                 vs_linear=round(ratio(t, times["F.linear"]), 3),
                 vs_torch_call=round(ratio(t, times[raw_name]), 3))
            for name, t in times.items()]


@torch.no_grad()
def layer_host_costs() -> list[dict]:
    """Host µs per eager call of a patched layer (``TunedLinear``, its table row naming each
    gemm_a16w16 backend in turn) against the same ``nn.Linear``, on a model's (1, M, K) input,
    under no_grad as in generation: the median over ROUNDS rounds of each round's ratio."""
    m, n, k = BACKEND_SHAPES["gemm_a16w16"]
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    plain = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), plain.weight.float())
    rows = []
    for name in OP_BACKENDS["gemm_a16w16"] + _cublaslt_backend("gemm_a16w16", m, n, k):
        install_rows(m, n, k, name)
        patched = copy.deepcopy(plain)
        gemmtune.patch_linear(patched)
        err = float((patched(x).float() - want).norm() / want.norm())
        if err > 3e-2:
            raise RuntimeError(f"TunedLinear {name}: relative error {err:.1e}")
        times = {"nn.Linear": [], "TunedLinear": []}
        for _ in range(ROUNDS):
            times["nn.Linear"].append(host_us_per_call(lambda: plain(x), calls=500, loops=1))
            times["TunedLinear"].append(host_us_per_call(lambda: patched(x), calls=500, loops=1))
        rows.append(dict(backend=name, linear_us=round(statistics.median(times["nn.Linear"]), 2),
                         tuned_us=round(statistics.median(times["TunedLinear"]), 2),
                         vs_linear=round(statistics.median(
                             a / b for a, b in zip(times["TunedLinear"], times["nn.Linear"])), 3)))
    return rows


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
    backends = [row for op in OP_BACKENDS for row in backend_host_costs(op)]
    layers = layer_host_costs()
    with open(out_dir / "dispatch_overhead_layers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(layers[0]))
        writer.writeheader()
        writer.writerows(layers)
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

    print(f"host µs per eager call at {BACKEND_SHAPES}, median of {ROUNDS} interleaved rounds "
          f"(vs the torch call: F.linear, or the raw torch._scaled_mm the op's torch backend "
          f"makes):")
    for r in backends:
        print(f"  {r['op']:<21} {r['backend']:<58} {r['host_us']:8.2f}  "
              f"{r['vs_linear']:.3f}x F.linear  {r['vs_torch_call']:.3f}x torch call")

    print(f"a patched layer against nn.Linear, x (1, {BACKEND_SHAPES['gemm_a16w16'][0]}, K), "
          f"no_grad, median of {ROUNDS} rounds' ratios:")
    for r in layers:
        print(f"  TunedLinear {r['backend']:<58} {r['tuned_us']:8.2f}  nn.Linear "
              f"{r['linear_us']:8.2f}  {r['vs_linear']:.3f}x")


if __name__ == "__main__":
    main()
