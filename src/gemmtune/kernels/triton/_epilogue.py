"""The output step every Triton GEMM here ends with (scales, bias, cast, masked store), and the
block-scaled K step of FP8 block-scale GEMMs.

``y = acc * scale_a * scale_b + bias``: ``scale_a`` per tensor (one value) or per row of x (M
values: per-token activation scales), ``scale_b`` per tensor or per column of y (N values:
per-channel weight scales), fp32 either way; ``acc`` is the fp32 (or int32, for int8 inputs)
accumulator of one (BLOCK_M, BLOCK_N) tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# How a launch passes a scale: the kernels' SCALE_A / SCALE_B constexprs. PER_BLOCK (FP8
# DeepSeek-style block scales: x per 1x128, w per 128x128 of K) is applied in the K loop, one
# K block at a time, so store_tile leaves it alone.
NO_SCALE, PER_TENSOR, PER_VECTOR, PER_BLOCK = 0, 1, 2, 3
SCALE_BLOCK = 128  # K (and w-row) extent of one block scale


def scale_modes(scale_a, scale_b, block_scales: bool) -> tuple[int, int]:
    if block_scales:
        return PER_BLOCK, PER_BLOCK
    return scale_mode(scale_a), scale_mode(scale_b)


def epilogue_operands(x: torch.Tensor, bias: torch.Tensor | None,
                      scale_a: torch.Tensor | None, scale_b: torch.Tensor | None) -> tuple:
    """``(bias, scale_a, scale_b)`` as a launch passes them: an absent one as x, a pointer the
    kernel never reads (HAS_BIAS, SCALE_A and SCALE_B say so)."""
    return tuple(x if t is None else t for t in (bias, scale_a, scale_b))


def epilogue_constexprs(bias: torch.Tensor | None, scale_a: torch.Tensor | None,
                        scale_b: torch.Tensor | None, block_scales: bool) -> dict:
    """The constexprs a launch gives ``store_tile``: HAS_BIAS, SCALE_A and SCALE_B."""
    mode_a, mode_b = scale_modes(scale_a, scale_b, block_scales)
    return dict(HAS_BIAS=bias is not None, SCALE_A=mode_a, SCALE_B=mode_b)


def operand_strides(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple:
    """x's, w's and out's (row, column) strides, then bias's (0 without one): the order in
    which the GEMM kernels take them."""
    return (x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            bias.stride(0) if bias is not None else 0)


def scale_mode(scale: torch.Tensor | None) -> int:
    """NO_SCALE, PER_TENSOR (one value) or PER_VECTOR (a value per row of x / column of y)."""
    if scale is None:
        return NO_SCALE
    return PER_TENSOR if scale.numel() == 1 else PER_VECTOR


@triton.jit
def store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
               M, N, stride_ym, stride_yn, stride_bias,
               HAS_BIAS: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr):
    """``rows``/``cols`` are the tile's row/column indices clamped into range (as the K loop
    read them), ``offs_m``/``offs_n`` the unclamped ones the store masks with."""
    acc = acc.to(tl.float32)
    if SCALE_A == 1:
        acc = acc * tl.load(scale_a_ptr)
    if SCALE_A == 2:
        acc = acc * tl.load(scale_a_ptr + rows)[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(scale_b_ptr)
    if SCALE_B == 2:
        acc = acc * tl.load(scale_b_ptr + cols)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias).to(tl.float32)
        acc = acc + bias[None, :]
    y_ptrs = (y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n.to(tl.int64)[None, :] * stride_yn)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def block_scaled_dot(a, b, acc, step, rows, cols, scale_a_ptr, scale_b_ptr, k_blocks,
                     BLOCK_K: tl.constexpr):
    """``acc + (a @ b) * sa[row, kb] * sb[col // 128, kb]`` for the K step ``step`` (BLOCK_K
    divides 128, so the step lies in one scale block ``kb``). Scales are contiguous fp32:
    x's (M, k_blocks), w's (ceil(N / 128), k_blocks)."""
    kb = (step * BLOCK_K) // 128
    sa = tl.load(scale_a_ptr + rows * k_blocks + kb)
    sb = tl.load(scale_b_ptr + (cols // 128) * k_blocks + kb)
    return acc + tl.dot(a, b) * sa[:, None] * sb[None, :]


@triton.jit
def block_scaled_dot_t(wt, xt, acc_t, step, rows, cols, scale_a_ptr, scale_b_ptr, k_blocks,
                       BLOCK_K: tl.constexpr):
    """``block_scaled_dot`` for the transposed product: ``acc_t`` (BLOCK_N, BLOCK_M) plus
    ``wt @ xt`` scaled by w's block scale per row and x's per column."""
    kb = (step * BLOCK_K) // 128
    sa = tl.load(scale_a_ptr + rows * k_blocks + kb)
    sb = tl.load(scale_b_ptr + (cols // 128) * k_blocks + kb)
    return acc_t + tl.dot(wt, xt) * sb[:, None] * sa[None, :]
