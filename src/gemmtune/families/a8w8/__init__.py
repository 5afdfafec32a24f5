"""The FP8/INT8 GEMM family with per-tensor or per-token x per-channel scales: ``gemm_a8w8``
(``op``), its tuner (``tuner``), and how the bench runs it."""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._family import BenchOp, Family
from gemmtune.families._gemm import SHORT_DTYPES, short_dtype
from gemmtune.families.a8w8.op import (DISPATCH, JSON_TAGS, SCHEMA, TUNED_OUT_DTYPE, A8w8Key,
                                       gemm_a8w8)
from gemmtune.kernels.torch_ref import (TORCH_SCALED_MM, gemm_a8w8_ref, scaled_mm_torch,
                                        torch_fast_path)
from gemmtune.tables.values import DTYPE_NAMES

BENCH_DTYPES = ("fp8", "int8")


def gemm_key(m: int, n: int, k: int, dtype: str, bias: bool = False) -> A8w8Key:
    """The key has no bias column: the rows are tuned without one."""
    return A8w8Key(m, n, k, DTYPE_NAMES[SHORT_DTYPES[dtype]])


def dtype_of_key(key) -> str:
    return short_dtype(key.q_dtype_w)


def _torch_call(xq, wq, x_scale, w_scale):
    return scaled_mm_torch(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale)


def bench_op(dtype: str) -> BenchOp:
    """Per-token activations x per-channel weights, bf16 output: FP8/INT8 serving's layout."""
    q_dtype = SHORT_DTYPES[dtype]
    per_token, per_channel = quant.token_channel_quantisers(q_dtype)

    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = per_token(torch.randn(m, k, generator=gen, device=device))
        wq, ws = per_channel(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
        return xq, wq, xs.reshape(-1), ws.reshape(-1)

    gpu = torch.cuda.is_available()
    return BenchOp(
        "a8w8" if dtype == "fp8" else "a8w8_int8", 1, TUNED_OUT_DTYPE, 1, inputs,
        torch=lambda args: _torch_call(*args),
        tuned=lambda a: gemm_a8w8(*a),
        reference=lambda a: gemm_a8w8_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: gemm_key(m, n, k, dtype),
        torch_kernel=TORCH_SCALED_MM,
        torch_is_reference=lambda m, n, k: not torch_fast_path(m, n, k, q_dtype, gpu))


FAMILY = Family(
    "a8w8", SCHEMA, DISPATCH, tuner="gemmtune.families.a8w8.tuner:A8w8Tuner", bench=bench_op,
    bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key, triton_json_tags=JSON_TAGS,
    dtype_of_key=dtype_of_key)
