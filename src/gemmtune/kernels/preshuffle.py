"""The pre-shuffled weight layout of ``gemm_a8w8_bpreshuffle``: an 8-bit weight (N, K) stored as
16-row x 128-byte tiles, each 2 KiB tile contiguous, the tiles of a 16-row band consecutive
along K. Element (n, k) lies at ``(n // 16) * 16 * K + (k // 128) * 2048 + (n % 16) * 128 +
k % 128``: one K step of a 16-row band is one contiguous run, whatever K is.

The shuffled tensor keeps w's shape (N, K) and dtype, so the op checks shapes as for a plain
weight (as AITER's ``shuffle_weight`` does); only its bytes move, and nothing in the tensor says
that they did: a row-major weight, or one shuffled by AITER (16-row x 32-byte tiles of 16-byte
columns, not this layout), gives wrong results. Plain torch: the kernels that read it (``triton.splitk``,
``triton.tile`` and ``triton.gemv`` with ``w_tiled``) use ``why_not_shufflable``.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16
TILE_BYTES = 128
# The weight dtypes the layout is defined for: one byte per element.
DTYPES = (torch.float8_e4m3fn, torch.int8)


def why_not_shufflable(n: int, k: int, dtype: torch.dtype) -> str | None:
    """Why an (N, K) ``dtype`` weight has no tiled layout, or None."""
    if dtype not in DTYPES:
        return (f"weights of {dtype} have no pre-shuffled layout; quantise to "
                f"{' or '.join(str(d) for d in DTYPES)} first")
    if n % TILE_ROWS or k % TILE_BYTES:
        return (f"a ({n}, {k}) weight does not tile: N must be a multiple of {TILE_ROWS} and K "
                f"of {TILE_BYTES}")
    return None


def _check(w: torch.Tensor, what: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{what}: expected a 2-D (N, K) weight, got {got}")
    why = why_not_shufflable(*w.shape, w.dtype)
    if why is not None:
        raise ValueError(f"{what}: {why}")


def shuffle(w: torch.Tensor) -> torch.Tensor:
    """``w`` (N, K) in the tiled layout: a new contiguous (N, K) tensor of the same dtype."""
    _check(w, "shuffle_weight")
    n, k = w.shape
    tiles = w.reshape(n // TILE_ROWS, TILE_ROWS, k // TILE_BYTES, TILE_BYTES)
    return tiles.permute(0, 2, 1, 3).contiguous().view(n, k)


def unshuffle(ws: torch.Tensor) -> torch.Tensor:
    """The row-major weight ``shuffle`` was given back from its result."""
    _check(ws, "unshuffle_weight")
    n, k = ws.shape
    tiles = ws.contiguous().view(n // TILE_ROWS, k // TILE_BYTES, TILE_ROWS, TILE_BYTES)
    return tiles.permute(0, 2, 1, 3).contiguous().view(n, k)
