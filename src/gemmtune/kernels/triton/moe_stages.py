"""The two stages of a fused MoE in Triton, over the blocks ``moe_routing`` made.

Stage 1 (``moe_stage1``): per block of ``block_m`` routed pairs of one expert, the gate and up
projections of their tokens (``w1[e]``'s rows ``[0, I)`` and ``[I, 2I)``) in one pass over K,
then ``act(gate) * up`` (SiLU or GELU), times the routing weight where ``doweight_stage1``, into
the intermediate ``inter``.

Stage 2 (``moe_stage2``): the down projection ``inter[row] @ w2[e].T`` per block, times the
routing weight unless stage 1 applied it, into ``partial`` (T * topk, D), split over
``inter_dim`` in ``ksplit`` parts (fp32 atomic adds; one part writes plainly, in the output's
dtype). Then ``moe_sum`` adds each token's ``topk`` rows in fp32 into the output, in slot order,
skipping pairs of other ranks' experts: with one part the result does not depend on how the
blocks were scheduled.

The intermediate follows the routing's rows (row r of block b at ``b * block_m + r``), so
stage 2 reads whole tiles of it; with pair blocks it has a row per pair. Its padding rows are
never written: an output row depends on its own row of the intermediate alone, and stage 2
stores only real rows.

Every launch covers the largest number of blocks routing can make, and blocks past
``rows_used`` return at once: no host synchronisation, so a call can be captured in a CUDA graph.
With pair blocks (``routing.pair_blocks``) there is no routing preparation: block b is pair b
alone, its expert read from ``topk_ids`` (a pair of another rank's expert returns at once).
Each launch after the first is a programmatic dependent launch of the one before.

Persistent stages (``persistent`` 1 or 2) are in ``moe_persistent``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.problem import MoeScales, Scaling
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_common import (PDL, SCALING_BLOCKS, SCALING_ROWS, StageScales,
                                                block_scaled_dot, gate_up_sums,
                                                gated_activation, let_next_start,
                                                rows_and_channels_scaled, stream_workspace,
                                                wait_for_inputs)
from gemmtune.kernels.triton.moe_configs import (BLOCK_MS, FLATTENED, PAIR_BLOCK_M, PERSISTENT,
                                                 MoeStage1Config, MoeStage2Config)
from gemmtune.kernels.triton.moe_persistent import (launch_stage1_persistent,
                                                    launch_stage2_persistent)
from gemmtune.kernels.triton.moe_quant import (AMAX_FLOOR, FP8_MAX, GROUPED_ROWS, PAIR_ROWS,
                                               RoutedRows, empty_quantised, group_tile,
                                               quant_blocks, quant_rows, quant_tensor,
                                               quantise_group)


def why_not_stage(config, dtype: torch.dtype, accumulators: int, w_tiles: int) -> str | None:
    """What keeps a stage config from running ``dtype`` inputs: tile sizes, warps and stages,
    and the registers of ``accumulators`` fp32 tiles and shared memory of ``w_tiles`` weight
    tiles per stage; None if it fits."""
    if config.block_m not in BLOCK_MS:
        return f"block_m={config.block_m} must be one of {BLOCK_MS}"
    if config.pair_blocks not in (0, 1):
        return f"pair_blocks={config.pair_blocks} must be 0 or 1"
    if config.pair_blocks and config.block_m != PAIR_BLOCK_M:
        return (f"pair blocks hold one pair each: their block_m is {PAIR_BLOCK_M}, not "
                f"{config.block_m}")
    if config.persistent not in (0, PERSISTENT, FLATTENED):
        return (f"persistent={config.persistent} must be 0, {PERSISTENT} or {FLATTENED} "
                f"(flattened)")
    if config.persistent and config.pair_blocks:
        return "persistent stages run over grouped routing, not pair blocks"
    problem = _checks.why_not_blocks(config) or _checks.why_not_warps_stages(config)
    if problem:
        return problem
    regs = accumulators * config.block_m * config.block_n // (32 * config.num_warps)
    if regs > _checks.MAX_ACC_REGS_PER_THREAD:
        return (f"{accumulators} accumulator(s) need {regs} registers per thread (> "
                f"{_checks.MAX_ACC_REGS_PER_THREAD}); use smaller blocks or more warps")
    smem = config.num_stages * (config.block_m + w_tiles * config.block_n) * config.block_k \
        * dtype.itemsize
    if smem > _checks.SMEM_LIMIT_BYTES:
        return f"shared memory {smem} B > {_checks.SMEM_LIMIT_BYTES} B; reduce blocks or stages"
    return None


def why_not_stage1(config: MoeStage1Config, dtype: torch.dtype, model_dim: int) -> str | None:
    if config.split_k != 1:
        if dtype.itemsize != 1:
            return (f"split_k={config.split_k}: stage 1 splits model_dim only for FP8 experts "
                    f"(their intermediate has a pass of its own, where the activation goes)")
        if config.persistent:
            return f"a persistent stage 1 takes split_k=1, not {config.split_k}"
        steps = triton.cdiv(model_dim, config.block_k)
        if not 1 <= config.split_k <= min(16, steps):
            return (f"split_k={config.split_k} must be in [1, 16] and leave each part a block_k "
                    f"step: model_dim={model_dim} is {steps} steps of block_k={config.block_k}")
    return why_not_stage(config, dtype, accumulators=2, w_tiles=2)  # gate and up


def why_not_stage2(config: MoeStage2Config, dtype: torch.dtype, inter_dim: int) -> str | None:
    if not 1 <= config.split_k <= 16:
        return f"split_k={config.split_k} must be in [1, 16]"
    if config.persistent and config.split_k != 1:
        return f"a persistent stage 2 takes split_k=1, not {config.split_k}"
    steps = triton.cdiv(inter_dim, config.block_k)
    if config.split_k > steps:
        return (f"split_k={config.split_k} leaves parts without a block_k step: inter_dim="
                f"{inter_dim} is {steps} steps of block_k={config.block_k}")
    return why_not_stage(config, dtype, accumulators=1, w_tiles=1)


@triton.jit
def _block_rows(sorted_ids_ptr, block_expert_ptr, block_rows_ptr, rows_used_ptr, topk_ids_ptr,
                expert_map_ptr, block, pairs, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """A block's local expert (int64; -1: nothing to compute, a block past the rows used or a
    pair of another rank's expert), the pair ids of its rows (``pairs`` on padding rows), and
    which rows hold a pair. Pair blocks: block b holds pair b in its first row, its
    expert read from topk_ids."""
    lanes = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        expert = tl.load(expert_map_ptr + tl.load(topk_ids_ptr + block))
        ids = tl.where(lanes == 0, block, pairs)
        real = lanes == 0
    else:
        used = block * BLOCK_M < tl.load(rows_used_ptr)
        expert = tl.where(used, tl.load(block_expert_ptr + block), -1)
        real = lanes < tl.load(block_rows_ptr + block)
        ids = tl.load(sorted_ids_ptr + block * BLOCK_M + lanes, mask=real, other=pairs)
    return expert.to(tl.int64), ids, real


@triton.jit
def _inter_rows(block, ids, real, PAIR_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The intermediate's rows of a block (int64): the block's own rows under grouped routing,
    the pair's row with pair blocks."""
    if PAIR_BLOCKS:
        return tl.where(real, ids, 0).to(tl.int64)
    return (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)


# ROUTING_FIRST: with programmatic dependent launch a kernel starts while the one before drains,
# and waits (wait_for_inputs) before reading what that one wrote. A launch that follows another
# of the op's own (ROUTING_READY: stage 1 after the activations' quantiser, stage 2 always)
# reads its routing before waiting, overlapping the previous kernel's tail: the routing was
# complete before that kernel passed its own wait, which came before it let this one start.
# Every program still waits, those with nothing to compute too: a launch whose programs all
# returned without waiting would count as done while the one before it still wrote, and the
# launch after it waits for this one only.


@triton.jit
def moe_stage1_kernel(
    x_ptr,  # (T, D)
    w1_ptr,  # (E, 2 * I, D)
    inter_ptr,  # (routing rows, I); with SPLIT_K the gate and up sums, (routing rows, 2I) fp32
    topk_weight_ptr,  # (pairs,) fp32
    sorted_ids_ptr, block_expert_ptr, block_rows_ptr, rows_used_ptr,
    topk_ids_ptr, expert_map_ptr,  # read with PAIR_BLOCKS
    xs_ptr, ws_ptr,  # SCALED (FP8 x and w1): x's scales and w1's (SCALING_* above)
    arrivals_ptr, q_ptr, qs_ptr,  # QUANT_OUT: per block, programs done; inter's FP8 and scales
    pairs, D, I, group,  # group: QUANT_OUT's columns per scale (I, or 128 for 1x128 blocks)
    stride_xt, stride_xd,
    stride_we, stride_wn, stride_wd,
    stride_ip, stride_in,
    stride_xs, stride_xk, stride_se, stride_sn, stride_sk,  # 0 where one scale covers many
    stride_qp, stride_qsr, stride_qsg,
    TOPK: tl.constexpr,
    ACT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
    ROUTING_READY: tl.constexpr,  # ROUTING_FIRST above
    SPLIT_K: tl.constexpr,
    QUANT_OUT: tl.constexpr,  # the block's last program quantises its rows
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    ONE_TILE: tl.constexpr, BLOCK_Q: tl.constexpr,  # quantise_group's
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    if not ROUTING_READY:
        wait_for_inputs(PDL)
    expert, ids, real = _block_rows(sorted_ids_ptr, block_expert_ptr, block_rows_ptr,
                                    rows_used_ptr, topk_ids_ptr, expert_map_ptr,
                                    tl.program_id(0), pairs, BLOCK_M, PAIR_BLOCKS)
    if expert < 0:
        if ROUTING_READY:  # (every program waits: see ROUTING_FIRST)
            wait_for_inputs(PDL)
        return
    tokens = tl.where(real, ids // TOPK, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.where(offs_n < I, offs_n, 0).to(tl.int64)
    # This program's part of model_dim: whole block_k steps, parts differing by at most one.
    steps = tl.cdiv(D, BLOCK_K)
    part = tl.program_id(2)
    k_lo = part * steps // SPLIT_K * BLOCK_K
    k_hi = tl.minimum((part + 1) * steps // SPLIT_K * BLOCK_K, D)
    if ROUTING_READY:
        wait_for_inputs(PDL)
    gate, up = gate_up_sums(x_ptr, w1_ptr, tokens, real, expert, cols, k_lo, k_hi, I,
                            stride_xt, stride_xd, stride_we, stride_wn, stride_wd, xs_ptr,
                            ws_ptr, stride_xs, stride_xk, stride_se, stride_sn, stride_sk,
                            INPUT_PRECISION, SCALED == SCALING_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K)
    if SCALED == SCALING_ROWS:  # the FP8 sums times the token's and the output channel's
        gate = rows_and_channels_scaled(gate, xs_ptr, tokens, real, stride_xs, ws_ptr, expert,
                                        cols, stride_se, stride_sn)
        up = rows_and_channels_scaled(up, xs_ptr, tokens, real, stride_xs, ws_ptr, expert,
                                      cols + I, stride_se, stride_sn)
    let_next_start(PDL)
    rows = _inter_rows(tl.program_id(0), ids, real, PAIR_BLOCKS, BLOCK_M)
    out = inter_ptr + rows[:, None] * stride_ip + offs_n.to(tl.int64)[None, :] * stride_in
    inside = real[:, None] & (offs_n[None, :] < I)
    if SPLIT_K > 1:  # the parts' sums meet in fp32; the activation is the next pass's
        tl.atomic_add(out, gate, mask=inside)
        tl.atomic_add(out + I * stride_in, up, mask=inside)
    else:
        h = gated_activation(gate, up, ACT)
        if MUL_WEIGHT:
            h = h * tl.load(topk_weight_ptr + ids, mask=real, other=0.0)[:, None]
        tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=inside)
    if QUANT_OUT:
        _quantise_when_last(inter_ptr, arrivals_ptr, q_ptr, qs_ptr, block_rows_ptr,
                            tl.program_id(0), I, group, stride_ip, stride_in, stride_qp,
                            stride_qsr, stride_qsg, SPLIT_K > 1, ACT, PAIR_BLOCKS, FP8_MAX,
                            AMAX_FLOOR, ONE_TILE, BLOCK_Q, BLOCK_M)


@triton.jit
def _quantise_when_last(inter_ptr, arrivals_ptr, q_ptr, qs_ptr, block_rows_ptr, block, I, group,
                        stride_ip, stride_in, stride_qp, stride_qsr, stride_qsg,
                        GATED: tl.constexpr, ACT: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
                        FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                        ONE_TILE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Count this program's tiles of ``block`` done; the program that completes the block
    quantises its rows (a scale per ``group`` columns, as the quantiser's launch would: the same
    bits; GATED: of the split parts' gate and up sums, which it leaves zero) and sets the count
    back to 0 for the next call. The count's release and acquire order every program's stores
    before the last one's loads, which bypass L1 (".cg": other SMs wrote the rows)."""
    tl.debug_barrier()  # every thread's stores issued before the count says they are
    parts = tl.num_programs(1) * tl.num_programs(2)
    if tl.atomic_add(arrivals_ptr + block, 1, sem="acq_rel") == parts - 1:
        tl.store(arrivals_ptr + block, 0)
        rows = 1 if PAIR_BLOCKS else tl.load(block_rows_ptr + block)
        first = block if PAIR_BLOCKS else block * BLOCK_M  # pair b's row is b
        for r in range(rows):
            row = (first + r).to(tl.int64)
            for lo in range(0, I, group):
                quantise_group(inter_ptr, q_ptr, qs_ptr + row * stride_qsr
                               + (lo // group) * stride_qsg, row, lo, tl.minimum(lo + group, I),
                               I, stride_ip, stride_in, stride_qp, FP8_MAX, AMAX_FLOOR, False,
                               True, GATED, ACT, ONE_TILE, BLOCK_Q, ".cg")


@triton.jit
def moe_stage2_kernel(
    inter_ptr,  # (routing rows, I)
    w2_ptr,  # (E, D, I)
    partial_ptr,  # (pairs, D): fp32 with split-K (atomic adds), else the output's dtype
    topk_weight_ptr,  # (pairs,) fp32
    sorted_ids_ptr, block_expert_ptr, block_rows_ptr, rows_used_ptr,
    topk_ids_ptr, expert_map_ptr,  # read with PAIR_BLOCKS
    is_ptr, ws_ptr,  # SCALED (FP8 inter and w2): inter's scales and w2's (SCALING_* above)
    pairs, D, I,
    stride_ip, stride_in,
    stride_we, stride_wn, stride_wk,
    stride_pp, stride_pn,
    stride_is, stride_ik, stride_se, stride_sn, stride_sk,  # 0 where one scale covers many
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Stage 2 follows a launch of the op's own: its routing is in place (ROUTING_FIRST).
    expert, ids, real = _block_rows(sorted_ids_ptr, block_expert_ptr, block_rows_ptr,
                                    rows_used_ptr, topk_ids_ptr, expert_map_ptr,
                                    tl.program_id(0), pairs, BLOCK_M, PAIR_BLOCKS)
    if expert < 0:
        wait_for_inputs(PDL)
        return
    rows = tl.where(real, ids, 0).to(tl.int64)
    inter_rows = _inter_rows(tl.program_id(0), ids, real, PAIR_BLOCKS, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.where(offs_n < D, offs_n, 0).to(tl.int64)
    # This program's part of inter_dim: whole block_k steps, parts differing by at most one.
    steps = tl.cdiv(I, BLOCK_K)
    part = tl.program_id(2)
    k_lo = part * steps // SPLIT_K * BLOCK_K
    k_hi = (part + 1) * steps // SPLIT_K * BLOCK_K
    wait_for_inputs(PDL)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + inter_rows[:, None] * stride_ip + offs_k[None, :] * stride_in
    b_ptrs = w2_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_left = I - k0
        lane = tl.arange(0, BLOCK_K)
        a = tl.load(a_ptrs, mask=real[:, None] & (lane[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=lane[:, None] < k_left, other=0.0)
        if SCALED == SCALING_BLOCKS:  # each K step lies in one 128 block (block_k | 128)
            acc = block_scaled_dot(acc, a, b, is_ptr, inter_rows, real, stride_is, stride_ik,
                                   ws_ptr, expert, cols, stride_se, stride_sn, stride_sk, k0,
                                   INPUT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_in
        b_ptrs += BLOCK_K * stride_wk
    let_next_start(PDL)
    if SCALED == SCALING_ROWS:
        acc = rows_and_channels_scaled(acc, is_ptr, inter_rows, real, stride_is, ws_ptr, expert,
                                       cols, stride_se, stride_sn)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weight_ptr + ids, mask=real, other=0.0)[:, None]
    out = partial_ptr + rows[:, None] * stride_pp + offs_n.to(tl.int64)[None, :] * stride_pn
    mask = real[:, None] & (offs_n[None, :] < D)
    if SPLIT_K == 1:
        tl.store(out, acc.to(partial_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def moe_sum_kernel(
    partial_ptr,  # (pairs, D) fp32 or the output's dtype
    topk_ids_ptr,  # (pairs,) int32 global expert ids
    expert_map_ptr,  # (E_global,) int32
    out_ptr,  # (T, D)
    D,
    stride_pp, stride_pn, stride_ot, stride_on,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    PDL: tl.constexpr,
    SPECULATE: tl.constexpr,
    ZERO: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A token's slots read at once (one round of loads, not one per slot: decode's sum is
    latency), then added in fp32 in slot order. SPECULATE (few tokens): every slot's row is
    loaded beside the expert map's answer whether its expert is local, a round of loads less
    on the critical path; a row of another rank's expert (never written) is read but unused.
    ZERO: every slot's row is left zero (those of other ranks' experts are zero already)."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = offs < D
    slots = tl.arange(0, TOPK_P2)
    pairs = token * TOPK + slots
    # A pair of another rank's expert was never written: its row is not used (nor read, but
    # with SPECULATE).
    local = tl.load(expert_map_ptr + tl.load(topk_ids_ptr + pairs, mask=slots < TOPK, other=0),
                    mask=slots < TOPK, other=-1)
    at = partial_ptr + pairs[:, None] * stride_pp + offs[None, :] * stride_pn
    if SPECULATE:
        rows = tl.load(at, mask=(slots < TOPK)[:, None] & inside[None, :], other=0.0)
        rows = tl.where((local >= 0)[:, None], rows.to(tl.float32), 0.0)
    else:
        rows = tl.load(at, mask=(local >= 0)[:, None] & inside[None, :],
                       other=0.0).to(tl.float32)
    if ZERO:
        tl.store(at, tl.zeros((TOPK_P2, BLOCK_D), dtype=partial_ptr.dtype.element_ty),
                 mask=(slots < TOPK)[:, None] & inside[None, :])
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOPK):  # (a sum over one row and zeros: that row, exactly)
        total += tl.sum(tl.where((slots == k)[:, None], rows, 0.0), axis=0)
    tl.store(out_ptr + token * stride_ot + offs * stride_on,
             total.to(out_ptr.dtype.element_ty), mask=inside)


def moe_stages(x, w1, w2, topk_weight, topk_ids, expert_map, routing, activation: int,
               doweight_stage1: bool, stage1: MoeStage1Config, stage2: MoeStage2Config,
               out: torch.Tensor | None = None, warmup: bool = False,
               scales: MoeScales | None = None,
               scaling: Scaling = Scaling.rowwise) -> torch.Tensor:
    """Both stages and the sum over ``routing`` (made with ``stage1.block_m``): x (T, D),
    w1 (E, 2I, D), w2 (E, D, I), topk_weight (T, topk) fp32, topk_ids (T, topk) int32, ->
    (T, D) in x's dtype, into ``out`` if given. Launch only: the caller checked the shapes.
    ``warmup``: compile every kernel for these arguments, launch none. With ``scales`` (FP8
    w1 and w2 scaled per output channel, per expert or per 128x128 block, as ``scaling`` says:
    rowwise, tensor, block): x is quantised first, and stage 1's intermediate for stage 2."""
    inter = run_stage1(x, w1, topk_weight, topk_ids, expert_map, routing, activation,
                       doweight_stage1, stage1, warmup, scales, scaling)
    return run_stage2(inter, w2, topk_weight, topk_ids, expert_map, routing, doweight_stage1,
                      stage2, x.shape[0], x.dtype, out, warmup, scales=scales)


class QuantisedInter(NamedTuple):
    """Stage 1's output for FP8 experts: the intermediate quantised for stage 2, and its scales
    (per row, per 1x128 block or one)."""

    q: torch.Tensor  # (rows of the routing, I) float8_e4m3fn
    scale: torch.Tensor


def _quantised(t: torch.Tensor, scaling: Scaling, static, warmup: bool,
               routed: RoutedRows | None = None, act: int | None = None):
    """A stage's FP8 input: per row, per 1x128 block, or per tensor (by ``static`` if given);
    only the rows ``routed`` says hold values; with ``act`` t holds gate and up sums."""
    if scaling is Scaling.tensor:
        return quant_tensor(t, static, warmup, routed, act)
    quantiser = quant_blocks if scaling is Scaling.block else quant_rows
    return quantiser(t, warmup, routed, act)


def _routed_rows(routing, topk_ids, expert_map) -> RoutedRows:
    """The intermediate's rows stage 1 wrote: a grouped routing's real rows, or with pair
    blocks the pairs of local experts."""
    if routing.pair_blocks:
        return RoutedRows(PAIR_ROWS.value, topk_ids.reshape(-1), expert_map)
    return RoutedRows(GROUPED_ROWS.value, routing.block_rows, routing.rows_used, routing.block_m)


SUMS_KIND = "moe_stage1_sums"


def _gate_up_sums(rows: int, inter_dim: int, device: torch.device) -> torch.Tensor:
    """Split stage 1's fp32 workspace of gate and up sums, (rows, 2I), zero as every call
    leaves it (the quantiser zeroes what it read)."""
    return stream_workspace((SUMS_KIND, rows, inter_dim), device,
                            lambda: torch.zeros((rows, 2 * inter_dim), dtype=torch.float32,
                                                device=device))


def run_stage1(x, w1, topk_weight, topk_ids, expert_map, routing, activation: int,
               doweight_stage1: bool, config: MoeStage1Config, warmup: bool = False,
               scales: MoeScales | None = None,
               scaling: Scaling = Scaling.rowwise) -> torch.Tensor | QuantisedInter:
    """Stage 1 alone: -> the intermediate, (rows of the routing, I). FP8 w1 comes with
    ``scales.w1`` ((E, 2I, 1), (E, 1, 1) or (E, 2I/128, D/128), as ``scaling`` says): x is
    quantised first (per token, per tensor or per 1x128 block), the intermediate made in fp32
    is quantised the same way for stage 2 (a QuantisedInter); with split-K parts of model_dim
    the activation is applied in that pass too."""
    x_scale = w_scale = None
    if scales is not None:
        x, x_scale = _quantised(x, scaling, scales.a1, warmup)
        w_scale = scales.w1
    tokens, model_dim = x.shape
    inter_dim = w1.shape[1] // 2
    topk = topk_weight.shape[1]
    pairs = tokens * topk
    scaled = x_scale is not None
    rows = routing.sorted_ids.numel()
    split = config.split_k > 1
    if split and not scaled:  # (the check refuses it; the workspace must never be left dirty)
        raise ValueError(f"{config.name}: a split stage 1 is for FP8 experts, whose "
                         f"quantiser applies the activation and zeroes the sums")
    inter = _gate_up_sums(rows, inter_dim, x.device) if split else torch.empty(
        (rows, inter_dim), dtype=torch.float32 if scaled else x.dtype, device=x.device)
    stage_scales = StageScales.of(x_scale, w_scale, inter)
    if config.quant_out:  # (the check refuses what cannot run; a direct caller gets its words)
        quant_out = why_not_quant_out(config, scaling if scaled else Scaling.none)
        if quant_out:
            raise ValueError(f"{config.name}: {quant_out}")
    out = _QuantOut.of(inter, inter_dim, routing, scaling, config.quant_out)
    if config.persistent:
        launch_stage1_persistent(x, w1, inter, topk_weight, routing, activation,
                                 doweight_stage1, config, stage_scales, warmup)
    else:
        _checks.start(moe_stage1_kernel,
                      (routing.blocks, triton.cdiv(inter_dim, config.block_n), config.split_k),
                      warmup, launch_pdl=PDL)(
            x, w1, inter, topk_weight.reshape(-1), routing.sorted_ids, routing.block_expert,
            routing.block_rows, routing.rows_used, topk_ids.reshape(-1), expert_map,
            stage_scales.x, stage_scales.w, out.arrivals, out.q, out.scale, pairs, model_dim,
            inter_dim, out.group, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1),
            w1.stride(2), inter.stride(0), inter.stride(1), *stage_scales.strides,
            *out.strides, TOPK=topk, ACT=activation, MUL_WEIGHT=doweight_stage1,
            SCALED=stage_scales.kind, INPUT_PRECISION=_checks.input_precision(x.dtype),
            PAIR_BLOCKS=routing.pair_blocks, PDL=PDL, ROUTING_READY=scaled,
            SPLIT_K=config.split_k, QUANT_OUT=bool(config.quant_out), FP8_MAX=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR, ONE_TILE=out.one_tile, BLOCK_Q=out.block,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages)
    if not scaled:
        return inter
    if config.quant_out:
        return QuantisedInter(out.q, out.scale)
    return QuantisedInter(*_quantised(inter, scaling, scales.a2, warmup,
                                      _routed_rows(routing, topk_ids, expert_map),
                                      activation if split else None))


ARRIVALS_KIND = "moe_stage1_arrivals"
QUANT_OUT_SCALINGS = (Scaling.rowwise, Scaling.block)  # what stage 1 can quantise itself


def why_not_quant_out(config: MoeStage1Config, scaling: Scaling) -> str | None:
    """Stage 1 quantising its own output (``QO1``): for FP8 experts scaled per token or per
    1x128 block (a per-tensor scale needs every row first), outside the persistent stage."""
    if config.quant_out not in (0, 1):
        return f"quant_out={config.quant_out} must be 0 or 1"
    if not config.quant_out:
        return None
    if config.persistent:
        return "quant_out: the persistent stage 1 leaves its output to the quantiser's launch"
    if scaling not in QUANT_OUT_SCALINGS:
        return (f"quant_out: stage 1 quantises its output per row or per 1x128 block, for FP8 "
                f"experts scaled per token or per block, not {scaling.value} scales")
    return None


# The widest group of columns the program finishing a block holds in registers at once (wider
# groups take two passes): its registers are those of the GEMM it ran.
QUANT_OUT_BLOCK_MAX = 2048


class _QuantOut(NamedTuple):
    """What stage 1 quantising its own output (``quant_out``) launches with: the count of each
    block's programs done (a workspace every call leaves zero), the FP8 intermediate and its
    scales, ``group`` columns per scale, and quantise_group's tile. Without quant_out, unread
    stand-ins."""

    arrivals: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor
    group: int
    strides: tuple[int, int, int]  # q's row, the scales' row and group
    one_tile: bool
    block: int

    @classmethod
    def of(cls, inter: torch.Tensor, inter_dim: int, routing, scaling: Scaling,
           quant_out: int) -> "_QuantOut":
        """For stage 1's ``inter`` (rows, inter_dim), or its split parts' sums (rows, 2I)."""
        rows = inter.shape[0]
        if not quant_out:
            return cls(inter, inter, inter, inter_dim, (0, 0, 0), True, 16)
        device = inter.device
        arrivals = stream_workspace((ARRIVALS_KIND, routing.blocks), device,
                                    lambda: torch.zeros(routing.blocks, dtype=torch.int32,
                                                        device=device))
        q, scale, group = empty_quantised(rows, inter_dim, scaling is Scaling.block, device)
        tile = group_tile(inter_dim, group, QUANT_OUT_BLOCK_MAX)
        return cls(arrivals, q, scale, group,
                   (q.stride(0), scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0),
                   tile.one_tile, tile.block)


def run_stage2(inter, w2, topk_weight, topk_ids, expert_map, routing, doweight_stage1: bool,
               config: MoeStage2Config, tokens: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, warmup: bool = False,
               with_sum: bool = True, scales: MoeScales | None = None) -> torch.Tensor:
    """Stage 2 and the sum over each token's slots: -> (T, D) in ``dtype``, into ``out`` if
    given. Without ``with_sum``: stage 2 alone, -> its (pairs, D) partial products (a
    benchmark's split of the time). FP8 experts: ``inter`` is stage 1's QuantisedInter and w2
    comes with ``scales.w2`` ((E, D, 1), (E, 1, 1) or per 128x128)."""
    x_scale = w_scale = None
    if scales is not None:
        inter, x_scale = inter
        w_scale = scales.w2
    inter_dim = inter.shape[1]
    pairs = topk_ids.numel()
    model_dim = w2.shape[1]
    # Split-K parts add into fp32; a whole product is rounded to the output's dtype once, which
    # halves the traffic of the sum over slots (it reads every pair's row).
    kept = False
    if config.split_k > 1:
        partial, kept = _split_partials(pairs, model_dim, inter.device, with_sum)
    else:
        partial = torch.empty((pairs, model_dim), dtype=dtype, device=inter.device)
    stage_scales = StageScales.of(x_scale, w_scale, partial)
    if config.persistent:
        launch_stage2_persistent(inter, w2, partial, topk_weight, routing, doweight_stage1,
                                 config, stage_scales, warmup)
    else:
        grid = (routing.blocks, triton.cdiv(model_dim, config.block_n), config.split_k)
        _checks.start(moe_stage2_kernel, grid, warmup, launch_pdl=PDL)(
            inter, w2, partial, topk_weight.reshape(-1), routing.sorted_ids,
            routing.block_expert, routing.block_rows, routing.rows_used, topk_ids.reshape(-1),
            expert_map, stage_scales.x, stage_scales.w, pairs, model_dim, inter_dim,
            inter.stride(0), inter.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
            partial.stride(0), partial.stride(1), *stage_scales.strides,
            MUL_WEIGHT=not doweight_stage1, SCALED=stage_scales.kind, SPLIT_K=config.split_k,
            INPUT_PRECISION=_checks.input_precision(dtype), PAIR_BLOCKS=routing.pair_blocks,
            PDL=PDL, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages)
    if not with_sum:
        return partial
    if out is None:
        out = torch.empty((tokens, model_dim), dtype=dtype, device=inter.device)
    return run_sum(partial, topk_ids, expert_map, out, warmup, zero=kept)


PARTIALS_KIND = "moe_stage2_partials"
# Split stage 2's fp32 rows are kept per stream and model_dim up to this size, zero as the sum
# leaves them: no fill launch per call. (A graph captured where its stream has none that fits
# makes its own, zero-filled in every replay.)
KEPT_PARTIALS_BYTES = 32 << 20


def _split_partials(pairs: int, model_dim: int, device: torch.device,
                    summed: bool) -> tuple[torch.Tensor, bool]:
    """Split stage 2's zeroed fp32 rows (pairs, D), and whether they are the stream's kept ones
    (which the sum must zero again): the first ``pairs`` rows of the most any call took so far,
    not for rows nobody sums here, nor past the size kept."""
    if not summed or pairs * model_dim * 4 > KEPT_PARTIALS_BYTES:
        return torch.zeros((pairs, model_dim), dtype=torch.float32, device=device), False
    rows = stream_workspace((PARTIALS_KIND, model_dim), device,
                            lambda: torch.zeros((pairs, model_dim), dtype=torch.float32,
                                                device=device),
                            fits=lambda kept: kept.shape[0] >= pairs)
    return rows[:pairs], True


# Up to this many tokens the sum reads every slot's row without waiting for the expert map (the
# rows of other ranks' experts too: bytes a prefill would not want to waste).
SPECULATIVE_SUM_TOKENS = 64


def run_sum(partial, topk_ids, expert_map, out, warmup: bool = False,
            zero: bool = False) -> torch.Tensor:
    """Each token's ``topk`` rows of ``partial`` (pairs, D), added in fp32 in slot order (pairs
    of other ranks' experts skipped), into ``out`` (T, D); ``zero``: the rows read are left
    zero (a workspace's)."""
    tokens, model_dim = out.shape
    topk_p2 = triton.next_power_of_2(topk_ids.shape[1])
    block_d = min(max(8192 // topk_p2, 16), triton.next_power_of_2(model_dim))
    _checks.start(moe_sum_kernel, (tokens, triton.cdiv(model_dim, block_d)), warmup,
                  launch_pdl=PDL)(
        partial, topk_ids.reshape(-1), expert_map, out, model_dim,
        partial.stride(0), partial.stride(1), out.stride(0), out.stride(1),
        TOPK=topk_ids.shape[1], TOPK_P2=topk_p2, PDL=PDL,
        SPECULATE=tokens <= SPECULATIVE_SUM_TOKENS, ZERO=zero, BLOCK_D=block_d, num_warps=4)
    return out
