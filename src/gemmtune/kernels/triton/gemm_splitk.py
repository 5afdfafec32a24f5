"""Split-K GEMM in Triton for small M (decode): ``y = (x @ w.T) * scale_a * scale_b + bias``.

A decode GEMM (M <= 64) is bound by reading w once, and one program per output tile leaves HBM
idle: 576x7168 has 9 tiles of 64 columns for 132 SMs. Here K is split as well, over a second grid
axis, so tiles x split_k programs stream w. Each program writes its fp32 partial tile to a
workspace and counts itself in on the tile's counter; the one that arrives last sums the partials
in split order (the result does not depend on arrival order: bitwise deterministic), applies
scales and bias, writes the output and resets the counter. One launch; split_k == 1 needs no
workspace and writes directly.

Measured on H100 SXM (benchmarks/splitk_sweep.py; bf16, graph replay, cold w; 9 decode (N, K) x
M 1-64): the best candidate per shape reached 0.58 of the roofline floor (geomean; 0.60 without
the counter memset) where torch reached 0.64. With one split it ran at 0.85-1.06x torch's speed;
where K was split, at 0.74-0.97x (1.03x at 4096x14336, M = 1): the split's tail (store,
release, counter atomic, loads of the partials) is a chain of dependent L2 round trips after the
last K step. Even one launch sits >= 3.2 µs above the floor (8192x1024, torch alike), which is
what caps efficiency on the smallest shapes (576x7168: floor 2.7 µs).

The family's config space (``SplitKConfig``, ``fits``, ``candidates``, ``default_config``), the
``@triton.jit`` kernel and its launchers ``gemm_splitk`` (validates) and ``launch_gemm_splitk``
(launches only). Operands as in ``gemm_tile``: ``x`` (M, K) and ``w`` (N, K) with any strides, in
fp16, bf16, fp32 or per-tensor-scaled float8_e4m3fn; accumulation is always fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import (SCALE_BLOCK, block_scaled_dot, block_scaled_dot_t,
                                               epilogue_constexprs, epilogue_operands,
                                               operand_strides)
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (MAX_SPLIT_K, PDL_OFF, PDL_PREFETCH, PDL_WAIT,
                                             launch_mode, split_chunk, store_split_tile,
                                             workspace)
from gemmtune.kernels.triton._wlayout import w_tile_pointers

KERNEL_PREFIX = "triton.splitk"

# The w bytes one launch may prefetch into L2 (H100: 50 MiB): more would evict its own prefetched
# lines, or the previous kernel's working set, before they are read.
PREFETCH_BUDGET_BYTES = 16 * 2**20


@dataclass(frozen=True)
class SplitKConfig(NamedConfig):
    """One point of the split-K kernel's config space; ``name`` is how tables and the CLI
    spell it, e.g. ``triton.splitk:BM16.BN64.BK256.SK8.W4.S3``."""

    NAME_CODEC = NameCodec("split-K config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("SK", "split_k"), Field("W", "num_warps"), Field("S", "num_stages"),
        Field("P", "pdl", default=PDL_OFF), Field("PK", "promote_k", default=0),
        Field("SW", "swap_ab", default=0)))

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    pdl: int = PDL_OFF  # PDL_OFF, PDL_WAIT or PDL_PREFETCH (see launch_gemm_splitk)
    promote_k: int = 0  # FP8: add the tensor cores' sums into fp32 every promote_k of K (0: never)
    # 1: the dot computes y.T = w @ x.T, w's block_n rows as the MMA's M (64+: Hopper's
    # warpgroup MMA, fed from shared memory by the pipeline) and x's few rows as its N
    swap_ab: int = 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def num_tiles(config: SplitKConfig, M: int, N: int) -> int:
    """Output tiles, i.e. programs per split, and the int32 tile counters a launch needs."""
    return triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)


def why_not_fits(config: SplitKConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM on ``dtype`` inputs, or None."""
    problem = _checks.why_not_blocks(config)
    if problem is not None:
        return problem
    if not 1 <= config.split_k <= MAX_SPLIT_K:
        return f"split_k={config.split_k} must be in [1, {MAX_SPLIT_K}]"
    problem = _checks.why_not_warps_stages(config)
    if problem is not None:
        return problem
    if config.swap_ab not in (0, 1):
        return f"swap_ab={config.swap_ab} must be 0 or 1"
    if config.pdl not in (PDL_OFF, PDL_WAIT, PDL_PREFETCH):
        return (f"pdl={config.pdl} must be {PDL_OFF} (off), {PDL_WAIT} (wait) or "
                f"{PDL_PREFETCH} (prefetch w, then wait)")
    # Each split must get at least one full BLOCK_K step: split_k * block_k <= K rounded up to
    # block_k. Splits beyond that would only add programs that write zero partials.
    k_steps = triton.cdiv(K, config.block_k)
    if config.split_k > max(1, k_steps):
        return (f"split_k={config.split_k} leaves splits without a block_k step: K={K} is "
                f"{k_steps} steps of block_k={config.block_k}; use split_k <= {max(1, k_steps)}")
    problem = (_checks.why_not_dot_k(config, dtype) or _checks.why_not_promote(config, dtype)
               or _checks.why_not_resources(config, dtype))
    if problem is not None:
        return problem
    programs = num_tiles(config, M, N)
    if programs > _checks.MAX_PROGRAMS:
        return f"{programs} tiles exceed the grid limit {_checks.MAX_PROGRAMS}; use larger blocks"
    return None


def why_not_supported(config: SplitKConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """Like ``why_not_fits``, also rejecting dtypes the kernel does not take: what a dispatch plan
    checks once per shape so that each later call can go straight to ``launch_gemm_splitk``."""
    return _checks.why_not_dtypes(dtype, out_dtype) or why_not_fits(config, M, N, K, dtype)


def fits(config: SplitKConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    """The one validity predicate of this family, shared by the pruner, heuristic and tables."""
    return why_not_fits(config, M, N, K, dtype) is None


_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def _block_m_choices(M: int) -> tuple[int, ...]:
    # One M tile up to M = 64, so w is read once; above, 64-row tiles (the M tiles of one w tile
    # run side by side, so w comes from HBM once and from L2 after).
    return (min(64, max(16, _next_pow2(M))),)


def _splits_around_one_wave(tiles: int, k_steps: int, num_sms: int) -> tuple[int, ...]:
    """The split that first gives a full wave of programs and the next one up: fewer leaves SMs
    without a stream of w, more only adds partials (each program then has fewer K steps)."""
    allowed = [s for s in _SPLITS if s <= max(1, k_steps)]
    first = next((i for i, s in enumerate(allowed) if tiles * s >= num_sms), len(allowed) - 1)
    return tuple(allowed[first:first + 2])


# Each thread moves 8 to 16 16-byte vectors of the w tile per stage: fewer leave warps idle
# waiting on a long dependent load chain, more cost registers (ptxas for sm_90: BM64.BN128 at 2
# warps needs 255 registers). And 16 to 64 KiB of w in flight per program (stages - 1 tiles):
# HBM latency x bandwidth / SMs is ~25 KiB per SM.
_VECTORS_PER_THREAD = (8, 16)
_W_IN_FLIGHT_BYTES = (16 * 1024, 64 * 1024)
# Rows of at least 256 B of K per tile: on H100 (bf16) BK 64 won none of 36 decode shapes.
_MIN_ROW_BYTES = 256
# The sweep's winners sat at the narrow, few-warp edge of BN {32, 64, 128} x warps {2, 4, 8}
# (BN 32 and 2 warps in 30 of 36): BN 16 and 1 warp extend the space past that edge.
_BLOCK_N = (16, 32, 64, 128)
_WARPS = (1, 2, 4, 8)


def candidates(M: int, N: int, K: int, dtype: torch.dtype,
               num_sms: int | None = None, pdl: int = PDL_OFF,
               block_ks: tuple[int, ...] | None = None) -> list[SplitKConfig]:
    """The pruned search space for tuning one shape: a few dozen to ~150 configs, all fitting.

    Pruning, each rule a reason: block_m covers M in one tile up to 64 (``_block_m_choices``);
    split_k reaches one to two waves of programs (``_splits_around_one_wave``); num_warps and
    num_stages keep ``_VECTORS_PER_THREAD`` and ``_W_IN_FLIGHT_BYTES``; a pipeline no deeper than
    the K steps of one split; ``_MIN_ROW_BYTES``. Every config gets ``pdl``. ``block_ks``
    replaces the block_k choices and the row-bytes rule (block scales need block_k | 128).
    ``num_sms``: the SMs to fill (default: the current GPU's, ``_checks.sm_count``).
    """
    num_sms = num_sms or _checks.sm_count()
    elem = dtype.itemsize
    found = []
    for bm in _block_m_choices(M):
        for bn in _BLOCK_N:
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
            for bk in block_ks or (64, 128, 256):
                if bk * elem < _MIN_ROW_BYTES and block_ks is None:
                    continue
                k_steps = triton.cdiv(K, bk)
                w_tile = bn * bk * elem
                warps_ok = [wp for wp in _WARPS if _VECTORS_PER_THREAD[0]
                            <= w_tile // (16 * 32 * wp) <= _VECTORS_PER_THREAD[1]]
                for sk in _splits_around_one_wave(tiles, k_steps, num_sms):
                    steps = max(1, k_steps // sk)
                    stages_ok = [st for st in (2, 3, 4, 5) if st - 1 <= steps and
                                 _W_IN_FLIGHT_BYTES[0] <= (st - 1) * w_tile
                                 <= _W_IN_FLIGHT_BYTES[1]]
                    for warps in warps_ok:
                        for stages in stages_ok:
                            cfg = SplitKConfig(bm, bn, bk, sk, warps, stages, pdl)
                            if fits(cfg, M, N, K, dtype):
                                found.append(cfg)
    if not found:
        found.append(dataclasses.replace(default_config(M, N, K, dtype, num_sms), pdl=pdl))
    return found


# Hopper's FP8 warpgroup MMAs accumulate with reduced precision. Over 2048 or more of K per split
# a split-K config's error with fp32 output is 10-30x cuBLAS's (1.3-4.1e-3 against 1.3e-4) and
# 1.3-2.6x with bf16 output; promoting into fp32 every 128 of K matches cuBLAS and costs this
# kernel 2-5% (docs/benchmarks.md, session 18). Tuners run such configs beside their promoted
# twin. (The tile kernel's promotion cost 20% there: its configs have no twin.)
PROMOTE_FROM_K = 2048
PROMOTE_EVERY = 128


def promoted(config: SplitKConfig) -> SplitKConfig:
    """``config`` promoting into fp32 every min(block_k, PROMOTE_EVERY) of K."""
    return dataclasses.replace(config, promote_k=min(config.block_k, PROMOTE_EVERY))


def promoted_twin(config: SplitKConfig, K: int, dtype: torch.dtype) -> SplitKConfig | None:
    """``promoted(config)`` where ``config`` is an FP8 wgmma dot that sums at least
    PROMOTE_FROM_K of K per split without promotion; else None."""
    if dtype != torch.float8_e4m3fn or config.promote_k or K // config.split_k < PROMOTE_FROM_K:
        return None
    twin = promoted(config)
    return twin if _checks.why_not_promote(twin, dtype) is None else None


# The swapped dot's w tile is the MMA's M: 64 or 128 rows for one warpgroup (4 warps).
_SWAP_BLOCK_N = (64, 128)
_SWAP_BLOCK_K = (128, 256)


def swapped_candidates(M: int, N: int, K: int, dtype: torch.dtype,
                       num_sms: int | None = None, pdl: int = PDL_OFF,
                       block_ks: tuple[int, ...] | None = None) -> list[SplitKConfig]:
    """Configs with ``swap_ab``, for M <= 64 (x's rows as the MMA's N): block_m covers M;
    ``_SWAP_BLOCK_N`` rows of w per tile for one warpgroup; ``_SWAP_BLOCK_K`` (or ``block_ks``)
    per step; splits and stages as ``candidates`` picks them."""
    if M > 64:
        return []
    num_sms = num_sms or _checks.sm_count()
    bm = _block_m_choices(M)[0]
    found = []
    for bn in _SWAP_BLOCK_N:
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        for bk in block_ks or _SWAP_BLOCK_K:
            k_steps = triton.cdiv(K, bk)
            w_tile = bn * bk * dtype.itemsize
            for sk in _splits_around_one_wave(tiles, k_steps, num_sms):
                steps = max(1, k_steps // sk)
                for stages in (3, 4, 5):
                    if stages - 1 > steps or not (
                            _W_IN_FLIGHT_BYTES[0] <= (stages - 1) * w_tile
                            <= _W_IN_FLIGHT_BYTES[1]):
                        continue
                    cfg = SplitKConfig(bm, bn, bk, sk, 4, stages, pdl, swap_ab=1)
                    if fits(cfg, M, N, K, dtype):
                        found.append(cfg)
    return found


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> SplitKConfig:
    """A config that always fits and is reasonable without tuning (the fallback on a table miss).

    Read off benchmarks/splitk_sweep.py on H100 SXM (bf16, triton 3.6, CUDA-graph replay, cold
    w; 9 decode (N, K) x M 1/16/32/64, every candidate timed): the fastest had 32 columns and 2
    warps in 30 of 36; rows of 256 B of K (BK 128 for bf16) with 4-5 stages at M <= 16 and
    M = 64, rows of 512 B with 3 stages at M = 32 (8 of 9); and the split that first gives a full
    wave of programs, or the next. The earlier default (BN 64, 4-8 warps, two waves of programs)
    reached 0.43 of the roofline floor (geomean) where the fastest candidates reached 0.58.
    The launcher trusts it without calling ``fits`` again; the tests check that it fits.
    ``num_sms``: the SMs to fill (default: the current GPU's, ``_checks.sm_count``).
    """
    num_sms = num_sms or _checks.sm_count()
    elem = dtype.itemsize
    bm = min(64, max(16, _next_pow2(M)))
    row_bytes, stages = (512, 3) if 16 < M <= 32 else (256, 5 if M <= 16 else 4)
    bk = min(_checks.MAX_BLOCK, row_bytes // elem)
    # Above M = 64 this is gemm_tile's territory; wider tiles keep the tile count sane.
    bn, warps = (32, 2) if M <= 64 else (64, 4)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = _splits_around_one_wave(tiles, triton.cdiv(K, bk), num_sms)[0]
    cfg = SplitKConfig(bm, bn, bk, split, warps, stages)
    while why_not_fits(cfg, M, N, K, dtype) is not None and cfg.num_stages > 1:
        cfg = SplitKConfig(bm, bn, bk, split, warps, cfg.num_stages - 1)
    return cfg  # tests/test_kernel_gemm_splitk.py::test_default_config_fits checks fits()


@triton.jit
def _prefetch_rows_to_l2(row_ptrs, nbytes):
    """One bulk L2 prefetch per row (sm_90 ``cp.async.bulk.prefetch.L2``): ``row_ptrs`` 16-byte
    aligned, ``nbytes`` a multiple of 16; lanes with ``nbytes == 0`` issue nothing. A hint only:
    L2 is the GPU's point of coherence, so it can never make a later load see stale data."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [row_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


# M and SPLIT_K are not specialised (M == 1, SPLIT_K % 16 == 0 would each double the compiled
# variants the tuner pays for, to save a compare per program).
@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemm_splitk_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K)
    y_ptr,  # (M, N)
    bias_ptr,  # (N,); unused unless HAS_BIAS
    scale_a_ptr,  # (1,) or (M,) fp32, as SCALE_A says
    scale_b_ptr,  # (1,) or (N,) fp32, as SCALE_B says; PER_BLOCK: see block_scaled_dot
    part_ptr,  # (tiles, SPLIT_K, BLOCK_M, BLOCK_N) fp32 partials; unused unless USE_WORKSPACE
    count_ptr,  # (tiles,) int32, zero on entry and left zero; unused unless USE_WORKSPACE
    M, N, K,
    scale_k_blocks,  # ceil(K / 128): columns of the block scales (PER_BLOCK only)
    SPLIT_K,
    prefetch_row_bytes,  # w bytes per row of the slice to prefetch; used when PDL == 2
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    SCALE_A: tl.constexpr,  # _epilogue.NO_SCALE, PER_TENSOR, PER_VECTOR or PER_BLOCK
    SCALE_B: tl.constexpr,
    USE_WORKSPACE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # None (Triton's default) or the config's promote_k
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    W_ELEM_BYTES: tl.constexpr,
    SWAP_AB: tl.constexpr,
    W_TILED: tl.constexpr,  # w pre-shuffled (gemmtune.kernels.preshuffle); strides unused
):
    # Axis 0: output tiles, M fastest, so the M tiles that share a w tile run side by side and
    # all but the first read it from L2. Axis 1: the split of K.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    # Balanced split of the K steps: split s takes steps [s*n/S, (s+1)*n/S), which differ in
    # length by at most one and are never empty while SPLIT_K <= n (what fits() asks).
    k_steps = tl.cdiv(K, BLOCK_K)
    step_lo = split * k_steps // SPLIT_K
    step_hi = (split + 1) * k_steps // SPLIT_K

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past the edge re-read column 0 instead of being masked (as in gemm_tile): w's
    # loads then need only the K mask, and the stores drop those lanes. Rows of x past M are
    # masked instead: re-reading row 0 made M = 1 run 1.27x slower than M = 16 with the same
    # config (FP8 6144x4096 on H100, benchmarks/small_m.py: 16.6 vs 13.1 µs at M = 1 with the
    # mask), every padding row of every program asking for the same L2 lines.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # int64 offsets: row * stride reaches 2^31 at M*K = 2^31, and a transposed view has
    # stride_xk = M.
    ks = (step_lo * BLOCK_K).to(tl.int64) + offs_k.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    # (BK, BN): w.T's tile
    w_ptrs, w_step = w_tile_pointers(w_ptr, ks, cols, K, stride_wk, stride_wn, BLOCK_K, W_TILED)
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K

    if PDL == 2:  # never with W_TILED (_wlayout.why_not_tiled): the rows are not contiguous
        # The rows of this program's w slice, from its first K step: one thread per row.
        slice_bytes = (tl.minimum(step_hi * BLOCK_K, K) - step_lo * BLOCK_K) * W_ELEM_BYTES
        nbytes = tl.minimum(slice_bytes, prefetch_row_bytes) // 16 * 16
        row_ptrs = w_ptr + cols * stride_wn + (step_lo * BLOCK_K).to(tl.int64)
        _prefetch_rows_to_l2(row_ptrs, tl.where(offs_n < N, nbytes, 0))
    if PDL != 0:
        # Let the next kernel's grid be scheduled now (it waits for this grid to finish before
        # touching memory, as this one does below): its launch and w stream overlap this tail.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    # int8 x int8 accumulates exactly in int32; everything else in fp32.
    acc_dtype = tl.int32 if x_ptr.dtype.element_ty == tl.int8 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_dtype)  # SWAP_AB's y.T tile
    for step in range(step_lo, step_hi):
        k_left = K - step * BLOCK_K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SWAP_AB:
            # Both operands stay K-contiguous (what FP8 warpgroup MMAs need) after the
            # transposes, which only change how the tiles are read from shared memory.
            if SCALE_A == 3:
                acc_t = block_scaled_dot_t(tl.trans(b), tl.trans(a), acc_t, step, rows, cols,
                                           scale_a_ptr, scale_b_ptr, scale_k_blocks, BLOCK_K)
            else:
                acc_t = tl.dot(tl.trans(b), tl.trans(a), acc_t, input_precision=INPUT_PRECISION,
                               out_dtype=acc_dtype, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        elif SCALE_A == 3:
            acc = block_scaled_dot(a, b, acc, step, rows, cols, scale_a_ptr, scale_b_ptr,
                                   scale_k_blocks, BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc_dtype,
                         max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        x_ptrs += x_step
        w_ptrs += w_step
    if SWAP_AB:
        acc = tl.trans(acc_t)

    store_split_tile(acc, pid, split, SPLIT_K, part_ptr, count_ptr, offs_m, offs_n, rows, cols,
                     y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym, stride_yn,
                     stride_bias, HAS_BIAS, SCALE_A, SCALE_B, USE_WORKSPACE, BLOCK_M, BLOCK_N,
                     SPLIT_CHUNK)


def gemm_splitk(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,  # (1,) fp32
    scale_b: torch.Tensor | None = None,  # (1,) fp32
    config: SplitKConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N)
    block_scales: bool = False,
) -> torch.Tensor:  # (M, N)
    """``y = (x @ w.T) * scale_a * scale_b + bias``, accumulated in fp32, written as ``out_dtype``.

    ``out_dtype`` defaults to ``x.dtype`` (bf16 for fp8 inputs); ``config`` to ``default_config``.
    No host synchronisation, so a call can be captured in a CUDA graph.
    """
    return _checks.validated_launch(
        "gemm_splitk", launch_gemm_splitk, default_config, why_not_fits,
        x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales)


def prefetch_row_bytes(w: torch.Tensor, split_k: int) -> int:
    """The most bytes of one w row's slice (its K range in one split) to prefetch: the equal
    share of ``PREFETCH_BUDGET_BYTES`` over rows and splits, so every slice is prefetched whole
    while all of w fits the budget (the kernel caps it at the slice); 0 where the bulk
    prefetch's 16-byte alignment does not hold (rows not contiguous, or not 16-byte aligned)."""
    elem = w.element_size()
    if w.stride(1) != 1 or (w.stride(0) * elem) % 16 or w.data_ptr() % 16:
        return 0
    share = PREFETCH_BUDGET_BYTES // max(1, w.shape[0] * split_k)
    return min(share, w.shape[1] * elem) // 16 * 16


def splitk_call(x, w, bias, out, scale_a, scale_b, config: SplitKConfig,
                counters: torch.Tensor | None = None, warmup: bool = False,
                block_scales: bool = False, w_tiled: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_splitk`` as data (what a dispatch plan records and replays),
    its split-K workspace made as that function's docstring says."""
    M, K = x.shape
    N = w.shape[0]
    tiles = num_tiles(config, M, N)
    use_workspace = config.split_k > 1
    parts, counters, per_call = workspace(x, out, tiles, config.block_m * config.block_n,
                                          config.split_k, counters, warmup)
    pdl = launch_mode(config.pdl, x.device)  # before its wait, only an L2 prefetch of w
    args = (x, w, out,
            *epilogue_operands(x, bias, scale_a, scale_b),
            parts, counters,
            M, N, K,
            triton.cdiv(K, SCALE_BLOCK),
            config.split_k,
            prefetch_row_bytes(w, config.split_k) if pdl == PDL_PREFETCH else 0,
            *operand_strides(x, w, out, bias))
    constexprs = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, block_scales),
        USE_WORKSPACE=use_workspace,
        INPUT_PRECISION=_checks.input_precision(x.dtype),
        MAX_IMPRECISE_ACC=config.promote_k or None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_CHUNK=split_chunk(config.block_m, config.block_n, config.num_warps),
        PDL=pdl,
        W_ELEM_BYTES=w.element_size(),
        SWAP_AB=bool(config.swap_ab),
        W_TILED=w_tiled)
    return KernelCall(gemm_splitk_kernel, (tiles, config.split_k), args, constexprs,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages),
                      launch_pdl=pdl != PDL_OFF, replayable=not per_call)


def launch_gemm_splitk(x, w, bias, out, scale_a, scale_b, config: SplitKConfig,
                       counters: torch.Tensor | None = None, warmup: bool = False,
                       block_scales: bool = False, w_tiled: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans). ``out`` is
    (M, N) with M, N > 0.

    With split_k > 1 it takes the fp32 partials from ``stream_partials`` and tile counters from
    ``counters``, else from ``stream_counters`` (both kept per stream; the counters zero at
    rest: each launch leaves them zero). Zeroing counters per call instead cost a memset of
    0.8-1.8 µs per call under graph replay on H100 (benchmarks/splitk_sweep.py) and would break
    a PDL chain.
    ``counters``: an int32 tensor of at least ``num_tiles(config, M, N)`` zeros on x's device,
    never used by two launches at once (one stream at a time).
    ``warmup``: compile for these arguments without launching (and without the memset).
    ``block_scales``: ``scale_a``/``scale_b`` are FP8 block scales (see ``block_scaled_dot``).
    ``w_tiled``: w is pre-shuffled (``gemmtune.kernels.preshuffle``; the caller checked
    ``_wlayout.why_not_tiled``).
    """
    launch(splitk_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup,
                       block_scales, w_tiled), warmup)
    return out
