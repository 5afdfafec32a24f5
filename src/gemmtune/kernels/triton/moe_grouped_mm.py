"""A fused MoE for many tokens: our routing, gather, activation and combine around torch's
grouped GEMM (``torch._grouped_mm``: cuBLAS/CUTLASS on the GPU) for the two projections, named
``triton.moe_gmm``. At prefill token counts the grouped GEMM outruns our Triton stages on large
experts (docs/benchmarks.md); everything around it stays lean (one launch each, bf16 between
steps), unlike the torch backend's argsort and fp32 steps.

1. routing (``moe_routing`` at block_m 1: pairs sorted by local expert, no padding) gives each
   expert's end row, the grouped GEMMs' offsets;
2. gather: row r of ``a`` is the hidden row of the r-th sorted pair, and ``row_of[pair] = r``;
3. ``h = a @ w1[e].T`` per expert's rows (grouped GEMM);
4. activation: ``act(h[:, :I]) * h[:, I:]`` (times the routing weight with ``doweight_stage1``);
5. ``y = act @ w2[e].T`` (grouped GEMM);
6. combine: ``out[t] = sum_k weight[t, k] * y[row_of[t, k]]`` in fp32, in slot order, pairs of
   other ranks' experts (``row_of`` -1) skipped.

bf16 only (the grouped GEMM's type), model_dim and inter_dim multiples of 8 (its 16-byte rows).
No host synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_configs import GROUPED_MM_NAME as NAME
from gemmtune.kernels.triton.moe_routing import moe_routing
from gemmtune.kernels.triton.moe_common import gated_activation

ROW_BLOCK = 1024  # columns per program of the gather, activation and combine


def why_not_grouped_mm(dtype: torch.dtype, model_dim: int, inter_dim: int) -> str | None:
    if dtype != torch.bfloat16:
        return f"{dtype} experts: {NAME} runs torch._grouped_mm, which takes bfloat16"
    if model_dim % 8 or inter_dim % 8:
        return (f"model_dim={model_dim}, inter_dim={inter_dim}: {NAME} needs multiples of 8 "
                f"(torch._grouped_mm's rows are whole 16 B)")
    return None


@triton.jit
def gather_rows_kernel(x_ptr, a_ptr, row_of_ptr, sorted_ids_ptr, rows_used_ptr, D, stride_xt,
                       stride_xd, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of ``a`` = x[token of the r-th sorted pair]; the first column block also records
    the pair's row. Rows past the rows used are left alone (the grouped GEMMs skip them)."""
    r = tl.program_id(0)
    if r < tl.load(rows_used_ptr):
        pair = tl.load(sorted_ids_ptr + r)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        token = (pair // TOPK).to(tl.int64)
        row = tl.load(x_ptr + token * stride_xt + cols * stride_xd, mask=inside)
        tl.store(a_ptr + r.to(tl.int64) * D + cols, row, mask=inside)
        if tl.program_id(1) == 0:
            tl.store(row_of_ptr + pair, r)


@triton.jit
def activation_kernel(h_ptr, act_ptr, sorted_ids_ptr, rows_used_ptr, topk_weight_ptr, I,
                      ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """act[r] = act(h[r, :I]) * h[r, I:], times the pair's routing weight with MUL_WEIGHT."""
    r = tl.program_id(0)
    if r < tl.load(rows_used_ptr):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        base = h_ptr + r.to(tl.int64) * 2 * I
        h = gated_activation(tl.load(base + cols, mask=inside, other=0.0),
                             tl.load(base + I + cols, mask=inside, other=0.0), ACT)
        if MUL_WEIGHT:
            h = h * tl.load(topk_weight_ptr + tl.load(sorted_ids_ptr + r))
        tl.store(act_ptr + r.to(tl.int64) * I + cols, h.to(act_ptr.dtype.element_ty),
                 mask=inside)


@triton.jit
def combine_kernel(y_ptr, out_ptr, row_of_ptr, topk_weight_ptr, D, stride_ot, stride_od,
                   TOPK: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = the sum over slots of (weight *) y[row of (t, k)], fp32, in slot order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < D
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOPK):
        row = tl.load(row_of_ptr + t * TOPK + k)
        if row >= 0:
            y = tl.load(y_ptr + row.to(tl.int64) * D + cols, mask=inside, other=0.0)
            y = y.to(tl.float32)
            if MUL_WEIGHT:
                y = y * tl.load(topk_weight_ptr + t * TOPK + k)
            total += y
    tl.store(out_ptr + t * stride_ot + cols * stride_od, total.to(out_ptr.dtype.element_ty),
             mask=inside)


def moe_grouped_mm(x, w1, w2, topk_weight, topk_ids, expert_map, activation: int,
                   doweight_stage1: bool, out: torch.Tensor | None = None,
                   warmup: bool = False) -> torch.Tensor:
    """The whole MoE (see the module's steps): x (T, D) bf16, w1 (E, 2I, D), w2 (E, D, I),
    topk_weight (T, topk) fp32, topk_ids (T, topk) int32 -> (T, D), into ``out`` if given.
    Launch only: the caller checked the shapes. ``warmup``: compile the Triton steps only."""
    tokens, model_dim = x.shape
    experts, inter_dim = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    pairs = tokens * topk
    if out is None:
        out = torch.empty_like(x)
    routing = moe_routing(topk_ids, expert_map, experts, 1, warmup=warmup)
    row_of = torch.full((pairs,), -1, dtype=torch.int32, device=x.device)
    a = torch.empty(pairs, model_dim, dtype=x.dtype, device=x.device)
    act = torch.empty(pairs, inter_dim, dtype=x.dtype, device=x.device)
    weight = topk_weight.reshape(-1)
    _checks.start(gather_rows_kernel, (pairs, triton.cdiv(model_dim, ROW_BLOCK)), warmup)(
        x, a, row_of, routing.sorted_ids, routing.rows_used, model_dim, x.stride(0), x.stride(1),
        TOPK=topk, BLOCK=ROW_BLOCK)
    if warmup:
        h = torch.empty(pairs, 2 * inter_dim, dtype=x.dtype, device=x.device)
        y = torch.empty(pairs, model_dim, dtype=x.dtype, device=x.device)
    else:
        offsets = routing.expert_ends[:experts]
        h = torch._grouped_mm(a, w1.transpose(1, 2), offs=offsets)
    _checks.start(activation_kernel, (pairs, triton.cdiv(inter_dim, ROW_BLOCK)), warmup)(
        h, act, routing.sorted_ids, routing.rows_used, weight, inter_dim, ACT=activation,
        MUL_WEIGHT=doweight_stage1, BLOCK=ROW_BLOCK)
    if not warmup:
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)
    _checks.start(combine_kernel, (tokens, triton.cdiv(model_dim, ROW_BLOCK)), warmup)(
        y, out, row_of, weight, model_dim, out.stride(0), out.stride(1), TOPK=topk,
        MUL_WEIGHT=not doweight_stage1, BLOCK=ROW_BLOCK)
    return out
