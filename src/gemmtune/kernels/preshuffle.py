"""The pre-shuffled weight layout of ``gemm_a8w8_bpreshuffle``: an 8-bit weight (N, K) in the
register order of Hopper's warpgroup MMA A operand, so that each thread of the kernel that reads
it (``triton.frag``) loads its fragment of a 16-row x 32-byte block as 16 contiguous bytes,
straight into the registers the MMA takes.

Per 16-row band, the 32-byte blocks along K are consecutive (a band's K step is one contiguous
run), and each 512-byte block holds its 16 x 32 elements as [row % 8][k % 16 // 4][k % 32 // 16]
[row % 16 // 8][k % 4]: lane ``l = (row % 8) * 4 + k % 16 // 4`` of a warp owns bytes
``16 l .. 16 l + 15`` (the m16n8k32 A fragment: rows r and r + 8, k 4t..4t+3 and 16+4t..16+4t+3).
Element (n, k) lies at ``w_offset(n, k) = (n // 16) * 16 * K + (k // 32) * 512 + (n % 8) * 64 +
(k % 16 // 4) * 16 + (k % 32 // 16) * 8 + (n % 16 // 8) * 4 + k % 4``; the row and K parts add
up, which is how the Triton kernels address it element by element (``triton._wlayout``).

The shuffled tensor keeps w's shape (N, K) and dtype, so the op checks shapes as for a plain
weight (as AITER's ``shuffle_weight`` does); only its bytes move, and nothing in the tensor says
that they did: a row-major weight, or one shuffled by AITER (its own layout, not this one), gives
wrong results. Plain torch: the kernels use ``why_not_shufflable``.
"""

from __future__ import annotations

import torch

BAND_ROWS = 16  # rows of one MMA fragment block
BLOCK_K = 32  # K (bytes) of one fragment block
# The weight dtypes the layout is defined for: one byte per element.
DTYPES = (torch.float8_e4m3fn, torch.int8)


def why_not_shufflable(n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why an (N, K) ``dtype`` weight has no pre-shuffled layout, or None."""
    if dtype not in DTYPES:
        return (f"weights of {dtype} have no pre-shuffled layout; quantise to "
                f"{' or '.join(str(d) for d in DTYPES)} first")
    if n % BAND_ROWS or k % BLOCK_K:
        return (f"a ({n}, {k}) weight has no pre-shuffled layout: N must be a multiple of "
                f"{BAND_ROWS} and K of {BLOCK_K}")
    return None


def _check(w: torch.Tensor, what: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{what}: expected a 2-D (N, K) weight, got {got}")
    why = why_not_shufflable(*w.shape, w.dtype)
    if why is not None:
        raise ValueError(f"{what}: {why}")


# Row-major (N, K) split as [band, row // 8 % 2, row % 8, k // 32, k // 16 % 2, k // 4 % 4,
# k % 4], and the order those dimensions are stored in.
_SPLIT = (2, 8)
_STORED = (0, 3, 2, 5, 4, 1, 6)
_ROW_MAJOR = (0, 5, 2, 1, 4, 3, 6)  # the inverse permutation


def shuffle(w: torch.Tensor) -> torch.Tensor:
    """``w`` (N, K) in the fragment order: a new contiguous (N, K) tensor of the same dtype."""
    _check(w, "shuffle_weight")
    n, k = w.shape
    parts = w.reshape(n // BAND_ROWS, *_SPLIT, k // BLOCK_K, 2, 4, 4)
    return parts.permute(_STORED).contiguous().view(n, k)


def unshuffle(ws: torch.Tensor) -> torch.Tensor:
    """The row-major weight ``shuffle`` was given back from its result."""
    _check(ws, "unshuffle_weight")
    n, k = ws.shape
    parts = ws.contiguous().view(n // BAND_ROWS, k // BLOCK_K, 8, 4, 2, 2, 4)
    return parts.permute(_ROW_MAJOR).contiguous().view(n, k)
