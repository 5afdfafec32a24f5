"""What the swapped FP8 decode kernels in Gluon share (``triton.frag``, ``triton.ring``): w's 64
rows per program as the warpgroup MMA's M and x's rows in blocks as its N, where they run, and
their end: the scales and bias, and K's splits summed by the last program to arrive.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BLOCK_N = 64  # w rows per program: one warpgroup's MMA M (4 warps, a 16-row band each)
NUM_WARPS = 4
# w rows of a program per warp (a warpgroup's 4 warps take 64 rows): the TMA-ring kernel also
# runs 128 rows of w with two warpgroups.
ROWS_PER_WARP = 16
# The MMA's N: x's rows per program (more rows take more programs on the grid's third axis).
# ptxas spilled registers at every 128 and 256 (Triton 3.6 and 3.9, session 20's review).
BLOCK_MS = (8, 16, 32, 64)
MAX_GRID_Z = 65535  # CUDA's limit on the grid's third axis (x's row blocks)
# fp32 partials the last program of a tile loads per unrolled group: BLOCK_M x 64 / 128 threads
# registers each, at most 64 registers in all (128 spilled at BLOCK_M 32-64, ptxas -v).
_PARTIAL_REGS = 64
# A barrier of the block's threads: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7 on.
barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@functools.lru_cache(maxsize=None)
def runs_here() -> bool:
    """Whether the current process's GPU is a Hopper (compute capability 9.0)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def why_not_here(kernel: str,
                 instead: str = "a triton.splitk, triton.tile or triton.gemv config") -> str | None:
    """Why a Gluon kernel (``kernel``, its words) cannot run in this process: Triton's
    interpreter, or a GPU other than a Hopper (the sm_90 instructions it is written for);
    None where it can. ``instead``: what to use then."""
    from gemmtune.kernels.triton import _checks

    if _checks.interpreted():
        return (f"Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1); on the "
                f"CPU use {instead}")
    if not runs_here():
        return f"the {kernel} is written for Hopper (sm_90); on this GPU use {instead}"
    return None


def why_not_grid(config, M: int, K: int, k_steps: int, max_split: int) -> str | None:
    """Why ``config``'s split of K's ``k_steps`` steps or its blocks of M's rows do not make a
    grid (each split at least one step, at most ``max_split``; the third axis CUDA's limit)."""
    if K < 1:
        return (f"K={K}: the Gluon decode kernels multiply at least one step of K; an empty sum "
                f"is the split-K kernels' or torch's")
    if not 1 <= config.split_k <= min(max_split, k_steps):
        return (f"split_k={config.split_k} must be in [1, {min(max_split, k_steps)}]: K={K} is "
                f"{k_steps} steps of block_k={config.block_k}, at most {max_split} splits")
    blocks = -(-M // config.block_m)
    if blocks > MAX_GRID_Z:
        return (f"M={M} takes {blocks} blocks of block_m={config.block_m}, more than the grid's "
                f"third axis holds ({MAX_GRID_Z}); use a larger block_m")
    return None


def why_not_add_splits(config) -> str | None:
    """Why ``config``'s ``add_splits`` (0 or 1; 1 only where K is split) is not one the kernels
    take."""
    if config.add_splits not in (0, 1):
        return f"add_splits={config.add_splits} must be 0 (sum in split order) or 1 (add)"
    if config.add_splits and config.split_k == 1:
        return "add_splits=1 needs split_k > 1: one split has nothing to add"
    return None


def block_m_for(M: int) -> int:
    """The smallest block of x's rows that takes all of M (at most 64: larger M takes several)."""
    return next((b for b in BLOCK_MS if b >= M), BLOCK_MS[-1])


def partials_per_load(split_k: int, block_n: int, block_m: int, warps: int) -> int:
    """Split partials (of ``split_k``) the last program of a (block_n, block_m) tile loads at
    once (finish_tile's PER_LOAD): as many as ``_PARTIAL_REGS`` registers a thread hold, each
    partial block_n x block_m over ``warps`` warps' threads."""
    per_thread = block_n * block_m // (warps * 32)
    return min(split_k, max(1, _PARTIAL_REGS // per_thread))


@gluon.jit
def split_steps(split, K, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr):
    """The K steps (of BLOCK_K) that split ``split`` of SPLIT_K takes: [lo, hi), the steps
    shared out as evenly as they go."""
    k_steps = K // BLOCK_K
    return split * k_steps // SPLIT_K, (split + 1) * k_steps // SPLIT_K


@gluon.jit
def release_next():
    """Programmatic dependent launch: let the next kernel's grid be scheduled (it waits for this
    one before touching what this one writes)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_for_previous():
    """Programmatic dependent launch: wait for the previous kernel to finish (what it wrote is
    read after this)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def release_then_wait():
    """Programmatic dependent launch: let the next kernel's grid be scheduled now, then wait for
    the previous kernel to finish (``release_next``, ``wait_for_previous``)."""
    release_next()
    wait_for_previous()


@gluon.jit
def step_scale_loads(step, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                     BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                     layout: gl.constexpr):
    """FP8 block scales of K step ``step`` for a tile of BLOCK_N rows of w and BLOCK_M of x,
    as loaded: (x's per row, in ``layout``, a slice of the tile's; w's one, the tile's 16-128
    rows lying in one block of 128). BLOCK_K divides 128, so the step lies in one block
    ``kb``; scales are contiguous fp32, x's (M, k_blocks), w's (ceil(N / 128), k_blocks)."""
    kb = step * BLOCK_K // 128
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    rows = gl.where(om < M, om, 0).to(gl.int64)
    sa = gl.load(scale_a_ptr + rows * k_blocks + kb)
    sb = gl.load(scale_b_ptr + (pid_n * BLOCK_N // 128).to(gl.int64) * k_blocks + kb)
    return sa, sb


@gluon.jit
def step_scales(step, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                layout: gl.constexpr):
    """``step_scale_loads``'s product: one factor per x row of y.T's (BLOCK_N, BLOCK_M) tile in
    ``layout`` (the tile's SliceLayout(0, ...))."""
    sa, sb = step_scale_loads(step, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                              BLOCK_N, BLOCK_M, BLOCK_K, layout)
    return sa * sb


@gluon.jit
def _scaled(acc, rows, cols, bias_ptr, scale_a_ptr, scale_b_ptr, stride_bias,
            HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr):
    """acc (BLOCK_N, BLOCK_M) = y.T's tile with its scales and bias; ``rows`` of x and ``cols``
    of w clamped into range."""
    if SCALE_A == 1:
        acc = acc * gl.load(scale_a_ptr)
    if SCALE_A == 2:
        acc = acc * gl.load(scale_a_ptr + rows)[None, :]
    if SCALE_B == 1:
        acc = acc * gl.load(scale_b_ptr)
    if SCALE_B == 2:
        acc = acc * gl.load(scale_b_ptr + cols)[:, None]
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + cols * stride_bias).to(gl.float32)[:, None]
    return acc


@gluon.jit
def _store_y(tile, y_tile, on, om, pid_n, pid_m, M, N, stride_ym, stride_yn,
             BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """y.T's (BLOCK_N, BLOCK_M) ``tile`` (w's block ``pid_n``, x's ``pid_m``) stored at
    ``y_tile`` (its corner) where it lies in y: ``on`` its rows of w, ``om`` its rows of x."""
    local_n = on - pid_n * BLOCK_N
    local_m = om - pid_m * BLOCK_M
    offsets = local_m[None, :] * stride_ym + local_n[:, None] * stride_yn
    inside = (on < N)[:, None] & (om < M)[None, :]
    gl.store(y_tile + offsets, tile.to(y_tile.dtype.element_ty), mask=inside)


@gluon.constexpr_function
def _end_layout(block_n, warps):
    """``finish_tile``'s layout: lanes down w's rows (all 32 where it has as many, else the rest
    across x's rows), warps down them as far as 32 rows each go, the rest across x's rows."""
    lanes = min(block_n, 32)
    down = max(1, min(block_n // 32, warps))
    return gl.BlockedLayout([1, 1], [lanes, 32 // lanes], [down, warps // down], [0, 1])


@gluon.jit
def _tile_end(acc, pid_n, pid_m, y_ptr, M, N, stride_ym, stride_yn, BLOCK_N: gl.constexpr,
              BLOCK_M: gl.constexpr):
    """What an end needs of y.T's (BLOCK_N, BLOCK_M) tile ``acc`` (w's block ``pid_n``, x's
    ``pid_m``): the tile in the end's layout, its rows of w and of x, both clamped into range,
    its corner in y, and each element's offset in the tile's fp32 sum or partial."""
    # Each element of the (BLOCK_N, BLOCK_M) tile held by one thread (BLOCK_N rows: 32 lanes x
    # BLOCK_N / 32 warps, or under 32 rows BLOCK_N lanes and the rest along x's rows; any other
    # warps along x's rows), so the partials' sum and the stores touch each element once.
    out_layout: gl.constexpr = _end_layout(BLOCK_N, gl.num_warps())
    out = gl.convert_layout(acc, out_layout)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    cols = gl.where(on < N, on, 0).to(gl.int64)
    rows = gl.where(om < M, om, 0).to(gl.int64)
    # The tile's corner in 64 bits, its elements' offsets from it in 32 (made at the store: a
    # tile of 64-bit pointers held across the sum took 2 registers an element).
    y_tile = y_ptr + (pid_m * BLOCK_M).to(gl.int64) * stride_ym \
        + (pid_n * BLOCK_N).to(gl.int64) * stride_yn
    # [BLOCK_M][BLOCK_N] (w's rows fastest, as the lanes of out_layout run): coalesced.
    local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))[:, None] \
        + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))[None, :] * BLOCK_N
    return out, on, om, cols, rows, y_tile, local


@gluon.jit
def _added_completes(out, tile_sum, count, share, whole, local):
    """Add ``out`` into the tile's fp32 sum in memory (relaxed atomics at L2) and ``share`` into
    its counter: whether these parts complete ``whole`` (this one is the last to arrive)."""
    gl.atomic_add(tile_sum + local, out, sem="relaxed", scope="gpu")
    # Every thread's part before the one release (as _splits.sum_splits_and_store).
    barrier()
    arrived = gl.atomic_add(count, share, sem="acq_rel", scope="gpu")
    return arrived == whole - share


@gluon.jit
def _taken_sum(tile_sum, count, local):
    """The tile's fp32 sum, read once; the sum and its counter left zero for the next launch."""
    total = gl.load(tile_sum + local, cache_modifier=".cg")
    gl.store(tile_sum + local, gl.zeros_like(total))
    gl.store(count, 0)
    return total


@gluon.jit
def finish_tile(acc, pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, part_ptr,
                count_ptr, M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS: gl.constexpr,
                SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, SPLIT_K: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, PER_LOAD: gl.constexpr,
                ADD_SPLITS: gl.constexpr, n_tiles=None):
    """y.T's (BLOCK_N, BLOCK_M) tile ``acc`` (any layout) of split ``split``: scaled and stored,
    or, split, the split's sum finished by the last to arrive. Either each split's fp32 partial
    is stored and the last sums them in split order (bitwise deterministic, as
    ``_splits.sum_splits_and_store``), or, ``ADD_SPLITS``, each split adds its partial into the
    tile's fp32 sum in memory (zero at rest: ``_splits.workspace``) and the last reads that sum
    once and zeroes it (one round trip instead of SPLIT_K / PER_LOAD; the adds' order, and so
    the sum's last bits, follow the splits' arrival). The tile is w's block ``pid_n`` and x's
    ``pid_m`` of ``n_tiles`` blocks of w (None: the grid's first axis, one program a tile)."""
    out, on, om, cols, rows, y_tile, local = _tile_end(acc, pid_n, pid_m, y_ptr, M, N,
                                                      stride_ym, stride_yn, BLOCK_N, BLOCK_M)
    if SPLIT_K == 1:
        out = _scaled(out, rows, cols, bias_ptr, scale_a_ptr, scale_b_ptr, stride_bias,
                      HAS_BIAS, SCALE_A, SCALE_B)
        _store_y(out, y_tile, on, om, pid_n, pid_m, M, N, stride_ym, stride_yn, BLOCK_N,
                 BLOCK_M)
    else:
        if n_tiles is None:
            tile = pid_m * gl.num_programs(0) + pid_n
        else:
            tile = pid_m * n_tiles + pid_n
        # A tile's partials (SPLIT_K of them), or with ADD_SPLITS its one sum.
        tile_size: gl.constexpr = BLOCK_N * BLOCK_M if ADD_SPLITS else SPLIT_K * BLOCK_N * BLOCK_M
        tile_parts = part_ptr + tile.to(gl.int64) * tile_size
        if ADD_SPLITS:
            last = _added_completes(out, tile_parts, count_ptr + tile, 1, SPLIT_K, local)
        else:
            gl.store(tile_parts + split * (BLOCK_N * BLOCK_M) + local, out)
            # Every thread's partial before the one release (as _splits.sum_splits_and_store).
            barrier()
            last = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            if ADD_SPLITS:
                total = _taken_sum(tile_parts, count_ptr + tile, local)
            else:
                total = gl.zeros_like(out)
                # PER_LOAD partials a group, unrolled: a group's loads are issued together (one
                # L2 round trip) and held in at most _PARTIAL_REGS registers.
                for s0 in range(0, SPLIT_K, PER_LOAD):
                    for s in gl.static_range(PER_LOAD):
                        total += gl.load(tile_parts + (s0 + s) * (BLOCK_N * BLOCK_M) + local,
                                         mask=s0 + s < SPLIT_K, other=0.0, cache_modifier=".cg")
                gl.store(count_ptr + tile, 0)  # zero for the next launch
            total = _scaled(total, rows, cols, bias_ptr, scale_a_ptr, scale_b_ptr, stride_bias,
                            HAS_BIAS, SCALE_A, SCALE_B)
            _store_y(total, y_tile, on, om, pid_n, pid_m, M, N, stride_ym, stride_yn, BLOCK_N,
                     BLOCK_M)


@gluon.jit
def stream_run(k_steps, tiles):
    """Stream-K: this program's run [first, end) of the tiles' K steps laid one tile after
    another, the runs of the programs as even as whole steps make them."""
    # In 64 bits: a program's index times the steps passes 2^31 from 8M steps at 264 programs.
    total = tiles.to(gl.int64) * k_steps
    programs = gl.num_programs(0)
    return ((gl.program_id(0) * total // programs).to(gl.int32),
            ((gl.program_id(0) + 1) * total // programs).to(gl.int32))


@gluon.jit
def stream_part(s, end, k_steps, n_tiles, m_tiles, M_FIRST: gl.constexpr):
    """Stream-K: the part of a tile from step ``s`` of a run ending at ``end``: (the tile, w's
    block, x's block, its first K step, its steps); w's blocks first (x's, ``M_FIRST``)."""
    tile = s // k_steps
    lo = s - tile * k_steps
    if M_FIRST:
        pid_m = tile % m_tiles
        pid_n = tile // m_tiles
    else:
        pid_n = tile % n_tiles
        pid_m = tile // n_tiles
    return tile, pid_n, pid_m, lo, gl.minimum(k_steps - lo, end - s)


@gluon.jit
def finish_share(acc, pid_n, pid_m, tile, steps, k_steps, y_ptr, bias_ptr, scale_a_ptr,
                 scale_b_ptr, part_ptr, count_ptr, M, N, stride_ym, stride_yn, stride_bias,
                 HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Stream-K's end: ``acc``, ``steps`` of the ``k_steps`` K steps of tile ``tile`` (w's
    block ``pid_n``, x's ``pid_m``). A whole tile is scaled and stored; a part is added into the
    tile's fp32 sum (zero at rest), its counter counting steps, and the part that completes the
    tile reads the sum once, zeroes it, and stores it scaled (the adds' order, and so the sum's
    last bits, follow the parts' arrival, as ``finish_tile``'s ADD_SPLITS)."""
    out, on, om, cols, rows, y_tile, local = _tile_end(acc, pid_n, pid_m, y_ptr, M, N,
                                                      stride_ym, stride_yn, BLOCK_N, BLOCK_M)
    if steps == k_steps:
        out = _scaled(out, rows, cols, bias_ptr, scale_a_ptr, scale_b_ptr, stride_bias,
                      HAS_BIAS, SCALE_A, SCALE_B)
        _store_y(out, y_tile, on, om, pid_n, pid_m, M, N, stride_ym, stride_yn, BLOCK_N,
                 BLOCK_M)
    else:
        tile_sum = part_ptr + tile.to(gl.int64) * (BLOCK_N * BLOCK_M)
        if _added_completes(out, tile_sum, count_ptr + tile, steps, k_steps, local):
            total = _taken_sum(tile_sum, count_ptr + tile, local)
            total = _scaled(total, rows, cols, bias_ptr, scale_a_ptr, scale_b_ptr, stride_bias,
                            HAS_BIAS, SCALE_A, SCALE_B)
            _store_y(total, y_tile, on, om, pid_n, pid_m, M, N, stride_ym, stride_yn, BLOCK_N,
                     BLOCK_M)
