"""A fused MoE in one launch, for few tokens: both GEMMs, the activation and the sum over top-k,
the routing read straight from ``topk_ids`` (no preparation launch).

The grid is stage-1 programs first, then stage-2 programs. Items are keyed by routed pair
("slot"); the first slot of each expert (its leader) does that expert's work for every token
routed to it, the other slots return at once, so each routed expert's weights are read once.

- Stage-1 program (slot, tile): ``h = act(x @ w1_gate[e, tile].T) * (x @ w1_up[e, tile].T)`` for
  the expert's tokens (a ``block_t`` tile of rows, those not routed to it masked), into the
  intermediate row of each (token, expert) pair; then it counts itself in ``ready[slot]``.
- Stage-2 program (slot, tile of model_dim): waits for ``ready[slot]`` to reach the stage-1 tile
  count (the expert's whole intermediate), then ``h @ w2[e, tile].T``, times the routing weight,
  added in fp32 into the token rows of a workspace. The last stage-2 program of an output tile
  (a counter per tile) rounds it into the output.

CUDA dispatches a grid's programs in order, so every stage-1 program has been placed on an SM
before any stage-2 program waits: the waits cannot starve the programs they wait on.

The workspace (fp32 sums and counters) is zero before a launch and the launch leaves it zero:
the converting program zeroes its tile and counter, and the last of those resets the stage-1
counters. So a call is one launch, and the workspace is made once per (device, stream, shape),
outside any CUDA-graph capture where it can be. Adds land in whatever order programs finish:
results may differ in the last fp32 bit between runs, not beyond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_configs import MoeOneStageConfig
from gemmtune.kernels.triton.moe_common import (gate_up_sums, gated_activation, global_time_ns,
                                                stream_workspace)

# Rows of the token tile: the smallest tl.dot takes; the tokens of a call share one tile.
MIN_BLOCK_T = 16
MAX_TOKENS = 64  # the token tile's accumulators grow with it; the kernel is for decode
# fp32 accumulator values a thread may hold (gate and up at stage 1, the down tile at stage 2).
MAX_ACC_REGS = 128
WORKSPACE_KIND = "moe_1stage"  # its workspaces' key in moe_common's cache
# Each launch waits on the kernel before it with programmatic dependent launch (Hopper+; the
# interpreter has none).
PDL = not _checks.interpreted()


def token_block(tokens: int) -> int:
    return max(MIN_BLOCK_T, triton.next_power_of_2(tokens))


def why_not_one_stage(config: MoeOneStageConfig, tokens: int, dtype: torch.dtype) -> str | None:
    """What keeps a 1-stage config from running ``tokens`` tokens of ``dtype``: tile sizes,
    warps and stages, registers and shared memory."""
    if tokens > MAX_TOKENS:
        return (f"{tokens} tokens: the 1-stage kernel takes at most {MAX_TOKENS} (it is for "
                f"decode; use a two-stage solution)")
    for field in ("block_n", "block_k", "block_d", "block_i"):
        v = getattr(config, field)
        if not _checks.is_pow2(v) or not 16 <= v <= 1024:
            return f"{field}={v} must be a power of two in [16, 1024]"
    problem = _checks.why_not_warps_stages(config)
    if problem:
        return problem
    threads = 32 * config.num_warps
    rows = token_block(tokens)
    for what, values in (("gate and up", 2 * rows * config.block_n),
                         ("down", rows * config.block_d)):
        if values > MAX_ACC_REGS * threads:
            return (f"{what} accumulators of {rows} tokens need more than {MAX_ACC_REGS} "
                    f"registers per thread; use smaller blocks or more warps")
    stage1 = (rows + 2 * config.block_n) * config.block_k
    stage2 = (rows + config.block_d) * config.block_i
    smem = config.num_stages * max(stage1, stage2) * dtype.itemsize
    if smem > _checks.SMEM_LIMIT_BYTES:
        return f"shared memory {smem} B > {_checks.SMEM_LIMIT_BYTES} B; reduce blocks or stages"
    return None


@triton.jit
def _slot_work(topk_ids_ptr, expert_map_ptr, slot, T,
               TOPK: tl.constexpr, BLOCK_T: tl.constexpr, TOPK_P2: tl.constexpr):
    """The local expert (int64) whose work slot ``slot`` does, -1 if none (another slot of the
    same expert leads, or the expert is another rank's); which token rows of the tile are routed
    to it; and the pair id of each such (token, expert)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, TOPK_P2)
    inside = (offs_t[:, None] < T) & (offs_k[None, :] < TOPK)
    ids = tl.load(topk_ids_ptr + offs_t[:, None] * TOPK + offs_k[None, :], mask=inside, other=-1)
    mine = tl.load(topk_ids_ptr + slot)
    hit = ids == mine
    pair = offs_t[:, None] * TOPK + offs_k[None, :]
    leader = tl.min(tl.min(tl.where(hit, pair, BLOCK_T * TOPK), axis=1), axis=0) == slot
    expert = tl.where(leader, tl.load(expert_map_ptr + mine), -1)
    routed = tl.max(hit.to(tl.int32), axis=1) > 0
    pair_of_row = tl.sum(tl.where(hit, pair, 0), axis=1)
    return expert.to(tl.int64), routed, pair_of_row


@triton.jit
def moe_one_stage_kernel(
    x_ptr,  # (T, D)
    w1_ptr,  # (E, 2 * I, D)
    w2_ptr,  # (E, D, I)
    out_ptr,  # (T, D)
    inter_ptr,  # (T * TOPK, I) in x's dtype
    acc_ptr,  # (T, D) fp32, zero
    ready_ptr,  # (T * TOPK,) int32, zero: stage-1 tiles done per leading slot
    done_ptr,  # (cdiv(D, BLOCK_D),) int32, zero: stage-2 programs done per output tile
    converted_ptr,  # (1,) int32, zero: output tiles converted
    topk_weight_ptr,  # (T * TOPK,) fp32
    topk_ids_ptr,  # (T * TOPK,) int32 global expert ids
    expert_map_ptr,  # (E_global,) int32, -1: another rank's expert
    T, D, I,
    stride_xt, stride_xd,
    stride_1e, stride_1n, stride_1d,
    stride_2e, stride_2d, stride_2i,
    stride_ot, stride_od,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    ACT: tl.constexpr,
    MUL_WEIGHT1: tl.constexpr,  # the routing weight applied in stage 1 (doweight_stage1)
    INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # stage 1: inter_dim tile, model_dim step
    BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,  # stage 2: model_dim tile, inter_dim step
    trace_ptr,  # (programs, 3) int64 with TRACE: start, end of stage 2's wait, end (ns)
    TRACE: tl.constexpr,  # a timeline per program (benchmarks/moe_one_stage_timeline.py)
):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the routing and x come from the kernels before
    pid = tl.program_id(0)
    if TRACE:
        tl.store(trace_ptr + pid * 3, global_time_ns(pid))
    tiles1 = tl.cdiv(I, BLOCK_N)
    stage1_programs = T * TOPK * tiles1
    if pid < stage1_programs:
        _stage1(x_ptr, w1_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr,
                expert_map_ptr, pid // tiles1, pid % tiles1, T, D, I,
                stride_xt, stride_xd, stride_1e, stride_1n, stride_1d,
                TOPK, TOPK_P2, ACT, MUL_WEIGHT1, INPUT_PRECISION, BLOCK_T, BLOCK_N, BLOCK_K)
    else:
        tiles2 = tl.cdiv(D, BLOCK_D)
        q = pid - stage1_programs
        _stage2(w2_ptr, out_ptr, inter_ptr, acc_ptr, ready_ptr, done_ptr, converted_ptr,
                topk_weight_ptr, topk_ids_ptr, expert_map_ptr, q // tiles2, q % tiles2, tiles1,
                tiles2, T, D, I, stride_2e, stride_2d, stride_2i, stride_ot, stride_od,
                TOPK, TOPK_P2, MUL_WEIGHT1, INPUT_PRECISION, BLOCK_T, BLOCK_D, BLOCK_I,
                trace_ptr, TRACE)
    if TRACE:
        tl.store(trace_ptr + pid * 3 + 2, global_time_ns(pid))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _stage1(x_ptr, w1_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr, expert_map_ptr,
            slot, tile, T, D, I, stride_xt, stride_xd, stride_1e, stride_1n, stride_1d,
            TOPK: tl.constexpr, TOPK_P2: tl.constexpr, ACT: tl.constexpr,
            MUL_WEIGHT1: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, routed, pairs = _slot_work(topk_ids_ptr, expert_map_ptr, slot, T, TOPK, BLOCK_T,
                                       TOPK_P2)
    if expert >= 0:
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.where(offs_n < I, offs_n, 0).to(tl.int64)
        gate, up = gate_up_sums(x_ptr, w1_ptr, offs_t, routed, expert, cols, 0, D, I, stride_xt,
                                stride_xd, stride_1e, stride_1n, stride_1d, x_ptr, w1_ptr,
                                0, 0, 0, 0, 0, INPUT_PRECISION, False, BLOCK_T, BLOCK_N,
                                BLOCK_K)  # no scales: bf16 / fp16 / fp32 experts
        h = gated_activation(gate, up, ACT)
        if MUL_WEIGHT1:
            h = h * tl.load(topk_weight_ptr + pairs, mask=routed, other=0.0)[:, None]
        dst = inter_ptr + pairs.to(tl.int64)[:, None] * I + offs_n[None, :]
        tl.store(dst, h.to(inter_ptr.dtype.element_ty),
                 mask=routed[:, None] & (offs_n[None, :] < I))
        # Every thread's stores are issued before the count moves (the barrier), and the
        # release makes them visible to the program that sees the count complete.
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + slot, 1, sem="release")


@triton.jit
def _stage2(w2_ptr, out_ptr, inter_ptr, acc_ptr, ready_ptr, done_ptr, converted_ptr,
            topk_weight_ptr, topk_ids_ptr, expert_map_ptr, slot, tile, tiles1, tiles2,
            T, D, I, stride_2e, stride_2d, stride_2i, stride_ot, stride_od,
            TOPK: tl.constexpr, TOPK_P2: tl.constexpr, MUL_WEIGHT1: tl.constexpr,
            INPUT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_I: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    expert, routed, pairs = _slot_work(topk_ids_ptr, expert_map_ptr, slot, T, TOPK, BLOCK_T,
                                       TOPK_P2)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    if expert >= 0:
        rows = tl.where(offs_d < D, offs_d, 0).to(tl.int64)
        offs_i = tl.arange(0, BLOCK_I)
        w_ptrs = (w2_ptr + expert * stride_2e + rows[None, :] * stride_2d
                  + offs_i[:, None] * stride_2i)  # (BI, BD): w2[e][tile, :].T
        h_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * I + offs_i[None, :]
        # Poll with plain loads (a read-modify-write per poll would queue behind the stage-1
        # counts on the same address), then one acquire orders the reads of h after the count.
        while tl.load(ready_ptr + slot, volatile=True) < tiles1:
            pass
        tl.atomic_add(ready_ptr + slot, 0, sem="acquire")
        if TRACE:
            tl.store(trace_ptr + tl.program_id(0) * 3 + 1, global_time_ns(slot))
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            h = tl.load(h_ptrs, mask=routed[:, None] & (offs_i[None, :] < I - i0), other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptrs, mask=offs_i[:, None] < I - i0, other=0.0)
            acc = tl.dot(h, w, acc, input_precision=INPUT_PRECISION)
            w_ptrs += BLOCK_I * stride_2i
            h_ptrs += BLOCK_I
        if not MUL_WEIGHT1:
            acc = acc * tl.load(topk_weight_ptr + pairs, mask=routed, other=0.0)[:, None]
        tl.atomic_add(acc_ptr + offs_t[:, None] * D + offs_d[None, :], acc,
                      mask=routed[:, None] & (offs_d[None, :] < D), sem="relaxed")
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + tile, 1, sem="acq_rel") == T * TOPK - 1:
        _convert_tile(out_ptr, acc_ptr, done_ptr, converted_ptr, ready_ptr, tile, tiles2, T, D,
                      stride_ot, stride_od, TOPK, TOPK_P2, BLOCK_T, BLOCK_D)


@triton.jit
def _convert_tile(out_ptr, acc_ptr, done_ptr, converted_ptr, ready_ptr, tile, tiles2, T, D,
                  stride_ot, stride_od, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The last stage-2 program of an output tile: round the tile's sums into the output and
    leave the workspace as it found it (zero); the last tile converted resets the stage-1
    counters, whose every reader has passed its wait by then."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    sums = acc_ptr + offs_t[:, None] * D + offs_d[None, :]
    total = tl.load(sums, mask=inside, other=0.0, cache_modifier=".cg")
    dst = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_d[None, :] * stride_od
    tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=inside)
    tl.debug_barrier()  # the zeros may be laid out over other threads than the loads were
    tl.store(sums, tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32), mask=inside)
    tl.atomic_xchg(done_ptr + tile, 0, sem="relaxed")
    if tl.atomic_add(converted_ptr, 1, sem="acq_rel") == tiles2 - 1:
        slots = tl.arange(0, BLOCK_T * TOPK_P2)
        tl.store(ready_ptr + slots, tl.zeros((BLOCK_T * TOPK_P2,), dtype=tl.int32),
                 mask=slots < T * TOPK)
        tl.atomic_xchg(converted_ptr, 0, sem="relaxed")


class _Workspace:
    """The zero-between-launches buffers of one (device, stream, T, topk, I, D, block_d)."""

    def __init__(self, tokens: int, topk: int, inter_dim: int, model_dim: int, tiles2: int,
                 dtype: torch.dtype, device: torch.device):
        pairs = tokens * topk
        counters = torch.zeros(pairs + tiles2 + 1, dtype=torch.int32, device=device)
        self.ready, self.done, self.converted = (counters[:pairs], counters[pairs:-1],
                                                 counters[-1:])
        self.acc = torch.zeros(tokens, model_dim, dtype=torch.float32, device=device)
        self.inter = torch.empty(pairs, inter_dim, dtype=dtype, device=device)


def _workspace(tokens, topk, inter_dim, model_dim, tiles2, dtype, device) -> _Workspace:
    return stream_workspace(
        (WORKSPACE_KIND, tokens, topk, inter_dim, model_dim, tiles2, dtype), device,
        lambda: _Workspace(tokens, topk, inter_dim, model_dim, tiles2, dtype, device))


def programs(tokens: int, topk: int, inter_dim: int, model_dim: int,
             config: MoeOneStageConfig) -> int:
    """The grid: stage-1 programs, then stage-2 programs, a set of each per routed pair."""
    return tokens * topk * (triton.cdiv(inter_dim, config.block_n)
                            + triton.cdiv(model_dim, config.block_d))


def moe_one_stage(x, w1, w2, topk_weight, topk_ids, expert_map, activation: int,
                  doweight_stage1: bool, config: MoeOneStageConfig,
                  out: torch.Tensor | None = None, warmup: bool = False,
                  trace: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE in one launch: x (T, D), w1 (E, 2I, D), w2 (E, D, I), topk_weight (T, topk)
    fp32, topk_ids (T, topk) int32 -> (T, D) in x's dtype, into ``out`` if given. Launch only:
    the caller checked the shapes. ``warmup``: compile, launch nothing. ``trace`` (GPU only):
    an int64 (programs, 3) tensor that gets each program's start, the end of its stage-2 wait
    (left as it was for stage-1 programs) and its end, in ns of the GPU's global timer."""
    tokens, model_dim = x.shape
    inter_dim = w2.shape[2]
    topk = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    tiles2 = triton.cdiv(model_dim, config.block_d)
    ws = _workspace(tokens, topk, inter_dim, model_dim, tiles2, x.dtype, x.device)
    grid = (programs(tokens, topk, inter_dim, model_dim, config),)
    _checks.start(moe_one_stage_kernel, grid, warmup, launch_pdl=PDL)(
        x, w1, w2, out, ws.inter, ws.acc, ws.ready, ws.done, ws.converted,
        topk_weight.reshape(-1), topk_ids.reshape(-1), expert_map,
        tokens, model_dim, inter_dim,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), ACT=activation,
        MUL_WEIGHT1=doweight_stage1, INPUT_PRECISION=_checks.input_precision(x.dtype), PDL=PDL,
        BLOCK_T=token_block(tokens), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_D=config.block_d, BLOCK_I=config.block_i, trace_ptr=trace, TRACE=trace is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
