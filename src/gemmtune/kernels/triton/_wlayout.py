"""How the GEMM kernels address their operands' K: as stored, or, for a pre-shuffled weight
(``W_TILED``: ``gemmtune.kernels.preshuffle``, the a8w8_bpreshuffle family's), x at the K
positions the weight's bytes hold. The weight itself stays in rows and is read as one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels import preshuffle

_BLOCK_K = tl.constexpr(preshuffle.BLOCK_K)


@triton.jit
def x_k_offsets(ks, stride_xk, W_TILED: tl.constexpr):
    """Element offsets into a row of x for the weight's stored K positions ``ks`` (int64):
    pre-shuffled, ``preshuffle.sigma(ks)`` (within each 64-byte block; runs of 4 stay
    contiguous), else ``ks`` itself."""
    if W_TILED:
        within = ks % _BLOCK_K
        ks = ks - within + within // 8 % 2 * 32 + within // 4 % 2 * 16 + within // 16 * 4 \
            + within % 4
        # What the compiler cannot see through the divisions: runs of 4 stay contiguous and
        # start at multiples of 4. Without it x is read a byte at a time, and a dot whose
        # operand is read so is not pipelined (the kernels ran 2-27x slower, session 20).
        ks = tl.max_contiguous(tl.multiple_of(ks, 4), 4)
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
    return ks * tl.cast(stride_xk, tl.int64)


@triton.jit
def w_tile_pointers(w_ptr, ks, cols, stride_wk, stride_wn, BLOCK_K: tl.constexpr):
    """Pointers to w.T's (BLOCK_K, BLOCK_N) tile at K offsets ``ks`` (int64) and rows ``cols``
    (int64) of w, and the pointer step to the next K block."""
    ptrs = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
    return ptrs, tl.cast(stride_wk, tl.int64) * BLOCK_K


def why_not_tiled(config, n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why ``config`` cannot read an (N, K) pre-shuffled weight, or None."""
    why = preshuffle.why_not_shufflable(n, k, dtype)
    if why is not None:
        return why
    if config.block_k % preshuffle.BLOCK_K:
        return (f"block_k={config.block_k}: a pre-shuffled weight's K is permuted within blocks "
                f"of {preshuffle.BLOCK_K}, which each step must take whole; use a multiple of "
                f"{preshuffle.BLOCK_K}")
    return None
