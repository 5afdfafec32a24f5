"""Tile GEMM in Triton: ``y = (x @ w.T) * scale_a * scale_b + bias``, one output tile per program.

The family's config space (``TileConfig``, ``fits``, ``default_config``), the ``@triton.jit``
kernel and its launcher ``gemm_tile``. ``x`` is (M, K) and ``w`` is (N, K), both with any strides,
in fp16, bf16, fp32 or per-tensor-scaled float8_e4m3fn; accumulation is always fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._epilogue import (SCALE_BLOCK, block_scaled_dot,
                                               epilogue_constexprs, epilogue_operands,
                                               operand_strides, store_tile)
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._wlayout import w_tile_pointers

KERNEL_PREFIX = "triton.tile"


@dataclass(frozen=True)
class TileConfig(NamedConfig):
    """One point of the tile kernel's config space; ``name`` is how tables and the CLI spell it,
    e.g. ``triton.tile:BM64.BN64.BK32.G8.W4.S3``."""

    NAME_CODEC = NameCodec("tile config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("G", "group_m"), Field("W", "num_warps"), Field("S", "num_stages"),
        Field("PK", "promote_k", default=0)))

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    promote_k: int = 0  # FP8: add the tensor cores' sums into fp32 every promote_k of K (0: never)


def why_not_fits(config: TileConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM on ``dtype`` inputs, or None.

    K takes no part today; it is accepted so every family's predicate has the same signature.
    """
    problem = (_checks.why_not_blocks(config)
               or (f"group_m={config.group_m} must be >= 1" if config.group_m < 1 else None)
               or _checks.why_not_warps_stages(config)
               or _checks.why_not_dot_k(config, dtype)
               or _checks.why_not_promote(config, dtype)
               or _checks.why_not_resources(config, dtype))
    if problem is not None:
        return problem
    programs = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    if programs > _checks.MAX_PROGRAMS:
        return (f"{programs} programs exceed the 1-D grid limit {_checks.MAX_PROGRAMS}; "
                f"use larger blocks")
    return None


def why_not_supported(config: TileConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """Like ``why_not_fits``, also rejecting dtypes the kernel does not take: what a dispatch plan
    checks once per shape so that each later call can go straight to ``launch_gemm_tile``."""
    return _checks.why_not_dtypes(dtype, out_dtype) or why_not_fits(config, M, N, K, dtype)


def fits(config: TileConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    """The one validity predicate of this family, shared by the pruner, heuristic and tables."""
    return why_not_fits(config, M, N, K, dtype) is None


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> TileConfig:
    """A config that always fits and is reasonable without tuning (the fallback on a table miss).

    The launcher trusts it without calling ``fits`` again; the tests check that it fits.
    """
    elem = dtype.itemsize
    if elem == 4:
        # fp32 tiles cost twice the shared memory and dot throughput of 16-bit ones: stay smaller.
        if M <= 16:
            cfg = TileConfig(16, 64, 64, 8, 4, 3)
        elif M <= 64:
            cfg = TileConfig(32 if M <= 32 else 64, 64, 32, 8, 4, 3)
        else:
            cfg = TileConfig(128, 128, 32, 8, 8, 3)
    else:
        # fp8 tiles take half the bytes of 16-bit ones: a deeper K tile for the same traffic.
        bk = 128 if elem == 1 else 64
        # Measured on H100 (bf16, triton 3.6, TFLOP/s): 128x128x64 W4 S3 led from 1000x4096x4096
        # (583; 128x256 W8: 502) up; 64x64 led wherever 128x128 tiles are fewer than the 132 SMs
        # (256x4096x4096: 243 vs 234; 1000x576x7168: 194 vs 167), with BK 128 up to M = 128
        # (128x4096x4096: 166 vs 133 with BK 64).
        if M <= 16:
            # Decode-like: w streaming dominates, so many narrow programs along N and a long K tile.
            cfg = TileConfig(16, 64, 2 * bk, 8, 4, 4)
        elif M <= 32:
            cfg = TileConfig(32, 64, 2 * bk, 8, 4, 4)
        elif M <= 128:
            cfg = TileConfig(64, 64, 2 * bk, 8, 4, 4)
        elif triton.cdiv(M, 128) * triton.cdiv(N, 128) < 128:
            cfg = TileConfig(64, 64, bk, 8, 4, 4)
        else:
            cfg = TileConfig(128, 128, bk, 8, 4, 3)
    return cfg  # tests/test_kernel_gemm_tile.py::test_default_config_fits checks fits()


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile number ``tile`` in grouped order: consecutive tiles walk
    GROUP_M tile rows down one tile column, so the w tile and those GROUP_M x row panels are
    reused from L2 instead of re-read from HBM."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = tile // num_pid_in_group * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def gemm_tile_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K)
    y_ptr,  # (M, N)
    bias_ptr,  # (N,); unused unless HAS_BIAS
    scale_a_ptr,  # (1,) or (M,) fp32, as SCALE_A says
    scale_b_ptr,  # (1,) or (N,) fp32, as SCALE_B says; PER_BLOCK: see block_scaled_dot
    M, N, K,
    scale_k_blocks,  # ceil(K / 128): columns of the block scales (PER_BLOCK only)
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    SCALE_A: tl.constexpr,  # _epilogue.NO_SCALE, PER_TENSOR, PER_VECTOR or PER_BLOCK
    SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # None (Triton's default) or the config's promote_k
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_TILED: tl.constexpr,  # w pre-shuffled (gemmtune.kernels.preshuffle); strides unused
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past the edge re-read column 0 instead of being masked: w's loads then need only
    # the K mask, and the store below drops those lanes. Rows of x past M are masked instead:
    # re-read, every padding row of every program hits the same L2 lines (M = 200 on 4096x4096
    # FP8 ran 22 µs where M = 256 takes 14 µs, H100; split-K showed the same at M = 1).
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # int64 offsets: row * stride reaches 2^31 already at M*K = 2^31 (e.g. 262144 x 8192), and a
    # transposed view has stride_xk = M.
    ks = offs_k.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    # (BK, BN): w.T's tile
    w_ptrs, w_step = w_tile_pointers(w_ptr, ks, cols, K, stride_wk, stride_wn, BLOCK_K, W_TILED)
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K

    # int8 x int8 accumulates exactly in int32; everything else in fp32.
    acc = tl.zeros((BLOCK_M, BLOCK_N),
                   dtype=tl.int32 if x_ptr.dtype.element_ty == tl.int8 else tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if SCALE_A == 3:
            acc = block_scaled_dot(a, b, acc, k, rows, cols, scale_a_ptr, scale_b_ptr,
                                   scale_k_blocks, BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc.dtype,
                         max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        x_ptrs += x_step
        w_ptrs += w_step

    store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
               M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B)


def gemm_tile(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,  # (1,) fp32
    scale_b: torch.Tensor | None = None,  # (1,) fp32
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N)
    block_scales: bool = False,
) -> torch.Tensor:  # (M, N)
    """``y = (x @ w.T) * scale_a * scale_b + bias`` with fp32 accumulation, written as ``out_dtype``.

    ``out_dtype`` defaults to ``x.dtype`` (bf16 for fp8 inputs); ``config`` to ``default_config``.
    No host synchronisation, so a call can be captured in a CUDA graph.
    """
    return _checks.validated_launch(
        "gemm_tile", launch_gemm_tile, default_config, why_not_fits,
        x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales)


def tile_call(x, w, bias, out, scale_a, scale_b, config: TileConfig,
              block_scales: bool = False, w_tiled: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_tile`` as data (what a dispatch plan records and replays)."""
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
    args = (x, w, out,
            *epilogue_operands(x, bias, scale_a, scale_b),
            M, N, K,
            triton.cdiv(K, SCALE_BLOCK),
            *operand_strides(x, w, out, bias))
    constexprs = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, block_scales),
        INPUT_PRECISION=_checks.input_precision(x.dtype),
        MAX_IMPRECISE_ACC=config.promote_k or None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        W_TILED=w_tiled)
    return KernelCall(gemm_tile_kernel, grid, args, constexprs,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages))


def launch_gemm_tile(x, w, bias, out, scale_a, scale_b, config: TileConfig,
                     warmup: bool = False, block_scales: bool = False,
                     w_tiled: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): saves the
    ~5 µs of host checks ``gemm_tile`` does on every call. ``out`` is (M, N) with M, N > 0.
    ``warmup``: compile for these arguments without launching. ``block_scales``:
    ``scale_a``/``scale_b`` are FP8 block scales (see ``block_scaled_dot``). ``w_tiled``: w is
    pre-shuffled (``gemmtune.kernels.preshuffle``; the caller checked ``_wlayout.why_not_tiled``).
    """
    launch(tile_call(x, w, bias, out, scale_a, scale_b, config, block_scales, w_tiled), warmup)
    return out
