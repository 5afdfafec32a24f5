"""The two MoE stages as persistent programs through TMA, for prefill's many tiles (a stage
config's ``persistent``: 1, or 2 with the tile loop flattened into the K loop so that an
epilogue overlaps the next tile's loads); launched by ``moe_stages.run_stage1`` / ``run_stage2``
over grouped routing.

One program per SM walks the tiles of the blocks used (read on the GPU, from ``rows_used``) in
grouped order, so a weight tile is read from HBM once for the blocks of its expert and a
block's rows stay in L2 across its tiles. The weights, and stage 2's intermediate, come through
TMA descriptors (whole boxes, zero past the edges: no address arithmetic or masks in the K
loop); stage 1's rows of x are gathered with plain loads. TMA asks for dense weights and 16-byte
rows (``why_not_tma``). FP8 experts are scaled as the other stages scale them (``SCALED``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.gemm_tile import grouped_tile
from gemmtune.kernels.triton.moe_common import (PDL, SCALING_BLOCKS, SCALING_ROWS, StageScales,
                                                block_scaled_dot, gate_up_block_step,
                                                gated_activation, let_next_start,
                                                rows_and_channels_scaled, wait_for_inputs)
from gemmtune.kernels.triton.moe_configs import FLATTENED

GROUP_BLOCKS = 8  # blocks a weight tile is walked down before the next tile


def why_not_tma(config, dtype: torch.dtype, row_elements: int) -> str | None:
    """What keeps a persistent stage from describing its operands to TMA: rows of
    ``row_elements`` (model_dim for stage 1's w1, inter_dim for stage 2's w2 and intermediate)
    must be multiples of 16 bytes; None if they are (or the stage is not persistent)."""
    if config.persistent and row_elements * dtype.itemsize % _checks.TMA_ALIGN:
        return (f"rows of {row_elements} elements are {row_elements * dtype.itemsize} B, not a "
                f"multiple of {_checks.TMA_ALIGN} B as TMA needs; use a config without P1/P2")
    return None


@triton.jit
def _tile_block(tile, rows_used_ptr, sorted_ids_ptr, block_expert_ptr, block_rows_ptr, tiles_n,
                pairs, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """A persistent program's tile number -> (block, column tile, the block's local expert,
    its pair ids, which rows hold a pair), in grouped order over the blocks used."""
    blocks = tl.cdiv(tl.load(rows_used_ptr), BLOCK_M)
    block, pid_n = grouped_tile(tile, blocks, tiles_n, GROUP_M)
    real = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + block)
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M), mask=real,
                  other=pairs)
    return block, pid_n, tl.load(block_expert_ptr + block), ids, real


@triton.jit
def moe_stage1_tma_kernel(
    x_ptr,  # (T, D)
    w1_desc,  # TMA descriptor of w1 as (E * 2I, D) rows, box (BLOCK_N, BLOCK_K)
    inter_ptr,  # (max_rows, I): the routing's rows
    topk_weight_ptr,  # (pairs,) fp32
    sorted_ids_ptr, block_expert_ptr, block_rows_ptr, rows_used_ptr,
    xs_ptr, ws_ptr,  # SCALED (FP8 x and w1): x's scales and w1's (moe_common's SCALING_*)
    pairs, D, I,
    stride_xt, stride_xd,
    stride_ip, stride_in,
    stride_xs, stride_xk, stride_se, stride_sn, stride_sk,  # 0 where one scale covers many
    num_programs,
    TOPK: tl.constexpr,
    ACT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    wait_for_inputs(PDL)
    tiles_n = tl.cdiv(I, BLOCK_N)
    tiles = tl.cdiv(tl.load(rows_used_ptr), BLOCK_M) * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=FLATTEN):
        block, pid_n, expert, ids, real = _tile_block(tile, rows_used_ptr, sorted_ids_ptr,
                                                      block_expert_ptr, block_rows_ptr, tiles_n,
                                                      pairs, BLOCK_M, GROUP_M)
        tokens = tl.where(real, ids // TOPK, 0).to(tl.int64)
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xd
        # A box past an expert's gate (or up) rows reads the next rows: their columns are not
        # stored. Past the last expert TMA reads zeros.
        gate_row = expert * 2 * I + pid_n * BLOCK_N
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.where(offs_n < I, offs_n, 0)  # (for the scales: the rest is not stored)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = tl.load(x_ptrs, mask=real[:, None] & (offs_k[None, :] < D - k0), other=0.0)
            wg = w1_desc.load([gate_row, k0])
            wu = w1_desc.load([gate_row + I, k0])
            if SCALED == SCALING_BLOCKS:
                gate, up = gate_up_block_step(gate, up, a, wg.T, wu.T, xs_ptr, tokens, real,
                                              stride_xs, stride_xk, ws_ptr, expert, cols, I,
                                              stride_se, stride_sn, stride_sk, k0,
                                              INPUT_PRECISION)
            else:
                gate = tl.dot(a, wg.T, gate, input_precision=INPUT_PRECISION)
                up = tl.dot(a, wu.T, up, input_precision=INPUT_PRECISION)
            x_ptrs += BLOCK_K * stride_xd
        if SCALED == SCALING_ROWS:
            gate = rows_and_channels_scaled(gate, xs_ptr, tokens, real, stride_xs, ws_ptr,
                                            expert, cols, stride_se, stride_sn)
            up = rows_and_channels_scaled(up, xs_ptr, tokens, real, stride_xs, ws_ptr, expert,
                                          cols + I, stride_se, stride_sn)
        h = gated_activation(gate, up, ACT)
        if MUL_WEIGHT:
            h = h * tl.load(topk_weight_ptr + ids, mask=real, other=0.0)[:, None]
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        out = inter_ptr + rows[:, None] * stride_ip + offs_n.to(tl.int64)[None, :] * stride_in
        tl.store(out, h.to(inter_ptr.dtype.element_ty),
                 mask=real[:, None] & (offs_n[None, :] < I))
    let_next_start(PDL)


@triton.jit
def moe_stage2_tma_kernel(
    inter_desc,  # TMA descriptor of the intermediate (max_rows, I), box (BLOCK_M, BLOCK_K)
    w2_desc,  # TMA descriptor of w2 as (E * D, I) rows, box (BLOCK_N, BLOCK_K)
    partial_ptr,  # (pairs, D) in the output's dtype
    topk_weight_ptr,  # (pairs,) fp32
    sorted_ids_ptr, block_expert_ptr, block_rows_ptr, rows_used_ptr,
    is_ptr, ws_ptr,  # SCALED (FP8 inter and w2): inter's scales and w2's (moe_common's SCALING_*)
    pairs, D, I,
    stride_pp, stride_pn,
    stride_is, stride_ik, stride_se, stride_sn, stride_sk,  # 0 where one scale covers many
    num_programs,
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    wait_for_inputs(PDL)
    tiles_n = tl.cdiv(D, BLOCK_N)
    tiles = tl.cdiv(tl.load(rows_used_ptr), BLOCK_M) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=FLATTEN):
        block, pid_n, expert, ids, real = _tile_block(tile, rows_used_ptr, sorted_ids_ptr,
                                                      block_expert_ptr, block_rows_ptr, tiles_n,
                                                      pairs, BLOCK_M, GROUP_M)
        w_row = expert * D + pid_n * BLOCK_N  # past the expert's rows: columns not stored
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.where(offs_n < D, offs_n, 0)  # (for the scales: the rest is not stored)
        inter_rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            a = inter_desc.load([block * BLOCK_M, k0])
            b = w2_desc.load([w_row, k0])
            if SCALED == SCALING_BLOCKS:
                acc = block_scaled_dot(acc, a, b.T, is_ptr, inter_rows, real, stride_is,
                                       stride_ik, ws_ptr, expert, cols, stride_se, stride_sn,
                                       stride_sk, k0, INPUT_PRECISION)
            else:
                acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
        if SCALED == SCALING_ROWS:
            acc = rows_and_channels_scaled(acc, is_ptr, inter_rows, real, stride_is, ws_ptr,
                                           expert, cols, stride_se, stride_sn)
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_weight_ptr + ids, mask=real, other=0.0)[:, None]
        rows = tl.where(real, ids, 0).to(tl.int64)
        out = partial_ptr + rows[:, None] * stride_pp + offs_n.to(tl.int64)[None, :] * stride_pn
        tl.store(out, acc.to(partial_ptr.dtype.element_ty),
                 mask=real[:, None] & (offs_n[None, :] < D))
    let_next_start(PDL)


def launch_stage1_persistent(x, w1, inter, topk_weight, routing, activation: int,
                             doweight_stage1: bool, config, scales: StageScales,
                             warmup: bool = False):
    """Stage 1 over ``routing`` into ``inter`` (the routing's rows, I); -> ``inter``. FP8 x and
    w1 come with their ``scales``."""
    pairs = topk_weight.numel()
    _start(moe_stage1_tma_kernel, x.device, warmup)(
        x, _descriptor(w1, "w1", config.block_n, config.block_k), inter,
        topk_weight.reshape(-1), routing.sorted_ids, routing.block_expert, routing.block_rows,
        routing.rows_used, scales.x, scales.w, pairs, x.shape[1], inter.shape[1], x.stride(0),
        x.stride(1), inter.stride(0), inter.stride(1), *scales.strides, _programs(x.device),
        TOPK=topk_weight.shape[1], ACT=activation, MUL_WEIGHT=doweight_stage1,
        SCALED=scales.kind, INPUT_PRECISION=_checks.input_precision(x.dtype), PDL=PDL,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=GROUP_BLOCKS, FLATTEN=config.persistent == FLATTENED,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return inter


def launch_stage2_persistent(inter, w2, partial, topk_weight, routing, doweight_stage1: bool,
                             config, scales: StageScales, warmup: bool = False) -> None:
    """Stage 2 over ``routing`` into ``partial`` (pairs, D), one row per pair. An FP8
    intermediate and w2 come with their ``scales``."""
    _start(moe_stage2_tma_kernel, inter.device, warmup)(
        _descriptor(inter, "the intermediate", config.block_m, config.block_k),
        _descriptor(w2, "w2", config.block_n, config.block_k), partial,
        topk_weight.reshape(-1), routing.sorted_ids, routing.block_expert, routing.block_rows,
        routing.rows_used, scales.x, scales.w, topk_weight.numel(), w2.shape[1],
        inter.shape[1], partial.stride(0), partial.stride(1), *scales.strides,
        _programs(inter.device), MUL_WEIGHT=not doweight_stage1, SCALED=scales.kind,
        INPUT_PRECISION=_checks.input_precision(partial.dtype),
        PDL=PDL, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=GROUP_BLOCKS, FLATTEN=config.persistent == FLATTENED,
        num_warps=config.num_warps, num_stages=config.num_stages)


def _programs(device: torch.device) -> int:
    """A persistent stage's grid: one program per SM (a few on the interpreter)."""
    return _checks.device_sms(device.index) if device.type == "cuda" else 4


def _start(kernel, device: torch.device, warmup: bool):
    return _checks.start(kernel, (_programs(device),), warmup, launch_pdl=PDL)


def _descriptor(t: torch.Tensor, what: str, box_rows: int, box_cols: int):
    """A TMA descriptor of ``t`` as rows of its last dimension (experts stacked), box
    (box_rows, box_cols). The rows must be dense: TMA reads whole boxes by a row pitch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not t.is_contiguous() or t.data_ptr() % _checks.TMA_ALIGN:
        raise ValueError(f"persistent MoE stages read {what} through TMA: it must be contiguous "
                         f"and {_checks.TMA_ALIGN}-byte aligned (got shape {tuple(t.shape)}, strides "
                         f"{t.stride()}); pass contiguous weights or use a config without P1/P2")
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [box_rows, box_cols])
