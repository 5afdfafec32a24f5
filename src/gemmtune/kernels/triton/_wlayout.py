"""How the Triton GEMM kernels address w: row-major through its strides, or element by element
in the fragment order of ``gemmtune.kernels.preshuffle`` (``W_TILED``, the a8w8_bpreshuffle
family's weights, which ``triton.frag`` reads at full width)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels import preshuffle
from gemmtune.kernels.triton._splits import PDL_PREFETCH

_BAND_ROWS = tl.constexpr(preshuffle.BAND_ROWS)
_BLOCK_K = tl.constexpr(preshuffle.BLOCK_K)


@triton.jit
def w_row_offsets(cols, K, stride_wn, W_TILED: tl.constexpr):
    """Element offsets of w's rows ``cols`` (int64) at K = 0; pre-shuffled, the row's part of
    ``preshuffle``'s w_offset: its band's start, its lane's row (row % 8) and its half."""
    if W_TILED:
        return cols // _BAND_ROWS * (_BAND_ROWS * K) + cols % 8 * 64 + cols % 16 // 8 * 4
    else:
        return cols * stride_wn


@triton.jit
def w_k_offsets(ks, stride_wk, W_TILED: tl.constexpr):
    """Element offsets of K positions ``ks`` (int64) within a row; pre-shuffled, the K part of
    ``preshuffle``'s w_offset: the 512-byte block, the lane's K group of 4, the K half, the
    byte."""
    if W_TILED:
        return ks // _BLOCK_K * (_BAND_ROWS * _BLOCK_K) + ks % 16 // 4 * 16 + ks % 32 // 16 * 8 \
            + ks % 4
    else:
        return ks * stride_wk


@triton.jit
def w_tile_pointers(w_ptr, ks, cols, K, stride_wk, stride_wn, BLOCK_K: tl.constexpr,
                    W_TILED: tl.constexpr):
    """Pointers to w.T's (BLOCK_K, BLOCK_N) tile at K offsets ``ks`` (int64, from a multiple of
    BLOCK_K) and rows ``cols`` (int64) of w, and the pointer step to the next K block.
    Pre-shuffled, a K block that is a multiple of the 32-byte fragment block moves by
    16 x BLOCK_K bytes in every band."""
    ptrs = w_ptr + w_k_offsets(ks, stride_wk, W_TILED)[:, None] \
        + w_row_offsets(cols, K, stride_wn, W_TILED)[None, :]
    if W_TILED:
        step = tl.cast(BLOCK_K * _BAND_ROWS, tl.int64)  # as the else branch's: one type
    else:
        # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
        step = tl.cast(stride_wk, tl.int64) * BLOCK_K
    return ptrs, step


def why_not_tiled(config, n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why ``config`` cannot read an (N, K) pre-shuffled weight, or None."""
    why = preshuffle.why_not_shufflable(n, k, dtype)
    if why is not None:
        return why
    if config.block_k % preshuffle.BLOCK_K:
        return (f"block_k={config.block_k}: a pre-shuffled weight is read in whole fragment "
                f"blocks of {preshuffle.BLOCK_K} of K; use a multiple of {preshuffle.BLOCK_K}")
    if getattr(config, "pdl", None) == PDL_PREFETCH:
        return "pdl=2 prefetches w's rows, which a pre-shuffled weight does not have; use 0 or 1"
    return None
