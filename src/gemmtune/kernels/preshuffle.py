"""The pre-shuffled weight layout of ``gemm_a8w8_bpreshuffle``: an 8-bit weight (N, K) kept in
rows, its K permuted within each 64-byte block so that what one thread of a Hopper warpgroup MMA
needs of a row, for two 32-deep K steps, is 16 contiguous bytes.

In the MMA's A fragment (m64nNk32, 8-bit) lane ``l`` holds, of rows ``l // 4`` and ``l // 4 + 8``
of its warp's 16, the K positions ``4t .. 4t+3`` and ``16 + 4t .. 16 + 4t + 3`` (``t = l % 4``).
Over a 64-byte block of K (two MMA steps) that is 16 positions per row, stored here at
``16t .. 16t + 15``: byte ``k'`` of a block holds K position ``sigma(k') = 32 * (k' // 8 % 2) +
16 * (k' // 4 % 2) + 4 * (k' // 16) + k' % 4``. So the fragment-order kernel (``triton.frag``)
loads each thread's fragments as two 16-byte pieces (one per row) straight into the MMA's
registers, and every other kernel reads the weight as rows (16-byte copies as for a row-major
weight) and x at the permuted positions (``triton._wlayout``): a permutation of K applied to
both operands leaves the product unchanged.

The shuffled tensor keeps w's shape (N, K) and dtype, so the op checks shapes as for a plain
weight (as AITER's ``shuffle_weight`` does); only its bytes move, and nothing in the tensor says
that they did: a row-major weight, or one shuffled by AITER (its own layout, not this one), gives
wrong results. Plain torch: the kernels use ``why_not_shufflable``.
"""

from __future__ import annotations

import torch

BLOCK_K = 64  # K (bytes) of one permuted block
# The weight dtypes the layout is defined for: one byte per element.
DTYPES = (torch.float8_e4m3fn, torch.int8)


def why_not_shufflable(n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why an (N, K) ``dtype`` weight has no pre-shuffled layout, or None."""
    if dtype not in DTYPES:
        return (f"weights of {dtype} have no pre-shuffled layout; quantise to "
                f"{' or '.join(str(d) for d in DTYPES)} first")
    if k % BLOCK_K:
        return f"a ({n}, {k}) weight has no pre-shuffled layout: K must be a multiple of {BLOCK_K}"
    return None


def _check(w: torch.Tensor, what: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{what}: expected a 2-D (N, K) weight, got {got}")
    why = why_not_shufflable(*w.shape, w.dtype)
    if why is not None:
        raise ValueError(f"{what}: {why}")


# A block's K split as [k // 32, k // 16 % 2, k // 4 % 4, k % 4], and the order those parts
# are stored in: [k // 4 % 4, k // 32, k // 16 % 2, k % 4].
_STORED = (0, 1, 4, 2, 3, 5)
_ROW_MAJOR = (0, 1, 3, 4, 2, 5)  # the inverse permutation


def shuffle(w: torch.Tensor) -> torch.Tensor:
    """``w`` (N, K) with K permuted per block: a new contiguous (N, K) tensor of the same
    dtype."""
    _check(w, "shuffle_weight")
    n, k = w.shape
    parts = w.reshape(n, k // BLOCK_K, 2, 2, 4, 4)
    return parts.permute(_STORED).contiguous().view(n, k)


def unshuffle(ws: torch.Tensor) -> torch.Tensor:
    """The row-major weight ``shuffle`` was given back from its result."""
    _check(ws, "unshuffle_weight")
    n, k = ws.shape
    parts = ws.contiguous().view(n, k // BLOCK_K, 4, 2, 2, 4)
    return parts.permute(_ROW_MAJOR).contiguous().view(n, k)


def sigma(kp: torch.Tensor | int):
    """The K position stored at byte ``kp`` of a row (works on ints and integer tensors)."""
    within = kp % BLOCK_K
    return kp - within + within // 8 % 2 * 32 + within // 4 % 2 * 16 + within // 16 * 4 \
        + within % 4
