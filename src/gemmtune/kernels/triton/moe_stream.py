"""A fused MoE for decode's few tokens as one streaming launch: every routed pair's weights read
once at the streaming bandwidth, with nothing between the reads of w1 and w2 but a short wait.

Decode is a read of the routed experts' weights; the GEMMs are matrix-vector products. So this
kernel does them on the CUDA cores in fp32 (weights loaded straight into registers, no tensor
core tile of 16 rows for one token, no shared memory) and spends its design on keeping the
memory busy until the last byte:

- **Many small programs.** Stage-1 programs come first in the grid, pair by pair: ``block_n``
  intermediate columns of one routed pair, ``h = act(x @ w1_gate.T) * (x @ w1_up.T)`` over all
  of model_dim. Then stage-2 programs, token by token: ``block_d`` output columns of one token,
  ``sum_k weight_k * w2[e_k][cols] @ h_k`` over the token's routed pairs, rounded straight into
  the output (no atomics, no sum launch, no routing preparation). Programs use few registers,
  so many are resident per SM and the hardware's dispatch balances the SMs: the tail that
  idles the memory system at the end of a launch is one small program.
- **Stage 2 takes a token's pairs at once, and loads before it waits.** A stage-2 program
  reads its rows of every routed expert's w2 as one (pair, row, step) tile per step, so no
  pair's load waits on the one before; it reads the pairs' intermediate rows once their
  stage-1 programs are counted in ``ready[pair]``, and its first tile, which depends on
  nothing, is loaded before that wait, so the wait overlaps the read. CUDA dispatches a grid's
  programs in order, so every stage-1 program has been placed on an SM before any stage-2
  program waits: the waits cannot starve the programs they wait on.
- Each program double-buffers its weight tiles by hand (the next step's load issued before this
  step's arithmetic), so it keeps two steps of loads in flight.

The workspace (an exit counter and ``ready``) is zero before a launch; the last program out
resets it, so a call is one launch and the workspace is made once per (device, stream, shape).
Pairs routed to another rank's experts (``expert_map`` -1) are skipped by both stages. Each
output element is one program's fp32 sum, in a fixed order: results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_common import (PDL, gated_activation, global_time_ns,
                                                let_next_start, stream_workspace,
                                                wait_for_inputs)
from gemmtune.kernels.triton.moe_configs import MoeStreamConfig

WORKSPACE_KIND = "moe_stream"  # its workspaces' key in moe_common's cache
# fp32 values a thread holds for one weight tile's products (stage 1: gate and up; stage 2: the
# down tile), each loaded tile double-buffered beside them: kept well below the 255 registers.
MAX_TILE_VALUES = 64
RESET_BLOCK = tl.constexpr(1024)  # ready counters the last program clears per step


def why_not_stream(config: MoeStreamConfig, topk: int) -> str | None:
    """What keeps a streaming config from compiling or running well: tile sizes, warps,
    registers."""
    for field, low, high in (("block_n", 2, 256), ("block_k", 16, 4096), ("block_d", 2, 256),
                             ("block_i", 16, 1024)):
        v = getattr(config, field)
        if not _checks.is_pow2(v) or not low <= v <= high:
            return f"{field}={v} must be a power of two in [{low}, {high}]"
    if config.num_warps not in _checks.VALID_WARPS:
        return f"num_warps={config.num_warps} must be one of {_checks.VALID_WARPS}"
    threads = 32 * config.num_warps
    for what, values in (("stage 1's gate and up tiles", 2 * config.block_n * config.block_k),
                         ("stage 2's down tile", triton.next_power_of_2(topk) * config.block_d
                          * config.block_i)):
        if values > MAX_TILE_VALUES * threads:
            return (f"{what} hold {values} values, more than {MAX_TILE_VALUES} per thread of "
                    f"{config.num_warps} warps; use smaller blocks or more warps")
    return None


@triton.jit
def moe_stream_kernel(
    x_ptr,  # (T, D)
    w1_ptr,  # (E, 2 * I, D)
    w2_ptr,  # (E, D, I)
    out_ptr,  # (T, D)
    inter_ptr,  # (T * TOPK, I) in x's dtype
    exited_ptr,  # (1,) int32, zero: programs finished
    ready_ptr,  # (T * TOPK,) int32, zero: stage-1 chunks done per pair
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
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # stage 1: inter_dim chunk, model_dim step
    BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,  # stage 2: model_dim chunk, inter_dim step
    trace_ptr,  # (programs, 3) int64 with TRACE: start, end of stage 2's wait, end (ns)
    TRACE: tl.constexpr,  # a timeline per program (benchmarks/moe_one_stage_timeline.py)
):
    wait_for_inputs(PDL)  # x and the routing come from the kernels before
    pid = tl.program_id(0)
    if TRACE:
        tl.store(trace_ptr + pid * 3, global_time_ns(pid))
    chunks1 = tl.cdiv(I, BLOCK_N)  # stage-1 programs per pair
    stage1_programs = T * TOPK * chunks1
    chunks2 = tl.cdiv(D, BLOCK_D)  # stage-2 programs per token
    if pid < stage1_programs:
        _stage1_chunk(x_ptr, w1_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr,
                      expert_map_ptr, pid // chunks1, pid % chunks1, D, I,
                      stride_xt, stride_xd, stride_1e, stride_1n, stride_1d,
                      TOPK, ACT, MUL_WEIGHT1, BLOCK_N, BLOCK_K)
    else:
        q = pid - stage1_programs
        _stage2_chunk(w2_ptr, out_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr,
                      expert_map_ptr, q // chunks2, q % chunks2, chunks1, D, I,
                      stride_2e, stride_2d, stride_2i, stride_ot, stride_od,
                      TOPK, TOPK_P2, MUL_WEIGHT1, BLOCK_D, BLOCK_I, trace_ptr, TRACE)
    if TRACE:
        tl.store(trace_ptr + pid * 3 + 2, global_time_ns(pid))
    # The last program out leaves the workspace zero: every wait has ended by then.
    tl.debug_barrier()
    if tl.atomic_add(exited_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        slots = tl.arange(0, RESET_BLOCK)
        for s0 in range(0, T * TOPK, RESET_BLOCK):
            tl.store(ready_ptr + s0 + slots, tl.zeros((RESET_BLOCK,), dtype=tl.int32),
                     mask=s0 + slots < T * TOPK)
        tl.atomic_xchg(exited_ptr, 0, sem="release")
    let_next_start(PDL)


@triton.jit
def _local_expert(topk_ids_ptr, expert_map_ptr, pair):
    """The local expert (int64) of a routed pair, -1 where another rank holds it."""
    return tl.load(expert_map_ptr + tl.load(topk_ids_ptr + pair)).to(tl.int64)


@triton.jit
def _stage1_chunk(x_ptr, w1_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr,
                  expert_map_ptr, pair, chunk, D, I, stride_xt, stride_xd,
                  stride_1e, stride_1n, stride_1d, TOPK: tl.constexpr, ACT: tl.constexpr,
                  MUL_WEIGHT1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``h[pair, cols] = act(x[token] @ w1_gate[e, cols].T) * (x[token] @ w1_up[e, cols].T)``
    for one chunk of columns, then the chunk counted in ``ready[pair]``."""
    expert = _local_expert(topk_ids_ptr, expert_map_ptr, pair)
    if expert >= 0:
        offs_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.where(offs_n < I, offs_n, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (pair // TOPK).to(tl.int64) * stride_xt + offs_k * stride_xd
        gate_ptrs = (w1_ptr + expert * stride_1e + cols[:, None] * stride_1n
                     + offs_k[None, :] * stride_1d)  # (BN, BK): rows [0, I) of w1[e]
        up_ptrs = gate_ptrs + I * stride_1n  # rows [I, 2I)
        inside = offs_k[None, :] < D
        gate_w = tl.load(gate_ptrs, mask=inside, other=0.0)
        up_w = tl.load(up_ptrs, mask=inside, other=0.0)
        gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            x = tl.load(x_ptrs, mask=offs_k < D - k0, other=0.0).to(tl.float32)[None, :]
            # The next step's tiles load while this step's products are summed.
            inside = offs_k[None, :] < D - k0 - BLOCK_K
            gate_ptrs += BLOCK_K * stride_1d
            up_ptrs += BLOCK_K * stride_1d
            next_gate = tl.load(gate_ptrs, mask=inside, other=0.0)
            next_up = tl.load(up_ptrs, mask=inside, other=0.0)
            gate += gate_w.to(tl.float32) * x
            up += up_w.to(tl.float32) * x
            gate_w, up_w = next_gate, next_up
            x_ptrs += BLOCK_K * stride_xd
        h = gated_activation(tl.sum(gate, axis=1), tl.sum(up, axis=1), ACT)
        if MUL_WEIGHT1:
            h = h * tl.load(topk_weight_ptr + pair)
        tl.store(inter_ptr + pair.to(tl.int64) * I + offs_n, h.to(inter_ptr.dtype.element_ty),
                 mask=offs_n < I)
        # Every thread's stores are issued before the count moves (the barrier), and the
        # release makes them visible to the program that sees the count complete.
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + pair, 1, sem="release")


@triton.jit
def _stage2_chunk(w2_ptr, out_ptr, inter_ptr, ready_ptr, topk_weight_ptr, topk_ids_ptr,
                  expert_map_ptr, token, chunk, chunks1, D, I, stride_2e, stride_2d, stride_2i,
                  stride_ot, stride_od, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  MUL_WEIGHT1: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                  trace_ptr, TRACE: tl.constexpr):
    """``out[token, rows] = sum_k weight_k * w2[e_k][rows] @ h[pair_k]`` over the token's
    routed pairs, all at once: a (pair, row, step) tile of w2 per step along inter_dim, the
    first loaded before waiting for the pairs' intermediate rows."""
    offs_p = tl.arange(0, TOPK_P2)
    pairs = token * TOPK + tl.where(offs_p < TOPK, offs_p, 0)
    experts = tl.load(expert_map_ptr + tl.load(topk_ids_ptr + pairs))
    live = (offs_p < TOPK) & (experts >= 0)
    offs_d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.where(offs_d < D, offs_d, 0).to(tl.int64)
    slabs = w2_ptr + tl.where(live, experts, 0).to(tl.int64) * stride_2e  # (pairs,)
    offs_i = tl.arange(0, BLOCK_I)
    w_ptrs = (slabs[:, None, None] + rows[None, :, None] * stride_2d
              + offs_i[None, None, :] * stride_2i)  # (pairs, BD, BI)
    w = tl.load(w_ptrs, mask=live[:, None, None] & (offs_i[None, None, :] < I), other=0.0)
    # Plain polls (a read-modify-write per poll would queue behind the stage-1 counts on the
    # same addresses), then one acquire orders the reads of h after the counts.
    while tl.min(tl.where(live, tl.load(ready_ptr + pairs, volatile=True), chunks1)) < chunks1:
        pass
    tl.atomic_add(ready_ptr + pairs, 0, mask=live, sem="acquire")
    if TRACE:
        tl.store(trace_ptr + tl.program_id(0) * 3 + 1, global_time_ns(token))
    scale = tl.where(live, 1.0, 0.0)
    if not MUL_WEIGHT1:
        scale = tl.load(topk_weight_ptr + pairs, mask=live, other=0.0)
    h_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * I + offs_i[None, :]  # (pairs, BI)
    total = tl.zeros((TOPK_P2, BLOCK_D), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        h = tl.load(h_ptrs, mask=live[:, None] & (offs_i[None, :] < I - i0), other=0.0,
                    cache_modifier=".cg")
        # The next step's tile loads while this step's products are summed.
        w_ptrs += BLOCK_I * stride_2i
        next_w = tl.load(w_ptrs, mask=live[:, None, None]
                         & (offs_i[None, None, :] < I - i0 - BLOCK_I), other=0.0)
        h = h.to(tl.float32) * scale[:, None]
        total += tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)
        w = next_w
        h_ptrs += BLOCK_I
    dst = out_ptr + token.to(tl.int64) * stride_ot + offs_d * stride_od
    tl.store(dst, tl.sum(total, axis=0).to(out_ptr.dtype.element_ty), mask=offs_d < D)


class _Workspace:
    """The zero-between-launches counters and the intermediate of one (T, topk, I, dtype)."""

    def __init__(self, pairs: int, inter_dim: int, dtype: torch.dtype, device: torch.device):
        counters = torch.zeros(pairs + 1, dtype=torch.int32, device=device)
        self.exited, self.ready = counters[:1], counters[1:]
        self.inter = torch.empty(pairs, inter_dim, dtype=dtype, device=device)


def programs(tokens: int, topk: int, inter_dim: int, model_dim: int,
             config: MoeStreamConfig) -> int:
    """The grid: stage-1 programs (a set per routed pair), then stage-2 programs (per token)."""
    return tokens * (topk * triton.cdiv(inter_dim, config.block_n)
                     + triton.cdiv(model_dim, config.block_d))


def moe_stream(x, w1, w2, topk_weight, topk_ids, expert_map, activation: int,
               doweight_stage1: bool, config: MoeStreamConfig, out: torch.Tensor | None = None,
               warmup: bool = False, trace: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE in one streaming launch: x (T, D), w1 (E, 2I, D), w2 (E, D, I), topk_weight
    (T, topk) fp32, topk_ids (T, topk) int32 -> (T, D) in x's dtype, into ``out`` if given.
    Launch only: the caller checked the shapes. ``warmup``: compile, launch nothing. ``trace``
    (GPU only): an int64 (programs, 3) tensor that gets each program's start, the end of its
    stage-2 wait (left as it was for stage-1 programs) and its end, in ns of the global timer."""
    tokens, model_dim = x.shape
    inter_dim = w2.shape[2]
    topk = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    ws = stream_workspace((WORKSPACE_KIND, tokens * topk, inter_dim, x.dtype), x.device,
                          lambda: _Workspace(tokens * topk, inter_dim, x.dtype, x.device))
    grid = (programs(tokens, topk, inter_dim, model_dim, config),)
    _checks.start(moe_stream_kernel, grid, warmup, launch_pdl=PDL)(
        x, w1, w2, out, ws.inter, ws.exited, ws.ready,
        topk_weight.reshape(-1), topk_ids.reshape(-1), expert_map,
        tokens, model_dim, inter_dim,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), ACT=activation,
        MUL_WEIGHT1=doweight_stage1, PDL=PDL,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_D=config.block_d,
        BLOCK_I=config.block_i, trace_ptr=trace, TRACE=trace is not None,
        num_warps=config.num_warps, num_stages=1)
    return out
