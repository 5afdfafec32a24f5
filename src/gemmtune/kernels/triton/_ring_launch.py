"""What the TMA-fed Gluon GEMMs (``triton.ring``, ``triton.wsring``) share: TMA's load into
shared memory, and on the host the TMA descriptors of x and w and a launch as data
(``_replay.KernelCall``: the operands of the end of ``_swapped.finish_tile``, the split's
workspace, the grid of (w's tiles, K's splits, x's tiles)). A dispatch plan replays it, the
descriptors rebuilt around each call's x and w."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import (SCALE_BLOCK, epilogue_constexprs,
                                                epilogue_operands)
from gemmtune.kernels.triton._replay import KernelCall
from gemmtune.kernels.triton._splits import PDL_OFF, launch_mode, workspace
from gemmtune.kernels.triton._swapped import partials_per_load

# TMA's load into shared memory: tma.async_load from Triton 3.7 on (3.9 refuses the old name),
# async_copy_global_to_shared in 3.6.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


def descriptors(x: torch.Tensor, w: torch.Tensor, block_n: int, block_m: int, block_k: int):
    """Gluon's host TMA descriptors of w in (block_n, block_k) boxes and x in (block_m,
    block_k), FP8."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    boxes = ([block_n, block_k], [block_m, block_k])
    return tuple(TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(
        box, gl.float8e4nv)) for t, box in zip((w, x), boxes))


class Persistent(NamedTuple):
    """A launch of at most ``per_sm`` programs an SM looping over units: ``units_per_tile`` of
    each tile (K's splits, or stream-K's K steps). ``parts_of_tiles`` (stream-K): unsplit, but
    programs add parts of tiles, so every tile has its zeroed fp32 sum and counter."""

    per_sm: int
    units_per_tile: int
    parts_of_tiles: bool = False


def ring_call(kernel, x, w, bias, out, scale_a, scale_b, config, counters, warmup: bool,
              block_scales: bool, constexprs: dict, options: dict, pdl: int = PDL_OFF,
              w_before_wait: bool = False, grid: tuple | None = None,
              persistent: Persistent | None = None,
              x_box_rows: int | None = None) -> KernelCall:
    """``kernel``'s launch for ``config`` (its block_n, block_m, block_k, stages, split_k,
    add_splits and num_warps) on x (M, K) and w (N, K) into ``out``, with the kernel's own
    ``constexprs`` and launch ``options`` beside the shared ones; on ``grid``, or of
    ``persistent`` programs, else a program a unit (w's block, K's split, x's block). x's TMA
    box is ``x_box_rows`` rows (the kernel's block_m where not given). ``pdl``: the launch mode
    (the kernel's PDL constexpr), off where the GPU lacks it or where the kernel reads w
    before its wait (``w_before_wait``) and w was copied here for TMA: the copy is only sure
    to be seen after the wait."""
    M, K = x.shape
    N = w.shape[0]
    given_w = w
    x, w = _checks.tma_ready(x), _checks.tma_ready(w)
    with_pdl = launch_mode(pdl, x.device, w_before_wait and w is not given_w) != PDL_OFF
    w_desc, x_desc = descriptors(x, w, config.block_n, x_box_rows or config.block_m,
                                 config.block_k)
    n_tiles, m_tiles = triton.cdiv(N, config.block_n), triton.cdiv(M, config.block_m)
    parts_of_tiles = persistent is not None and persistent.parts_of_tiles
    if persistent is not None:
        units = n_tiles * m_tiles * persistent.units_per_tile
        grid = (min(units, _checks.sm_count(x.device) * persistent.per_sm),)
    # The workspace of added splits (any split above one sizes it alike) for parts of tiles.
    split_k = max(config.split_k, 2) if parts_of_tiles else config.split_k
    parts, counters, per_call = workspace(x, out, n_tiles * m_tiles,
                                          config.block_n * config.block_m, split_k, counters,
                                          warmup, bool(config.add_splits) or parts_of_tiles)
    bias_, scale_a_, scale_b_ = epilogue_operands(x, bias, scale_a, scale_b)
    args = (w_desc, x_desc, out, bias_, scale_a_, scale_b_, parts, counters, M, N, K,
            out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
            triton.cdiv(K, SCALE_BLOCK))
    shared = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, block_scales),
        SPLIT_K=config.split_k,
        BLOCK_N=config.block_n,
        BLOCK_M=config.block_m,
        STAGES=config.stages,
        PER_LOAD=partials_per_load(config.split_k, config.block_n, config.block_m,
                                   config.num_warps),
        ADD_SPLITS=bool(config.add_splits),
        PDL=with_pdl)
    return KernelCall(kernel, grid or (n_tiles, config.split_k, m_tiles), args,
                      {**shared, **constexprs},
                      {"num_warps": config.num_warps, **options}, launch_pdl=with_pdl,
                      replayable=not per_call)
