"""FP8 e4m3 inputs of the fused MoE's FP8 stages, one scale per row (a token of x, a routing
row of the intermediate) or per tensor, as ``gemmtune.quant.per_token_fp8`` and
``per_tensor_fp8`` make them: the scale is ``max(amax, AMAX_FLOOR) / FP8_MAX``, each value
divided by it in fp32 and rounded once to nearest even, saturating at +-FP8_MAX; a NaN makes its
row's (tensor's) scale NaN."""

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
                      stride_scale, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                      SCALE_GIVEN: tl.constexpr, WRITE_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per row: its scale (or, ``SCALE_GIVEN``, the one at ``scale_ptr + row * stride_scale``)
    and, with ``WRITE_Q``, its FP8 values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    if SCALE_GIVEN:
        scale = tl.load(scale_ptr + row * stride_scale)
    else:
        amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_D,), dtype=tl.int32)
        for d0 in range(0, D, BLOCK_D):
            v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=d0 + offs < D,
                        other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
            nan += (v != v).to(tl.int32)
        scale = tl.maximum(tl.max(amax, 0), AMAX_FLOOR) / FP8_MAX
        scale = tl.where(tl.sum(nan, 0) > 0, float("nan"), scale)
        tl.store(scale_ptr + row * stride_scale, scale)
    if WRITE_Q:
        for d0 in range(0, D, BLOCK_D):
            inside = d0 + offs < D
            v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=inside,
                        other=0.0).to(tl.float32)
            v = tl.clamp(v / scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + row * stride_qt + d0 + offs, v.to(q_ptr.dtype.element_ty),
                     mask=inside)


def _launch(x, q, scale, scale_stride: int, given: bool, write_q: bool, warmup: bool) -> None:
    rows, dim = x.shape
    if rows:
        _checks.start(quant_rows_kernel, (rows,), warmup)(
            x, q, scale, dim, x.stride(0), x.stride(1), q.stride(0), scale_stride,
            FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, SCALE_GIVEN=given, WRITE_Q=write_q,
            BLOCK_D=min(1024, triton.next_power_of_2(max(dim, 16))), num_warps=4)


def quant_rows(x: torch.Tensor, warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D) contiguous, scale float32 (R,)): one scale per row,
    as ``gemmtune.quant.per_token_fp8``."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, q, scale, 1, given=False, write_q=True, warmup=warmup)
    return q, scale


def quant_tensor(x: torch.Tensor, scale: torch.Tensor | None = None,
                 warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D), scale float32 ()): one scale for the whole tensor,
    the given one (a static scale) or its amax's, as ``gemmtune.quant.per_tensor_fp8``."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:  # each row's scale, then the largest: the scale of the largest amax
        rows = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _launch(x, q, rows, 1, given=False, write_q=False, warmup=warmup)
        scale = rows.max() if x.shape[0] else torch.tensor(AMAX_FLOOR / FP8_MAX,
                                                            device=x.device)
    scale = scale.reshape(()).to(torch.float32)
    _launch(x, q, scale, 0, given=True, write_q=True, warmup=warmup)
    return q, scale
