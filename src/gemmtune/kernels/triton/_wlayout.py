"""How the GEMM kernels address w: row-major through its strides, or in the pre-shuffled tiles
of ``gemmtune.kernels.preshuffle`` (``W_TILED``, the a8w8_bpreshuffle family's weights)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels import preshuffle
from gemmtune.kernels.triton._splits import PDL_PREFETCH

_TILE_ROWS = tl.constexpr(preshuffle.TILE_ROWS)
_TILE_BYTES = tl.constexpr(preshuffle.TILE_BYTES)


@triton.jit
def w_row_offsets(cols, K, stride_wn, W_TILED: tl.constexpr):
    """Element offsets of w's rows ``cols`` (int64) at K = 0: tiled, its 16-row band's start plus
    the row's 128 bytes within a tile."""
    if W_TILED:
        return cols // _TILE_ROWS * (_TILE_ROWS * K) + cols % _TILE_ROWS * _TILE_BYTES
    else:
        return cols * stride_wn


@triton.jit
def w_k_offsets(ks, stride_wk, W_TILED: tl.constexpr):
    """Element offsets of K positions ``ks`` (int64) within a row: tiled, whole 2 KiB tiles
    along K, then the byte within the tile's row."""
    if W_TILED:
        return ks // _TILE_BYTES * (_TILE_ROWS * _TILE_BYTES) + ks % _TILE_BYTES
    else:
        return ks * stride_wk


@triton.jit
def w_tile_pointers(w_ptr, ks, cols, K, stride_wk, stride_wn, BLOCK_K: tl.constexpr,
                    W_TILED: tl.constexpr):
    """Pointers to w.T's (BLOCK_K, BLOCK_N) tile at K offsets ``ks`` (int64, from a multiple of
    BLOCK_K) and rows ``cols`` (int64) of w, and the pointer step to the next K block. Tiled, a
    K block that is a multiple of the tile's 128 bytes moves by 16 x BLOCK_K bytes in every band;
    one band's step is then BLOCK_K / 128 contiguous 2 KiB tiles."""
    ptrs = w_ptr + w_k_offsets(ks, stride_wk, W_TILED)[:, None] \
        + w_row_offsets(cols, K, stride_wn, W_TILED)[None, :]
    if W_TILED:
        step = tl.cast(BLOCK_K * _TILE_ROWS, tl.int64)  # as the else branch's: one type
    else:
        # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
        step = tl.cast(stride_wk, tl.int64) * BLOCK_K
    return ptrs, step


def why_not_tiled(config, n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why ``config`` cannot read an (N, K) pre-shuffled weight, or None."""
    why = preshuffle.why_not_shufflable(n, k, dtype)
    if why is not None:
        return why
    if config.block_k % preshuffle.TILE_BYTES:
        return (f"block_k={config.block_k}: a pre-shuffled weight is read in whole tiles of "
                f"{preshuffle.TILE_BYTES} of K; use a multiple of {preshuffle.TILE_BYTES}")
    if getattr(config, "pdl", None) == PDL_PREFETCH:
        return "pdl=2 prefetches w's rows, which a pre-shuffled weight does not have; use 0 or 1"
    return None
