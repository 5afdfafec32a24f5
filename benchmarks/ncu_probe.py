"""Where a decode GEMM's time goes, per kernel, from Nsight Compute (issue 15).

Runs ``gemm_a8w8`` on one shape with each named kernel (a few launches each, after a warm-up
pass that compiles them) so that ``ncu`` can profile the last launch of each:

    ncu --launch-skip-before-match 0 --section SpeedOfLight ... \
        python3 benchmarks/ncu_probe.py --shape 16,4096,4096 --kernels NAME,NAME,...

Each kernel is preceded by an NVTX range named after it (``ncu --nvtx``); the weights are
fresh copies per launch so each launch reads w from DRAM, as decode does.
"""

from __future__ import annotations

import argparse

import torch

import gemmtune
from gemmtune import quant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16,4096,4096", help="M,N,K")
    parser.add_argument("--kernels", required=True, help="comma-separated kernelNames")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen)
    xq, xs = quant.per_token_fp8(x)
    ws = []
    for _ in range(4):  # > L2 for the larger shapes; each launch a different copy
        w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
        ws.append(quant.per_channel_fp8(w))
    names = args.kernels.split(",")
    for name in names:  # compile and check first
        y = gemmtune.gemm_a8w8(xq, ws[0][0], xs.reshape(-1), ws[0][1].reshape(-1), kernel=name)
    torch.cuda.synchronize()
    for name in names:
        torch.cuda.nvtx.range_push(name)
        for i in range(args.launches):
            wq, wsc = ws[i % len(ws)]
            y = gemmtune.gemm_a8w8(xq, wq, xs.reshape(-1), wsc.reshape(-1), kernel=name)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print("ok", tuple(y.shape))


if __name__ == "__main__":
    main()
