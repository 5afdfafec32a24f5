"""GEMV GEMM in Triton for decode (M <= 16): ``y = (x @ w.T) * scale_a * scale_b + bias`` on
the CUDA cores, streaming w at the speed of memory.

At M = 1 a GEMM only has to read w once; what decides its time is how many bytes of w are in
flight. Tensor-core tiles need 16 rows of x and a w tile of 16+ columns per program, which
leaves narrow weights with too few programs to keep HBM busy. Here a program takes BLOCK_N rows
of w (1-64) and a slice of K, loads BLOCK_K contiguous elements of each row per step (16-byte
vectors, 1-8 KiB per row), multiplies them by the same K of each of x's M rows in fp32 and sums
them per row. Many small programs (8-32 per SM) keep the weight stream wide; the CUDA cores have
FLOPs to spare up to M of ~8 (2 FLOPs per 2-byte element per row of x).

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
from gemmtune.kernels.triton._epilogue import SCALE_BLOCK, scale_modes, store_tile
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (MAX_SPLIT_K, PDL_OFF, PDL_WAIT, pdl_supported,
                                             split_chunk, sum_splits_and_store, workspace)

KERNEL_PREFIX = "triton.gemv"
# Rows of x one launch takes: all of them live in one program's registers, and the CUDA cores'
# FLOPs (2 per w element per row) outgrow the weight stream past a few rows.
MAX_M = 16
MAX_BLOCK_N = 64
MIN_BLOCK_K, MAX_BLOCK_K = 16, 8192
INT8_REFUSED = ("int8 inputs are not supported by the GEMV kernel (its products are summed in "
                "fp32, not exactly in int32); use a tile or split-K kernel")
# The products of one step, kept per row of x until the end: BLOCK_M * BLOCK_N * BLOCK_K /
# (32 * num_warps) fp32 registers per thread, at most this.
MAX_ACC_REGS_PER_THREAD = 128


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
    num_stages: int
    pdl: int = PDL_OFF  # PDL_OFF or PDL_WAIT


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def block_m(M: int) -> int:
    """Rows of x one program takes (all of them): the next power of 2."""
    return _next_pow2(max(1, M))


def num_tiles(config: GemvConfig, N: int) -> int:
    """Row blocks of w, i.e. programs per split, and the tile counters a split launch needs."""
    return triton.cdiv(N, config.block_n)


def acc_registers(config: GemvConfig, M: int) -> int:
    """fp32 registers per thread that the running products of M rows of x take."""
    return block_m(M) * config.block_n * config.block_k // (32 * config.num_warps)


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
    if c.pdl not in (PDL_OFF, PDL_WAIT):
        return f"pdl={c.pdl} must be {PDL_OFF} (off) or {PDL_WAIT} (wait)"
    if acc_registers(c, M) > MAX_ACC_REGS_PER_THREAD:
        return (f"the running products of {block_m(M)} rows of x by block_n x block_k = "
                f"{c.block_n} x {c.block_k} of w take {acc_registers(c, M)} fp32 registers per "
                f"thread (> {MAX_ACC_REGS_PER_THREAD}); use smaller blocks or more warps")
    k_steps = triton.cdiv(K, c.block_k)
    if c.split_k > max(1, k_steps):
        return (f"split_k={c.split_k} leaves splits without a block_k step: K={K} is "
                f"{k_steps} steps of block_k={c.block_k}; use split_k <= {max(1, k_steps)}")
    if dtype == torch.int8:
        return INT8_REFUSED
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
    return None


def fits(config: GemvConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


# Bytes of each w row per step: 1-2 KiB won every preset shape in the probe (16-byte vectors,
# so at 4 warps a thread holds 2-4 of them per row); 512 B leaves room for more rows of x.
_ROW_STEP_BYTES = (512, 1024, 2048)
_BLOCK_N = (1, 2, 4, 8, 16)
# 4 warps (the probe's), 8 where the running products would take more than half of 4 warps'
# registers.
_WARPS = (4, 8)
_WIDE_REGS = MAX_ACC_REGS_PER_THREAD // 2
# At most this many configs per shape: the widest steps first.
_MAX_CANDIDATES = 24
# Programs per SM the split aims at: the probe's best readers used 8-32 per SM.
_PROGRAMS_PER_SM = (8, 32)


def _split_for(tiles: int, k_steps: int, programs: int) -> int:
    """The split that brings tiles x split nearest above ``programs``, within the K steps."""
    return max(1, min(MAX_SPLIT_K, k_steps, triton.cdiv(programs, tiles)))


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF, block_scales: bool = False) -> list[GemvConfig]:
    """The pruned search space for one shape (at most 20 configs): rows per program ``_BLOCK_N``; steps of ``_ROW_STEP_BYTES`` per row (at least 128 elements with
    block scales, and no more than K needs); 4 warps, or 8 for wide steps; K split to reach
    each of ``_PROGRAMS_PER_SM``. Every config gets ``pdl``. Empty for M > MAX_M."""
    if M > MAX_M:
        return []
    num_sms = num_sms or _checks.sm_count()
    found = {}
    for bn in _BLOCK_N:
        tiles = triton.cdiv(N, bn)
        for row_bytes in sorted(_ROW_STEP_BYTES, reverse=True):
            bk = min(row_bytes // dtype.itemsize, max(MIN_BLOCK_K, _next_pow2(K)))
            if block_scales:
                bk = max(bk, SCALE_BLOCK)
            k_steps = triton.cdiv(K, bk)
            warps = next((w for w in _WARPS if block_m(M) * bn * bk // (32 * w) <= _WIDE_REGS),
                         _WARPS[-1])
            for per_sm in _PROGRAMS_PER_SM:
                split = _split_for(tiles, k_steps, per_sm * num_sms)
                cfg = GemvConfig(bn, bk, split, warps, 1, pdl)
                if fits(cfg, M, N, K, dtype) and not (
                        block_scales and why_not_block_scaled(cfg, dtype)):
                    found[cfg] = None
    return list(found)[:_MAX_CANDIDATES]


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> GemvConfig:
    """A config that fits any M <= MAX_M and is reasonable untuned: 4 rows of w per program
    (1 from M = 8 on), 2 KiB of each row per step or less where M rows' products would take
    more than half of 4 warps' registers (128-multiples, as block scales need), 4 warps, K split
    until there are 8 programs per SM. The launcher checks it; the tests check that it fits."""
    num_sms = num_sms or _checks.sm_count()
    bn = 4 if M < 8 else 1
    bk = max(SCALE_BLOCK, min(2048 // dtype.itemsize, _next_pow2(K)))
    while bk > SCALE_BLOCK and block_m(M) * bn * bk // (32 * 4) > _WIDE_REGS:
        bk //= 2
    split = _split_for(triton.cdiv(N, bn), triton.cdiv(K, bk), 8 * num_sms)
    return GemvConfig(bn, bk, split, 4, 1)


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
    w_rows = w_ptr + cols[:, None] * stride_wn  # (BLOCK_N, 1)
    if PDL != 0:
        # Let the next kernel's grid be scheduled now (it waits for this grid to finish before
        # touching memory, as this one does here).
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    # Without block scales the products are only added up, per row of x and column of w, and
    # reduced over K once at the end: no reduction across threads inside the loop.
    products = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rows[:, None] * stride_xm  # (BLOCK_M, 1)
    for step in range(step_lo, step_hi):
        ks = tl.cast(step, tl.int64) * BLOCK_K + offs_k
        k_in = ks < K
        w = tl.load(w_rows + ks[None, :] * stride_wk, mask=k_in[None, :], other=0.0)
        # Rows of x past M read nothing (zeros).
        x = tl.load(x_rows + ks[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & k_in[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if SCALE_A == 3:
            # Each 128 of K summed, then scaled by its blocks' scales: x's (BLOCK_M, blocks),
            # w's (BLOCK_N, blocks).
            kbs = step * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)
            kb_in = kbs < scale_k_blocks
            sa = tl.load(scale_a_ptr + rows[:, None] * scale_k_blocks + kbs[None, :],
                         mask=(offs_m[:, None] < M) & kb_in[None, :], other=0.0)
            sb = tl.load(scale_b_ptr + (cols // 128)[:, None] * scale_k_blocks + kbs[None, :],
                         mask=kb_in[None, :], other=0.0)
            per_block = tl.sum(tl.reshape(prod, (BLOCK_M, BLOCK_N, BLOCK_K // 128, 128)), axis=3)
            acc += tl.sum(per_block * sa[:, None, :] * sb[None, :, :], axis=2)
        else:
            products += prod
    if SCALE_A != 3:
        acc = tl.sum(products, axis=2)

    if USE_WORKSPACE:
        sum_splits_and_store(acc, pid, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n, rows,
                             cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym,
                             stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B, BLOCK_M, BLOCK_N,
                             SPLIT_CHUNK)
    else:
        store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                   M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B)


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
        "gemm_gemv", launch_gemm_gemv, _default_for_launch, why_not_fits,
        x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales,
        why_not_block_scaled=why_not_block_scaled)


def _default_for_launch(M: int, N: int, K: int, dtype: torch.dtype) -> GemvConfig:
    """``default_config``, checked, since the launcher trusts it: it fits every shape but those
    no config takes (M > MAX_M, int8 inputs), which are refused here, after the arguments."""
    config = default_config(M, N, K, dtype)
    problem = why_not_fits(config, M, N, K, dtype)
    if problem is not None:
        raise ValueError(f"gemm_gemv: {problem}")
    return config


def gemv_call(x, w, bias, out, scale_a, scale_b, config: GemvConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_gemv`` as data (what a dispatch plan records and replays)."""
    M, K = x.shape
    N = w.shape[0]
    bm = block_m(M)
    tiles = num_tiles(config, N)
    use_workspace = config.split_k > 1
    if use_workspace:
        parts, counters, per_call = workspace(x, tiles, bm * config.block_n,
                                              config.split_k, counters, warmup)
    else:
        parts = counters = out  # never read: USE_WORKSPACE is False
        per_call = False
    pdl = config.pdl if pdl_supported(x.device) else PDL_OFF
    modes = scale_modes(scale_a, scale_b, block_scales)
    args = (x, w, out,
            bias if bias is not None else x,
            scale_a if scale_a is not None else x,
            scale_b if scale_b is not None else x,
            parts, counters,
            M, N, K,
            triton.cdiv(K, SCALE_BLOCK),
            config.split_k,
            x.stride(0), x.stride(1),
            w.stride(0), w.stride(1),
            out.stride(0), out.stride(1),
            bias.stride(0) if bias is not None else 0)
    constexprs = dict(
        HAS_BIAS=bias is not None,
        SCALE_A=modes[0],
        SCALE_B=modes[1],
        USE_WORKSPACE=use_workspace,
        BLOCK_M=bm,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_CHUNK=split_chunk(bm, config.block_n, config.num_warps),
        PDL=pdl)
    return KernelCall(gemm_gemv_kernel, (tiles, config.split_k), args, constexprs,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages),
                      launch_pdl=pdl != PDL_OFF, replayable=not per_call)


def launch_gemm_gemv(x, w, bias, out, scale_a, scale_b, config: GemvConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans). ``out`` is
    (M, N) with 0 < M <= MAX_M and N > 0. Split launches take their partials and counters as
    ``gemm_splitk``'s do (``_splits.workspace``); ``counters``: the caller's own zeroed ones."""
    launch(gemv_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup, block_scales),
           warmup)
    return out
