"""What the split-K GEMM kernels (``gemm_splitk``, ``gemm_gemv``) share: programmatic dependent
launch modes, the per-stream fp32 partials and tile counters, and the tail in which the last
split of an output tile to finish sums every split's partial and stores the tile.

The tail is deterministic: partials are summed in split order, whatever order the splits
arrived in, so the result is bitwise the same on every run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import store_tile

# Programmatic dependent launch (Hopper+), a config field because it changes what a launch overlaps
# with: PDL_OFF launches plainly; PDL_WAIT launches with PDL, so the grid is scheduled while the
# previous kernel drains and waits (griddepcontrol.wait) before touching memory other than w
# (gemv, frag, ring, w4frag and wsring's w_ahead load w's first steps before it;
# ``launch_mode``); PDL_PREFETCH
# (gemm_splitk only) also asks L2 for the first bytes of its w slice before that wait, so the
# weight stream starts under the previous kernel's tail (w is never the previous kernel's
# output; x, the partials and the output are only touched after the wait).
PDL_OFF, PDL_WAIT, PDL_PREFETCH = 0, 1, 2

# The last program of a tile sums SPLIT_CHUNK partials per load: at most this many fp32 registers
# per thread, so the reduction never needs more registers than the accumulator may have.
REDUCE_REGS_PER_THREAD = 64
# More than 64 splits only adds partials to sum, never bandwidth.
MAX_SPLIT_K = 64


def split_chunk(block_m: int, block_n: int, num_warps: int) -> int:
    """Partials the last program of a (block_m, block_n) tile sums per load: one load of many
    partials costs one L2 round trip where a load per split would cost split_k of them (~0.2 µs
    each)."""
    per_load = REDUCE_REGS_PER_THREAD * 32 * num_warps // (block_m * block_n)
    return max(1, min(MAX_SPLIT_K, per_load))


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def split_for(tiles: int, k_steps: int, programs: int, max_split: int = MAX_SPLIT_K) -> int:
    """The split of K that brings tiles x split nearest above ``programs``, within the K steps
    and ``max_split`` (each split then gets the same number of steps, give or take one)."""
    return max(1, min(max_split, k_steps, triton.cdiv(programs, tiles)))


class WaveSplit(NamedTuple):
    """A split of K aimed at ``per_sm`` programs an SM, from above or from below."""

    per_sm: int
    split: int
    above: bool  # the programs nearest above per_sm an SM (else nearest below)


def splits_around(tiles: int, k_steps: int, num_sms: int, per_sm_counts,
                  max_split: int = MAX_SPLIT_K) -> list[WaveSplit]:
    """Per count of ``per_sm_counts``, ``split_for``'s split (the programs nearest above that
    many an SM) and, where it differs, the one nearest below: a program an SM at a time, a
    few programs past the wave take a wave of their own (24 tiles split 6 ways make 144
    programs on 132 SMs; 5 ways, 120 in one wave)."""
    found = []
    for per_sm in per_sm_counts:
        above = split_for(tiles, k_steps, per_sm * num_sms, max_split)
        below = max(1, min(above, per_sm * num_sms // tiles))
        found += [WaveSplit(per_sm, above, True)] + (
            [WaveSplit(per_sm, below, False)] if below != above else [])
    return found


def launch_variants(split_k: int, pdl: int) -> list[tuple[int, int]]:
    """The (PDL mode, add_splits) pairs a tuner offers beside a config split ``split_k`` ways:
    without PDL and with ``pdl``, each with the split sums in order and, where K is split,
    added."""
    return [(mode, add) for mode in sorted({PDL_OFF, pdl})
            for add in sorted({0, int(split_k > 1)})]


def why_not_wait_pdl(pdl: int) -> str | None:
    """Why ``pdl`` is not a launch mode of a kernel without row prefetch (PDL_OFF or PDL_WAIT),
    or None."""
    if pdl not in (PDL_OFF, PDL_WAIT):
        return f"pdl={pdl} must be {PDL_OFF} (off) or {PDL_WAIT} (wait)"
    return None


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90+ (and a compiled, not interpreted, kernel);
    elsewhere a PDL config runs as a plain launch, which computes the same result."""
    return (not _checks.interpreted() and device.type == "cuda"
            and _capability_major(device.index if device.index is not None
                                  else torch.cuda.current_device()) >= 9)


def launch_mode(pdl: int, device: torch.device, copied_w: bool = False) -> int:
    """The PDL mode a launch takes: ``pdl`` where the GPU has it, else PDL_OFF; PDL_OFF too where
    the launcher has just copied w (or its scales) for a kernel that reads w before its wait:
    the copying kernel's writes are only sure to be seen after the wait."""
    return pdl if pdl_supported(device) and not copied_w else PDL_OFF


def pdl_where_supported() -> int:
    """The launch mode tuner candidates get: PDL_WAIT where this process's GPU has it (consecutive
    GEMMs then overlap one's launch and weight stream with the previous one's tail), else
    PDL_OFF."""
    return (PDL_WAIT if torch.cuda.is_available() and pdl_supported(torch.device("cuda"))
            else PDL_OFF)


# A stream keeps at most this much of split-K partials; larger ones are made per call.
STREAM_PARTIALS_MAX_BYTES = 256 << 20
# (what, device index, stream handle) -> the stream's buffer of each kind, grown on demand.
_STREAM_BUFFERS: dict[tuple[str, int, int], torch.Tensor] = {}
# Outgrown buffers: a CUDA graph captured (or a launch recorded) before the growth still points
# at them.
_RETIRED_BUFFERS: list[torch.Tensor] = []


def _stream_buffer(what: str, device: torch.device, numel: int, make) -> torch.Tensor:
    """At least ``numel`` elements of the current stream's ``what`` buffer, made by
    ``make(numel)`` and doubled when outgrown."""
    stream = torch.cuda.current_stream(device)
    key = (what, stream.device_index, stream.cuda_stream)
    found = _STREAM_BUFFERS.get(key)
    if found is not None and found.numel() >= numel:
        return found
    grown = make(max(numel, 2 * found.numel() if found is not None else 1024))
    if found is not None:
        _RETIRED_BUFFERS.append(found)
    _STREAM_BUFFERS[key] = grown
    return grown


def stream_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed counters owned by the current stream of ``device``: launches on
    one stream run one after another (a PDL launch touches them only after its wait), so they
    can share one buffer. The first launch on a stream allocates it (a memset); under graph
    capture that memset is recorded once into the graph, and the buffer comes from the graph's
    pool, kept alive here.

    Limit: a graph uses the buffer of the stream it was captured on, and ``torch.cuda.graph``
    captures on one shared stream unless given ``stream=``. Graphs with split-K launches that
    are replayed at the same time on different streams must therefore be captured on different
    streams; replayed one after another (as serving engines do), they may share one."""
    return _stream_buffer("counters", device, tiles, lambda n: torch.zeros(
        n, dtype=torch.int32, device=device))


def stream_partials(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` fp32 split-K partials owned by the current stream of ``device``,
    shared by every launch on it as ``stream_counters`` are (each launch writes a tile's
    partials after its PDL wait and reads them back before it ends), with the same limit on
    graphs. A buffer per stream, not per call: a dispatch plan's recorded launch keeps its
    buffers, so per-call buffers would each be kept."""
    return _stream_buffer("partials", device, numel, lambda n: torch.empty(
        n, dtype=torch.float32, device=device))


def stream_sums(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` zeroed fp32 tile sums owned by the current stream of ``device``, for
    launches whose splits add their partials into one sum per tile and leave it zero
    (``_swapped.finish_tile``'s ADD_SPLITS): shared as ``stream_counters`` are, with the same
    limit on graphs."""
    return _stream_buffer("sums", device, numel, lambda n: torch.zeros(
        n, dtype=torch.float32, device=device))


class Workspace(NamedTuple):
    """What a split launch reads and writes besides its operands."""

    # fp32, [tile][split][tile's elements]; with add_splits [tile][tile's elements], zero at
    # rest
    partials: torch.Tensor
    counters: torch.Tensor  # int32, one per tile, zero at rest
    per_call: bool  # the partials were made for this call alone: a recording must not keep them


def workspace(x: torch.Tensor, out: torch.Tensor, tiles: int, tile_numel: int, split_k: int,
              counters: torch.Tensor | None, warmup: bool, add_splits: bool = False) -> Workspace:
    """The partials (``tiles * split_k * tile_numel`` fp32) and ``tiles`` counters of a split
    launch on x's device: the current stream's (``stream_partials``, ``stream_counters``), or
    per call past ``STREAM_PARTIALS_MAX_BYTES``, under the interpreter, and for a warmup (which
    launches nothing, so needs no zeroed counters). ``add_splits``: instead of the partials,
    ``tiles * tile_numel`` zeroed fp32 sums (``stream_sums``) that the splits add into.
    ``counters``: the caller's own, if given. One split needs none: ``out`` stands in for both,
    never read."""
    if split_k == 1:
        return Workspace(out, out, False)
    numel = tiles * tile_numel * (1 if add_splits else split_k)
    shared = not warmup and x.is_cuda
    per_call = not shared or numel * 4 > STREAM_PARTIALS_MAX_BYTES
    if not per_call:
        parts = (stream_sums if add_splits else stream_partials)(x.device, numel)
    else:
        parts = (torch.zeros if add_splits and not warmup else torch.empty)(
            numel, dtype=torch.float32, device=x.device)
    if counters is None and shared:
        counters = stream_counters(x.device, tiles)
    if counters is None:
        counters = (torch.empty if warmup else torch.zeros)(tiles, dtype=torch.int32,
                                                             device=x.device)
    return Workspace(parts, counters, per_call)


@triton.jit
def sum_splits_and_store(acc, tile, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n, rows,
                         cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym,
                         stride_yn, stride_bias, HAS_BIAS: tl.constexpr, SCALE_A: tl.constexpr,
                         SCALE_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr):
    """Split ``split`` of output tile ``tile`` stores its fp32 partial ``acc`` and counts itself
    in on the tile's counter; the last to arrive sums all partials in split order, resets the
    counter to zero for the next launch and stores the tile (``store_tile``'s scales and bias).
    Partials are laid out [tile][split][BLOCK_M][BLOCK_N], stored only where the output is."""
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile_parts = part_ptr + tile.to(tl.int64) * SPLIT_K * (BLOCK_M * BLOCK_N)
    tl.store(tile_parts + split.to(tl.int64) * (BLOCK_M * BLOCK_N) + local, acc.to(tl.float32),
             mask=inside)
    # All threads' stores happen before one thread's release (the barrier orders them; the
    # gpu-scope release makes them visible with it), as CUTLASS's arrive_inc does.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        # Last of the tile: the acquire above makes every split's partial visible. Sum them in
        # split order, SPLIT_CHUNK per load (.cg reads L2, where the partials are).
        offs_s = tl.arange(0, SPLIT_CHUNK)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s0 in range(0, SPLIT_K, SPLIT_CHUNK):
            ss = s0 + offs_s
            ptrs = tile_parts + ss.to(tl.int64)[:, None, None] * (BLOCK_M * BLOCK_N) \
                + local[None, :, :]
            mask = (ss[:, None, None] < SPLIT_K) & inside[None, :, :]
            parts = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            total += tl.sum(parts, axis=0)
        tl.store(count_ptr + tile, 0)  # leave the counter zero for the next launch
        store_tile(total, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                   M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B)


@triton.jit
def store_split_tile(acc, tile, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n, rows, cols,
                     y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym, stride_yn,
                     stride_bias, HAS_BIAS: tl.constexpr, SCALE_A: tl.constexpr,
                     SCALE_B: tl.constexpr, USE_WORKSPACE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """A split launch's last step: ``sum_splits_and_store`` where K is split (USE_WORKSPACE),
    else ``store_tile`` of the program's own sum."""
    if USE_WORKSPACE:
        sum_splits_and_store(acc, tile, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n,
                             rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N,
                             stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B,
                             BLOCK_M, BLOCK_N, SPLIT_CHUNK)
    else:
        store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                   M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B)
