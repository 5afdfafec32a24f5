"""Routing preparation of a fused MoE, on the GPU in one launch (three for many pairs): which
(token, slot) pairs each local expert computes, grouped per expert into blocks of ``block_m``
rows.

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
# Pairs one program groups: above this the preparation spreads over programs (three launches),
# since one program steps through the pairs CHUNK at a time.
PAIRS_PER_PROGRAM = 1024


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
    """The whole preparation in one program: for few pairs, where one launch beats three."""
    bins = tl.arange(0, EXPERTS_POW2)
    counts = _count(topk_ids_ptr, expert_map_ptr, 0, pairs, experts, EXPERTS_POW2, CHUNK)
    starts, ends = _expert_runs(counts, bins, experts, rows_used_ptr, BLOCK_M)
    _fill_padding(sorted_ids_ptr, 0, max_rows_, pairs, CHUNK)
    _fill_blocks(block_expert_ptr, 0, max_blocks, starts, ends, bins, BLOCK_M, CHUNK)
    _place(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, 0, pairs, experts, starts, bins, CHUNK)


@triton.jit
def moe_count_kernel(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, counts_ptr, pairs, experts,
                     max_rows_, PAIRS_PER_PROGRAM: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                     CHUNK: tl.constexpr):
    """Many pairs, step 1 of 3: each program counts its span of pairs per expert (into row
    ``pid`` of ``counts``) and marks its share of ``sorted_ids`` as padding."""
    pid = tl.program_id(0)
    first = pid * PAIRS_PER_PROGRAM
    last = tl.minimum(first + PAIRS_PER_PROGRAM, pairs)
    counts = _count(topk_ids_ptr, expert_map_ptr, first, last, experts, EXPERTS_POW2, CHUNK)
    tl.store(counts_ptr + pid * EXPERTS_POW2 + tl.arange(0, EXPERTS_POW2), counts)
    rows_each = tl.cdiv(max_rows_, tl.num_programs(0))
    _fill_padding(sorted_ids_ptr, pid * rows_each, tl.minimum((pid + 1) * rows_each, max_rows_),
                  pairs, CHUNK)


@triton.jit
def moe_offsets_kernel(counts_ptr, offsets_ptr, runs_ptr, rows_used_ptr, experts, programs,
                       BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                       PROGRAMS_STEP: tl.constexpr):
    """Step 2 of 3, one program: the experts' padded runs (into ``runs``: starts, then ends),
    and the row where each step-1 program's first pair of each expert goes (into
    ``offsets``): its expert's start plus that expert's pairs in the programs before it."""
    bins = tl.arange(0, EXPERTS_POW2)
    steps = tl.arange(0, PROGRAMS_STEP)
    totals = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for p in range(0, programs, PROGRAMS_STEP):
        tile = _program_tile(counts_ptr, p + steps, programs, bins, EXPERTS_POW2)
        totals += tl.sum(tile, axis=0)
    starts, ends = _expert_runs(totals, bins, experts, rows_used_ptr, BLOCK_M)
    tl.store(runs_ptr + bins, starts)
    tl.store(runs_ptr + EXPERTS_POW2 + bins, ends)
    running = starts
    for p in range(0, programs, PROGRAMS_STEP):
        tile = _program_tile(counts_ptr, p + steps, programs, bins, EXPERTS_POW2)
        before = tl.cumsum(tile, axis=0) - tile  # this step's programs before each one
        tl.store(offsets_ptr + (p + steps)[:, None] * EXPERTS_POW2 + bins[None, :],
                 running[None, :] + before, mask=(p + steps)[:, None] < programs)
        running += tl.sum(tile, axis=0)


@triton.jit
def moe_place_kernel(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr, offsets_ptr,
                     runs_ptr, pairs, experts, max_blocks, BLOCK_M: tl.constexpr,
                     PAIRS_PER_PROGRAM: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                     CHUNK: tl.constexpr):
    """Step 3 of 3: each program puts its span of pairs in their rows, in pair order, and sets
    the expert of its share of the blocks."""
    pid = tl.program_id(0)
    bins = tl.arange(0, EXPERTS_POW2)
    first = pid * PAIRS_PER_PROGRAM
    base = tl.load(offsets_ptr + pid * EXPERTS_POW2 + bins)
    _place(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, first,
           tl.minimum(first + PAIRS_PER_PROGRAM, pairs), experts, base, bins, CHUNK)
    starts = tl.load(runs_ptr + bins)
    ends = tl.load(runs_ptr + EXPERTS_POW2 + bins)
    blocks_each = tl.cdiv(max_blocks, tl.num_programs(0))
    _fill_blocks(block_expert_ptr, pid * blocks_each,
                 tl.minimum((pid + 1) * blocks_each, max_blocks), starts, ends, bins, BLOCK_M,
                 CHUNK)


@triton.jit
def _count(topk_ids_ptr, expert_map_ptr, first, last, experts, EXPERTS_POW2: tl.constexpr,
           CHUNK: tl.constexpr):
    """Pairs [first, last) per local expert (the spare bin ``experts`` zeroed)."""
    bins = tl.arange(0, EXPERTS_POW2)
    counts = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for start in range(first, last, CHUNK):
        expert = _local_expert(topk_ids_ptr, expert_map_ptr, start + tl.arange(0, CHUNK), last,
                               experts)
        counts += tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
    return tl.where(bins < experts, counts, 0)


@triton.jit
def _expert_runs(counts, bins, experts, rows_used_ptr, BLOCK_M: tl.constexpr):
    """Each expert's run of rows, padded to whole blocks: (starts, ends); stores the rows used."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(rows_used_ptr, tl.sum(padded, axis=0))
    return ends - padded, ends


@triton.jit
def _fill_padding(sorted_ids_ptr, first_row, last_row, pairs, CHUNK: tl.constexpr):
    for start in range(first_row, last_row, CHUNK):
        row = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + row, tl.zeros((CHUNK,), dtype=tl.int32) + pairs,
                 mask=row < last_row)


@triton.jit
def _fill_blocks(block_expert_ptr, first_block, last_block, starts, ends, bins,
                 BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The local expert of blocks [first_block, last_block), -1 past the experts' runs."""
    for start in range(first_block, last_block, CHUNK):
        block = start + tl.arange(0, CHUNK)
        first_row = block * BLOCK_M
        inside = (first_row[:, None] >= starts[None, :]) & (first_row[:, None] < ends[None, :])
        owner = tl.sum(tl.where(inside, bins[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(block_expert_ptr + block, tl.where(owned, owner, -1), mask=block < last_block)


@triton.jit
def _place(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, first, last, experts, base, bins,
           CHUNK: tl.constexpr):
    """Pairs [first, last) to their rows: ``base`` (per expert, the row of its first pair here)
    plus the pairs of the same expert before it."""
    offs = tl.arange(0, CHUNK)
    earlier = offs[None, :] < offs[:, None]  # (row j, column c): pair c comes before pair j
    seen = base
    for start in range(first, last, CHUNK):
        i = start + offs
        expert = _local_expert(topk_ids_ptr, expert_map_ptr, i, last, experts)
        same = (expert[:, None] == expert[None, :]) & earlier
        rank = tl.sum(same.to(tl.int32), axis=1)
        onehot = expert[:, None] == bins[None, :]
        row = tl.sum(tl.where(onehot, seen[None, :], 0), axis=1)
        tl.store(sorted_ids_ptr + row + rank, i, mask=(i < last) & (expert < experts))
        seen += tl.sum(onehot.to(tl.int32), axis=0)


@triton.jit
def _program_tile(counts_ptr, programs_here, programs, bins, EXPERTS_POW2: tl.constexpr):
    return tl.load(counts_ptr + programs_here[:, None] * EXPERTS_POW2 + bins[None, :],
                   mask=programs_here[:, None] < programs, other=0)


@triton.jit
def _local_expert(topk_ids_ptr, expert_map_ptr, i, last, experts):
    """The local expert of pairs ``i``; ``experts`` (the spare bin) for a pair at or past
    ``last`` or routed to an expert of another rank."""
    inside = i < last
    global_id = tl.load(topk_ids_ptr + i, mask=inside, other=0)
    local = tl.load(expert_map_ptr + global_id, mask=inside, other=-1)
    return tl.where(inside & (local >= 0), local, experts)


def moe_routing(topk_ids: torch.Tensor, expert_map: torch.Tensor, experts: int,
                block_m: int, warmup: bool = False,
                pairs_per_program: int = PAIRS_PER_PROGRAM) -> MoeRouting:
    """Group the pairs of ``topk_ids`` (T, topk) int32 by local expert (``expert_map``:
    (E_global,) int32, -1 for experts of other ranks) into blocks of ``block_m`` rows: in one
    launch up to ``pairs_per_program`` pairs, else in three (count per span of pairs, offsets,
    place), each span a program. ``warmup``: compile only (the routing's tensors are left
    unset)."""
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
    ids, expert_map = topk_ids.reshape(-1).contiguous(), expert_map.contiguous()
    bins = triton.next_power_of_2(experts + 1)
    if pairs <= pairs_per_program:
        _checks.start(moe_routing_kernel, (1,), warmup)(
            ids, expert_map, routing.sorted_ids, routing.block_expert, routing.rows_used, pairs,
            experts, rows, blocks, BLOCK_M=block_m, EXPERTS_POW2=bins, CHUNK=CHUNK,
            num_warps=4)
        return routing
    programs = triton.cdiv(pairs, pairs_per_program)
    counts = torch.empty((programs, bins), dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    runs = torch.empty((2, bins), dtype=torch.int32, device=device)
    _checks.start(moe_count_kernel, (programs,), warmup)(
        ids, expert_map, routing.sorted_ids, counts, pairs, experts, rows,
        PAIRS_PER_PROGRAM=pairs_per_program, EXPERTS_POW2=bins, CHUNK=CHUNK, num_warps=4)
    _checks.start(moe_offsets_kernel, (1,), warmup)(
        counts, offsets, runs, routing.rows_used, experts, programs, BLOCK_M=block_m,
        EXPERTS_POW2=bins, PROGRAMS_STEP=16, num_warps=4)
    _checks.start(moe_place_kernel, (programs,), warmup)(
        ids, expert_map, routing.sorted_ids, routing.block_expert, offsets, runs, pairs,
        experts, blocks, BLOCK_M=block_m, PAIRS_PER_PROGRAM=pairs_per_program,
        EXPERTS_POW2=bins, CHUNK=CHUNK, num_warps=4)
    return routing
