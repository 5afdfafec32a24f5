"""GEMV GEMM in Triton for decode (M <= 16): ``y = (x @ w.T) * scale_a * scale_b + bias`` on
the CUDA cores, streaming w at the speed of memory.

At M = 1 a GEMM only has to read w once; what decides its time is how many bytes of w are in
flight. Tensor-core tiles need 16 rows of x and a w tile of 16+ columns per program, which
leaves narrow weights with too few programs to keep HBM busy. Here a program takes BLOCK_N rows
of w (1-64) and a slice of K, loads BLOCK_K contiguous elements of each row per step (16-byte
vectors, 1-2 KiB per row), multiplies them by the same K of x in fp32 and adds the products up
in w's own layout, reducing them over K once at the end (no shared memory, no barrier in the
loop). Many small programs (8-32 per SM) keep the weight stream wide. From M = 2 each row of x
is multiplied and reduced per step, which is right but loses to tensor-core kernels from M = 2-4
on (docs/benchmarks.md, session 17): tuning keeps it only where it wins.

K is split over a second grid axis where there are too few row blocks to fill the GPU; the
splits' fp32 partials are summed by the last one to finish (``_splits.sum_splits_and_store``:
one launch, bitwise deterministic). Scales: per tensor or per row of x / of w in the epilogue
(``store_tile``); FP8 block scales (x per 1x128, w per 128x128 of K) per 128 of K inside the
step, which spans whole scale blocks (BLOCK_K a multiple of 128).

benchmarks/read_floor_probe.py measured the design on an H100 at M = 1 (bf16, one launch, whole
K per program): 0.90-0.97 of the attainable floor per preset where torch.mm reached 0.80-0.90
(docs/benchmarks.md, session 16).

Operands: ``x`` (M, K) and ``w`` (N, K) with any strides, fp16, bf16, fp32 or float8_e4m3fn
(scaled); int8 is refused (its products would be summed in fp32, not exactly in int32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import (PER_BLOCK, SCALE_BLOCK, epilogue_constexprs,
                                               epilogue_operands, operand_strides)
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (MAX_SPLIT_K, PDL_OFF, launch_mode, split_chunk,
                                             split_for, store_split_tile, why_not_wait_pdl,
                                             workspace)
from gemmtune.kernels.triton._wlayout import w_k_offsets, w_row_offsets

KERNEL_PREFIX = "triton.gemv"
# As the jitted code reads it
_PER_BLOCK = tl.constexpr(PER_BLOCK)
# Rows of x one launch takes: all of them live in one program's registers, and the CUDA cores'
# FLOPs (2 per w element per row) outgrow the weight stream past a few rows.
MAX_M = 16
# At most 64 rows of w per program: they then lie in one 128-row block of FP8 block scales.
MAX_BLOCK_N = 64
MIN_BLOCK_K, MAX_BLOCK_K = 16, 8192
# One step of w in fp32, BLOCK_N * BLOCK_K / (32 * num_warps) registers per thread, at most this:
# as many again hold its products (kept to the end at M = 1), out of a thread's 255.
MAX_W_REGS_PER_THREAD = 64


@dataclass(frozen=True)
class GemvConfig(NamedConfig):
    """One point of the GEMV kernel's config space; ``name`` is how tables and the CLI spell
    it, e.g. ``triton.gemv:BN4.BK1024.SK1.W4.S1.P1``. It runs any M up to MAX_M: each launch
    takes all of x's rows in one program (``block_m``, the next power of 2), so a row tuned at
    one M serves the smaller ones that table lookup pads up to it."""

    NAME_CODEC = NameCodec("GEMV config", KERNEL_PREFIX, (
        Field("BN", "block_n"), Field("BK", "block_k"),
        Field("SK", "split_k"), Field("W", "num_warps"), Field("S", "num_stages"),
        Field("P", "pdl", default=PDL_OFF)))

    block_n: int  # rows of w (columns of y) per program
    block_k: int  # elements of each w row loaded per step
    split_k: int
    num_warps: int
    num_stages: int  # steps of w in flight per thread: 1, or 2 (the next loaded before use)
    # PDL_OFF or PDL_WAIT (w's first step loads before the wait; block-scaled: nothing does)
    pdl: int = PDL_OFF


def block_m(M: int) -> int:
    """Rows of x one program takes (all of them): the next power of 2."""
    return triton.next_power_of_2(max(1, M))


def num_tiles(config: GemvConfig, N: int) -> int:
    """Row blocks of w, i.e. programs per split, and the tile counters a split launch needs."""
    return triton.cdiv(N, config.block_n)


def w_registers(config: GemvConfig) -> int:
    """fp32 registers per thread that one step of w takes."""
    return config.block_n * config.block_k // (32 * config.num_warps)


def why_not_fits(config: GemvConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM on ``dtype`` inputs, or None."""
    c = config
    if M > MAX_M:
        return (f"M={M} exceeds {MAX_M}, the rows of x one GEMV program takes; use a tile or "
                f"split-K kernel for larger M")
    if not (_checks.is_pow2(c.block_n) and c.block_n <= MAX_BLOCK_N):
        return f"block_n={c.block_n} must be a power of 2 up to {MAX_BLOCK_N}"
    if not (_checks.is_pow2(c.block_k) and MIN_BLOCK_K <= c.block_k <= MAX_BLOCK_K):
        return f"block_k={c.block_k} must be a power of 2 in [{MIN_BLOCK_K}, {MAX_BLOCK_K}]"
    if not 1 <= c.split_k <= MAX_SPLIT_K:
        return f"split_k={c.split_k} must be in [1, {MAX_SPLIT_K}]"
    problem = _checks.why_not_warps_stages(c)
    if problem is not None:
        return problem
    if c.num_stages not in (1, 2):
        return (f"num_stages={c.num_stages} must be 1 or 2, the steps of w in flight per "
                f"thread")
    problem = why_not_wait_pdl(c.pdl)
    if problem is not None:
        return problem
    if w_registers(c) > MAX_W_REGS_PER_THREAD:
        return (f"a step of block_n x block_k = {c.block_n} x {c.block_k} of w takes "
                f"{w_registers(c)} fp32 registers per thread (> {MAX_W_REGS_PER_THREAD}), as "
                f"many again for its products; use smaller blocks or more warps")
    k_steps = triton.cdiv(K, c.block_k)
    if c.split_k > max(1, k_steps):
        return (f"split_k={c.split_k} leaves splits without a block_k step: K={K} is "
                f"{k_steps} steps of block_k={c.block_k}; use split_k <= {max(1, k_steps)}")
    if dtype == torch.int8:
        return ("int8 inputs are not supported by the GEMV kernel (its products are summed in "
                "fp32, not exactly in int32); use a tile or split-K kernel")
    return None


def why_not_supported(config: GemvConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """Like ``why_not_fits``, also rejecting dtypes the kernel does not take: what a dispatch plan
    checks once per shape so that each later call can go straight to ``launch_gemm_gemv``."""
    return _checks.why_not_dtypes(dtype, out_dtype) or why_not_fits(config, M, N, K, dtype)


def why_not_block_scaled(config: GemvConfig, dtype: torch.dtype) -> str | None:
    """What keeps ``config`` from an FP8 block-scaled GEMM (scales per 128 of K), or None."""
    if dtype != torch.float8_e4m3fn:
        return f"block scales need float8_e4m3fn inputs, not {dtype}"
    if config.block_k % SCALE_BLOCK:
        return (f"block_k={config.block_k} must be a multiple of {SCALE_BLOCK}, the K extent of "
                f"one block scale (each step spans whole scale blocks)")
    if config.num_stages != 1:
        return (f"num_stages={config.num_stages}: the block-scaled steps load w as they use it; "
                f"use num_stages=1")
    return None


def fits(config: GemvConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


# Bytes of each w row per step: 1-2 KiB won every preset shape in the probe (16-byte vectors,
# so at 4 warps a thread holds 2-4 of them per row).
_ROW_STEP_BYTES = (1024, 2048)
_BLOCK_N = (1, 2, 4, 8, 16)
# 4 warps (the probe's), 8 where a step of w would take more than half of 4 warps' registers.
_WARPS = (4, 8)
_WIDE_REGS = MAX_W_REGS_PER_THREAD // 2
# Steps of w in flight per thread (``GemvConfig.num_stages``).
_STAGES = (1, 2)
# At most this many configs per shape: the widest steps first.
_MAX_CANDIDATES = 40
# Programs per SM the split aims at: the probe's best readers used 8-32 per SM.
_PROGRAMS_PER_SM = (8, 32)


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF, block_scales: bool = False) -> list[GemvConfig]:
    """The pruned search space for one shape (at most ``_MAX_CANDIDATES``): rows per program
    ``_BLOCK_N``; steps of ``_ROW_STEP_BYTES`` per row (at least 128 elements with block
    scales, and no more than K needs); 4 warps, or 8 for wide steps; K split to reach each of
    ``_PROGRAMS_PER_SM``; one or two steps of w in flight (``_STAGES``; one with block
    scales). Every config gets ``pdl``. Empty for M > MAX_M."""
    if M > MAX_M:
        return []
    num_sms = num_sms or _checks.sm_count()
    found = {}
    for bn in _BLOCK_N:
        tiles = triton.cdiv(N, bn)
        for row_bytes in sorted(_ROW_STEP_BYTES, reverse=True):
            bk = min(row_bytes // dtype.itemsize, max(MIN_BLOCK_K, triton.next_power_of_2(K)))
            if block_scales:
                bk = max(bk, SCALE_BLOCK)
            k_steps = triton.cdiv(K, bk)
            warps = next((w for w in _WARPS if bn * bk // (32 * w) <= _WIDE_REGS), _WARPS[-1])
            for per_sm in _PROGRAMS_PER_SM:
                split = split_for(tiles, k_steps, per_sm * num_sms)
                for stages in _STAGES if not block_scales else (1,):
                    cfg = GemvConfig(bn, bk, split, warps, stages, pdl)
                    if fits(cfg, M, N, K, dtype) and not (
                            block_scales and why_not_block_scaled(cfg, dtype)):
                        found[cfg] = None
    return list(found)[:_MAX_CANDIDATES]


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> GemvConfig:
    """A config that fits any M <= MAX_M and is reasonable untuned: 4 rows of w per program,
    2 KiB of each row per step (128-multiples, as block scales need), 4 warps, K split until
    there are 8 programs per SM. The tests check that it fits every M <= MAX_M."""
    num_sms = num_sms or _checks.sm_count()
    bk = max(SCALE_BLOCK, min(2048 // dtype.itemsize, triton.next_power_of_2(K)))
    split = split_for(triton.cdiv(N, 4), triton.cdiv(K, bk), 8 * num_sms)
    return GemvConfig(4, bk, split, 4, 1)


@triton.jit
def _w_step(w_rows, step, step_hi, offs_k, K, stride_wk, BLOCK_K: tl.constexpr,
            W_TILED: tl.constexpr):
    """Step ``step`` of the program's w rows, as stored (nothing past its last step)."""
    ks = tl.cast(step, tl.int64) * BLOCK_K + offs_k
    k_end = tl.where(step < step_hi, K, 0)
    # First to leave the caches: w is read once, x again by every program. H200, the H100
    # rows' configs: FP8 0.99-1.08x (1.024 geomean), bf16 unchanged; pre-shuffled w not timed
    # (docs/benchmarks.md, session 37).
    return tl.load(w_rows + w_k_offsets(ks, stride_wk, W_TILED)[None, :],
                   mask=ks[None, :] < k_end, other=0.0, eviction_policy="evict_first")


@triton.jit
def _add_step(x_ptr, w, step, products, acc, offs_m, offs_k, M, K, stride_xm, stride_xk,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``products`` (one row of x) or ``acc`` with step ``step``'s w (as loaded) times x."""
    ks = tl.cast(step, tl.int64) * BLOCK_K + offs_k
    w = w.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        # Rows of x past M read nothing: their K ends at 0.
        x_end = tl.where(m < M, K, 0)
        xm = tl.load(x_ptr + m * stride_xm + ks * stride_xk, mask=ks < x_end, other=0.0)
        prod = w * xm.to(tl.float32)[None, :]
        if BLOCK_M == 1:
            products += prod
        else:
            part = tl.sum(prod, axis=1)
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    return products, acc


@triton.jit
def _steps(x_ptr, w_rows, w_first, acc, offs_m, offs_k, step_lo, step_hi, M, K, stride_xm,
           stride_xk, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, STAGES: tl.constexpr, W_TILED: tl.constexpr):
    """``acc`` (BLOCK_M, BLOCK_N) plus x @ w.T over steps [step_lo, step_hi), the first step of
    w loaded (``w_first``: a split is never empty). With STAGES 2 the next step of w is loaded
    before this one is used: two loads in flight per thread."""
    # One row of x (decode's M = 1): the products are only added up in w's own layout and
    # reduced over K once at the end, so the loop holds no reduction across threads and no
    # layout change. More rows: each row of x reduced per step (a 3-D broadcast of x against w
    # would move both through shared memory at every step).
    products = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # The first step apart (its w loaded before the PDL wait), the loop loading each step's w
    # where it is used: a w carried across the loop's end at one step made the FP8 decode up
    # to 1.4x slower (docs/benchmarks.md, session 38).
    if STAGES == 2:
        w_next = _w_step(w_rows, step_lo + 1, step_hi, offs_k, K, stride_wk, BLOCK_K, W_TILED)
    products, acc = _add_step(x_ptr, w_first, step_lo, products, acc, offs_m, offs_k, M, K,
                              stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    for step in range(step_lo + 1, step_hi):
        if STAGES == 2:
            w = w_next
            w_next = _w_step(w_rows, step + 1, step_hi, offs_k, K, stride_wk, BLOCK_K, W_TILED)
        else:
            w = _w_step(w_rows, step, step_hi, offs_k, K, stride_wk, BLOCK_K, W_TILED)
        products, acc = _add_step(x_ptr, w, step, products, acc, offs_m, offs_k, M, K,
                                  stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.sum(products, axis=1)[None, :]
    return acc


@triton.jit
def _block_scaled_steps(x_ptr, w_ptr, scale_a_ptr, scale_b_ptr, acc, offs_m, cols, pid,
                        step_lo, step_hi, M, K, scale_k_blocks, stride_xm, stride_xk, stride_wn,
                        stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """``_steps`` with FP8 block scales, one step of w in flight (``why_not_block_scaled``
    refuses two). A step is BLOCKS whole scale blocks of K, and w and x are loaded as
    (.., BLOCKS, 128): each 128 of x is scaled by its own block's scales (x's and the program's
    w rows', which lie in one 128-row block) before the products, which then only add up, as
    unscaled ones do."""
    BLOCKS: tl.constexpr = BLOCK_K // 128
    blocks = tl.arange(0, BLOCKS)
    within = tl.arange(0, 128)
    k_of = blocks[:, None] * 128 + within[None, :]  # (BLOCKS, 128): a step's K offsets
    w_rows = w_ptr + cols[:, None, None] * stride_wn  # (BLOCK_N, 1, 1)
    w_scale_row = scale_b_ptr + ((pid * BLOCK_N) // 128) * scale_k_blocks
    products = tl.zeros((BLOCK_N, BLOCKS, 128), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        ks = tl.cast(step, tl.int64) * BLOCK_K + k_of
        k_in = ks < K
        # A plain load: evict-first (_w_step's) has not been timed with block scales
        w = tl.load(w_rows + ks[None, :, :] * stride_wk, mask=k_in[None, :, :], other=0.0)
        w = w.to(tl.float32)
        kbs = step * BLOCKS + blocks
        kb_in = kbs < scale_k_blocks
        sb = tl.load(w_scale_row + kbs, mask=kb_in, other=0.0)
        for m in tl.static_range(BLOCK_M):
            x_end = tl.where(m < M, K, 0)
            xm = tl.load(x_ptr + m * stride_xm + ks * stride_xk, mask=ks < x_end, other=0.0)
            sa = tl.load(scale_a_ptr + m * scale_k_blocks + kbs,
                         mask=kbs < tl.where(m < M, scale_k_blocks, 0), other=0.0)
            prod = w * (xm.to(tl.float32) * (sa * sb)[:, None])[None, :, :]
            if BLOCK_M == 1:
                products += prod
            else:
                part = tl.sum(tl.sum(prod, axis=2), axis=1)
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(products, axis=2), axis=1)[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemm_gemv_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K)
    y_ptr,  # (M, N)
    bias_ptr,  # (N,); unused unless HAS_BIAS
    scale_a_ptr,  # (1,) or (M,) fp32, or (M, scale_k_blocks) block scales
    scale_b_ptr,  # (1,) or (N,) fp32, or (ceil(N / 128), scale_k_blocks) block scales
    part_ptr,  # (tiles, SPLIT_K, BLOCK_M, BLOCK_N) fp32 partials; unused unless USE_WORKSPACE
    count_ptr,  # (tiles,) int32, zero on entry and left zero; unused unless USE_WORKSPACE
    M, N, K,
    scale_k_blocks,  # ceil(K / 128): columns of the block scales (PER_BLOCK only)
    SPLIT_K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    SCALE_A: tl.constexpr,  # _epilogue.NO_SCALE, PER_TENSOR, PER_VECTOR or PER_BLOCK
    SCALE_B: tl.constexpr,
    USE_WORKSPACE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    STAGES: tl.constexpr,  # steps of w in flight per thread: 1, or 2 (the next one loaded early)
    W_TILED: tl.constexpr,  # w pre-shuffled (gemmtune.kernels.preshuffle); never block-scaled
):
    # Axis 0: row blocks of w; axis 1: the split of K, balanced as in gemm_splitk (split s takes
    # steps [s*n/S, (s+1)*n/S), never empty while SPLIT_K <= n).
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_steps = tl.cdiv(K, BLOCK_K)
    step_lo = split * k_steps // SPLIT_K
    step_hi = (split + 1) * k_steps // SPLIT_K

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    # Rows of w past N re-read row 0 instead of being masked (the store drops them), so w's
    # loads need only the K mask.
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    w_rows = w_ptr + w_row_offsets(cols, K, stride_wn, W_TILED)[:, None]  # (BLOCK_N, 1)
    if SCALE_A != _PER_BLOCK:
        # w is not the previous kernel's output (weights are written long before): its first
        # step loads before the PDL wait, its latency passing under that kernel's end.
        w_first = _w_step(w_rows, step_lo, step_hi, offs_k, K, stride_wk, BLOCK_K, W_TILED)
    if PDL != 0:
        # Let the next kernel's grid be scheduled now (it waits for this grid to finish before
        # touching memory other than w, as this one does here).
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_A == _PER_BLOCK:
        acc = _block_scaled_steps(x_ptr, w_ptr, scale_a_ptr, scale_b_ptr, acc, offs_m, cols, pid,
                                  step_lo, step_hi, M, K, scale_k_blocks, stride_xm, stride_xk,
                                  stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _steps(x_ptr, w_rows, w_first, acc, offs_m, offs_k, step_lo, step_hi, M, K,
                     stride_xm, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, W_TILED)

    store_split_tile(acc, pid, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n, rows, cols,
                     y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym, stride_yn,
                     stride_bias, HAS_BIAS, SCALE_A, SCALE_B, USE_WORKSPACE, BLOCK_M, BLOCK_N,
                     SPLIT_CHUNK)


def gemm_gemv(
    x: torch.Tensor,  # (M, K), M <= MAX_M
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N)
    block_scales: bool = False,
) -> torch.Tensor:  # (M, N)
    """``y = (x @ w.T) * scale_a * scale_b + bias``, accumulated in fp32, written as ``out_dtype``
    (default ``x.dtype``, bf16 for fp8 inputs); ``config`` defaults to ``default_config``. No
    host synchronisation, so a call can be captured in a CUDA graph."""
    return _checks.validated_launch(
        "gemm_gemv", launch_gemm_gemv, default_config, why_not_fits,
        x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales,
        why_not_block_scaled=why_not_block_scaled)


def gemv_call(x, w, bias, out, scale_a, scale_b, config: GemvConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False, w_tiled: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_gemv`` as data (what a dispatch plan records and replays)."""
    M, K = x.shape
    N = w.shape[0]
    bm = block_m(M)
    tiles = num_tiles(config, N)
    use_workspace = config.split_k > 1
    parts, counters, per_call = workspace(x, out, tiles, bm * config.block_n,
                                          config.split_k, counters, warmup)
    pdl = launch_mode(config.pdl, x.device)  # w as given: never copied here
    args = (x, w, out,
            *epilogue_operands(x, bias, scale_a, scale_b),
            parts, counters,
            M, N, K,
            triton.cdiv(K, SCALE_BLOCK),
            config.split_k,
            *operand_strides(x, w, out, bias))
    constexprs = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, block_scales),
        USE_WORKSPACE=use_workspace,
        BLOCK_M=bm,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_CHUNK=split_chunk(bm, config.block_n, config.num_warps),
        PDL=pdl,
        STAGES=config.num_stages,
        W_TILED=w_tiled)
    return KernelCall(gemm_gemv_kernel, (tiles, config.split_k), args, constexprs,
                      dict(num_warps=config.num_warps, num_stages=1),
                      launch_pdl=pdl != PDL_OFF, replayable=not per_call)


def launch_gemm_gemv(x, w, bias, out, scale_a, scale_b, config: GemvConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False, w_tiled: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans). ``out`` is
    (M, N) with 0 < M <= MAX_M and N > 0. Split launches take their partials and counters as
    ``gemm_splitk``'s do (``_splits.workspace``); ``counters``: the caller's own zeroed ones.
    ``w_tiled``: w is pre-shuffled (the caller checked ``_wlayout.why_not_tiled``)."""
    launch(gemv_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup, block_scales,
                     w_tiled), warmup)
    return out
