"""An FP8 GEMM for 16 <= M <= 256 with a warp-specialised TMA ring, in Gluon:
``y = (x @ w.T) * scale_a * scale_b + bias``, FP8 block scales applied per K step.

Not swapped, unlike ``triton.ring``: x's rows are the warpgroup MMA's M (64 or 128 a program:
one or two math warpgroups), w's rows its N (16, 32, 64 or 128). A producer warp of its own
(``gl.warp_specialize``) keeps a ring of STAGES slots filled through TMA, each slot freed by the
math warps once their MMA has read it; the math warps only wait, multiply and scale. So loads
are issued as soon as a slot frees instead of after each step's multiply and scaling, which in
``triton.ring``'s wide tile (one thread stream doing both, one 255-register program per SM) ran
step after step with nothing beside it (docs/benchmarks.md, session 27).

Each K step of 128 (one FP8 scale block) multiplies from zero and is added into fp32, scaled by
x's per-row block scales and w's one block scale of the tile (BLOCK_N <= 128 lies in one block of
128 rows); per-token / per-tensor scales and bias are the end's (``_swapped.finish_tile``, which
also sums K's splits, in order or, ``.R1``, added).

With programmatic dependent launch (``.P1``) a program releases the next kernel and waits for
the previous one before any load, or (``w_ahead``, a program a unit) its producer loads w's
first slots before that wait, the math warps waiting before they read x's scales.

Row-major w only, K a multiple of 16 (TMA's row pitch), any N and M (TMA zero-fills past the
edges). FP8 (float8_e4m3fn), Hopper (sm_90) only; Gluon does not run in Triton's interpreter,
so the CPU checks only compile it (tests/test_kernels_compile_for_hopper.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks, _ring_launch
from gemmtune.kernels.triton._epilogue import PER_BLOCK
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (PDL_OFF, WaveSplit, split_for, splits_around,
                                             why_not_wait_pdl)
from gemmtune.kernels.triton._ring_launch import tma_load
from gemmtune.kernels.triton._swapped import (MAX_GRID_Z, ROWS_PER_WARP, barrier, finish_share,
                                              finish_tile, release_next, release_then_wait,
                                              step_scale_loads, stream_part, stream_run,
                                              wait_for_previous, why_not_add_splits,
                                              why_not_grid, why_not_here)

KERNEL_PREFIX = "triton.wsring"
BLOCK_K = 128  # one FP8 scale block a step
BLOCK_MS = (64, 128)  # x rows a program: one or two math warpgroups (64 rows each)
BLOCK_NS = (16, 32, 64, 128)  # w rows a program (the MMA's N); within one block scale of 128
# The narrow tiles (16, 32 rows of w): one program an SM streams its slab of w over all of K,
# with no split's sum to add at the end. On an H200, with x loaded as only the rows M fills
# (``x_box_rows``), the unsplit 32-row tile took 0.95-1.12x the best ring config's time at
# 16-32 x 4096 x 4096 (32 steps), 1.12-1.32x at 16 x 4096 x 14336 (112 steps), and won at
# 16-32 x 4096 x 512; deeper rings (12, 16 slots) were slower (docs/benchmarks.md, sessions
# 33-34). So they are offered only up to 32 steps: M <= 32, unsplit, a program a tile, one wave.
NARROW_NS = (16, 32)
NARROW_MAX_M = 32
NARROW_MAX_STEPS = 32
# The Ms the candidates cover. Below 64 rows the 64-row MMA is partly zeros (``x_box_rows``:
# at M <= 32 loaded as fewer rows, the slot's others zeroed once; from 33 TMA's zero fill); the
# warp-specialised ring wins some shapes there (H200, docs/benchmarks.md, sessions 31 and 34).
MIN_M, MAX_M = 16, 256
TWO_PER_SM_TILE = (64, 64)  # the tile two programs of an SM can hold (registers)
MAX_SPLIT_K = 32
# ``w_ahead``: 0 waits for the previous kernel before any load; the others load w's first
# slots before the wait and release the next kernel at the start or after the loop
W_AHEAD_START, W_AHEAD_AFTER = 1, 2
W_AHEADS = (0, W_AHEAD_START, W_AHEAD_AFTER)
SMEM_BYTES = _checks.SMEM_LIMIT_BYTES  # one program's most
# An SM's shared memory, of which each resident program's block reserves 1 KiB besides its own
BLOCK_RESERVED_BYTES = 1024
SM_SMEM_BYTES = SMEM_BYTES + BLOCK_RESERVED_BYTES
# The producer warp only computes coordinates and waits: few registers, the rest the math's.
_PRODUCER_WARPS = gl.constexpr(1)
_PRODUCER_REGS = gl.constexpr(40)
_PER_BLOCK = gl.constexpr(PER_BLOCK)
_W_AHEAD_START = gl.constexpr(W_AHEAD_START)
_W_AHEAD_AFTER = gl.constexpr(W_AHEAD_AFTER)


@dataclass(frozen=True)
class WsRingConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.wsring:BM128.BN128.S4.SK4``."""

    NAME_CODEC = NameCodec("warp-specialised ring config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("S", "stages"),
        Field("SK", "split_k"), Field("R", "add_splits", default=0),
        Field("O", "per_sm", default=1), Field("P", "pdl", default=PDL_OFF),
        Field("L", "persistent", default=0), Field("G", "m_first", default=0),
        Field("F", "fast_accumulation", default=0), Field("K", "stream_k", default=0),
        Field("A", "w_ahead", default=0)))

    block_m: int  # x rows a program (the MMA's M): 64 a math warpgroup
    block_n: int  # w rows a program (the MMA's N)
    stages: int  # slots of the ring, each 128 bytes of K of both tiles
    split_k: int
    add_splits: int = 0  # 1: the splits add into one fp32 sum (``finish_tile``'s ADD_SPLITS)
    # Programs an SM holds at once: 2 caps the registers (``max_registers``) so that two fit.
    per_sm: int = 1
    # PDL_WAIT: launched with programmatic dependent launch, its setup under the previous
    # kernel's tail (``_splits``); PDL_OFF: launched plainly
    pdl: int = PDL_OFF
    # 1: at most ``per_sm`` programs an SM, each taking units (w's block, K's split, x's
    # block) in turn, so the producer fills the next unit's slots under this one's end; 0: a
    # program a unit
    persistent: int = 0
    # 1: x's blocks first in the launch order (the grid's first axis, or a persistent
    # program's units), so the programs reading one block of w run together and w comes
    # from HBM once; 0: w's blocks first
    m_first: int = 0
    # 1 (per-token and per-tensor scales only): each step's MMA adds into the running sum in
    # the tensor cores, the next one issued before it is waited for, so they run back to back;
    # FP8's reduced-precision sum then spans the split's K (as torch's use_fast_accum and
    # gemm_splitk's promote_k=0). 0: each step's MMA from zero, added into fp32 (exact sums of
    # 128 of K, as cuBLAS; block scales need it)
    fast_accumulation: int = 0
    # 1 (persistent, split_k 1): stream-K. The tiles' K steps, one after another, dealt out
    # evenly to the programs: each takes its run of them, tile parts included, a part added
    # into its tile's fp32 sum (as ``add_splits``) and the part that completes the tile
    # storing it, so no program idles while others finish a wave. Run by name only: each part's
    # end costs L2 round trips that made it slower on every shape timed (``candidates``).
    stream_k: int = 0
    # With PDL, a program a unit. W_AHEAD_START (1): the producer loads w's first slots before
    # the wait for the previous kernel (w is not its output) and x's after it, the next kernel
    # released at the start; W_AHEAD_AFTER (2): the same, the next kernel released after the
    # loop; 0: the next kernel released, then the wait, before any load. On an H200, 1 was
    # 1.01-1.18x 0 at M <= 32 and 0.99-1.14x at M = 128, and at most 3% slower than 2 (0.91-1.13x
    # 0): the tuner offers 1 (docs/benchmarks.md, session 39); 0 and 2 run by name.
    w_ahead: int = 0

    @property
    def block_k(self) -> int:
        return BLOCK_K

    @property
    def num_warps(self) -> int:
        """The math warps (the producer's are the warp-specialised region's own)."""
        return self.block_m // ROWS_PER_WARP  # a warpgroup's 4 warps: 64 rows of x

    @property
    def threads(self) -> int:
        """A program's threads: the math warps and the producer's warpgroup (setmaxnreg hands
        registers over a warpgroup at a time, so the producer's warp comes with three idle)."""
        return (self.num_warps + 4) * 32


def max_registers(config: WsRingConfig) -> int:
    """Registers a thread may take so that ``per_sm`` programs share an SM's 64K (Triton gives
    the warp-specialised kernel's partitions their shares of it)."""
    return _checks.registers_to_share(config.threads, config.per_sm)


def ring_bytes(config: WsRingConfig) -> int:
    return config.stages * (config.block_m + config.block_n) * BLOCK_K


def smem_bytes(config: WsRingConfig) -> int:
    """A program's shared memory: the ring and its mbarriers, and the end's conversion of the
    fp32 tile where the ring is still in use then (persistent: the next unit's steps are in
    it; a program of one unit reuses the ring's memory, compiled so in Triton 3.6 and 3.9)."""
    end = config.block_m * config.block_n * 4 if config.persistent else 0
    return ring_bytes(config) + end + 1024


def smem_fits(config: WsRingConfig) -> bool:
    """Whether ``per_sm`` programs of ``config`` fit an SM's shared memory together."""
    return (smem_bytes(config) + BLOCK_RESERVED_BYTES) * config.per_sm <= SM_SMEM_BYTES


def why_not_fits(config: WsRingConfig, M: int, N: int, K: int,
                 dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM, or None."""
    c = config
    if c.block_m not in BLOCK_MS:
        return f"block_m={c.block_m} must be one of {BLOCK_MS}"
    if c.block_n not in BLOCK_NS:
        return f"block_n={c.block_n} must be one of {BLOCK_NS}"
    if c.stages < 2:
        return f"stages={c.stages} must be >= 2 (a ring of one slot waits on every load)"
    problem = why_not_add_splits(c) or why_not_wait_pdl(c.pdl)
    if problem is not None:
        return problem
    if c.m_first not in (0, 1):
        return f"m_first={c.m_first} must be 0 (w's blocks first) or 1 (x's blocks first)"
    if c.fast_accumulation not in (0, 1):
        return (f"fast_accumulation={c.fast_accumulation} must be 0 (each step added into fp32) "
                f"or 1 (the steps summed in the tensor cores)")
    if c.stream_k not in (0, 1):
        return f"stream_k={c.stream_k} must be 0 or 1 (the K steps dealt out evenly)"
    if c.stream_k and (not c.persistent or c.split_k != 1):
        return (f"stream_k=1 takes persistent programs (L1) and split_k=1 (its parts of tiles "
                f"are added, whatever their number), not L{c.persistent}, SK{c.split_k}")
    if c.persistent not in (0, 1):
        return f"persistent={c.persistent} must be 0 (a program a unit) or 1 (a loop over them)"
    if c.w_ahead not in W_AHEADS or (c.w_ahead and (c.pdl == PDL_OFF or c.persistent)):
        return (f"w_ahead={c.w_ahead}: 1 and 2 load w's first slots before the PDL wait (the "
                f"next kernel released at the start, or after the loop), which takes PDL (P1) "
                f"and a program a unit (L0); else 0")
    if c.per_sm not in (1, 2):
        return f"per_sm={c.per_sm} must be 1 or 2"
    if c.per_sm == 2 and (c.block_m, c.block_n) != TWO_PER_SM_TILE:
        # 128 registers a thread: the 64 x 64 tile's sum, product and MMA operand fit, no more.
        return (f"per_sm=2 takes the {TWO_PER_SM_TILE[0]} x {TWO_PER_SM_TILE[1]} tile only (its "
                f"{max_registers(c)} registers a thread hold no larger one)")
    if not smem_fits(c):
        return (f"{c.per_sm} program(s) of {c.stages} stages of ({c.block_m} + {c.block_n}) x "
                f"{BLOCK_K} bytes take {(smem_bytes(c) + BLOCK_RESERVED_BYTES) * c.per_sm} B of "
                f"an SM's shared memory (> {SM_SMEM_BYTES}); use fewer stages")
    if dtype != torch.float8_e4m3fn:
        return (f"{dtype} weights: the warp-specialised ring takes float8_e4m3fn only; use a "
                f"triton.splitk or triton.tile config")
    if K % _checks.TMA_ALIGN:
        return (f"K={K} FP8 rows are not a multiple of {_checks.TMA_ALIGN} B, as TMA needs; use a "
                f"triton.splitk config")
    if c.m_first and not c.persistent and triton.cdiv(N, c.block_n) > MAX_GRID_Z:
        return (f"N={N} takes {triton.cdiv(N, c.block_n)} blocks of block_n={c.block_n}, more "
                f"than the grid's third axis holds ({MAX_GRID_Z}) with x's blocks first; use "
                f"m_first=0")
    return why_not_grid(c, M, K, triton.cdiv(K, BLOCK_K), MAX_SPLIT_K)


def why_not_supported(config: WsRingConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output dtypes, and whether the kernel can run here (compiled, on a
    Hopper GPU)."""
    return (why_not_here("warp-specialised ring kernel", "a triton.splitk or triton.tile config")
            or _checks.why_not_dtypes(dtype, out_dtype)
            or why_not_fits(config, M, N, K, dtype))


def why_not_block_scaled(config: WsRingConfig, dtype: torch.dtype) -> str | None:
    """What keeps ``config`` from FP8 block scales (a scale per 128 of K), or None."""
    if config.fast_accumulation:
        return ("fast_accumulation=1 sums the K steps in the tensor cores, where block scales "
                "must scale each step's product: use fast_accumulation=0")
    return _checks.why_not_block_scaled(config, dtype)


def fits(config: WsRingConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


_PROGRAMS_PER_SM = (1, 2)
# Slots a ring may take, where a program's shared memory holds them (``_depths``): deeper
# rings keep more of w in flight, which the 64-row tiles need (H200, a8w8 64 x 7168 x 8192,
# 64 x 64 tile: 24.7 µs with 4 slots, 18.6 with 8; docs/benchmarks.md, session 33). 3 won no
# shipped row.
_STAGES = (4, 6, 8)


def _depths(bm: int, bn: int, per_sm: int, persistent: int) -> list[int]:
    """The depths of ``_STAGES`` whose ring ``per_sm`` programs of the tile hold (as many as
    fit, at least the shallowest)."""
    fit = [s for s in _STAGES
           if smem_fits(WsRingConfig(bm, bn, s, 1, 0, per_sm, PDL_OFF, persistent))]
    return fit or [min(_STAGES)]


def _configs(bm: int, bn: int, split: int, held: int, above: bool, looped: int, k_steps: int,
             several_x_blocks: bool, pdl: int):
    """One tile's and split's configs: each depth of ``_depths`` (none deeper than the split's
    steps use), the sums in order and added, each launch mode (with PDL, w's first slots before
    the wait: ``w_ahead``), each launch order; a split from
    below (``not above``) with ``pdl`` alone; where ``looped``, persistent programs too, with
    their deepest ring (it runs on across units) and ``pdl``."""
    depths = _depths(bm, bn, held, 0)
    deepest = max(2, min(max(depths), triton.cdiv(k_steps, split)))
    looped_ring = max(_depths(bm, bn, held, 1))
    for add, first in itertools.product(sorted({0, int(split > 1)}),
                                        sorted({0, int(several_x_blocks)})):
        for stages, mode in itertools.product(sorted({min(s, deepest) for s in depths}),
                                              sorted({PDL_OFF, pdl}) if above else [pdl]):
            yield WsRingConfig(bm, bn, stages, split, add, held, mode, 0, first,
                               w_ahead=W_AHEAD_START if mode != PDL_OFF else 0)
        if looped:
            yield WsRingConfig(bm, bn, looped_ring, split, add, held, pdl, 1, first)


def _narrow_pays(M: int, N: int, k_steps: int, bn: int, num_sms: int) -> bool:
    """Whether a narrow tile of ``bn`` rows of w is offered (unsplit, a program a tile): at
    most NARROW_MAX_M rows of x, one wave of its tiles, and at most NARROW_MAX_STEPS steps of
    K (a slab the ring holds most of)."""
    return (M <= NARROW_MAX_M and triton.cdiv(N, bn) <= num_sms
            and k_steps <= NARROW_MAX_STEPS)


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF) -> list[WsRingConfig]:
    """The configs to tune one shape with, for MIN_M <= M <= MAX_M (none elsewhere): every tile
    (the narrow ones, unsplit and a program a tile, where ``_narrow_pays``); K split to reach
    one program per SM and two (of the 64 x 64 tile, held two at a time, and of the others one
    after another), from above and (``pdl`` alone) from below (``_splits.splits_around``);
    rings of 4, 6 and 8 slots where they fit and the split's steps use them; split sums in
    order and added; launched plainly and, where ``pdl`` is PDL_WAIT, with PDL (w's first
    slots before the wait, ``W_AHEAD_START``); where M takes
    several blocks of x, w's blocks first and x's (``m_first``); where there are more units
    than the SMs hold programs, persistent programs too (their deepest ring, ``pdl``); 128 rows
    of x only past 64 (``_configs``). Stream-K (``streamed_configs``) is not among them: it
    lost on every shape it was timed on (docs/benchmarks.md, session 32)."""
    if not MIN_M <= M <= MAX_M:
        return []
    num_sms = num_sms or _checks.sm_count()
    k_steps = triton.cdiv(K, BLOCK_K)
    found = {}
    # 128 rows of x where M takes more than 64 (at M = 64 half of them would be TMA's zeros)
    for bm in (b for b in BLOCK_MS if b == BLOCK_MS[0] or M > BLOCK_MS[0]):
        for bn in (b for b in BLOCK_NS
                   if b not in NARROW_NS or _narrow_pays(M, N, k_steps, b, num_sms)):
            tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
            narrow = bn in NARROW_NS
            for per_sm, split, above in ([WaveSplit(1, 1, True)] if narrow else splits_around(
                    tiles, k_steps, num_sms, _PROGRAMS_PER_SM, MAX_SPLIT_K)):
                held = per_sm if (bm, bn) == TWO_PER_SM_TILE else 1
                looped = int(tiles * split > held * num_sms and not narrow)
                for cfg in _configs(bm, bn, split, held, above, looped, k_steps,
                                    triton.cdiv(M, bm) > 1, pdl):
                    if fits(cfg, M, N, K, dtype):
                        found[cfg] = None
    return list(found)


def streamed_configs(bm: int, bn: int, several_x_blocks: bool, pdl: int):
    """One tile's stream-K configs: 4 slots (as they were timed), ``pdl``, as many
    programs an SM as the tile's registers allow, each launch order."""
    for held in _PROGRAMS_PER_SM if (bm, bn) == TWO_PER_SM_TILE else (1,):
        for first in sorted({0, int(several_x_blocks)}):
            yield WsRingConfig(bm, bn, 4, 1, 0, held, pdl, 1, first, 0, 1)


def fast_twin(config: WsRingConfig, K: int) -> WsRingConfig | None:
    """``config`` with fast accumulation where its splits sum two or more K steps (with one
    the two are the same kernel); else None. For per-token and per-tensor scales only."""
    if config.fast_accumulation or triton.cdiv(K, BLOCK_K) // config.split_k < 2:
        return None
    return dataclasses.replace(config, fast_accumulation=1)


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> WsRingConfig:
    """Reasonable untuned: 128 rows of x (64 where M fits in them), 128 of w, four slots, K
    split until there is a program per SM."""
    num_sms = num_sms or _checks.sm_count()
    bm = 64 if M <= 64 else 128
    tiles = triton.cdiv(N, 128) * triton.cdiv(M, bm)
    return WsRingConfig(bm, 128, 4, split_for(tiles, triton.cdiv(K, BLOCK_K), num_sms,
                                              MAX_SPLIT_K))


@gluon.jit
def _x_slot(x_desc, x_ring, slot):
    """Where x's TMA load into ``slot`` lands: the slot, or its top rows where the box brings
    fewer rows than the MMA takes (``x_box_rows``)."""
    x_slot = x_ring.index(slot)
    if x_desc.block_type.shape[0] < x_ring.shape[1]:
        x_slot = x_slot.slice(0, x_desc.block_type.shape[0])
    return x_slot


@gluon.jit
def _load_steps(w_desc, x_desc, w_ring, x_ring, ready, empty, base, off_n, off_m, lo, steps,
                STAGES: gl.constexpr, first=0):
    """The producer's K steps [lo + first, lo + steps) of one tile (w's rows from ``off_n``,
    x's from ``off_m``) at ring positions ``base + first`` on: each step's tiles into its slot
    once the math warps have freed it (a fresh mbarrier passes a wait on phase 1, so the first
    STAGES go at once)."""
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for i in range(first, steps):
        slot = (base + i) % STAGES
        mbarrier.wait(empty.index(slot), (((base + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), nbytes)
        tma_load(w_desc, [off_n, (lo + i) * 128], ready.index(slot), w_ring.index(slot))
        tma_load(x_desc, [off_m, (lo + i) * 128], ready.index(slot),
                 _x_slot(x_desc, x_ring, slot))


@gluon.jit
def _producer(w_desc, x_desc, w_ring, x_ring, ready, empty, off_n, off_m, lo, steps,
              STAGES: gl.constexpr, W_AHEAD: gl.constexpr):
    """The producer warp of a program of one tile. ``W_AHEAD`` (PDL): w's first slots start
    loading before the wait for the previous kernel (w is not its output; a w the launcher
    copied goes without PDL), x's after it (each slot's barrier expects both, so no step starts
    before its x lands); the later steps as without."""
    first = 0
    if W_AHEAD:
        nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
        first = gl.minimum(steps, STAGES)
        for i in range(first):
            mbarrier.expect(ready.index(i), nbytes)
            tma_load(w_desc, [off_n, (lo + i) * 128], ready.index(i), w_ring.index(i))
        wait_for_previous()
        for i in range(first):
            tma_load(x_desc, [off_m, (lo + i) * 128], ready.index(i),
                     _x_slot(x_desc, x_ring, i))
    _load_steps(w_desc, x_desc, w_ring, x_ring, ready, empty, 0, off_n, off_m, lo, steps,
                STAGES, first)


@gluon.jit
def _unit(u, K, n_tiles, m_tiles, SPLIT_K: gl.constexpr, M_FIRST: gl.constexpr):
    """Work unit ``u`` of a persistent program: (w's block, K's split, x's block, K's first
    step and its steps), w's blocks fastest, then K's splits; ``M_FIRST``: x's blocks fastest,
    so the programs that read one block of w run together (one read of it from HBM)."""
    if M_FIRST:
        pid_m = u % m_tiles
        split = (u // m_tiles) % SPLIT_K
        pid_n = u // (m_tiles * SPLIT_K)
    else:
        pid_n = u % n_tiles
        split = (u // n_tiles) % SPLIT_K
        pid_m = u // (n_tiles * SPLIT_K)
    k_steps = gl.cdiv(K, 128)
    lo = split * k_steps // SPLIT_K
    return pid_n, split, pid_m, lo, (split + 1) * k_steps // SPLIT_K - lo


@gluon.jit
def _streamed_producer(w_desc, x_desc, w_ring, x_ring, ready, empty, K, n_tiles, m_tiles,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       M_FIRST: gl.constexpr):
    """The producer warp of a stream-K program: its run's steps through the ring, part after
    part (the ring's positions the steps' places in the run)."""
    k_steps = gl.cdiv(K, 128)
    first, end = stream_run(k_steps, n_tiles * m_tiles)
    s = first
    while s < end:
        tile, pid_n, pid_m, lo, steps = stream_part(s, end, k_steps, n_tiles, m_tiles, M_FIRST)
        _load_steps(w_desc, x_desc, w_ring, x_ring, ready, empty, s - first, pid_n * BLOCK_N,
                    pid_m * BLOCK_M, lo, steps, STAGES)
        s += steps


@gluon.jit
def _persistent_producer(w_desc, x_desc, w_ring, x_ring, ready, empty, K, units, n_tiles,
                         m_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         SPLIT_K: gl.constexpr, STAGES: gl.constexpr, M_FIRST: gl.constexpr):
    """The producer warp of a persistent program: its units' steps one after another through
    the ring, so the next tile's slots fill while the math warps finish this one."""
    base = 0
    for u in range(gl.program_id(0), units, gl.num_programs(0)):
        pid_n, split, pid_m, lo, steps = _unit(u, K, n_tiles, m_tiles, SPLIT_K, M_FIRST)
        _load_steps(w_desc, x_desc, w_ring, x_ring, ready, empty, base, pid_n * BLOCK_N,
                    pid_m * BLOCK_M, lo, steps, STAGES)
        base += steps


@gluon.jit
def _zero_x_padding(x_ring, X_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """Where TMA brings fewer rows of x than the MMA takes (``x_box_rows``), the slots' other
    rows zeroed once, by the math warps before their first MMA (TMA never writes them; the
    producer's first loads, to other bytes, may already be landing). The MMA's rows past M
    never reach y, but zeros keep them finite, so no split's or part's fp32 sum ever holds
    what an earlier kernel left in shared memory. Triton 3.6 puts a barrier between the stores;
    the measured times include them, under the first loads' latency."""
    BLOCK_M: gl.constexpr = x_ring.shape[1]
    STEP_K: gl.constexpr = x_ring.shape[2]
    if X_ROWS < BLOCK_M:
        rows: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
        zeros = gl.zeros([X_ROWS, STEP_K], x_ring.dtype, rows)
        for s in gl.static_range(STAGES):
            for j in gl.static_range(1, BLOCK_M // X_ROWS):
                x_ring.index(s).slice(j * X_ROWS, X_ROWS).store(zeros)
        fence_async_shared()  # the stores seen by the MMA's (async) reads
        barrier()


@gluon.jit
def _issue(w_ring, x_ring, ready, i, zero, STAGES: gl.constexpr):
    """Step ``i``'s MMA, from zero, issued once its slot has landed (asynchronous: its token)."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    return warpgroup_mma(x_ring.index(slot), w_ring.index(slot).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _landed(token, empty, i, STAGES: gl.constexpr):
    """Step ``i``'s product once its MMA is done, its slot freed: every math warp past the wait
    before one arrive (the producer may then overwrite the slot)."""
    product = warpgroup_mma_wait(0, deps=[token])
    barrier()
    mbarrier.arrive(empty.index(i % STAGES), count=1)
    return product


@gluon.jit
def _scale_loads(step, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
                 BLOCK_SCALED: gl.constexpr):
    """Step ``step``'s FP8 block scales as loaded (x's per row down the tile's rows, w's one),
    multiplied only where used a step later: a product right after its loads waits on them.
    Ones without block scales (their scales are the end's)."""
    if BLOCK_SCALED:
        sa, sb = step_scale_loads(step, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                                  BLOCK_N, BLOCK_M, 128, layout)
    else:
        sa = gl.full([BLOCK_M], 1.0, gl.float32, layout=layout)
        sb = 1.0
    return sa, sb


@gluon.jit
def _added(acc, product, sa, sb, BLOCK_SCALED: gl.constexpr):
    """acc + a step's product, scaled by its block scales where there are any."""
    if BLOCK_SCALED:
        return acc + product * (sa * sb)[:, None]
    return acc + product


@gluon.jit
def _tile_sum(w_ring, x_ring, ready, empty, base, pid_n, pid_m, lo, steps, M, scale_a_ptr,
              scale_b_ptr, k_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, BLOCK_SCALED: gl.constexpr):
    """The math warps: x @ w.T's (BLOCK_M, BLOCK_N) tile over K steps [lo, lo + steps) (ring
    positions ``base`` on), fp32 in the MMA's layout. Pipelined by one step: step i's MMA runs
    on the tensor cores while step i - 1's product is scaled and added on the FMA units (each
    MMA from zero, so FP8's reduced-precision sum spans one step of K); step i's scales are
    loaded as its MMA is issued. Unrolled by two, the two products' registers alternating, and
    only waited-for products cross the loop's back edge: ptxas serialises every MMA whose
    registers another instruction reads before its wait, and a product carried in the same
    registers each step cost a copy of it (64 moves a thread at 128 x 128)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32])
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    sa, sb = _scale_loads(lo, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_M,
                          BLOCK_N, rows, BLOCK_SCALED)
    even = _landed(_issue(w_ring, x_ring, ready, base, zero, STAGES), empty, base, STAGES)
    for i in range(1, steps - 1, 2):  # steps i (odd) and i + 1 (even)
        token = _issue(w_ring, x_ring, ready, base + i, zero, STAGES)
        sa_odd, sb_odd = _scale_loads(lo + i, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr,
                                      k_blocks, BLOCK_M, BLOCK_N, rows, BLOCK_SCALED)
        acc = _added(acc, even, sa, sb, BLOCK_SCALED)
        odd = _landed(token, empty, base + i, STAGES)
        token = _issue(w_ring, x_ring, ready, base + i + 1, zero, STAGES)
        sa, sb = _scale_loads(lo + i + 1, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks,
                              BLOCK_M, BLOCK_N, rows, BLOCK_SCALED)
        acc = _added(acc, odd, sa_odd, sb_odd, BLOCK_SCALED)
        even = _landed(token, empty, base + i + 1, STAGES)
    if steps % 2 == 0:  # the last step, odd, is left
        token = _issue(w_ring, x_ring, ready, base + steps - 1, zero, STAGES)
        sa_odd, sb_odd = _scale_loads(lo + steps - 1, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr,
                                      k_blocks, BLOCK_M, BLOCK_N, rows, BLOCK_SCALED)
        acc = _added(acc, even, sa, sb, BLOCK_SCALED)
        odd = _landed(token, empty, base + steps - 1, STAGES)
        acc = _added(acc, odd, sa_odd, sb_odd, BLOCK_SCALED)
    else:
        acc = _added(acc, even, sa, sb, BLOCK_SCALED)
    return acc


@gluon.jit
def _chained_sum(w_ring, x_ring, ready, empty, base, steps, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The math warps with fast accumulation: x @ w.T's tile over ``steps`` K steps (ring
    positions ``base`` on) summed in the tensor cores, each step's MMA issued before the one
    before it is waited for (one in flight behind it), that one's slot freed once it has
    completed (warpgroup MMAs complete in order)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    mbarrier.wait(ready.index(base % STAGES), (base // STAGES) & 1)
    acc = warpgroup_mma(x_ring.index(base % STAGES),
                        w_ring.index(base % STAGES).permute((1, 0)), acc, use_acc=False,
                        is_async=True)
    acc = warpgroup_mma_wait(1, deps=[acc])  # passes at once: the loop carries a tensor
    for i in range(1, steps):
        slot = (base + i) % STAGES
        mbarrier.wait(ready.index(slot), ((base + i) // STAGES) & 1)
        acc = warpgroup_mma(x_ring.index(slot), w_ring.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        # Step i - 1's MMA is done: every math warp past the wait, then one arrive.
        barrier()
        mbarrier.arrive(empty.index((base + i - 1) % STAGES), count=1)
    acc = warpgroup_mma_wait(0, deps=[acc])
    barrier()
    mbarrier.arrive(empty.index((base + steps - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _unit_sum(w_ring, x_ring, ready, empty, base, pid_n, pid_m, lo, steps, M, scale_a_ptr,
              scale_b_ptr, k_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, BLOCK_SCALED: gl.constexpr, FAST: gl.constexpr):
    """One unit's tile: summed in the tensor cores (``FAST``) or step by step in fp32."""
    gl.static_assert(not (FAST and BLOCK_SCALED),
                     "fast accumulation cannot scale each K step by its block scales")
    if FAST:
        acc = _chained_sum(w_ring, x_ring, ready, empty, base, steps, BLOCK_M, BLOCK_N, STAGES)
    else:
        acc = _tile_sum(w_ring, x_ring, ready, empty, base, pid_n, pid_m, lo, steps, M,
                        scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_M, BLOCK_N, STAGES,
                        BLOCK_SCALED)
    return acc


@gluon.jit
def _math(w_ring, x_ring, ready, empty, pid_n, pid_m, lo, steps, M, scale_a_ptr, scale_b_ptr,
          k_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
          BLOCK_SCALED: gl.constexpr, FAST: gl.constexpr, X_ROWS: gl.constexpr,
          W_AHEAD: gl.constexpr):
    """The math warps of a program of one tile: its sum, the region's result (a tuple).
    ``W_AHEAD`` (PDL; the kernel has not waited yet): they wait for the previous kernel first
    (x's scales, and the end's, may be its output)."""
    if W_AHEAD:
        wait_for_previous()
    _zero_x_padding(x_ring, X_ROWS, STAGES)
    return (_unit_sum(w_ring, x_ring, ready, empty, 0, pid_n, pid_m, lo, steps, M, scale_a_ptr,
                      scale_b_ptr, k_blocks, BLOCK_M, BLOCK_N, STAGES, BLOCK_SCALED, FAST),)


@gluon.jit
def _persistent_math(w_ring, x_ring, ready, empty, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                     part_ptr, count_ptr, M, N, K, stride_ym, stride_yn, stride_bias, k_blocks,
                     units, n_tiles, m_tiles, HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr,
                     SCALE_B: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PER_LOAD: gl.constexpr,
                     ADD_SPLITS: gl.constexpr, M_FIRST: gl.constexpr, FAST: gl.constexpr,
                     X_ROWS: gl.constexpr):
    """The math warps of a persistent program: each unit's sum, then its end (scales, bias,
    splits), while the producer already fills the ring with the next unit's steps."""
    _zero_x_padding(x_ring, X_ROWS, STAGES)
    base = 0
    for u in range(gl.program_id(0), units, gl.num_programs(0)):
        pid_n, split, pid_m, lo, steps = _unit(u, K, n_tiles, m_tiles, SPLIT_K, M_FIRST)
        acc = _unit_sum(w_ring, x_ring, ready, empty, base, pid_n, pid_m, lo, steps, M,
                        scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_M, BLOCK_N, STAGES,
                        SCALE_A == _PER_BLOCK, FAST)
        base += steps
        finish_tile(acc.permute((1, 0)), pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr,
                    scale_b_ptr, part_ptr, count_ptr, M, N, stride_ym, stride_yn, stride_bias,
                    HAS_BIAS, SCALE_A, SCALE_B, SPLIT_K, BLOCK_N, BLOCK_M, PER_LOAD,
                    ADD_SPLITS, n_tiles)


@gluon.jit
def _streamed_math(w_ring, x_ring, ready, empty, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                   part_ptr, count_ptr, M, N, K, stride_ym, stride_yn, stride_bias, k_blocks,
                   n_tiles, m_tiles, HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr,
                   SCALE_B: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, M_FIRST: gl.constexpr, FAST: gl.constexpr,
                   X_ROWS: gl.constexpr):
    """The math warps of a stream-K program: each part's sum, then its end (``finish_share``),
    while the producer already fills the ring with the next part's steps."""
    _zero_x_padding(x_ring, X_ROWS, STAGES)
    k_steps = gl.cdiv(K, 128)
    first, end = stream_run(k_steps, n_tiles * m_tiles)
    s = first
    while s < end:
        tile, pid_n, pid_m, lo, steps = stream_part(s, end, k_steps, n_tiles, m_tiles, M_FIRST)
        acc = _unit_sum(w_ring, x_ring, ready, empty, s - first, pid_n, pid_m, lo, steps, M,
                        scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_M, BLOCK_N, STAGES,
                        SCALE_A == _PER_BLOCK, FAST)
        finish_share(acc.permute((1, 0)), pid_n, pid_m, tile, steps, k_steps, y_ptr, bias_ptr,
                     scale_a_ptr, scale_b_ptr, part_ptr, count_ptr, M, N, stride_ym, stride_yn,
                     stride_bias, HAS_BIAS, SCALE_A, SCALE_B, BLOCK_N, BLOCK_M)
        s += steps


@gluon.jit(do_not_specialize=["M"])
def gemm_wsring_kernel(
    w_desc, x_desc,  # TMA descriptors: w (N, K) in (BLOCK_N, 128) boxes, x (M, K) in
                     # (x_box_rows(M, BLOCK_M), 128)
    y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,  # as gemm_ring's
    part_ptr, count_ptr,  # the splits' partials and counters, as gemm_ring's
    M, N, K, stride_ym, stride_yn, stride_bias,
    k_blocks,  # ceil(K / 128): columns of the block scales (SCALE_A == PER_BLOCK only)
    HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
    SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PER_LOAD: gl.constexpr, ADD_SPLITS: gl.constexpr, PDL: gl.constexpr,
    PERSISTENT: gl.constexpr, M_FIRST: gl.constexpr, FAST: gl.constexpr,
    STREAM_K: gl.constexpr, W_AHEAD: gl.constexpr,
):
    gl.static_assert(W_AHEAD == 0 or not (PERSISTENT or STREAM_K),
                     "w_ahead takes a program a unit: persistent programs wait before any load")
    # Launched plainly (_ring_launch drops PDL where w was just copied), w is not loaded ahead
    AHEAD: gl.constexpr = W_AHEAD if PDL else 0
    if PDL and AHEAD == 0:
        # Before any memory is touched: only the setup overlaps the previous kernel.
        release_then_wait()
    if AHEAD == _W_AHEAD_START:  # the producer loads w's first slots before its wait
        release_next()
    if not PERSISTENT:  # a program a unit: the grid's three axes
        if M_FIRST:  # x's blocks first: the programs of one block of w launch together
            pid_m = gl.program_id(0)
            split = gl.program_id(1)
            pid_n = gl.program_id(2)
            tile_row = gl.cdiv(N, BLOCK_N)  # w's blocks: the grid's third axis, not its first
        else:
            pid_n = gl.program_id(0)
            split = gl.program_id(1)
            pid_m = gl.program_id(2)
            tile_row = None  # the grid's first axis
        k_steps = gl.cdiv(K, 128)
        lo = split * k_steps // SPLIT_K
        steps = (split + 1) * k_steps // SPLIT_K - lo
    # x's rows a load brings: BLOCK_M, or fewer where M is (``x_box_rows``)
    X_ROWS: gl.constexpr = x_desc.block_type.shape[0]
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 128], w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, 128], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    if STREAM_K:
        # The tiles' K steps dealt out evenly, a grid of at most a program an SM.
        n_tiles = gl.cdiv(N, BLOCK_N)
        m_tiles = gl.cdiv(M, BLOCK_M)
        gl.warp_specialize([
            (_streamed_math, (w_ring, x_ring, ready, empty, y_ptr, bias_ptr, scale_a_ptr,
                              scale_b_ptr, part_ptr, count_ptr, M, N, K, stride_ym, stride_yn,
                              stride_bias, k_blocks, n_tiles, m_tiles, HAS_BIAS, SCALE_A,
                              SCALE_B, BLOCK_M, BLOCK_N, STAGES, M_FIRST, FAST, X_ROWS)),
            (_streamed_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, K, n_tiles,
                                  m_tiles, BLOCK_M, BLOCK_N, STAGES, M_FIRST)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])
    elif PERSISTENT:
        # Units (w's block, K's split, x's block) in turn, a grid of at most a program an SM.
        n_tiles = gl.cdiv(N, BLOCK_N)
        m_tiles = gl.cdiv(M, BLOCK_M)
        units = n_tiles * SPLIT_K * m_tiles
        gl.warp_specialize([
            (_persistent_math, (w_ring, x_ring, ready, empty, y_ptr, bias_ptr, scale_a_ptr,
                                scale_b_ptr, part_ptr, count_ptr, M, N, K, stride_ym,
                                stride_yn, stride_bias, k_blocks, units, n_tiles, m_tiles,
                                HAS_BIAS, SCALE_A, SCALE_B, SPLIT_K, BLOCK_M, BLOCK_N, STAGES,
                                PER_LOAD, ADD_SPLITS, M_FIRST, FAST, X_ROWS)),
            (_persistent_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, K, units,
                                    n_tiles, m_tiles, BLOCK_M, BLOCK_N, SPLIT_K, STAGES,
                                    M_FIRST)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])
    else:
        acc, = gl.warp_specialize([
            (_math, (w_ring, x_ring, ready, empty, pid_n, pid_m, lo, steps, M, scale_a_ptr,
                     scale_b_ptr, k_blocks, BLOCK_M, BLOCK_N, STAGES, SCALE_A == _PER_BLOCK,
                     FAST, X_ROWS, AHEAD != 0)),
            (_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, pid_n * BLOCK_N,
                         pid_m * BLOCK_M, lo, steps, STAGES, AHEAD != 0)),
        ], [_PRODUCER_WARPS], [_PRODUCER_REGS])
        if AHEAD == _W_AHEAD_AFTER:  # after the loop, as ``triton.ring`` does
            release_next()
        # finish_tile takes y.T's tile (w's rows down), as the swapped kernels hold it.
        finish_tile(acc.permute((1, 0)), pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr,
                    scale_b_ptr, part_ptr, count_ptr, M, N, stride_ym, stride_yn, stride_bias,
                    HAS_BIAS, SCALE_A, SCALE_B, SPLIT_K, BLOCK_N, BLOCK_M, PER_LOAD,
                    ADD_SPLITS, tile_row)


def x_box_rows(M: int, block_m: int) -> int:
    """x's rows a TMA load brings into a slot of ``block_m``: all of them, or where M is under
    ``block_m`` the fewest (a power of two, at least 16) that hold M, the slot's other rows
    zeroed once (``_zero_x_padding``). TMA's zero fill of the rows past M is slow: on an H200
    the 64 x 32 tile over 16 x 4096 x 4096 took 12.5 µs with 48 such rows a load, 8.3 µs at
    M = 64 with none (docs/benchmarks.md, session 34). M from 33 (of 64 rows) still loads all of
    them. The box is part of the compiled kernel's type, so a row's kernel builds once for each
    class (16, 32, block_m); the tables' rows at powers of two serve the Ms padded up to them,
    all of the row's own class."""
    if M >= block_m:
        return block_m
    return min(block_m, max(16, triton.next_power_of_2(M)))


def wsring_call(x, w, bias, out, scale_a, scale_b, config: WsRingConfig,
                counters: torch.Tensor | None = None, warmup: bool = False,
                block_scales: bool = False) -> KernelCall:
    """The launch as data (what a dispatch plan records and replays; its TMA descriptors are
    rebuilt around each later call's x and w), with its registers capped for ``per_sm``."""
    if block_scales and (problem := why_not_block_scaled(config, x.dtype)):
        raise ValueError(f"gemm_wsring: {config.name}: {problem}")
    grid = persistent = None
    if config.persistent:
        # Stream-K's units are the tiles' K steps: at most one program a step.
        persistent = _ring_launch.Persistent(
            config.per_sm, triton.cdiv(x.shape[1], BLOCK_K) if config.stream_k
            else config.split_k, bool(config.stream_k))
    elif config.m_first:
        grid = (triton.cdiv(x.shape[0], config.block_m), config.split_k,
                triton.cdiv(w.shape[0], config.block_n))
    return _ring_launch.ring_call(gemm_wsring_kernel, x, w, bias, out, scale_a, scale_b, config,
                                  counters, warmup, block_scales,
                                  dict(W_AHEAD=config.w_ahead,
                                       PERSISTENT=bool(config.persistent),
                                       M_FIRST=bool(config.m_first),
                                       FAST=bool(config.fast_accumulation),
                                       STREAM_K=bool(config.stream_k)),
                                  dict(maxnreg=max_registers(config)),
                                  pdl=config.pdl, w_before_wait=config.w_ahead != 0, grid=grid,
                                  persistent=persistent,
                                  x_box_rows=x_box_rows(x.shape[0], config.block_m))


def launch_gemm_wsring(x, w, bias, out, scale_a, scale_b, config: WsRingConfig,
                       counters: torch.Tensor | None = None, warmup: bool = False,
                       block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans)."""
    launch(wsring_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup,
                       block_scales), warmup)
    return out


def gemm_wsring(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, scale_a: torch.Tensor | None = None,
                scale_b: torch.Tensor | None = None, config: WsRingConfig | None = None,
                out: torch.Tensor | None = None, block_scales: bool = False) -> torch.Tensor:
    """``y = (x @ w.T) * scale_a * scale_b + bias`` for FP8 x and row-major w; validates
    everything, then launches (``block_scales``: x's per 1x128 and w's per 128x128 scales)."""
    if _checks.interpreted():
        raise ValueError("gemm_wsring: Gluon kernels do not run in Triton's interpreter")
    return _checks.validated_launch("gemm_wsring", launch_gemm_wsring, default_config,
                                    why_not_fits, x, w, bias, out_dtype, scale_a, scale_b,
                                    config, out, block_scales, why_not_block_scaled)
