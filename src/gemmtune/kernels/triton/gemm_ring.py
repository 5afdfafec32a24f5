"""An FP8 decode GEMM fed by a TMA ring, in Gluon: ``y = (x @ w.T) * scale_a * scale_b + bias``.

Swapped as ``triton.frag`` is (w's 64 rows of a program are the warpgroup MMA's M, x's rows its
N, BLOCK_M 8-64; more rows take more programs on the grid's third axis). Both operands arrive
through TMA into a ring of STAGES slots of shared memory, one mbarrier per slot: every slot is
in flight before the first MMA, and the loop holds only the slot's wait, the MMA (from zero, added
into fp32 each step, so FP8's reduced-precision sum spans one step of K) and the slot's refill.
K is split over a second grid axis so that every SM streams; the end is ``triton.frag``'s (the
scales, bias, and the splits summed in order by the last to arrive, bitwise deterministic, or,
``.R1``, added into one sum per tile: ``_swapped.finish_tile``).

Where it pays (docs/benchmarks.md, session 21): cuBLASLt's FP8 rows at M = 16-64 run one
program per 64 rows of w with a ring as deep as shared memory allows, on as few as half the
SMs; this kernel streams the same way from every SM, so it wins where one program per tile
already fills the GPU (e.g. 6144 x 4096 at M = 16) or few splits do, and loses where many
splits' sum costs more than the stream (the sum is a chain of dependent global-memory round
trips at the end of a kernel of a few µs).

With FP8 block scales (``block_scales``: x's per 1x128, w's per 128x128; steps of 128, one
scale block each) each step's product is scaled before its add, the next step's scales loaded
before this step's wait.

With programmatic dependent launch (``.P1``) w's slots start loading before the wait for the
previous kernel (w must not be that kernel's output: weights are written long before, and a w
copied for TMA is launched without PDL), x's once it is done, and the next kernel is released
when the program's loop is, so that the next kernel's programs take SMs' places as this one's
finish: released when every program here has started, they would land unevenly among SMs
under a wave's worth of programs. Stream-K releases, then waits, before any load.

Row-major w only (TMA reads rows; the pre-shuffled tiles are ``triton.frag``'s and the split-K
kernels'); K a multiple of 16 (TMA's 16-byte row pitch), any N, M. FP8 (float8_e4m3fn), Hopper
(sm_90) only; Gluon does not run in Triton's interpreter, so the CPU checks only compile it
(tests/test_kernels_compile_for_hopper.py). Dispatch replays its launch as the other kernels'
(``_replay``), its two TMA descriptors rebuilt around each call's x and w.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks, _ring_launch
from gemmtune.kernels.triton._epilogue import PER_BLOCK
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._ring_launch import tma_load
from gemmtune.kernels.triton._splits import (PDL_OFF, split_for, splits_around,
                                             why_not_wait_pdl)
from gemmtune.kernels.triton._swapped import (BLOCK_MS, BLOCK_N, ROWS_PER_WARP, barrier,
                                              block_m_for, finish_share, finish_tile,
                                              release_next, release_then_wait, step_scales,
                                              stream_part, stream_run, wait_for_previous,
                                              why_not_add_splits, why_not_grid, why_not_here)

KERNEL_PREFIX = "triton.ring"
# Programs per SM the splits (and stream-K) aim at; a ring takes up to 200 KiB, so 2 and 4 per
# SM share it.
_PROGRAMS_PER_SM = (1, 2, 4)
_STAGES = (2, 4, 8)
BLOCK_KS = (128, 256)
# w rows per program: 64 (one warpgroup) for M <= 64, 128 (two) for 64 < M <= 256, where x's
# rows come in blocks of 128 (WIDE_BLOCK_M; with 64 rows of w, ptxas spilled at 128 rows of x).
BLOCK_NS = (BLOCK_N, 2 * BLOCK_N)
WIDE_BLOCK_M = 128
WIDE_BLOCK_K = 128  # the wide tile's step (ptxas spills at 256)
MAX_M = 256  # the largest M the candidates cover
MAX_SPLIT_K = 32
# Shared memory the ring may take, and what a block may have in all (H100): the ring, the end's
# layout conversion of the fp32 tile (at most its size) and the mbarriers.
RING_BYTES = 200 * 1024
SMEM_BYTES = 227 * 1024
_PER_BLOCK = gl.constexpr(PER_BLOCK)  # as the jitted code reads them
_ROWS_PER_WARP = gl.constexpr(ROWS_PER_WARP)


@dataclass(frozen=True)
class RingConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.ring:BM16.BK256.S4.SK2``."""

    NAME_CODEC = NameCodec("TMA-ring config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BK", "block_k"), Field("S", "stages"),
        Field("SK", "split_k"), Field("R", "add_splits", default=0),
        Field("N", "block_n", default=BLOCK_N), Field("K", "stream_k", default=0),
        Field("P", "pdl", default=PDL_OFF)))

    block_m: int
    block_k: int
    stages: int  # slots of the ring, each BLOCK_K bytes of w's 64 rows and of x's BLOCK_M
    split_k: int
    # 1: the splits add their partials into one fp32 sum per tile, read once by the last
    # (``_swapped.finish_tile``'s ADD_SPLITS: not bitwise reproducible); 0: summed in order
    add_splits: int = 0
    block_n: int = BLOCK_N  # w rows per program (the MMA's M): 64, or 128 on two warpgroups
    # Stream-K (split_k 1): 1, 2 or 4 programs an SM, each taking an even run of the tiles' K
    # steps (its parts of tiles added into the tile's fp32 sum, the part that completes a tile
    # storing it: ``_swapped.finish_share``); 0: a program a tile and split
    stream_k: int = 0
    # PDL_OFF or PDL_WAIT: launched with programmatic dependent launch, w's first slots loading
    # before the wait for the previous kernel, x's after it, the next kernel released once this
    # program's loop is done (``ring_tile``; stream-K: released and waited for first)
    pdl: int = PDL_OFF

    @property
    def num_warps(self) -> int:
        return self.block_n // ROWS_PER_WARP


def max_registers(config: RingConfig) -> int | None:
    """A stream-K program's registers, capped so that ``stream_k`` of them share an SM's 64K
    (ptxas took all 255 for its loop over parts, where a program a tile takes 80-199, so more
    than one an SM would have run in waves); None elsewhere (ptxas's own choice)."""
    if not config.stream_k:
        return None
    return min(255, _checks.registers_to_share(config.num_warps * 32, config.stream_k))


def ring_bytes(config: RingConfig) -> int:
    """Shared memory the ring of ``config`` takes."""
    return config.stages * (config.block_n + config.block_m) * config.block_k


def smem_bytes(config: RingConfig) -> int:
    """Shared memory a program of ``config`` may take: the ring, the end's conversion of the
    fp32 tile, the mbarriers."""
    return ring_bytes(config) + config.block_n * config.block_m * 4 + 1024


def why_not_fits(config: RingConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM, or None."""
    c = config
    if c.block_n not in BLOCK_NS:
        return f"block_n={c.block_n} must be one of {BLOCK_NS}"
    block_ms = BLOCK_MS + ((WIDE_BLOCK_M,) if c.block_n > BLOCK_N else ())
    if c.block_m not in block_ms:
        return f"block_m={c.block_m} must be one of {block_ms} with block_n={c.block_n}"
    if c.block_k not in BLOCK_KS:
        return f"block_k={c.block_k} must be one of {BLOCK_KS}"
    if c.block_n > BLOCK_N and c.block_k > WIDE_BLOCK_K:
        # ptxas spilled 176-260 B at 256 (split sums; Triton 3.6 and 3.9), 24 B at 128.
        return (f"block_k={c.block_k} with block_n={c.block_n}: the wide tile takes "
                f"block_k {WIDE_BLOCK_K} (its registers spill beyond)")
    if c.stages < 2:
        return f"stages={c.stages} must be >= 2 (a ring of one slot waits on every load)"
    problem = why_not_add_splits(c) or why_not_wait_pdl(c.pdl)
    if problem is not None:
        return problem
    if c.stream_k not in (0,) + _PROGRAMS_PER_SM:
        return (f"stream_k={c.stream_k} must be 0 (a program a tile and split) or the programs "
                f"an SM, one of {_PROGRAMS_PER_SM}")
    if c.stream_k and c.split_k != 1:
        return (f"stream_k={c.stream_k} takes split_k=1 (its runs of K steps part the tiles), "
                f"not {c.split_k}")
    if ring_bytes(c) > RING_BYTES or smem_bytes(c) > SMEM_BYTES:
        return (f"{c.stages} stages of ({c.block_n} + {c.block_m}) x {c.block_k} bytes take "
                f"{ring_bytes(c)} B of shared memory (> {RING_BYTES}, or > {SMEM_BYTES} with the "
                f"end's {c.block_n} x {c.block_m} fp32 tile); use fewer stages")
    if dtype != torch.float8_e4m3fn:
        return (f"{dtype} weights: the TMA-ring kernel takes float8_e4m3fn only; use a "
                f"triton.splitk, triton.tile or triton.gemv config")
    if K % _checks.TMA_ALIGN:
        return (f"K={K} FP8 rows are not a multiple of {_checks.TMA_ALIGN} B, as TMA needs; use a "
                f"triton.splitk config")
    k_steps = triton.cdiv(K, c.block_k)
    return why_not_grid(c, M, K, k_steps, MAX_SPLIT_K)


def why_not_supported(config: RingConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output dtypes, and whether the kernel can run here: compiled (not in
    Triton's interpreter) for a Hopper GPU."""
    return (why_not_here("TMA-ring kernel") or _checks.why_not_dtypes(dtype, out_dtype)
            or why_not_fits(config, M, N, K, dtype))


def fits(config: RingConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


def tile_for(M: int) -> tuple[int, int]:
    """(block_n, block_m) for M rows of x: 64 rows of w and the smallest block of x that takes
    M up to 64; past it 128 rows of each (two warpgroups)."""
    if M <= BLOCK_MS[-1]:
        return BLOCK_N, block_m_for(M)
    return 2 * BLOCK_N, WIDE_BLOCK_M


def tiles_for(M: int) -> list[tuple[int, int]]:
    """The (block_n, block_m) tiles the candidates take: ``tile_for``'s, and past 64 rows of x
    also 64 of w by 64 of x (M in several blocks, each reading w again, from L2 where it stays
    there): the wide tile takes all of a multiprocessor's registers, one program each."""
    if M <= BLOCK_MS[-1]:
        return [tile_for(M)]
    return [(BLOCK_N, BLOCK_MS[-1]), tile_for(M)]


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF) -> list[RingConfig]:
    """The configs to tune one shape with, for M <= 256 (none above): each tile ``tiles_for``
    gives; each block_k; K split to reach each of ``_PROGRAMS_PER_SM`` from above and (the
    deepest ring that fits only) from below (``_splits.splits_around``); 2, 4 or 8 slots, as
    many as that many programs per SM can hold and the split's steps use; split sums in order
    and, split, added; launched plainly and, where ``pdl`` is PDL_WAIT, with PDL (faster on
    short loops, slower on some long ones: docs/benchmarks.md, session 38). Only configs that
    fit. Stream-K (``streamed``) is not among them: it lost on every shape it was timed on
    (docs/benchmarks.md, session 32)."""
    if M > MAX_M:
        return []
    num_sms = num_sms or _checks.sm_count()
    found = {}
    for bn, bm in tiles_for(M):
        for bk in BLOCK_KS:
            k_steps = triton.cdiv(K, bk)
            tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
            for per_sm, split, above in splits_around(tiles, k_steps, num_sms,
                                                      _PROGRAMS_PER_SM, MAX_SPLIT_K):
                most = RING_BYTES // per_sm // ((bn + bm) * bk)
                for add, mode in itertools.product(sorted({0, int(split > 1)}),
                                                   sorted({PDL_OFF, pdl})):
                    fitting = [cfg for cfg in (
                        RingConfig(bm, bk, max(2, min(stages, most, triton.cdiv(k_steps, split))),
                                   split, add, bn, pdl=mode) for stages in _STAGES)
                               if fits(cfg, M, N, K, dtype)]
                    if fitting and not above:  # from below, the deepest ring that fits alone
                        fitting = [max(fitting, key=lambda c: c.stages)]
                    found.update(dict.fromkeys(fitting))
    return list(found)


def streamed(bm: int, bk: int, bn: int, M: int, N: int, K: int, dtype: torch.dtype):
    """One tile's stream-K configs: each count of programs an SM whose rings of 2 slots or more
    fit beside each other, with the deepest ring that many fit; one program an SM for the wide
    tile (its registers, 145-199 a thread a tile, hold no second one)."""
    for per_sm in _PROGRAMS_PER_SM if bn == BLOCK_N else (1,):
        most = min(max(_STAGES), RING_BYTES // per_sm // ((bn + bm) * bk))
        fitting = (cfg for cfg in (RingConfig(bm, bk, stages, 1, 0, bn, per_sm)
                                   for stages in range(most, 1, -1))
                   if fits(cfg, M, N, K, dtype))
        deepest = next(fitting, None)
        if deepest is not None:
            yield deepest


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> RingConfig:
    """Reasonable untuned: ``tile_for``'s tile, 256 bytes of K per step (128 for the wide tile,
    whose end takes more of the shared memory), four slots, K split until there is one program
    per SM (the one-program-per-tile ring won where that filled the GPU)."""
    num_sms = num_sms or _checks.sm_count()
    bn, bm = tile_for(M)
    bk = 256 if bn == BLOCK_N else 128
    tiles = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    return RingConfig(bm, bk, 4, split_for(tiles, triton.cdiv(K, bk), num_sms, MAX_SPLIT_K), 0,
                      bn)


@gluon.jit
def ring_mainloop(w_desc, x_desc, pid_n, pid_m, lo, steps, M, scale_a_ptr, scale_b_ptr,
                  k_blocks, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, BLOCK_SCALED: gl.constexpr, PDL: gl.constexpr):
    """y.T's (BLOCK_N, BLOCK_M) tile over K steps [lo, lo + steps) of BLOCK_K, fp32, in the MMA's
    layout (one warpgroup per 64 rows of w): every slot's loads issued first, then per step the
    slot's wait, the MMA from zero added into fp32, and the slot's refill with the step STAGES
    on. ``BLOCK_SCALED``: each step's product is scaled by its FP8 block scales before the add
    (``step_scales``; the next step's are loaded before this step's wait). ``PDL``: w's slots
    start loading before the wait for the previous kernel, everything else after it."""
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    # A slot's bytes, out-of-bounds zeros too.
    nbytes: gl.constexpr = (BLOCK_N + BLOCK_M) * BLOCK_K
    for s in gl.static_range(STAGES):
        pred = s < steps
        mbarrier.expect(ready.index(s), nbytes, pred=pred)
        tma_load(w_desc, [pid_n * BLOCK_N, (lo + s) * BLOCK_K], ready.index(s),
                  w_ring.index(s), pred=pred)
        if not PDL:
            tma_load(x_desc, [pid_m * BLOCK_M, (lo + s) * BLOCK_K], ready.index(s),
                     x_ring.index(s), pred=pred)
    if PDL:
        # w is not the previous kernel's output (``ring_call``): its slots fill while that
        # kernel ends (each slot's barrier expects x's bytes too, so no step starts before x's
        # load below lands).
        wait_for_previous()
        for s in gl.static_range(STAGES):
            tma_load(x_desc, [pid_m * BLOCK_M, (lo + s) * BLOCK_K], ready.index(s),
                     x_ring.index(s), pred=s < steps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[BLOCK_N // _ROWS_PER_WARP, 1],
        instr_shape=[16, BLOCK_M, 32])
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    if BLOCK_SCALED:
        scale = step_scales(lo, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_N,
                            BLOCK_M, BLOCK_K, gl.SliceLayout(0, mma))
    for i in range(steps):
        if BLOCK_SCALED:
            now = scale
            scale = step_scales(lo + gl.minimum(i + 1, steps - 1), pid_n, pid_m, M,
                                scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_N, BLOCK_M, BLOCK_K,
                                gl.SliceLayout(0, mma))
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        product = warpgroup_mma(w_ring.index(slot), x_ring.index(slot).permute((1, 0)), acc,
                                use_acc=False)
        if BLOCK_SCALED:
            acc += product * now[None, :]
        else:
            acc += product
        barrier()  # every warp's MMA has read the slot before TMA writes it again
        nxt = i + STAGES
        pred = nxt < steps
        mbarrier.expect(ready.index(slot), nbytes, pred=pred)
        tma_load(w_desc, [pid_n * BLOCK_N, (lo + nxt) * BLOCK_K], ready.index(slot),
                  w_ring.index(slot), pred=pred)
        tma_load(x_desc, [pid_m * BLOCK_M, (lo + nxt) * BLOCK_K], ready.index(slot),
                  x_ring.index(slot), pred=pred)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    return acc


@gluon.jit
def ring_tile(w_desc, x_desc, M, K, scale_a_ptr, scale_b_ptr, k_blocks,
              SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, BLOCK_SCALED: gl.constexpr,
              PDL: gl.constexpr):
    """This program's tile (w's BLOCK_N rows ``pid_n``, x's block ``pid_m``) over its split of
    K: (acc, pid_n, split, pid_m), acc in the MMA's layout (``ring_mainloop``)."""
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_steps = gl.cdiv(K, BLOCK_K)
    lo = split * k_steps // SPLIT_K
    acc = ring_mainloop(w_desc, x_desc, pid_n, pid_m, lo, (split + 1) * k_steps // SPLIT_K - lo,
                        M, scale_a_ptr, scale_b_ptr, k_blocks, BLOCK_N, BLOCK_M, BLOCK_K, STAGES,
                        BLOCK_SCALED, PDL)
    if PDL:
        # Now, so that the next kernel's programs take SMs' places as this one's end, evenly:
        # released when every program here has started, they landed unevenly where the grid is
        # under a wave (up to 1.3x slower on long loops: docs/benchmarks.md, session 38).
        release_next()
    return acc, pid_n, split, pid_m


@gluon.jit(do_not_specialize=["M"])
def gemm_ring_kernel(
    w_desc, x_desc,  # TMA descriptors: w (N, K) in (BLOCK_N, BLOCK_K) boxes, x (M, K) (BLOCK_M, ..)
    y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,  # as gemm_frag's
    part_ptr, count_ptr,  # the splits' partials and counters, as gemm_frag's
    M, N, K, stride_ym, stride_yn, stride_bias,
    k_blocks,  # ceil(K / 128): columns of the block scales (SCALE_A == PER_BLOCK only)
    HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
    SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, PER_LOAD: gl.constexpr, ADD_SPLITS: gl.constexpr,
    STREAM_K: gl.constexpr, PDL: gl.constexpr,
):
    if STREAM_K:
        if PDL:  # before any load: the parts' rings load w and x together
            release_then_wait()
        # An even run of the tiles' K steps, part by part, the ring refilled for each.
        n_tiles = gl.cdiv(N, BLOCK_N)
        m_tiles = gl.cdiv(M, BLOCK_M)
        k_steps = gl.cdiv(K, BLOCK_K)
        s, end = stream_run(k_steps, n_tiles * m_tiles)
        while s < end:
            tile, pid_n, pid_m, lo, steps = stream_part(s, end, k_steps, n_tiles, m_tiles, False)
            acc = ring_mainloop(w_desc, x_desc, pid_n, pid_m, lo, steps, M, scale_a_ptr,
                                scale_b_ptr, k_blocks, BLOCK_N, BLOCK_M, BLOCK_K, STAGES,
                                SCALE_A == _PER_BLOCK, False)
            finish_share(acc, pid_n, pid_m, tile, steps, k_steps, y_ptr, bias_ptr, scale_a_ptr,
                         scale_b_ptr, part_ptr, count_ptr, M, N, stride_ym, stride_yn,
                         stride_bias, HAS_BIAS, SCALE_A, SCALE_B, BLOCK_N, BLOCK_M)
            s += steps
    else:
        acc, pid_n, split, pid_m = ring_tile(w_desc, x_desc, M, K, scale_a_ptr, scale_b_ptr,
                                             k_blocks, SPLIT_K, BLOCK_N, BLOCK_M, BLOCK_K,
                                             STAGES, SCALE_A == _PER_BLOCK, PDL)
        finish_tile(acc, pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                    part_ptr, count_ptr, M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS,
                    SCALE_A, SCALE_B, SPLIT_K, BLOCK_N, BLOCK_M, PER_LOAD, ADD_SPLITS)


def ring_call(x, w, bias, out, scale_a, scale_b, config: RingConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_ring`` as data (what a dispatch plan records and replays: its
    TMA descriptors are rebuilt around each later call's x and w, ``_replay.DescribedRole``)."""
    persistent = None
    if config.stream_k:  # at most a program a K step
        persistent = _ring_launch.Persistent(config.stream_k,
                                             triton.cdiv(x.shape[1], config.block_k), True)
    regs = max_registers(config)
    return _ring_launch.ring_call(gemm_ring_kernel, x, w, bias, out, scale_a, scale_b, config,
                                  counters, warmup, block_scales,
                                  dict(BLOCK_K=config.block_k, STREAM_K=bool(config.stream_k)),
                                  {} if regs is None else dict(maxnreg=regs),
                                  pdl=config.pdl, w_before_wait=True, persistent=persistent)


def launch_gemm_ring(x, w, bias, out, scale_a, scale_b, config: RingConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0. Split launches take their partials and counters as ``gemm_frag``'s."""
    launch(ring_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup,
                     block_scales), warmup)
    return out


def gemm_ring(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, scale_a: torch.Tensor | None = None,
              scale_b: torch.Tensor | None = None, config: RingConfig | None = None,
              out: torch.Tensor | None = None, block_scales: bool = False) -> torch.Tensor:
    """``y = (x @ w.T) * scale_a * scale_b + bias`` for FP8 x and row-major w; validates
    everything, then launches. ``config`` defaults to ``default_config`` (with block_k 128 for
    ``block_scales``: x's per 1x128 and w's per 128x128 scales, applied per K step)."""
    if _checks.interpreted():
        raise ValueError("gemm_ring: Gluon kernels do not run in Triton's interpreter")
    return _checks.validated_launch("gemm_ring", launch_gemm_ring, default_config, why_not_fits,
                                    x, w, bias, out_dtype, scale_a, scale_b, config, out,
                                    block_scales)
