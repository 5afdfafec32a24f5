"""Routing preparation of a fused MoE, on the GPU in one launch: which (token, slot) pairs each
local expert computes, grouped per expert into blocks of ``block_m`` rows.

``topk_ids`` (T, topk) holds global expert ids. Pair ``i = t * topk + k`` (token t, slot k) goes to
expert ``expert_map[topk_ids[t, k]]`` (-1: not a local expert, the pair contributes nothing). The
result, all on the device and sized by upper bounds (no host sync: CUDA-graph capturable):

- ``sorted_ids`` (max_rows,) int32: the pairs of local expert 0, then expert 1, ..., each
  expert's run padded to a multiple of ``block_m`` with the sentinel ``T * topk``; within an
  expert, pairs keep their order (a stable grouping, so results never depend on scheduling);
- ``block_expert`` (max_blocks,) int32: the local expert of each block of ``block_m`` rows, -1
  past the last used block;
- ``rows_used`` (1,) int32: how many rows of ``sorted_ids`` the experts' runs take.

``max_rows = T * topk + E * (block_m - 1)`` (each expert's run wastes at most block_m - 1 rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks

# Pairs handled per step of the grouping loop: the stable rank of a pair among the earlier
# pairs of its expert comes from a (CHUNK, CHUNK) comparison, so CHUNK^2 values live at once.
CHUNK = 64


class MoeRouting(NamedTuple):
    sorted_ids: torch.Tensor  # (max_rows,) int32
    block_expert: torch.Tensor  # (max_blocks,) int32
    rows_used: torch.Tensor  # (1,) int32
    block_m: int


def max_rows(pairs: int, experts: int, block_m: int) -> int:
    return pairs + experts * (block_m - 1)


@triton.jit
def moe_routing_kernel(
    topk_ids_ptr,  # (T * topk,) int32 global expert ids
    expert_map_ptr,  # (E_global,) int32: local expert or -1
    sorted_ids_ptr,  # (max_rows,) int32
    block_expert_ptr,  # (max_blocks,) int32
    rows_used_ptr,  # (1,) int32
    pairs,  # T * topk
    experts,  # local experts E
    max_rows_,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,  # >= experts + 1 (the last bin takes non-local pairs)
    CHUNK: tl.constexpr,
):
    bins = tl.arange(0, EXPERTS_POW2)
    offs = tl.arange(0, CHUNK)
    # 1. Pairs per local expert.
    counts = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        i = start + offs
        expert = _local_expert(topk_ids_ptr, expert_map_ptr, i, pairs, experts)
        counts += tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
    counts = tl.where(bins < experts, counts, 0)
    # 2. Each expert's run, padded to whole blocks, and where it starts.
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(rows_used_ptr, tl.sum(padded, axis=0))
    # 3. Every row a padding row first; every block's expert.
    for start in range(0, max_rows_, CHUNK):
        row = start + offs
        tl.store(sorted_ids_ptr + row, tl.zeros((CHUNK,), dtype=tl.int32) + pairs,
                 mask=row < max_rows_)
    for start in range(0, max_blocks, CHUNK):
        block = start + offs
        first_row = block * BLOCK_M
        inside = (first_row[:, None] >= starts[None, :]) & (first_row[:, None] < ends[None, :])
        owner = tl.sum(tl.where(inside, bins[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(block_expert_ptr + block, tl.where(owned, owner, -1), mask=block < max_blocks)
    # 4. Each pair to its row: its expert's start plus the pairs of that expert before it.
    seen = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)  # pairs placed so far, per expert
    earlier = offs[None, :] < offs[:, None]  # (row j, column c): pair c comes before pair j
    for start in range(0, pairs, CHUNK):
        i = start + offs
        expert = _local_expert(topk_ids_ptr, expert_map_ptr, i, pairs, experts)
        same = (expert[:, None] == expert[None, :]) & earlier
        rank = tl.sum(same.to(tl.int32), axis=1)
        onehot = expert[:, None] == bins[None, :]
        base = tl.sum(tl.where(onehot, (starts + seen)[None, :], 0), axis=1)
        tl.store(sorted_ids_ptr + base + rank, i, mask=(i < pairs) & (expert < experts))
        seen += tl.sum(onehot.to(tl.int32), axis=0)


@triton.jit
def _local_expert(topk_ids_ptr, expert_map_ptr, i, pairs, experts):
    """The local expert of pairs ``i``; ``experts`` (the spare bin) for a pair that is past the
    end or routed to an expert of another rank."""
    inside = i < pairs
    global_id = tl.load(topk_ids_ptr + i, mask=inside, other=0)
    local = tl.load(expert_map_ptr + global_id, mask=inside, other=-1)
    return tl.where(inside & (local >= 0), local, experts)


def moe_routing(topk_ids: torch.Tensor, expert_map: torch.Tensor, experts: int,
                block_m: int, warmup: bool = False) -> MoeRouting:
    """Group the pairs of ``topk_ids`` (T, topk) int32 by local expert (``expert_map``:
    (E_global,) int32, -1 for experts of other ranks) into blocks of ``block_m`` rows.
    ``warmup``: compile only (the routing's tensors are left unset)."""
    if topk_ids.dtype != torch.int32 or expert_map.dtype != torch.int32:
        raise TypeError(f"moe_routing: topk_ids and expert_map must be int32, got "
                        f"{topk_ids.dtype} and {expert_map.dtype}")
    if not _checks.is_pow2(block_m):
        raise ValueError(f"moe_routing: block_m={block_m} must be a power of two")
    pairs = topk_ids.numel()
    rows = max_rows(pairs, experts, block_m)
    blocks = triton.cdiv(rows, block_m)
    device = topk_ids.device
    routing = MoeRouting(torch.empty(rows, dtype=torch.int32, device=device),
                         torch.empty(blocks, dtype=torch.int32, device=device),
                         torch.empty(1, dtype=torch.int32, device=device), block_m)
    _checks.start(moe_routing_kernel, (1,), warmup)(
        topk_ids.reshape(-1).contiguous(), expert_map.contiguous(), routing.sorted_ids,
        routing.block_expert, routing.rows_used, pairs, experts, rows, blocks,
        BLOCK_M=block_m, EXPERTS_POW2=triton.next_power_of_2(experts + 1), CHUNK=CHUNK,
        num_warps=4)
    return routing
