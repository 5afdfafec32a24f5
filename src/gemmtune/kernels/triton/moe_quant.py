"""FP8 e4m3 inputs of the fused MoE's FP8 stages, one scale per row (a token of x, a routing
row of the intermediate) or per tensor, as ``gemmtune.quant.per_token_fp8`` and
``per_tensor_fp8`` make them: the scale is ``max(amax, AMAX_FLOOR) / FP8_MAX``, each value
divided by it in fp32 and rounded once to nearest even, saturating at +-FP8_MAX; a NaN makes its
row's (tensor's) scale NaN."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_common import (PDL, gated_activation, let_next_start,
                                                wait_for_inputs)

# gemmtune.quant's values (tests check they agree; kernels do not import the layer above).
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
BLOCK = 128  # the K extent of a block scale (activations 1x128, weights 128x128)
ONE_TILE_MAX = 8192  # the widest group one program holds in registers (read once)
# Decode's few rows: a wide row's divisions spread over programs of CHUNK_VALUES values each
# (at most MAX_CHUNKS), each program measuring the whole row (benchmarks/quant_rows_probe.py).
CHUNKED_MAX_ROWS = 16
CHUNK_VALUES = 1024
MAX_CHUNKS = 8


# Which rows of the input hold values (ROUTED): all; those a grouped routing filled (a block's
# first block_rows rows, below rows_used); those of pairs routed to a local expert (pair blocks).
ALL_ROWS, GROUPED_ROWS, PAIR_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _holds_values(row, routed_a_ptr, routed_b_ptr, ROUTED: tl.constexpr,
                  ROUTED_BLOCK_M: tl.constexpr):
    """Whether ``row`` holds values (ROUTED above; routed_a/b: block_rows and rows_used of a
    grouped routing, or topk_ids and expert_map of pair blocks)."""
    if ROUTED == GROUPED_ROWS:
        return (row < tl.load(routed_b_ptr)) \
            & (row % ROUTED_BLOCK_M < tl.load(routed_a_ptr + row // ROUTED_BLOCK_M))
    if ROUTED == PAIR_ROWS:
        return tl.load(routed_b_ptr + tl.load(routed_a_ptr + row)) >= 0
    return True


@triton.jit
def _values(x_ptr, row, cols, inside, D, stride_xt, stride_xd, GATED: tl.constexpr,
            ACT: tl.constexpr, CACHE: tl.constexpr):
    """fp32 values of ``row`` at ``cols``: x's own, or with GATED ``act(gate) * up`` of the
    gate sums at ``cols`` and the up sums D columns on; loaded with the CACHE modifier."""
    at = x_ptr + row * stride_xt + cols * stride_xd
    v = tl.load(at, mask=inside, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if GATED:
        v = gated_activation(v, tl.load(at + D * stride_xd, mask=inside, other=0.0,
                                        cache_modifier=CACHE), ACT)
    return v


@triton.jit
def quant_rows_kernel(x_ptr, q_ptr, scale_ptr, routed_a_ptr, routed_b_ptr, D, GROUP,
                      stride_xt, stride_xd, stride_qt, stride_sr, stride_sg,
                      FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                      SCALE_GIVEN: tl.constexpr, WRITE_Q: tl.constexpr, ROUTED: tl.constexpr,
                      ROUTED_BLOCK_M: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                      PDL: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                      CHUNKS: tl.constexpr = 1):
    """One group of ``GROUP`` columns of one row (program (row, group)): its scale (or,
    ``SCALE_GIVEN``, the one stored for it) and, with ``WRITE_Q``, its FP8 values. A row
    without values (padding of a routing: ``ROUTED``) is neither read nor written, but for a
    scale of 0 when measuring (so a per-tensor maximum over rows ignores it). ``GATED``: x is
    (rows, 2D) gate and up sums of a split stage 1, each value ``act(gate) * up`` (ACT), and
    the writing pass leaves the sums it read zero (x is a workspace). ``ONE_TILE``: the group
    fits BLOCK_D, read once (decode's rows: latency), else in two passes. ``CHUNKS`` > 1 (one
    tile, not GATED): program (row, group, chunk) measures the whole group but divides and
    writes only its 1/CHUNKS of it, so a wide row's divisions spread over several SMs. With PDL
    it waits for the kernel that wrote x, and lets the next one be scheduled at once (its grid is
    small; the next kernel waits for it to finish before reading)."""
    wait_for_inputs(PDL)
    let_next_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    where = scale_ptr + row * stride_sr + group * stride_sg
    lo = group * GROUP
    hi = tl.minimum(lo + GROUP, D)
    holds = _holds_values(row, routed_a_ptr, routed_b_ptr, ROUTED, ROUTED_BLOCK_M)
    if ONE_TILE and CHUNKS == 1:
        # The group's values load beside the routing's answer whether the row holds any: one
        # round of loads less on decode's critical path (a row without values is read, unused).
        offs = lo + tl.arange(0, BLOCK_D)
        inside = offs < hi
        v = _values(x_ptr, row, offs, inside, D, stride_xt, stride_xd, GATED, ACT, "")
        if holds:
            _quantise_values(v, x_ptr, q_ptr, where, row, offs, inside, D, stride_xt, stride_xd,
                             stride_qt, FP8_MAX, AMAX_FLOOR, SCALE_GIVEN, WRITE_Q, GATED,
                             BLOCK_D)
        elif not SCALE_GIVEN:
            tl.store(where, 0.0)
    elif not holds:
        if not SCALE_GIVEN:
            tl.store(where, 0.0)
    elif CHUNKS == 1:
        quantise_group(x_ptr, q_ptr, where, row, lo, hi, D, stride_xt, stride_xd, stride_qt,
                       FP8_MAX, AMAX_FLOOR, SCALE_GIVEN, WRITE_Q, GATED, ACT, ONE_TILE, BLOCK_D,
                       "")
    else:  # (the launch asks for chunks with ONE_TILE, neither GATED nor SCALE_GIVEN)
        offs = tl.arange(0, BLOCK_D)
        v = _values(x_ptr, row, lo + offs, lo + offs < hi, D, stride_xt, stride_xd, False, 0, "")
        scale = _scale_of(v, FP8_MAX, AMAX_FLOOR)
        chunk = tl.program_id(2)
        if chunk == 0:
            tl.store(where, scale)
        if WRITE_Q:
            cols = lo + chunk * (BLOCK_D // CHUNKS) + tl.arange(0, BLOCK_D // CHUNKS)
            inside = cols < hi
            v = _values(x_ptr, row, cols, inside, D, stride_xt, stride_xd, False, 0, "")
            _store_q(x_ptr, q_ptr, row, cols, inside, v, scale, D, stride_xt, stride_xd,
                     stride_qt, False, FP8_MAX, BLOCK_D // CHUNKS)


@triton.jit
def quantise_group(x_ptr, q_ptr, where, row, lo, hi, D, stride_xt, stride_xd, stride_qt,
                   FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, SCALE_GIVEN: tl.constexpr,
                   WRITE_Q: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                   ONE_TILE: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """Columns [lo, hi) of ``row`` as quant_rows_kernel says, their scale at ``where``; x read
    with the CACHE modifier (".cg" where other programs of the same launch wrote it)."""
    offs = tl.arange(0, BLOCK_D)
    if ONE_TILE:  # the whole group in registers: read once
        inside = lo + offs < hi
        v = _values(x_ptr, row, lo + offs, inside, D, stride_xt, stride_xd, GATED, ACT, CACHE)
        _quantise_values(v, x_ptr, q_ptr, where, row, lo + offs, inside, D, stride_xt,
                         stride_xd, stride_qt, FP8_MAX, AMAX_FLOOR, SCALE_GIVEN, WRITE_Q, GATED,
                         BLOCK_D)
    else:
        if SCALE_GIVEN:
            scale = tl.load(where)
        else:
            amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
            nan = tl.zeros((BLOCK_D,), dtype=tl.int32)
            for d0 in range(lo, hi, BLOCK_D):
                v = _values(x_ptr, row, d0 + offs, d0 + offs < hi, D, stride_xt, stride_xd,
                            GATED, ACT, CACHE)
                amax = tl.maximum(amax, tl.abs(v))
                nan += (v != v).to(tl.int32)
            scale = _scale(tl.max(amax, 0), tl.sum(nan, 0), FP8_MAX, AMAX_FLOOR)
            tl.store(where, scale)
        if WRITE_Q:
            for d0 in range(lo, hi, BLOCK_D):
                inside = d0 + offs < hi
                v = _values(x_ptr, row, d0 + offs, inside, D, stride_xt, stride_xd, GATED, ACT,
                            CACHE)
                _store_q(x_ptr, q_ptr, row, d0 + offs, inside, v, scale, D, stride_xt,
                         stride_xd, stride_qt, GATED, FP8_MAX, BLOCK_D)


@triton.jit
def _quantise_values(v, x_ptr, q_ptr, where, row, cols, inside, D, stride_xt, stride_xd,
                     stride_qt, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                     SCALE_GIVEN: tl.constexpr, WRITE_Q: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """A group's values ``v`` held whole: their scale (or the one stored at ``where``) and, with
    WRITE_Q, their FP8 codes at ``cols``."""
    if SCALE_GIVEN:
        scale = tl.load(where)
    else:
        scale = _scale_of(v, FP8_MAX, AMAX_FLOOR)
        tl.store(where, scale)
    if WRITE_Q:
        _store_q(x_ptr, q_ptr, row, cols, inside, v, scale, D, stride_xt, stride_xd, stride_qt,
                 GATED, FP8_MAX, BLOCK_D)


@triton.jit
def _scale_of(v, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """The scale of a group's values held whole (masked-out lanes 0)."""
    return _scale(tl.max(tl.abs(v), 0), tl.sum((v != v).to(tl.int32), 0), FP8_MAX, AMAX_FLOOR)


@triton.jit
def _scale(amax, nans, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """The scale of a group from its amax; NaN if it held a NaN. Divisions rounded to nearest,
    as torch's (Triton's "/" may be approximate on a GPU)."""
    scale = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    return tl.where(nans > 0, float("nan"), scale)


@triton.jit
def _store_q(x_ptr, q_ptr, row, cols, inside, v, scale, D, stride_xt, stride_xd, stride_qt,
             GATED: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_D: tl.constexpr):
    """``v / scale`` rounded to FP8 (saturating) at ``cols`` of the row; with GATED the gate
    and up sums read there are zeroed (the workspace left as it was found)."""
    q = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + row * stride_qt + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
    if GATED:
        at = x_ptr + row * stride_xt + cols * stride_xd
        tl.store(at, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=inside)
        tl.store(at + D * stride_xd, tl.zeros((BLOCK_D,), dtype=tl.float32), mask=inside)


class RoutedRows(NamedTuple):
    """Which rows of an intermediate hold values (the rest are a routing's padding, never
    written): ``kind`` GROUPED_ROWS with a grouped routing's (block_rows, rows_used, block_m),
    PAIR_ROWS with pair blocks' (topk_ids, expert_map)."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor
    block_m: int = 1


class GroupTile(NamedTuple):
    """How a program holds a group of columns: ``block`` values at a time, and whether that is
    the whole group (read once)."""

    block: int
    one_tile: bool


def group_tile(width: int, group: int, block_max: int) -> GroupTile:
    """The tile for groups of ``group`` columns of rows ``width`` wide, at most ``block_max``."""
    span = triton.next_power_of_2(max(min(width, group), 16))
    return GroupTile(min(span, block_max), span <= block_max)


def _launch(x, q, scale, group: int, scale_strides: tuple[int, int], given: bool,
            write_q: bool, warmup: bool, routed: RoutedRows | None, act: int | None) -> None:
    rows, dim = q.shape
    kind, a, b, block_m = routed if routed is not None else (ALL_ROWS.value, scale, scale, 1)
    block_d, one_tile = group_tile(dim, group, ONE_TILE_MAX)
    chunks = 1  # (a pass that only measures gains nothing from chunks: each measures it all)
    if one_tile and write_q and act is None and not given and rows <= CHUNKED_MAX_ROWS:
        chunks = max(1, min(MAX_CHUNKS, block_d // CHUNK_VALUES))
    if rows and dim:
        _checks.start(quant_rows_kernel, (rows, triton.cdiv(dim, group), chunks), warmup,
                      launch_pdl=PDL)(
            x, q, scale, a, b, dim, group, x.stride(0), x.stride(1), q.stride(0),
            *scale_strides, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, SCALE_GIVEN=given,
            WRITE_Q=write_q, ROUTED=kind, ROUTED_BLOCK_M=block_m, GATED=act is not None,
            ACT=act or 0, PDL=PDL, ONE_TILE=one_tile, BLOCK_D=block_d, CHUNKS=chunks,
            num_warps=min(16, max(4, block_d // 512)))  # a wide row alone: many threads


def _quantised_shape(x: torch.Tensor, act: int | None) -> tuple[int, int]:
    """The values' shape: x's, or with ``act`` (x holds gate and up sums) half as wide."""
    return (x.shape[0], x.shape[1] // 2) if act is not None else tuple(x.shape)


def empty_quantised(rows: int, width: int, per_block: bool,
                    device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Room for ``rows`` x ``width`` FP8 values and their scales, one a row ((rows,)) or one a
    1x128 block ((rows, ceil(width/128))), and the columns a scale covers."""
    q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=device)
    if per_block:
        scale = torch.empty((rows, triton.cdiv(width, BLOCK)), dtype=torch.float32,
                            device=device)
        return q, scale, BLOCK
    return q, torch.empty(rows, dtype=torch.float32, device=device), max(1, width)


def quant_rows(x: torch.Tensor, warmup: bool = False, routed: RoutedRows | None = None,
               act: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D) contiguous, scale float32 (R,)): one scale per row,
    as ``gemmtune.quant.per_token_fp8``. Rows ``routed`` says are empty are left unset. With
    ``act`` (SILU or GELU) x is (R, 2D) fp32 gate and up sums: the values quantised are
    ``act(gate) * up``, and the sums read are left zero."""
    q, scale, group = empty_quantised(*_quantised_shape(x, act), False, x.device)
    _launch(x, q, scale, group, (1, 0), given=False, write_q=True, warmup=warmup, routed=routed,
            act=act)
    return q, scale


def quant_blocks(x: torch.Tensor, warmup: bool = False, routed: RoutedRows | None = None,
                 act: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D), scale float32 (R, ceil(D/128))): one scale per
    1x128 block, as ``gemmtune.quant.per_block_fp8(x, ACT_BLOCK)``. Rows ``routed`` says are
    empty are left unset; ``act`` as in quant_rows."""
    q, scale, group = empty_quantised(*_quantised_shape(x, act), True, x.device)
    _launch(x, q, scale, group, (scale.stride(0), 1), given=False, write_q=True, warmup=warmup,
            routed=routed, act=act)
    return q, scale


def quant_tensor(x: torch.Tensor, scale: torch.Tensor | None = None, warmup: bool = False,
                 routed: RoutedRows | None = None,
                 act: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, D) -> (q float8_e4m3fn (R, D), scale float32 ()): one scale for the whole tensor,
    the given one (a static scale) or its amax's, as ``gemmtune.quant.per_tensor_fp8``; rows
    ``routed`` says are empty take no part (and are left unset); ``act`` as in quant_rows."""
    q = torch.empty(_quantised_shape(x, act), dtype=torch.float8_e4m3fn, device=x.device)
    group = max(1, q.shape[1])
    if scale is None:  # each row's scale, then the largest: the scale of the largest amax
        rows = torch.empty(q.shape[0], dtype=torch.float32, device=x.device)
        _launch(x, q, rows, group, (1, 0), given=False, write_q=False, warmup=warmup,
                routed=routed, act=act)
        # (Empty rows measured 0: with every row empty, the scale of an all-zero tensor.)
        scale = torch.clamp_min(rows.max(), AMAX_FLOOR / FP8_MAX) if x.shape[0] else \
            torch.tensor(AMAX_FLOOR / FP8_MAX, device=x.device)
    scale = scale.reshape(()).to(torch.float32)
    _launch(x, q, scale, group, (0, 0), given=True, write_q=True, warmup=warmup, routed=routed,
            act=act)
    return q, scale
