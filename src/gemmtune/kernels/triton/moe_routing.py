"""Routing preparation of a fused MoE, on the GPU in one launch (three for many pairs): which
(token, slot) pairs each local expert computes, grouped per expert into blocks of ``block_m``
rows.

``topk_ids`` (T, topk) holds global expert ids. Pair ``i = t * topk + k`` (token t, slot k) goes to
expert ``expert_map[topk_ids[t, k]]`` (-1: not a local expert, the pair contributes nothing). The
result, all on the device and sized by upper bounds (no host sync: CUDA-graph capturable):

- ``sorted_ids`` (max_rows,) int32: the pairs of local expert 0, then expert 1, ..., each
  expert's run padded to a multiple of ``block_m``; within an expert, pairs keep their order (a
  stable grouping, so results never depend on scheduling). Padding rows are left unset (set to
  the sentinel ``T * topk`` only with ``sentinels``, for kernels that want them);
- ``block_expert`` (max_blocks,) int32: the local expert of each block of ``block_m`` rows;
- ``block_rows`` (max_blocks,) int32: how many of a block's rows hold a pair (the rest pad);
- ``rows_used`` (1,) int32: how many rows of ``sorted_ids`` the experts' runs take;
- ``expert_ends`` (the power of two above E,) int32: the row where each local expert's run
  ends, its first E the offsets of a grouped GEMM over the runs.

Rows at and past ``rows_used``, and their blocks, are left unset: the stages never read them.
``max_rows = T * topk + E * (block_m - 1)`` (each expert's run wastes at most block_m - 1 rows).
A program sorts its span of pairs by (expert, pair) and counts them per expert; every pair at the
start of a block records the block's expert and real rows (each block of a run starts with a
pair, since only a run's last block is padded).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_configs import PAIR_BLOCK_M

# Pairs one program groups (a power of two: they are sorted at once, by expert then pair):
# above this the preparation spreads over programs, in three launches.
PAIRS_PER_PROGRAM = 1024
MIN_SPAN = 16  # the fewest lanes a program sorts (tl.sort and tl.histogram want a few)
ROUTING_WARPS = 4


class MoeRouting(NamedTuple):
    """The blocks the stages run over: grouped by expert (the tensors below), or with
    ``pair_blocks`` one block per routed pair, nothing prepared (the four tensors are then
    ``topk_ids`` flattened, placeholders the stages never read)."""

    sorted_ids: torch.Tensor  # (max_rows,) int32
    block_expert: torch.Tensor  # (max_blocks,) int32
    rows_used: torch.Tensor  # (1,) int32
    block_m: int
    pair_blocks: bool = False
    expert_ends: torch.Tensor | None = None  # (bins,) int32; None with pair blocks
    block_rows: torch.Tensor | None = None  # (max_blocks,) int32; a placeholder with pair blocks

    @property
    def blocks(self) -> int:
        """The blocks a stage's grid covers."""
        return self.sorted_ids.numel() if self.pair_blocks else self.block_expert.numel()


def pair_blocks(topk_ids: torch.Tensor) -> MoeRouting:
    """One block of PAIR_BLOCK_M rows per routed pair (its first row the pair): for decode's few
    pairs, where grouping would make the same blocks and costs a launch."""
    ids = topk_ids.reshape(-1)
    return MoeRouting(ids, ids, ids, PAIR_BLOCK_M, pair_blocks=True, block_rows=ids)


def max_rows(pairs: int, experts: int, block_m: int) -> int:
    return pairs + experts * (block_m - 1)


@triton.jit
def moe_routing_kernel(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr,
                       block_rows_ptr, rows_used_ptr, ends_ptr, pairs, experts,
                       BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr, SPAN: tl.constexpr):
    """The whole preparation in one program, for up to SPAN pairs: one launch beats three."""
    expert = _span_experts(topk_ids_ptr, expert_map_ptr, 0, pairs, experts, SPAN)
    counts = _local_counts(expert, experts, EXPERTS_POW2)
    starts = _expert_runs(counts, rows_used_ptr, ends_ptr, BLOCK_M)
    _place(sorted_ids_ptr, block_expert_ptr, block_rows_ptr, expert, 0, starts, counts,
           starts + counts, experts, BLOCK_M, SPAN)


@triton.jit
def moe_count_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, pairs, experts,
                     EXPERTS_POW2: tl.constexpr, SPAN: tl.constexpr):
    """Many pairs, step 1 of 3: each program counts its span of pairs per local expert, into row
    ``pid`` of ``counts``."""
    pid = tl.program_id(0)
    expert = _span_experts(topk_ids_ptr, expert_map_ptr, pid * SPAN, pairs, experts, SPAN)
    counts = _local_counts(expert, experts, EXPERTS_POW2)
    tl.store(counts_ptr + pid * EXPERTS_POW2 + tl.arange(0, EXPERTS_POW2), counts)


@triton.jit
def moe_offsets_kernel(counts_ptr, offsets_ptr, real_ends_ptr, rows_used_ptr, ends_ptr,
                       programs, BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                       PROGRAMS_STEP: tl.constexpr):
    """Step 2 of 3, one program: the experts' padded runs, where each one's pairs end
    (``real_ends``), and the row where each step-1 program's first pair of each expert goes
    (into ``offsets``): its expert's start plus that expert's pairs in the programs before it."""
    bins = tl.arange(0, EXPERTS_POW2)
    steps = tl.arange(0, PROGRAMS_STEP)
    totals = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for p in range(0, programs, PROGRAMS_STEP):
        totals += tl.sum(_program_tile(counts_ptr, p + steps, programs, bins, EXPERTS_POW2),
                         axis=0)
    starts = _expert_runs(totals, rows_used_ptr, ends_ptr, BLOCK_M)
    tl.store(real_ends_ptr + bins, starts + totals)
    running = starts
    for p in range(0, programs, PROGRAMS_STEP):
        tile = _program_tile(counts_ptr, p + steps, programs, bins, EXPERTS_POW2)
        before = tl.cumsum(tile, axis=0) - tile  # this step's programs before each one
        tl.store(offsets_ptr + (p + steps)[:, None] * EXPERTS_POW2 + bins[None, :],
                 running[None, :] + before, mask=(p + steps)[:, None] < programs)
        running += tl.sum(tile, axis=0)


@triton.jit
def moe_place_kernel(topk_ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr,
                     block_rows_ptr, offsets_ptr, counts_ptr, real_ends_ptr, pairs, experts,
                     BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr, SPAN: tl.constexpr):
    """Step 3 of 3: each program puts its span of pairs in their rows, in pair order."""
    pid = tl.program_id(0)
    bins = tl.arange(0, EXPERTS_POW2)
    expert = _span_experts(topk_ids_ptr, expert_map_ptr, pid * SPAN, pairs, experts, SPAN)
    counts = tl.load(counts_ptr + pid * EXPERTS_POW2 + bins)  # step 1's
    base = tl.load(offsets_ptr + pid * EXPERTS_POW2 + bins)
    _place(sorted_ids_ptr, block_expert_ptr, block_rows_ptr, expert, pid * SPAN, base, counts,
           tl.load(real_ends_ptr + bins), experts, BLOCK_M, SPAN)


@triton.jit
def _span_experts(topk_ids_ptr, expert_map_ptr, first, pairs, experts, SPAN: tl.constexpr):
    """The local expert of pairs [first, first + SPAN); ``experts`` (the spare bin) for a pair
    past the end or routed to an expert of another rank."""
    i = first + tl.arange(0, SPAN)
    inside = i < pairs
    global_id = tl.load(topk_ids_ptr + i, mask=inside, other=0)
    local = tl.load(expert_map_ptr + global_id, mask=inside, other=-1)
    return tl.where(inside & (local >= 0), local, experts)


@triton.jit
def _local_counts(expert, experts, EXPERTS_POW2: tl.constexpr):
    """Pairs per local expert (the spare bin zeroed)."""
    bins = tl.arange(0, EXPERTS_POW2)
    return tl.where(bins < experts, tl.histogram(expert, EXPERTS_POW2), 0)


@triton.jit
def _expert_runs(counts, rows_used_ptr, ends_ptr, BLOCK_M: tl.constexpr):
    """Where each expert's run of rows starts, its runs padded to whole blocks; stores the rows
    used and where each run ends."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(rows_used_ptr, tl.sum(padded, axis=0))
    tl.store(ends_ptr + tl.arange(0, padded.shape[0]), ends)
    return ends - padded


@triton.jit
def _place(sorted_ids_ptr, block_expert_ptr, block_rows_ptr, expert, first, base, counts,
           real_ends, experts, BLOCK_M: tl.constexpr, SPAN: tl.constexpr):
    """Pairs [first, first + SPAN) (their experts ``expert``) to their rows: ``base`` (per
    expert, the row of its first pair here) plus the pairs of the same expert before it. A
    sort by (expert, pair) lines each expert's pairs up in order; the pair at the start of a
    block also records the block's expert and how many of its rows hold pairs (its expert's
    pairs end at ``real_ends``)."""
    position = tl.arange(0, SPAN)
    ordered = tl.sort(expert * SPAN + position)
    expert_at = ordered // SPAN
    pair_at = first + ordered % SPAN
    # The sorted position of an expert's first pair: the pairs of the experts below it.
    shift = base - (tl.cumsum(counts, axis=0) - counts)
    row = tl.gather(shift, tl.minimum(expert_at, experts), 0) + position
    local = expert_at < experts
    tl.store(sorted_ids_ptr + row, pair_at, mask=local)
    starts_block = local & (row % BLOCK_M == 0)
    tl.store(block_expert_ptr + row // BLOCK_M, expert_at, mask=starts_block)
    real_end = tl.gather(real_ends, tl.minimum(expert_at, experts), 0)
    tl.store(block_rows_ptr + row // BLOCK_M, tl.minimum(real_end - row, BLOCK_M),
             mask=starts_block)


@triton.jit
def _program_tile(counts_ptr, programs_here, programs, bins, EXPERTS_POW2: tl.constexpr):
    return tl.load(counts_ptr + programs_here[:, None] * EXPERTS_POW2 + bins[None, :],
                   mask=programs_here[:, None] < programs, other=0)


def moe_routing(topk_ids: torch.Tensor, expert_map: torch.Tensor, experts: int,
                block_m: int, warmup: bool = False,
                pairs_per_program: int = PAIRS_PER_PROGRAM,
                num_warps: int = ROUTING_WARPS, sentinels: bool = False) -> MoeRouting:
    """Group the pairs of ``topk_ids`` (T, topk) int32 by local expert (``expert_map``:
    (E_global,) int32, -1 for experts of other ranks) into blocks of ``block_m`` rows: in one
    launch up to ``pairs_per_program`` pairs, else in three (count per span of pairs, offsets,
    place), each span a program. ``sentinels``: padding rows hold ``T * topk`` (a fill launch
    more). ``warmup``: compile only (the routing's tensors are left unset)."""
    if topk_ids.dtype != torch.int32 or expert_map.dtype != torch.int32:
        raise TypeError(f"moe_routing: topk_ids and expert_map must be int32, got "
                        f"{topk_ids.dtype} and {expert_map.dtype}")
    if not (_checks.is_pow2(block_m) and _checks.is_pow2(pairs_per_program)):
        raise ValueError(f"moe_routing: block_m={block_m} and pairs_per_program="
                         f"{pairs_per_program} must be powers of two")
    pairs = topk_ids.numel()
    rows = max_rows(pairs, experts, block_m)
    blocks = triton.cdiv(rows, block_m)
    device = topk_ids.device
    bins = triton.next_power_of_2(experts + 1)
    sorted_ids = (torch.full((rows,), pairs, dtype=torch.int32, device=device) if sentinels
                  else torch.empty(rows, dtype=torch.int32, device=device))
    routing = MoeRouting(sorted_ids, torch.empty(blocks, dtype=torch.int32, device=device),
                         torch.empty(1, dtype=torch.int32, device=device), block_m,
                         expert_ends=torch.empty(bins, dtype=torch.int32, device=device),
                         block_rows=torch.empty(blocks, dtype=torch.int32, device=device))
    ids, expert_map = topk_ids.reshape(-1).contiguous(), expert_map.contiguous()
    if pairs <= pairs_per_program:
        _checks.start(moe_routing_kernel, (1,), warmup)(
            ids, expert_map, routing.sorted_ids, routing.block_expert, routing.block_rows,
            routing.rows_used, routing.expert_ends, pairs, experts, BLOCK_M=block_m,
            EXPERTS_POW2=bins,
            SPAN=max(MIN_SPAN, triton.next_power_of_2(pairs)), num_warps=num_warps)
        return routing
    programs = triton.cdiv(pairs, pairs_per_program)
    counts = torch.empty((programs, bins), dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    real_ends = torch.empty(bins, dtype=torch.int32, device=device)
    _checks.start(moe_count_kernel, (programs,), warmup)(
        ids, expert_map, counts, pairs, experts, EXPERTS_POW2=bins, SPAN=pairs_per_program,
        num_warps=num_warps)
    _checks.start(moe_offsets_kernel, (1,), warmup)(
        counts, offsets, real_ends, routing.rows_used, routing.expert_ends, programs,
        BLOCK_M=block_m, EXPERTS_POW2=bins, PROGRAMS_STEP=16, num_warps=num_warps)
    _checks.start(moe_place_kernel, (programs,), warmup)(
        ids, expert_map, routing.sorted_ids, routing.block_expert, routing.block_rows, offsets,
        counts, real_ends, pairs, experts, BLOCK_M=block_m, EXPERTS_POW2=bins,
        SPAN=pairs_per_program, num_warps=num_warps)
    return routing
