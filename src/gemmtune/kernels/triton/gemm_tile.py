"""Tile GEMM in Triton: ``y = (x @ w.T) * scale_a * scale_b + bias``, one output tile per program.

The family's config space (``TileConfig``, ``fits``, ``default_config``), the ``@triton.jit``
kernel and its launcher ``gemm_tile``. ``x`` is (M, K) and ``w`` is (N, K), both with any strides,
in fp16, bf16, fp32 or per-tensor-scaled float8_e4m3fn; accumulation is always fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KERNEL_PREFIX = "triton.tile"

# Hopper (sm_90) allows 227 KiB of shared memory per block; the largest of the GPUs we tune for.
SMEM_LIMIT_BYTES = 227 * 1024
# The fp32 accumulator lives in registers: BM*BN/(32*num_warps) of them per thread. A thread has at
# most 255, and the operand fragments and addresses need the rest; above 128 ptxas starts spilling.
MAX_ACC_REGS_PER_THREAD = 128
# The kernel's program id is an int32 on a 1-D grid.
MAX_PROGRAMS = 2**31 - 1

_VALID_WARPS = (1, 2, 4, 8)
_MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16
_MAX_BLOCK = 256
_MAX_STAGES = 8

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn,)

_NAME_FORMAT = f"{KERNEL_PREFIX}:BM<int>.BN<int>.BK<int>.G<int>.W<int>.S<int>"
_NAME_FIELDS = (("BM", "block_m"), ("BN", "block_n"), ("BK", "block_k"), ("G", "group_m"),
                ("W", "num_warps"), ("S", "num_stages"))


@dataclass(frozen=True)
class TileConfig:
    """One point of the tile kernel's config space; ``name`` is how tables and the CLI spell it."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return (f"{KERNEL_PREFIX}:BM{self.block_m}.BN{self.block_n}.BK{self.block_k}"
                f".G{self.group_m}.W{self.num_warps}.S{self.num_stages}")

    @classmethod
    def from_name(cls, name: str) -> "TileConfig":
        """Parse ``name`` (e.g. ``triton.tile:BM64.BN64.BK32.G8.W4.S3``) back into a config."""
        prefix, sep, body = name.partition(":")
        if not sep or prefix != KERNEL_PREFIX:
            raise ValueError(f"tile config {name!r}: prefix {prefix!r} is not {KERNEL_PREFIX!r}; "
                             f"expected {_NAME_FORMAT}")
        parts = body.split(".")
        if len(parts) != len(_NAME_FIELDS):
            raise ValueError(f"tile config {name!r}: has {len(parts)} dot-separated fields, "
                             f"expected {len(_NAME_FIELDS)}: {_NAME_FORMAT}")
        values = {}
        for part, (tag, field) in zip(parts, _NAME_FIELDS):
            match = re.fullmatch(rf"{tag}([0-9]+)", part)
            if match is None:
                raise ValueError(f"tile config {name!r}: bad field {part!r}, expected {tag}<int>; "
                                 f"expected {_NAME_FORMAT}")
            values[field] = int(match.group(1))
        return cls(**values)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def smem_bytes(config: TileConfig, dtype: torch.dtype) -> int:
    """Shared memory the software pipeline holds: ``num_stages`` copies of one x and one w tile."""
    return config.num_stages * (config.block_m * config.block_k
                                + config.block_k * config.block_n) * dtype.itemsize


def why_not_fits(config: TileConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM on ``dtype`` inputs, or None.

    K takes no part today; it is accepted so every family's predicate has the same signature.
    """
    for field in ("block_m", "block_n", "block_k"):
        v = getattr(config, field)
        if not _is_pow2(v) or not _MIN_BLOCK <= v <= _MAX_BLOCK:
            return f"{field}={v} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}]"
    if config.group_m < 1:
        return f"group_m={config.group_m} must be >= 1"
    if config.num_warps not in _VALID_WARPS:
        return f"num_warps={config.num_warps} must be one of {_VALID_WARPS}"
    if not 1 <= config.num_stages <= _MAX_STAGES:
        return f"num_stages={config.num_stages} must be in [1, {_MAX_STAGES}]"
    acc_regs = config.block_m * config.block_n // (32 * config.num_warps)
    if acc_regs > MAX_ACC_REGS_PER_THREAD:
        return (f"accumulator needs {acc_regs} registers per thread (> {MAX_ACC_REGS_PER_THREAD}); "
                f"use smaller blocks or more warps")
    smem = smem_bytes(config, dtype)
    if smem > SMEM_LIMIT_BYTES:
        return (f"shared memory {smem} B > {SMEM_LIMIT_BYTES} B; "
                f"reduce block sizes or num_stages")
    programs = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    if programs > MAX_PROGRAMS:
        return f"{programs} programs exceed the 1-D grid limit {MAX_PROGRAMS}; use larger blocks"
    return None


def why_not_supported(config: TileConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """Like ``why_not_fits``, also rejecting dtypes the kernel does not take: what a dispatch plan
    checks once per shape so that each later call can go straight to ``launch_gemm_tile``."""
    if dtype not in _INPUT_DTYPES:
        return f"input dtype {dtype} is not one of {[str(d) for d in _INPUT_DTYPES]}"
    if out_dtype not in _OUT_DTYPES:
        return f"output dtype {out_dtype} is not one of {[str(d) for d in _OUT_DTYPES]}"
    return why_not_fits(config, M, N, K, dtype)


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
def gemm_tile_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K)
    y_ptr,  # (M, N)
    bias_ptr,  # (N,); unused unless HAS_BIAS
    scale_a_ptr,  # (1,) fp32; unused unless HAS_SCALES
    scale_b_ptr,  # (1,) fp32; unused unless HAS_SCALES
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: consecutive programs walk GROUP_M tile rows down one tile column, so the
    # w tile and those GROUP_M x row panels are reused from L2 instead of re-read from HBM.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge re-read row/column 0 instead of being masked: the loads in the
    # K loop then need only the K mask, and the store below drops those lanes.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    # int64 offsets: row * stride reaches 2^31 already at M*K = 2^31 (e.g. 262144 x 8192), and a
    # transposed view has stride_xk = M.
    ks = offs_k.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # (BM, BK)
    w_ptrs = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn  # (BK, BN): w.T's tile
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr, which has no .to().
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K
    w_step = tl.cast(stride_wk, tl.int64) * BLOCK_K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += x_step
        w_ptrs += w_step

    if HAS_SCALES:
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias).to(tl.float32)
        acc = acc + bias[None, :]

    y_ptrs = (y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n.to(tl.int64)[None, :] * stride_yn)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Under TRITON_INTERPRET=1 triton.jit returns an InterpretedFunction, which runs on CPU tensors.
_INTERPRETED = not isinstance(gemm_tile_kernel, triton.runtime.JITFunction)


def _check_scale(name: str, s: torch.Tensor, device: torch.device) -> None:
    if s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
        raise ValueError(f"{name}: expected a one-element float32 tensor on {device}, got "
                         f"shape {tuple(s.shape)} {s.dtype} on {s.device}; "
                         f"pass e.g. torch.tensor([s], dtype=torch.float32, device={str(device)!r})")


def gemm_tile(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,  # (1,) fp32
    scale_b: torch.Tensor | None = None,  # (1,) fp32
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,  # (M, N)
) -> torch.Tensor:  # (M, N)
    """``y = (x @ w.T) * scale_a * scale_b + bias`` with fp32 accumulation, written as ``out_dtype``.

    ``out_dtype`` defaults to ``x.dtype`` (bf16 for fp8 inputs); ``config`` to ``default_config``.
    No host synchronisation, so a call can be captured in a CUDA graph.
    """
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemm_tile: expected x (M, K) and w (N, K), got x {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}; reshape batched inputs to 2-D first")
    M, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"gemm_tile: x is (M={M}, K={K}) but w is (N={N}, K={Kw}); "
                         f"w must be (N, K) (pass w, not w.T)")
    if x.dtype != w.dtype or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"gemm_tile: x {x.dtype} and w {w.dtype} must share one dtype of "
                        f"{[str(d) for d in _INPUT_DTYPES]}")
    if w.device != x.device:
        raise ValueError(f"gemm_tile: x is on {x.device} but w is on {w.device}; "
                         f"move both to one device")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"gemm_tile: tensors on {x.device} need TRITON_INTERPRET=1, set before "
                         f"gemmtune's triton kernels are imported; or move them to a CUDA device")
    if (scale_a is None) != (scale_b is None):
        raise ValueError("gemm_tile: pass both scale_a and scale_b or neither")
    has_scales = scale_a is not None
    if has_scales:
        _check_scale("scale_a", scale_a, x.device)
        _check_scale("scale_b", scale_b, x.device)
    elif x.dtype in _FP8_DTYPES:
        raise ValueError(f"gemm_tile: {x.dtype} inputs need per-tensor scale_a and scale_b; "
                         f"pass torch.ones(1, device=...) for unscaled values")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if x.dtype in _FP8_DTYPES else x.dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"gemm_tile: out_dtype {out_dtype} not supported; "
                        f"use one of {[str(d) for d in _OUT_DTYPES]}")
    if bias is not None:
        if bias.shape != (N,) or not bias.is_floating_point() or bias.device != x.device:
            raise ValueError(f"gemm_tile: bias must be a float (N={N},) tensor on {x.device}, got "
                             f"shape {tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or out.device != x.device:
        raise ValueError(f"gemm_tile: out must be ({M}, {N}) {out_dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if config is None:
        config = default_config(M, N, K, x.dtype)
    else:
        problem = why_not_fits(config, M, N, K, x.dtype)
        if problem is not None:
            raise ValueError(f"gemm_tile: {config.name} does not fit (M={M}, N={N}, K={K}, "
                             f"{x.dtype}): {problem}")
    if M == 0 or N == 0:
        return out
    return launch_gemm_tile(x, w, bias, out, scale_a, scale_b, config)


def launch_gemm_tile(x, w, bias, out, scale_a, scale_b, config: TileConfig) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): saves the
    ~5 µs of host checks ``gemm_tile`` does on every call. ``out`` is (M, N) with M, N > 0."""
    M, K = x.shape
    N = w.shape[0]
    has_scales = scale_a is not None
    # fp32 operands: tf32 only where torch itself would use it, so results match torch.mm.
    # 16-bit and fp8 operands ignore the setting; "tf32" is Triton's default for them.
    if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        precision = "ieee"
    else:
        precision = "tf32"
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
    gemm_tile_kernel[grid](
        x, w, out,
        bias if bias is not None else x,
        scale_a if has_scales else x,
        scale_b if has_scales else x,
        M, N, K,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None,
        HAS_SCALES=has_scales,
        INPUT_PRECISION=precision,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
