"""The MXFP4 x MXFP4 GEMM family (AITER's A4W4 block-scale): ``gemm_a4w4_blockscale``
(``op``), its tuner (``tuner``) and how the bench runs it (each weight in the layout its table's
rows favour, beside bf16 ``F.linear`` and the FP8 per-token op; ``--run_config`` times a table's
unpacked rows only). Model shapes list each GEMM in both weight layouts (``other_layouts``). A
shape without a row runs the family default (``op``)."""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._compare import linear_and_fp8
from gemmtune.families._family import BenchOp, Family
from gemmtune.families._mxfp4_layout import packed_twin
from gemmtune.families.a4w4_blockscale.op import (DISPATCH, SCHEMA, TUNED_OUT_DTYPE, A4w4Key,
                                                  gemm_a4w4_blockscale, packed_layout_tuned)
from gemmtune.kernels import mxfp4
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM,
                                        dequant_mm_torch, gemm_a4w4_ref)

BENCH_DTYPES = ("fp4",)  # both operands MXFP4, the output bf16


def gemm_key(m: int, n: int, k: int, dtype: str = "fp4", bias: bool = False,
             packed: bool = False) -> A4w4Key:
    return A4w4Key(m, n, k, packed)


def _why_not_gemm(n: int, k: int, dtype: str) -> str | None:
    return mxfp4.why_not_quantisable(k)


def bench_op(dtype: str) -> BenchOp:
    """x and w quantised to MXFP4 once, w stored packed where the table's rows say so
    (``packed_layout_tuned``); the torch column dequantises both on every call (the family's
    torch backend for the weight as quantised). bf16 ``F.linear`` and the FP8 per-token op are
    timed beside them."""
    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = quant.mxfp4(torch.randn(m, k, generator=gen, device=device))
        wq, ws = quant.mxfp4(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
        packed = packed_layout_tuned(n, k)
        return xq, quant.prepack_mxfp4(wq, ws)[0] if packed else wq, xs, ws, packed

    def codes(a):  # as quantised
        return mxfp4.unpack(a[1]) if a[4] else a[1]

    return BenchOp(
        "a4w4_blockscale", 1, TUNED_OUT_DTYPE, 1, inputs,
        torch=lambda a: dequant_mm_torch(a[0], codes(a), None, TUNED_OUT_DTYPE, a[2], a[3]),
        tuned=lambda a: gemm_a4w4_blockscale(a[0], a[1], a[2], a[3], packed=a[4]),
        reference=lambda a: gemm_a4w4_ref(a[0], codes(a), a[2], a[3]),
        table_key=lambda m, n, k: gemm_key(m, n, k, packed=packed_layout_tuned(n, k)),
        torch_kernel=TORCH_DEQUANT_MM, torch_aliases=(TORCH_UNPACK_DEQUANT_MM,),
        w_bytes=0.5 + 1 / mxfp4.BLOCK, x_bytes=0.5 + 1 / mxfp4.BLOCK,
        comparisons=linear_and_fp8(TUNED_OUT_DTYPE), math_dtype=torch.bfloat16)


FAMILY = Family(
    "a4w4_blockscale", SCHEMA, DISPATCH,
    tuner="gemmtune.families.a4w4_blockscale.tuner:A4w4BlockscaleTuner", bench=bench_op,
    bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key, why_not_gemm=_why_not_gemm,
    other_layouts=packed_twin, dtype_of_key=lambda key: "fp4")

__all__ = ["A4w4Key", "FAMILY", "gemm_a4w4_blockscale"]
