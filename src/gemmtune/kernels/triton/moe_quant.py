"""FP8 e4m3 rows for the fused MoE's FP8 stages: one scale per row (a token of x, a routing row
of the intermediate), as ``gemmtune.quant.per_token_fp8`` makes them: the scale is
``max(amax, AMAX_FLOOR) / FP8_MAX``, each value divided by it in fp32 and rounded once to
nearest even, saturating at +-FP8_MAX; a row holding a NaN gets a NaN scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks

# gemmtune.quant's values (tests check they agree; kernels do not import the layer above).
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, scale_ptr, D, stride_xt, stride_xd, stride_qt,
                      FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
    nan = tl.zeros((BLOCK_D,), dtype=tl.int32)
    for d0 in range(0, D, BLOCK_D):
        v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=d0 + offs < D,
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        nan += (v != v).to(tl.int32)
    scale = tl.maximum(tl.max(amax, 0), AMAX_FLOOR) / FP8_MAX
    scale = tl.where(tl.sum(nan, 0) > 0, float("nan"), scale)
    tl.store(scale_ptr + row, scale)
    for d0 in range(0, D, BLOCK_D):
        inside = d0 + offs < D
        v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=inside,
                    other=0.0).to(tl.float32)
        v = tl.clamp(v / scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + row * stride_qt + d0 + offs, v.to(q_ptr.dtype.element_ty), mask=inside)


def quant_rows(x: torch.Tensor, warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D) contiguous, scale float32 (R,))."""
    rows, dim = x.shape
    q = torch.empty((rows, dim), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _checks.start(quant_rows_kernel, (rows,), warmup)(
            x, q, scale, dim, x.stride(0), x.stride(1), q.stride(0), FP8_MAX=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR, BLOCK_D=min(1024, triton.next_power_of_2(max(dim, 16))),
            num_warps=4)
    return q, scale
