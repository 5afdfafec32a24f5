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
BLOCK = 128  # the K extent of a block scale (activations 1x128, weights 128x128)


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, scale_ptr, D, GROUP, stride_xt, stride_xd, stride_qt,
                      stride_sr, stride_sg, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                      SCALE_GIVEN: tl.constexpr, WRITE_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """One group of ``GROUP`` columns of one row (program (row, group)): its scale (or,
    ``SCALE_GIVEN``, the one stored for it) and, with ``WRITE_Q``, its FP8 values."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    lo = group * GROUP
    hi = tl.minimum(lo + GROUP, D)
    offs = tl.arange(0, BLOCK_D)
    where = scale_ptr + row * stride_sr + group * stride_sg
    if SCALE_GIVEN:
        scale = tl.load(where)
    else:
        amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_D,), dtype=tl.int32)
        for d0 in range(lo, hi, BLOCK_D):
            v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=d0 + offs < hi,
                        other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
            nan += (v != v).to(tl.int32)
        # Divisions rounded to nearest, as torch's (Triton's "/" may be approximate on a GPU).
        scale = tl.div_rn(tl.maximum(tl.max(amax, 0), AMAX_FLOOR), FP8_MAX)
        scale = tl.where(tl.sum(nan, 0) > 0, float("nan"), scale)
        tl.store(where, scale)
    if WRITE_Q:
        for d0 in range(lo, hi, BLOCK_D):
            inside = d0 + offs < hi
            v = tl.load(x_ptr + row * stride_xt + (d0 + offs) * stride_xd, mask=inside,
                        other=0.0).to(tl.float32)
            v = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX,
                         propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + row * stride_qt + d0 + offs, v.to(q_ptr.dtype.element_ty),
                     mask=inside)


def _launch(x, q, scale, group: int, scale_strides: tuple[int, int], given: bool,
            write_q: bool, warmup: bool) -> None:
    rows, dim = x.shape
    if rows and dim:
        _checks.start(quant_rows_kernel, (rows, triton.cdiv(dim, group)), warmup)(
            x, q, scale, dim, group, x.stride(0), x.stride(1), q.stride(0), *scale_strides,
            FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, SCALE_GIVEN=given, WRITE_Q=write_q,
            BLOCK_D=min(1024, triton.next_power_of_2(max(min(dim, group), 16))), num_warps=4)


def quant_rows(x: torch.Tensor, warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D) contiguous, scale float32 (R,)): one scale per row,
    as ``gemmtune.quant.per_token_fp8``."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, q, scale, max(1, x.shape[1]), (1, 0), given=False, write_q=True, warmup=warmup)
    return q, scale


def quant_blocks(x: torch.Tensor, warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D), scale float32 (R, ceil(D/128))): one scale per
    1x128 block, as ``gemmtune.quant.per_block_fp8(x, ACT_BLOCK)``."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], triton.cdiv(x.shape[1], BLOCK)), dtype=torch.float32,
                        device=x.device)
    _launch(x, q, scale, BLOCK, (scale.stride(0), 1), given=False, write_q=True, warmup=warmup)
    return q, scale


def quant_tensor(x: torch.Tensor, scale: torch.Tensor | None = None,
                 warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D), scale float32 ()): one scale for the whole tensor,
    the given one (a static scale) or its amax's, as ``gemmtune.quant.per_tensor_fp8``."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    group = max(1, x.shape[1])
    if scale is None:  # each row's scale, then the largest: the scale of the largest amax
        rows = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _launch(x, q, rows, group, (1, 0), given=False, write_q=False, warmup=warmup)
        scale = rows.max() if x.shape[0] else torch.tensor(AMAX_FLOOR / FP8_MAX,
                                                            device=x.device)
    scale = scale.reshape(()).to(torch.float32)
    _launch(x, q, scale, group, (0, 0), given=True, write_q=True, warmup=warmup)
    return q, scale
