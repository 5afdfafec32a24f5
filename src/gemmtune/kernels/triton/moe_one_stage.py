"""A fused MoE in one launch, for few tokens: both GEMMs and the activation per routed pair, with
the routing read straight from ``topk_ids`` (no grouping: each pair is its own program row).

Program (part, pair) takes ``block_i`` rows of the intermediate of one pair (token t, expert e):
``h = act(w1_gate[e, rows] @ x[t]) * (w1_up[e, rows] @ x[t]) * weight`` (matrix-vector products
over the whole model_dim), then adds ``w2[e][:, rows] @ h`` into the token's fp32 row of a
workspace. Each weight element is read once per pair, which is what decode's few tokens need: the
experts' bytes are the whole cost, and a pair per program spreads them over every SM at once.
(Stage 1's weight and stage 2's are the same scale of the same product, since the down projection
is linear: applying it once to ``h`` serves ``doweight_stage1`` both ways.)

The last program to finish a token (a per-token counter) rounds its fp32 row into the output, so
the op is one launch after the workspace's one zero fill. Adds land in whatever order programs
finish: results may differ in the last fp32 bit between runs, not beyond.

On the H100 it has lost to the two stages over pair blocks at every decode shape tuned
(docs/benchmarks.md): every program of a token adds into the same fp32 row, and L2 serialises
those adds, and an expert's weights are read once per pair routed to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_configs import MoeOneStageConfig

# fp32 values a thread may hold for the gate and up partial sums together, and for a down tile.
MAX_GATE_UP_REGS = 128
MAX_DOWN_REGS = 64


def why_not_one_stage(config: MoeOneStageConfig) -> str | None:
    """What keeps a 1-stage config from running: its tile sizes, warps and registers."""
    for field in ("block_i", "block_k", "block_d"):
        v = getattr(config, field)
        if not _checks.is_pow2(v) or not 8 <= v <= 1024:
            return f"{field}={v} must be a power of two in [8, 1024]"
    if config.num_warps not in _checks.VALID_WARPS:
        return f"num_warps={config.num_warps} must be one of {_checks.VALID_WARPS}"
    threads = 32 * config.num_warps
    if 2 * config.block_i * config.block_k > MAX_GATE_UP_REGS * threads:
        return (f"gate and up sums of {config.block_i}x{config.block_k} need more than "
                f"{MAX_GATE_UP_REGS} registers per thread; use smaller blocks or more warps")
    if config.block_d * config.block_i > MAX_DOWN_REGS * threads:
        return (f"a {config.block_d}x{config.block_i} down tile needs more than {MAX_DOWN_REGS} "
                f"registers per thread; use smaller blocks or more warps")
    return None


@triton.jit
def moe_one_stage_kernel(
    x_ptr,  # (T, D)
    w1_ptr,  # (E, 2 * I, D)
    w2_ptr,  # (E, D, I)
    out_ptr,  # (T, D)
    acc_ptr,  # (T, D) fp32, zeroed
    done_ptr,  # (T,) int32, zeroed: programs finished per token
    topk_weight_ptr,  # (pairs,) fp32
    topk_ids_ptr,  # (pairs,) int32 global expert ids
    expert_map_ptr,  # (E_global,) int32, -1: another rank's expert
    D, I,
    stride_xt, stride_xd,
    stride_1e, stride_1n, stride_1d,
    stride_2e, stride_2d, stride_2i,
    stride_ot, stride_od,
    TOPK: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Axis 0 runs over one pair's parts, so the programs that run together read neighbouring
    # columns of the same w2 rows.
    part = tl.program_id(0)
    pair = tl.program_id(1)
    token = (pair // TOPK).to(tl.int64)
    expert = tl.load(expert_map_ptr + tl.load(topk_ids_ptr + pair))
    offs_d = tl.arange(0, BLOCK_D)
    if expert >= 0:  # a pair of another rank's expert adds nothing, but still counts as done
        e = expert.to(tl.int64)
        offs_i = part * BLOCK_I + tl.arange(0, BLOCK_I)
        rows = tl.where(offs_i < I, offs_i, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        gate_ptrs = w1_ptr + e * stride_1e + rows[:, None] * stride_1n + offs_k[None, :] * stride_1d
        up_ptrs = gate_ptrs + I * stride_1n
        x_ptrs = x_ptr + token * stride_xt + offs_k * stride_xd
        gate_sum = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
        up_sum = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            inside = offs_k < D - k0
            x = tl.load(x_ptrs, mask=inside, other=0.0).to(tl.float32)[None, :]
            gate_sum += tl.load(gate_ptrs, mask=inside[None, :], other=0.0).to(tl.float32) * x
            up_sum += tl.load(up_ptrs, mask=inside[None, :], other=0.0).to(tl.float32) * x
            x_ptrs += BLOCK_K * stride_xd
            gate_ptrs += BLOCK_K * stride_1d
            up_ptrs += BLOCK_K * stride_1d
        gate = tl.sum(gate_sum, axis=1)
        up = tl.sum(up_sum, axis=1)
        if ACT == 0:
            act = gate / (1.0 + tl.exp(-gate))  # SiLU
        else:
            act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))  # exact GELU
        h = tl.where(offs_i < I, act * up * tl.load(topk_weight_ptr + pair), 0.0)
        down_ptrs = w2_ptr + e * stride_2e + offs_d[:, None] * stride_2d + rows[None, :] * stride_2i
        acc_ptrs = acc_ptr + token * D + offs_d
        for d0 in range(0, D, BLOCK_D):
            inside = offs_d < D - d0
            w = tl.load(down_ptrs, mask=inside[:, None] & (offs_i < I)[None, :], other=0.0)
            tl.atomic_add(acc_ptrs, tl.sum(w.to(tl.float32) * h[None, :], axis=1), mask=inside,
                          sem="relaxed")
            down_ptrs += BLOCK_D * stride_2d
            acc_ptrs += BLOCK_D
    # Every thread's adds are issued before the counter moves (the barrier), and the counter's
    # acquire-release makes them visible to the program that finds itself last.
    tl.debug_barrier()
    finished = tl.atomic_add(done_ptr + token, 1, sem="acq_rel")
    if finished == TOPK * tl.num_programs(0) - 1:
        for d0 in range(0, D, BLOCK_D):
            inside = offs_d < D - d0
            total = tl.load(acc_ptr + token * D + d0 + offs_d, mask=inside, other=0.0,
                            cache_modifier=".cg")
            tl.store(out_ptr + token * stride_ot + (d0 + offs_d) * stride_od,
                     total.to(out_ptr.dtype.element_ty), mask=inside)


def moe_one_stage(x, w1, w2, topk_weight, topk_ids, expert_map, activation: int,
                  config: MoeOneStageConfig, out: torch.Tensor | None = None,
                  warmup: bool = False) -> torch.Tensor:
    """The whole MoE in one launch: x (T, D), w1 (E, 2I, D), w2 (E, D, I), topk_weight (T, topk)
    fp32, topk_ids (T, topk) int32 -> (T, D) in x's dtype, into ``out`` if given. Launch only:
    the caller checked the shapes. ``warmup``: compile, launch nothing."""
    tokens, model_dim = x.shape
    inter_dim = w2.shape[2]
    topk = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    # One zero fill serves both: the fp32 sums, then the per-token counters (zero bits either way).
    workspace = torch.zeros(tokens * model_dim + tokens, dtype=torch.float32, device=x.device)
    acc, done = workspace[:tokens * model_dim], workspace[tokens * model_dim:].view(torch.int32)
    grid = (triton.cdiv(inter_dim, config.block_i), tokens * topk)
    _checks.start(moe_one_stage_kernel, grid, warmup)(
        x, w1, w2, out, acc, done, topk_weight.reshape(-1), topk_ids.reshape(-1), expert_map,
        model_dim, inter_dim,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        TOPK=topk, ACT=activation,
        BLOCK_I=config.block_i, BLOCK_K=config.block_k, BLOCK_D=config.block_d,
        num_warps=config.num_warps)
    return out
