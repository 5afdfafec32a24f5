"""The MXFP4-weight GEMM family (bf16 or fp16 x, MXFP4 w): ``gemm_a16w4`` (``op``), its tuner
(``tuner``) and how the bench runs it (each weight in the layout ``patch_linear`` would store it
in, beside bf16 ``F.linear`` and the FP8 per-token op; ``--run_config`` times a table's
unpacked rows only). Model shapes list each GEMM in both weight layouts (``other_layouts``). A
shape without a row runs the family default (``op``)."""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._compare import linear_and_fp8
from gemmtune.families._family import BenchOp, Family
from gemmtune.families._gemm import SHORT_DTYPES, short_dtype
from gemmtune.families._mxfp4_layout import packed_twin
from gemmtune.families.a16w4.op import (DISPATCH, SCHEMA, A16w4Key, gemm_a16w4,
                                        packed_layout_tuned)
from gemmtune.kernels import mxfp4
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_LINEAR,
                                        dequant_linear_torch, gemm_a16w4_ref)
from gemmtune.tables.values import DTYPE_NAMES

BENCH_DTYPES = ("bf16", "fp16")  # x's dtype (and the output's)


def gemm_key(m: int, n: int, k: int, dtype: str = "bf16", bias: bool = False,
             packed: bool = False) -> A16w4Key:
    return A16w4Key(m, n, k, DTYPE_NAMES[SHORT_DTYPES[dtype]], packed)


def _why_not_gemm(n: int, k: int, dtype: str) -> str | None:
    return mxfp4.why_not_quantisable(k)


def bench_op(dtype: str) -> BenchOp:
    """x in ``dtype``, a weight quantised to MXFP4 once and stored as ``patch_linear`` would
    store it (packed where the table's rows say so: ``packed_layout_tuned``); the torch column
    dequantises it on every call (the family's torch backend for that layout). bf16
    ``F.linear`` and the FP8 per-token op are timed beside them."""
    x_dtype = SHORT_DTYPES[dtype]

    def inputs(m, n, k, gen):
        device = gen.device
        x = torch.randn(m, k, generator=gen, device=device).to(x_dtype)
        wq, ws = quant.mxfp4(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
        packed = packed_layout_tuned(n, k, x_dtype)
        return x, quant.prepack_mxfp4(wq, ws)[0] if packed else wq, ws, packed

    def codes(a):  # as quantised
        return mxfp4.unpack(a[1]) if a[3] else a[1]

    return BenchOp(
        f"a16w4_{dtype}", x_dtype.itemsize, x_dtype, 1, inputs,
        torch=lambda a: dequant_linear_torch(a[0], codes(a), None, x_dtype, None, a[2]),
        tuned=lambda a: gemm_a16w4(a[0], a[1], a[2], packed=a[3]),
        reference=lambda a: gemm_a16w4_ref(a[0], codes(a), a[2]),
        table_key=lambda m, n, k: gemm_key(m, n, k, dtype,
                                           packed=packed_layout_tuned(n, k, x_dtype)),
        torch_kernel=TORCH_DEQUANT_LINEAR, torch_aliases=(TORCH_UNPACK_DEQUANT_LINEAR,),
        w_bytes=0.5 + 1 / mxfp4.BLOCK, comparisons=linear_and_fp8(x_dtype), math_dtype=x_dtype)


FAMILY = Family("a16w4", SCHEMA, DISPATCH, tuner="gemmtune.families.a16w4.tuner:A16w4Tuner",
                bench=bench_op, bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key,
                why_not_gemm=_why_not_gemm, other_layouts=packed_twin,
                dtype_of_key=lambda key: short_dtype(key.dtype))

__all__ = ["A16w4Key", "FAMILY", "gemm_a16w4"]
