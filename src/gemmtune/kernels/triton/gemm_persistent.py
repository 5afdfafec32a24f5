"""Persistent TMA GEMM in Triton: ``y = (x @ w.T) * scale_a * scale_b + bias`` for large M.

One program per SM walks the output tiles (grouped order, as ``gemm_tile``) and loads its x and w
tiles through tensor-memory-accelerator descriptors: the copy engine fetches whole boxes, zero-
filled past the edges, so the K loop has no address arithmetic or masks, and no program waits
for a launch slot. (Only the K loop is pipelined: the tile loop is not flattened, so an epilogue
does not overlap the next tile's loads; ``tl.range(..., flatten=True)`` is what to try on the
GPU.) Same dtypes and scale layouts as ``gemm_tile``
(fp16, bf16, fp32, FP8 and INT8 with per-tensor or per-row/column scales); no FP8 block scales.

TMA asks for 16-byte aligned rows: K * itemsize a multiple of 16 (``why_not_fits``), and a
dense inner dimension (the launcher copies a strided or misaligned operand first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels._names import Field, NameCodec
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._epilogue import (epilogue_constexprs, epilogue_operands,
                                               store_tile)
from gemmtune.kernels.triton.gemm_tile import TileConfig, grouped_tile

KERNEL_PREFIX = "triton.persistent"


@dataclass(frozen=True)
class PersistentConfig(TileConfig):
    """The tile kernel's fields under this family's prefix, e.g.
    ``triton.persistent:BM128.BN128.BK64.G8.W8.S3``."""

    NAME_CODEC = NameCodec("persistent config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("G", "group_m"), Field("W", "num_warps"), Field("S", "num_stages"),
        Field("PK", "promote_k", default=0)))


def why_not_fits(config: PersistentConfig, M: int, N: int, K: int,
                 dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM on ``dtype`` inputs, or None."""
    problem = (_checks.why_not_blocks(config)
               or (f"group_m={config.group_m} must be >= 1" if config.group_m < 1 else None)
               or _checks.why_not_warps_stages(config)
               or _checks.why_not_dot_k(config, dtype)
               or _checks.why_not_promote(config, dtype)
               or _checks.why_not_resources(config, dtype))
    if problem is not None:
        return problem
    if K * dtype.itemsize % _checks.TMA_ALIGN:
        return (f"K={K} rows of {dtype} are {K * dtype.itemsize} B, not a multiple of "
                f"{_checks.TMA_ALIGN} B as TMA needs; use triton.tile")
    return None


def why_not_supported(config: PersistentConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    return _checks.why_not_dtypes(dtype, out_dtype) or why_not_fits(config, M, N, K, dtype)


def fits(config: PersistentConfig, M: int, N: int, K: int, dtype: torch.dtype) -> bool:
    return why_not_fits(config, M, N, K, dtype) is None


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> PersistentConfig:
    """A config that fits every K that TMA takes (the tests check it)."""
    bk = 128 if dtype.itemsize == 1 else (32 if dtype.itemsize == 4 else 64)
    return PersistentConfig(128, 128, bk, 8, 8, 3)


@triton.jit
def gemm_persistent_kernel(
    x_desc,  # TMA descriptor of x (M, K), box (BLOCK_M, BLOCK_K)
    w_desc,  # TMA descriptor of w (N, K), box (BLOCK_N, BLOCK_K)
    y_ptr,  # (M, N)
    bias_ptr,  # (N,); unused unless HAS_BIAS
    scale_a_ptr,  # (1,) or (M,) fp32, as SCALE_A says
    scale_b_ptr,  # (1,) or (N,) fp32, as SCALE_B says
    M, N, K,
    num_programs,
    stride_ym, stride_yn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    SCALE_A: tl.constexpr,  # _epilogue.NO_SCALE, PER_TENSOR or PER_VECTOR
    SCALE_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # None (Triton's default) or the config's promote_k
    ACC_INT32: tl.constexpr,  # int8 x int8 accumulates exactly in int32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if ACC_INT32 else tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION, out_dtype=acc.dtype,
                         max_num_imprecise_acc=MAX_IMPRECISE_ACC)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                   M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS, SCALE_A, SCALE_B)


def gemm_persistent(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,  # (1,) or (M,) fp32
    scale_b: torch.Tensor | None = None,  # (1,) or (N,) fp32
    config: PersistentConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N)
    block_scales: bool = False,
) -> torch.Tensor:  # (M, N)
    """``y = (x @ w.T) * scale_a * scale_b + bias`` with fp32 (int32 for INT8) accumulation,
    written as ``out_dtype``; validates everything, then launches."""
    if block_scales:
        raise ValueError("gemm_persistent: FP8 block scales are not supported; use "
                         "triton.tile or triton.splitk")
    return _checks.validated_launch(
        "gemm_persistent", launch_gemm_persistent, _fitting_default, why_not_fits,
        x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales)


def _fitting_default(M: int, N: int, K: int, dtype: torch.dtype) -> PersistentConfig:
    """The default config, or ValueError where no config fits (K rows TMA cannot describe)."""
    config = default_config(M, N, K, dtype)
    problem = why_not_fits(config, M, N, K, dtype)
    if problem is not None:
        raise ValueError(f"gemm_persistent: {problem}")
    return config


def persistent_call(x, w, bias, out, scale_a, scale_b, config: PersistentConfig,
                    block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_persistent`` as data (what a dispatch plan records and
    replays), for K > 0. x and w go in as host TMA descriptors; a replay rebuilds them around
    a later call's tensors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if block_scales:
        raise ValueError("gemm_persistent: FP8 block scales are not supported")
    M, K = x.shape
    N = w.shape[0]
    x, w = _checks.tma_ready(x), _checks.tma_ready(w)
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [config.block_n, config.block_k])
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    programs = min(tiles, _checks.device_sms(x.device.index) if x.is_cuda else 4)
    args = (x_desc, w_desc, out,
            *epilogue_operands(x, bias, scale_a, scale_b),
            M, N, K,
            programs,
            out.stride(0), out.stride(1),
            bias.stride(0) if bias is not None else 0)
    constexprs = dict(
        **epilogue_constexprs(bias, scale_a, scale_b, False),
        INPUT_PRECISION=_checks.input_precision(x.dtype),
        MAX_IMPRECISE_ACC=config.promote_k or None,
        ACC_INT32=x.dtype == torch.int8,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m)
    return KernelCall(gemm_persistent_kernel, (programs,), args, constexprs,
                      dict(num_warps=config.num_warps, num_stages=config.num_stages))


def launch_gemm_persistent(x, w, bias, out, scale_a, scale_b, config: PersistentConfig,
                           warmup: bool = False, block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans). ``out`` is
    (M, N) with M, N > 0. ``warmup``: compile for these arguments without launching."""
    if block_scales:
        raise ValueError("gemm_persistent: FP8 block scales are not supported")
    M, K = x.shape
    N = w.shape[0]
    if K == 0:  # an empty sum: TMA cannot describe a zero-width tensor, and nothing compiles
        if not warmup:
            out.copy_((bias if bias is not None else torch.zeros((), device=out.device))
                      .to(out.dtype).expand(M, N))
        return out
    launch(persistent_call(x, w, bias, out, scale_a, scale_b, config), warmup)
    return out
