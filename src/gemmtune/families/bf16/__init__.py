"""The bf16/fp16/fp32 GEMM family: ``gemm_a16w16`` (``op``), its tuner (``tuner``), and how the
bench runs it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemmtune.families._family import BenchOp, Family
from gemmtune.families._gemm import SHORT_DTYPES, short_dtype
from gemmtune.families.bf16.op import DISPATCH, JSON_TAGS, SCHEMA, Bf16Key, gemm_a16w16
from gemmtune.kernels.torch_ref import TORCH_LINEAR, gemm_a16w16_ref
from gemmtune.tables.values import DTYPE_NAMES

BENCH_DTYPES = ("bf16", "fp16", "fp32")


def gemm_key(m: int, n: int, k: int, dtype: str, bias: bool = False) -> Bf16Key:
    name = DTYPE_NAMES[SHORT_DTYPES[dtype]]
    return Bf16Key(m, n, k, bias, name, name, False, False)


def dtype_of_key(key) -> str:
    return short_dtype(key.dtype)


def bench_op(dtype: str) -> BenchOp:
    torch_dtype = SHORT_DTYPES[dtype]

    def inputs(m, n, k, gen):
        device = gen.device
        x = torch.randn(m, k, generator=gen, device=device).to(torch_dtype)
        w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(torch_dtype)
        return x, w

    return BenchOp(
        "bf16" if dtype == "bf16" else f"bf16_{dtype}", torch_dtype.itemsize, torch_dtype, 1,
        inputs,
        torch=lambda a: F.linear(*a), tuned=lambda a: gemm_a16w16(*a),
        reference=lambda a: gemm_a16w16_ref(*a, out_dtype=torch.float32),
        table_key=lambda m, n, k: gemm_key(m, n, k, dtype),
        torch_kernel=TORCH_LINEAR)


FAMILY = Family(
    "bf16", SCHEMA, DISPATCH, tuner="gemmtune.families.bf16.tuner:Bf16Tuner", bench=bench_op,
    bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key, triton_json_tags=JSON_TAGS,
    dtype_of_key=dtype_of_key)
