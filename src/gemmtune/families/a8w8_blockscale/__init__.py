"""The FP8 block-scale GEMM family (x per 1x128, w per 128x128): ``gemm_a8w8_blockscale``
(``op``), its tuner (``tuner``), and how the bench runs it."""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._family import BenchOp, Family
from gemmtune.families.a8w8_blockscale.op import (DISPATCH, JSON_TAG, SCHEMA, TUNED_OUT_DTYPE,
                                                  BlockscaleKey, gemm_a8w8_blockscale)
from gemmtune.kernels.torch_ref import (TORCH_BLOCKSCALE, blockscale_torch, cublas_block_wise,
                                        gemm_a8w8_blockscale_ref)

BENCH_DTYPES = ("fp8",)


def gemm_key(m: int, n: int, k: int, dtype: str = "fp8", bias: bool = False) -> BlockscaleKey:
    return BlockscaleKey(m, n, k)


def _torch_call(xq, wq, x_scale, w_scale):
    return blockscale_torch(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale)


def bench_op(dtype: str) -> BenchOp:
    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = quant.per_block_fp8(torch.randn(m, k, generator=gen, device=device),
                                     quant.ACT_BLOCK)
        wq, ws = quant.per_block_fp8(torch.randn(n, k, generator=gen, device=device) / k ** 0.5,
                                     quant.WEIGHT_BLOCK)
        return xq, wq, xs, ws

    return BenchOp(
        "a8w8_blockscale", 1, TUNED_OUT_DTYPE, 1, inputs,
        torch=lambda args: _torch_call(*args),
        tuned=lambda a: gemm_a8w8_blockscale(*a),
        reference=lambda a: gemm_a8w8_blockscale_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: gemm_key(m, n, k),
        torch_kernel=TORCH_BLOCKSCALE,
        torch_is_reference=lambda m, n, k: not (torch.cuda.is_available()
                                                 and cublas_block_wise(n, k)))


FAMILY = Family(
    "a8w8_blockscale", SCHEMA, DISPATCH,
    tuner="gemmtune.families.a8w8_blockscale.tuner:A8w8BlockscaleTuner", bench=bench_op,
    bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key, dtype_of_key=lambda key: "fp8",
    triton_json_tags={torch.float8_e4m3fn: JSON_TAG}, triton_json_by_name_only=True)
