"""A register-direct FP8 decode GEMM, in Gluon (Triton's layout-explicit dialect):
``y = (x @ w.T) * scale_a * scale_b + bias`` with w row-major (K contiguous) or in the 16-row x
128-byte tiles of ``gemmtune.kernels.preshuffle`` (``w_tiled``), loaded straight from global
memory into the registers the warpgroup MMA takes its A operand from.

Swapped as the split-K kernel's ``SW1`` configs are (y.T = w @ x.T): w's 64 rows of a program
are the MMA's M, x's rows its N (BLOCK_M, 8-64; more rows take more programs). Plain Triton
feeds both operands through shared memory; Hopper's ``wgmma`` takes A from registers, so here
each thread loads its own fragments (4 consecutive bytes of K per row and 32-deep step) with no
shared memory and no barrier for w (the compile test checks both), which pays where few
programs stream a weight and each step's latency, not bandwidth, bounds the time (narrow
weights at M = 16-32). x, a few KiB, goes through shared memory as the MMA's B. The next
AHEAD K steps of w are loaded before the current one is multiplied.

Each step's product is added into the fp32 accumulator (the MMA starts from zero per step), so
FP8's reduced-precision accumulation spans one step of K at most. K is split over a second grid
axis; the splits' fp32 partials are summed in split order by the last to finish (bitwise
deterministic, as ``_splits.sum_splits_and_store``) or, ``.R1``, added into one sum per tile
(``_swapped.finish_tile``). A third grid axis takes x's rows in blocks of BLOCK_M. Scales per tensor or per row of x / of w, bias, and the output dtype in the
epilogue; FP8 block scales (x's per 1x128, w's per 128x128) per K step of 128, on the product
before its add.

FP8 (float8_e4m3fn) only; Hopper (sm_90) only: Gluon kernels do not run in
Triton's interpreter, so the CPU checks only compile it (tests/test_kernels_compile_for_hopper.py).
Registers: at BLOCK_M 8-32 no config of the space spills; at BLOCK_M 64 the kernel uses all 255
and some configs spill a few dozen bytes (up to 76 B, ``ptxas -v``, Triton 3.6 and 3.9, without
a clear rule over split, steps ahead, scales and bias), which their tuned time then includes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import (PER_BLOCK, SCALE_BLOCK, epilogue_constexprs,
                                                epilogue_operands)
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (PDL_OFF, launch_mode, launch_variants, split_for,
                                             why_not_wait_pdl, workspace)
from gemmtune.kernels.triton._swapped import (BLOCK_MS, BLOCK_N, NUM_WARPS, barrier,
                                              block_m_for, finish_tile, partials_per_load,
                                              release_then_wait, split_steps, step_scales,
                                              why_not_add_splits, why_not_grid, why_not_here)
from gemmtune.kernels.triton._wlayout import why_not_tiled

KERNEL_PREFIX = "triton.frag"
_BN = gl.constexpr(BLOCK_N)  # as the jitted code reads it
_PER_BLOCK = gl.constexpr(PER_BLOCK)
BLOCK_KS = (128, 256)  # whole 128-byte tiles of the layout (512 spills: MAX_W_BYTES_IN_FLIGHT)
MAX_AHEAD = 3
# Bytes of each of a thread's rows in flight, (ahead + 1) * block_k: above 512 ptxas spilled
# registers at every block_m (e.g. BK512 with one step ahead, BK256 with two at BM 64).
MAX_W_BYTES_IN_FLIGHT = 512
# More splits only add partials to sum.
MAX_SPLIT_K = 32


@dataclass(frozen=True)
class FragConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.frag:BM16.BK256.SK4.A1.P1``."""

    NAME_CODEC = NameCodec("register-direct config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BK", "block_k"), Field("SK", "split_k"),
        Field("A", "ahead"), Field("P", "pdl", default=PDL_OFF),
        Field("R", "add_splits", default=0)))

    block_m: int
    block_k: int
    split_k: int
    ahead: int  # K steps of w loaded before the current one is multiplied
    # PDL_OFF or PDL_WAIT. With PDL_WAIT w's first steps load before the wait: w must not have
    # been written by the kernel launched just before on the same stream (weights never are)
    pdl: int = PDL_OFF
    # 1: the splits add their partials into one fp32 sum per tile, read once by the last
    # (``_swapped.finish_tile``'s ADD_SPLITS: not bitwise reproducible); 0: summed in order
    add_splits: int = 0


def w_bytes_in_flight(config: FragConfig) -> int:
    """Bytes of each of a thread's rows of w loaded before they are multiplied."""
    return config.block_k * (config.ahead + 1)


def why_not_fits(config: FragConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM, or None."""
    c = config
    if c.block_m not in BLOCK_MS:
        return f"block_m={c.block_m} must be one of {BLOCK_MS}"
    if c.block_k not in BLOCK_KS:
        return f"block_k={c.block_k} must be one of {BLOCK_KS}"
    if not 1 <= c.ahead <= MAX_AHEAD:
        return f"ahead={c.ahead} must be in [1, {MAX_AHEAD}]"
    problem = why_not_wait_pdl(c.pdl) or why_not_add_splits(c)
    if problem is not None:
        return problem
    if w_bytes_in_flight(c) > MAX_W_BYTES_IN_FLIGHT:
        return (f"block_k={c.block_k} with {c.ahead} steps ahead keeps {w_bytes_in_flight(c)} "
                f"bytes of each row in flight (> {MAX_W_BYTES_IN_FLIGHT}: registers spill); "
                f"use a smaller block_k or fewer steps ahead")
    if dtype != torch.float8_e4m3fn:
        return (f"{dtype} weights: the register-direct kernel takes float8_e4m3fn only; use a "
                f"triton.splitk, triton.tile or triton.gemv config")
    # A pre-shuffled w's own constraints (N, K whole tiles) are _wlayout.why_not_tiled's.
    if K % c.block_k:
        return f"K={K} is not a multiple of block_k={c.block_k}: use a block_k that divides it"
    k_steps = K // c.block_k
    return why_not_grid(c, M, K, k_steps, MAX_SPLIT_K)


def why_not_supported(config: FragConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output dtypes, and whether the kernel can run here: compiled (not
    in Triton's interpreter) for a Hopper GPU (its warpgroup MMA with the fp32 sums it is
    written for)."""
    return (why_not_here("register-direct kernel") or _checks.why_not_dtypes(dtype, out_dtype)
            or why_not_fits(config, M, N, K, dtype))


def fits(config: FragConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


# Programs per SM the splits aim at: a program has 8 KiB (BK 128) or 16 KiB (BK 256) of w in
# flight per step ahead; the probe's best had 1-4 programs per SM.
_PROGRAMS_PER_SM = (1, 2, 4, 8)


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF) -> list[FragConfig]:
    """The configs to tune one shape with, for M <= 64 (decode, where the kernel pays; none
    above): block_m covering M; each block_k dividing K; 1-3 steps ahead; K split to reach each
    of ``_PROGRAMS_PER_SM``; without PDL and, where ``pdl`` is PDL_WAIT, with it (neither won
    everywhere: docs/benchmarks.md, session 20); split sums in order and, split, added. Only
    configs that fit."""
    if M > BLOCK_MS[-1]:
        return []
    num_sms = num_sms or _checks.sm_count()
    bm = block_m_for(M)
    found = {}
    for bk in BLOCK_KS:
        if K % bk:
            continue
        tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, bm)
        for per_sm in _PROGRAMS_PER_SM:
            split = split_for(tiles, K // bk, per_sm * num_sms, MAX_SPLIT_K)
            for ahead in range(1, MAX_AHEAD + 1):
                for mode, add in launch_variants(split, pdl):
                    cfg = FragConfig(bm, bk, split, ahead, mode, add)
                    if fits(cfg, M, N, K, dtype):
                        found[cfg] = None
    return list(found)


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> FragConfig:
    """Reasonable untuned: 256 bytes of K per step where they divide K, else 128, one step
    ahead, K split until there are 2 programs per SM. Fits every shape the layout takes (K a
    multiple of 128)."""
    num_sms = num_sms or _checks.sm_count()
    bm = block_m_for(M)
    bk = 256 if K % 256 == 0 else 128
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, bm)
    return FragConfig(bm, bk, split_for(tiles, K // bk, 2 * num_sms, MAX_SPLIT_K), 1)


@gluon.jit
def _w_offsets(pid_n, N, K, stride_wn, BLOCK_K: gl.constexpr, W_TILED: gl.constexpr,
               a_layout: gl.constexpr):
    """Offsets of w's first K step for this program, in the MMA's A-operand layout itself, and
    the rows' mask. Row-major, element (n, k) at n * stride_wn + k; tiled, at (n // 16) * 16 K
    + (k // 128) * 2048 + (n % 16) * 128 + k % 128 (``preshuffle``). Either way each thread's
    4 consecutive K per row and K step are 4 contiguous bytes."""
    n = pid_n * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, a_layout))
    k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    rows = gl.where(n < N, n, 0).to(gl.int64)
    if W_TILED:
        offs = (rows // 16 * 16 * K + rows % 16 * 128)[:, None] \
            + (k // 128 * 2048 + k % 128)[None, :]
    else:
        offs = (rows * stride_wn)[:, None] + k[None, :]
    return offs, (n < N)[:, None]


@gluon.jit
def _w_step(w_ptr, offs, in_n, step, BLOCK_K: gl.constexpr, W_TILED: gl.constexpr):
    """K step ``step`` of w (rows past N read 0): BLOCK_K bytes along every row, tiled
    BLOCK_K / 128 tiles along every band."""
    if W_TILED:
        return gl.load(w_ptr + offs + step.to(gl.int64) * (BLOCK_K * 16), mask=in_n, other=0.0)
    else:
        return gl.load(w_ptr + offs + step.to(gl.int64) * BLOCK_K, mask=in_n, other=0.0)


@gluon.jit(do_not_specialize=["M"])
def gemm_frag_kernel(
    x_ptr,  # (M, K) float8_e4m3fn, K contiguous
    w_ptr,  # (N, K) float8_e4m3fn: rows stride_wn apart, K contiguous; or W_TILED
    y_ptr,  # (M, N)
    bias_ptr, scale_a_ptr, scale_b_ptr,  # as gemm_splitk's (unused where the constexprs say)
    # (tiles, SPLIT_K, BLOCK_M, BLOCK_N) fp32, or with ADD_SPLITS (tiles, BLOCK_M, BLOCK_N)
    # zeroed and left zero; unused unless SPLIT_K > 1
    part_ptr,
    count_ptr,  # (tiles,) int32, zero on entry and left zero; unused unless SPLIT_K > 1
    M, N, K,
    stride_xm, stride_wn, stride_ym, stride_yn, stride_bias,
    k_blocks,  # ceil(K / 128): columns of the block scales (SCALE_A == PER_BLOCK only)
    HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
    SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
    AHEAD: gl.constexpr, PDL: gl.constexpr, PER_LOAD: gl.constexpr, W_TILED: gl.constexpr,
    ADD_SPLITS: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    x_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K],
                                                                       gl.float8e4nv)
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    pid_m = gl.program_id(2)
    step_lo, step_hi = split_steps(split, K, BLOCK_K, SPLIT_K)

    w_offs, in_n = _w_offsets(pid_n, N, K, stride_wn, BLOCK_K, W_TILED, a_layout)
    # w is not the previous kernel's output (weights are written long before; frag_call
    # launches a copy of its own without PDL): its first steps load before the PDL wait.
    w0 = _w_step(w_ptr, w_offs, in_n, step_lo, BLOCK_K, W_TILED)
    if AHEAD >= 2:
        w1 = _w_step(w_ptr, w_offs, in_n, gl.minimum(step_lo + 1, step_hi - 1), BLOCK_K,
                     W_TILED)
    if AHEAD >= 3:
        w2 = _w_step(w_ptr, w_offs, in_n, gl.minimum(step_lo + 2, step_hi - 1), BLOCK_K,
                     W_TILED)
    if PDL:
        # The next kernel's launch overlaps this one's tail; w is already loading.
        release_then_wait()

    xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * stride_xm + xk[None, :]
    x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, BLOCK_K], x_smem_layout)
    acc = gl.zeros([_BN, BLOCK_M], gl.float32, layout=mma)
    BLOCK_SCALED: gl.constexpr = SCALE_A == _PER_BLOCK
    if BLOCK_SCALED:
        scale = step_scales(step_lo, pid_n, pid_m, M, scale_a_ptr, scale_b_ptr, k_blocks, _BN,
                            BLOCK_M, BLOCK_K, gl.SliceLayout(0, mma))
    for step in range(step_lo, step_hi):
        if BLOCK_SCALED:  # the next step's block scales load while this one multiplies
            now = scale
            scale = step_scales(gl.minimum(step + 1, step_hi - 1), pid_n, pid_m, M, scale_a_ptr,
                                scale_b_ptr, k_blocks, _BN, BLOCK_M, BLOCK_K,
                                gl.SliceLayout(0, mma))
        w_now = w0
        # The steps up to AHEAD on are in flight while this one multiplies (the last steps
        # re-read the final one: a few L2 hits instead of a branch).
        ahead = gl.minimum(step + AHEAD, step_hi - 1)
        if AHEAD == 1:
            w0 = _w_step(w_ptr, w_offs, in_n, ahead, BLOCK_K, W_TILED)
        elif AHEAD == 2:
            w0 = w1
            w1 = _w_step(w_ptr, w_offs, in_n, ahead, BLOCK_K, W_TILED)
        else:
            w0 = w1
            w1 = w2
            w2 = _w_step(w_ptr, w_offs, in_n, ahead, BLOCK_K, W_TILED)
        x = gl.load(x_ptrs + step.to(gl.int64) * BLOCK_K, mask=(xm < M)[:, None], other=0.0)
        barrier()  # the previous step's MMA has read x_smem
        x_smem.store(x)
        fence_async_shared()
        # From zero per step: the MMA's reduced-precision FP8 sum spans one step, the fp32 add
        # the rest (with block scales, once scaled).
        product = warpgroup_mma(w_now, x_smem.permute((1, 0)), acc, use_acc=False)
        if BLOCK_SCALED:
            acc += product * now[None, :]
        else:
            acc += product

    finish_tile(acc, pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, part_ptr,
                 count_ptr, M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B,
                 SPLIT_K, _BN, BLOCK_M, PER_LOAD, ADD_SPLITS)


def frag_call(x, w, bias, out, scale_a, scale_b, config: FragConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False, w_tiled: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_frag`` as data (what a dispatch plan records and replays)."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    copied_w = not w_tiled and (w.stride(1) != 1 or w.stride(0) % 16)
    if copied_w:
        # Each thread reads 4 bytes of a row at once: K contiguous, rows 16-byte aligned (any
        # weight of the families' K, a multiple of 128, is).
        w = w.contiguous()
    n_tiles, m_tiles = triton.cdiv(N, BLOCK_N), triton.cdiv(M, config.block_m)
    parts, counters, per_call = workspace(x, out, n_tiles * m_tiles, BLOCK_N * config.block_m,
                                          config.split_k, counters, warmup,
                                          bool(config.add_splits))
    pdl = launch_mode(config.pdl, x.device, copied_w)
    bias_, scale_a_, scale_b_ = epilogue_operands(x, bias, scale_a, scale_b)
    args = (x, w, out, bias_, scale_a_, scale_b_, parts, counters, M, N, K,
            x.stride(0), w.stride(0), out.stride(0), out.stride(1),
            bias.stride(0) if bias is not None else 0, triton.cdiv(K, SCALE_BLOCK))
    constexprs = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, block_scales),
        SPLIT_K=config.split_k,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        AHEAD=config.ahead,
        PDL=pdl != PDL_OFF,
        PER_LOAD=partials_per_load(config.split_k, BLOCK_N, config.block_m, NUM_WARPS),
        W_TILED=w_tiled,
        ADD_SPLITS=bool(config.add_splits))
    return KernelCall(gemm_frag_kernel, (n_tiles, config.split_k, m_tiles), args, constexprs,
                      dict(num_warps=NUM_WARPS), launch_pdl=pdl != PDL_OFF,
                      replayable=not per_call)


def launch_gemm_frag(x, w, bias, out, scale_a, scale_b, config: FragConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False, w_tiled: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0; ``w_tiled``: w is pre-shuffled (the caller checked
    ``_wlayout.why_not_tiled``). Split launches take their partials and counters as
    ``gemm_splitk``'s do (``_splits.workspace``)."""
    launch(frag_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup,
                     block_scales, w_tiled), warmup)
    return out


def gemm_frag(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, scale_a: torch.Tensor | None = None,
              scale_b: torch.Tensor | None = None, config: FragConfig | None = None,
              out: torch.Tensor | None = None, block_scales: bool = False,
              w_tiled: bool = False) -> torch.Tensor:
    """``y = (x @ w.T) * scale_a * scale_b + bias`` for an FP8 ``w``, row-major or, with
    ``w_tiled``, pre-shuffled (``gemmtune.quant.shuffle_weight``); validates everything, then
    launches. ``config`` defaults to ``default_config`` (with block_k 128 for ``block_scales``:
    x's per 1x128 and w's per 128x128 scales, applied per K step)."""
    if _checks.interpreted():
        raise ValueError("gemm_frag: Gluon kernels do not run in Triton's interpreter")
    if w_tiled and not w.is_contiguous():
        raise ValueError("gemm_frag: a pre-shuffled w must be contiguous, as "
                         "gemmtune.quant.shuffle_weight returns it (the kernel ignores its "
                         "strides)")

    def why_not(config, M, N, K, dtype):
        return why_not_fits(config, M, N, K, dtype) or (
            why_not_tiled(config, N, K, dtype) if w_tiled else None)

    return _checks.validated_launch("gemm_frag", functools.partial(launch_gemm_frag,
                                                                   w_tiled=w_tiled),
                                    default_config, why_not, x, w, bias, out_dtype, scale_a,
                                    scale_b, config, out, block_scales)

