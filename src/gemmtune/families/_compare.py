"""What the MXFP4 families' benches time beside their ops (issue: MXFP4): the same GEMM as bf16
``F.linear`` (the weight in x's dtype: what the quantised weight replaces) and as the FP8
per-token op (``gemm_a8w8`` through its table: the other way to cut the weight's bytes). The
FP8 op takes x quantised, as ``gemm_a8w8`` does: quantising x per call (a layer's cost, an
extra launch at decode) is not in its time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemmtune import quant
from gemmtune.families._family import Comparison
from gemmtune.families.a8w8.op import gemm_a8w8


def _linear_inputs(dtype: torch.dtype):
    def inputs(m, n, k, gen):
        device = gen.device
        return (torch.randn(m, k, generator=gen, device=device).to(dtype),
                (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype))
    return inputs


def _fp8_inputs(m, n, k, gen):
    device = gen.device
    xq, xs = quant.per_token_fp8(torch.randn(m, k, generator=gen, device=device))
    wq, ws = quant.per_channel_fp8(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
    return xq, wq, xs, ws


def linear_and_fp8(dtype: torch.dtype) -> tuple[Comparison, ...]:
    """``F.linear`` in ``dtype`` and the FP8 per-token op with ``dtype`` output."""
    return (Comparison("F.linear", _linear_inputs(dtype), 1, lambda a: F.linear(a[0], a[1])),
            Comparison("FP8 op", _fp8_inputs, 1,
                       lambda a: gemm_a8w8(a[0], a[1], a[2], a[3], dtype=dtype)))
