"""Where a decode GEMM's time goes, per kernel, from Nsight Compute (issues 15 and 16).

Runs one op (``--family``: a8w8, a8w8-blockscale or a16w4) on one shape with each named kernel
(a few launches each, after a warm-up pass that compiles them) so that ``ncu`` can profile the
last launch of each:

    ncu --clock-control none --launch-skip-before-match 0 --section SpeedOfLight ... \
        python3 benchmarks/ncu_probe.py --family a16w4 --shape 1,28672,4096 --kernels NAME,...

Each kernel is preceded by an NVTX range named after it (``ncu --nvtx``); the weights are
fresh copies per launch so each launch reads w from DRAM, as decode does. An a16w4 kernel
name with ``.L1`` gets the packed weight (``quant.prepack_mxfp4``).
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

import torch

import gemmtune
from gemmtune import quant


class Operands(NamedTuple):
    """x's operands, and a call of the op on one copy of the weight with a named kernel."""

    weights: list  # per copy: whatever ``call`` takes for w
    call: Callable  # call(weight, kernel_name) -> y


def a8w8_operands(x: torch.Tensor, ws: list[torch.Tensor]) -> Operands:
    xq, xs = quant.per_token_fp8(x)
    return Operands([quant.per_channel_fp8(w) for w in ws], lambda w, name: gemmtune.gemm_a8w8(
        xq, w[0], xs.reshape(-1), w[1].reshape(-1), kernel=name))


def blockscale_operands(x: torch.Tensor, ws: list[torch.Tensor]) -> Operands:
    xq, xs = quant.per_block_fp8(x, (1, 128))
    return Operands([quant.per_block_fp8(w, (128, 128)) for w in ws],
                    lambda w, name: gemmtune.gemm_a8w8_blockscale(xq, w[0], xs, w[1],
                                                                  kernel=name))


def a16w4_operands(x: torch.Tensor, ws: list[torch.Tensor]) -> Operands:
    x = x.to(torch.bfloat16)
    stored = []
    for w in ws:
        wq, w_scale = quant.mxfp4(w)
        stored.append((wq, w_scale, quant.prepack_mxfp4(wq, w_scale)[0]))

    def call(w, name):
        packed = ".L1" in name
        return gemmtune.gemm_a16w4(x, w[2] if packed else w[0], w[1], kernel=name,
                                   packed=packed)
    return Operands(stored, call)


FAMILIES = {"a8w8": a8w8_operands, "a8w8-blockscale": blockscale_operands,
            "a16w4": a16w4_operands}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="a8w8")
    parser.add_argument("--shape", default="16,4096,4096", help="M,N,K")
    parser.add_argument("--kernels", required=True, help="comma-separated kernelNames")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen)
    # > L2 for the larger shapes; each launch a different copy
    ws = [torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5 for _ in range(4)]
    operands = FAMILIES[args.family](x, ws)
    del ws
    names = args.kernels.split(",")
    for name in names:  # compile and check first
        y = operands.call(operands.weights[0], name)
    torch.cuda.synchronize()
    for name in names:
        torch.cuda.nvtx.range_push(name)
        for i in range(args.launches):
            y = operands.call(operands.weights[i % len(operands.weights)], name)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print("ok", tuple(y.shape))


if __name__ == "__main__":
    main()
