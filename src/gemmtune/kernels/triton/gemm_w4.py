"""MXFP4 weights with bf16/fp16 activations in Triton: ``y = x @ dequant(wq, w_scale).T + bias``.

The weight stays 4-bit in memory (``gemmtune.kernels.mxfp4``: two E2M1 elements per byte, one
E8M0 scale per 32 along K) and is decoded in registers, a (BLOCK_N, 32) block at a time, to x's
dtype without its scale (exact: E2M1 values are 0-6 with one mantissa bit), multiplied with x
on the tensor cores into fp32, and scaled there by the block's power of two (exact, for any
scale byte, where dequantising to fp16 would overflow or lose bits). x is read as it is. One
program per (BLOCK_M, BLOCK_N) tile of y and split of K (SPLIT_K; the splits' fp32 partials
summed in split order by the last to finish, as the split-K kernel's:
``_splits.store_split_tile``), BLOCK_K / 32 blocks a step; output in x's dtype.

``gemm_a16w4`` dispatches to it (``triton.w4:...`` rows): as every kernel module's, a launch
takes ``(x, w, bias, out, scale_a, scale_b, config)``, here w the packed codes and scale_b
their scales (scale_a None). Not yet timed on a GPU with its split of K or tuned (untuned and
unsplit: 0.45-0.60x bf16 ``F.linear``, docs/benchmarks.md, session 22).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels import mxfp4
from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._mxfp4_calls import scaled_launcher, validated_launch
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (MAX_SPLIT_K, split_chunk, split_for,
                                             store_split_tile, workspace)

KERNEL_PREFIX = "triton.w4"
_BLOCK = tl.constexpr(mxfp4.BLOCK)  # elements per scale
_X_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES_OF_MXFP4_X = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class W4Config(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.w4:BM16.BN64.BK128.W4.S3``."""

    NAME_CODEC = NameCodec("MXFP4-weight config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("W", "num_warps"), Field("S", "num_stages"), Field("SK", "split_k", default=1),
        Field("DS", "dot_scaled", default=0)))

    block_m: int
    block_n: int
    block_k: int  # elements of K per step: a multiple of the 32-element scale block
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs along K per tile (decode: enough programs to stream the weight)
    # 1: each step is one ``tl.dot_scaled`` (Triton's own E2M1 upcast to bf16, scales applied in
    # bf16: exact); 0: one dot per 32-element block, its scale applied in fp32 after it
    dot_scaled: int = 0


def why_not_fits(config: W4Config, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM with ``dtype`` x, or None."""
    c = config
    if dtype not in _X_DTYPES and dtype != torch.uint8:
        return (f"x of {dtype}: the MXFP4-weight kernel takes bf16 or fp16 activations, or "
                f"MXFP4 ones (uint8 codes)")
    for name, value in (("block_m", c.block_m), ("block_n", c.block_n), ("block_k", c.block_k)):
        if value < 16 or value & (value - 1):
            return f"{name}={value} must be a power of two >= 16 (tl.dot's smallest block)"
    if c.block_k % mxfp4.BLOCK:
        return f"block_k={c.block_k} must be a multiple of the MXFP4 block ({mxfp4.BLOCK})"
    why = mxfp4.why_not_quantisable(K)
    if why is not None:
        return why
    if c.dot_scaled not in (0, 1):
        return f"dot_scaled={c.dot_scaled} must be 0 or 1"
    if c.dot_scaled and dtype == torch.float16:
        return ("dot_scaled=1 takes bf16 or MXFP4 x: tl.dot_scaled multiplies in bf16, which "
                "would round fp16 x; use a dot_scaled=0 config")
    if c.num_warps not in (1, 2, 4, 8) or not 1 <= c.num_stages <= 5:
        return f"num_warps={c.num_warps} (1, 2, 4 or 8) and num_stages={c.num_stages} (1-5)"
    k_steps = max(1, triton.cdiv(K, c.block_k))  # K = 0: one program writes the bias
    if not 1 <= c.split_k <= min(MAX_SPLIT_K, k_steps):
        return (f"split_k={c.split_k} must be in [1, {min(MAX_SPLIT_K, k_steps)}]: K={K} is "
                f"{k_steps} steps of block_k={c.block_k}")
    return None


def why_not_supported(config: W4Config, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, and the output: in x's dtype, or with MXFP4 x (``dtype`` uint8, its
    storage) bf16, fp16 or fp32."""
    if dtype == torch.uint8:
        if out_dtype not in _OUT_DTYPES_OF_MXFP4_X:
            return f"with MXFP4 x the kernel writes bf16, fp16 or fp32, not {out_dtype}"
    elif out_dtype != dtype:
        return f"the MXFP4-weight kernel writes x's dtype ({dtype}), not {out_dtype}"
    return why_not_fits(config, M, N, K, dtype)


# Programs per SM the splits of K aim at, for decode (M <= DECODE_M)
_PROGRAMS_PER_SM = (1, 4)
DECODE_M = 64


def candidates(M: int, N: int, K: int, dtype: torch.dtype,
               num_sms: int | None = None) -> list[W4Config]:
    """The configs to tune one shape with: x's rows in the smallest block that takes M
    (16-128), 64 or 128 rows of w, 128 or 256 of K a step, 4 warps (8 for 128 x 128 tiles), 3
    stages; for decode (M <= DECODE_M) also K split to reach each of ``_PROGRAMS_PER_SM``.
    Each step through ``tl.dot_scaled`` (DS1) for bf16 and MXFP4 x, per scale block (DS0) for
    fp16 x: on the H100 DS1 took 0.25-0.55 of DS0's time at every shape timed
    (docs/benchmarks.md, session 23). Only configs that fit."""
    bm = min(128, max(16, triton.next_power_of_2(M)))
    num_sms = num_sms or _checks.sm_count()
    dot_scaled = int(dtype != torch.float16)
    found = {}
    for bn in (64, 128):
        for bk in (128, 256):
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
            k_steps = triton.cdiv(K, bk)
            splits = {1} | ({split_for(tiles, k_steps, per_sm * num_sms)
                             for per_sm in _PROGRAMS_PER_SM} if M <= DECODE_M else set())
            warps = 8 if bm * bn > 64 * 128 else 4
            for split in sorted(splits):
                found[W4Config(bm, bn, bk, warps, 3, split, dot_scaled)] = None
    return [c for c in found if why_not_fits(c, M, N, K, dtype) is None]


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> W4Config:
    """Reasonable untuned: 16-64 rows of x, 64 of w, 128 of K per step (64 bytes of w per row)."""
    return W4Config(min(64, max(16, triton.next_power_of_2(M))), 64, 128, 4, 3)


@triton.jit
def e2m1(code):
    """fp32 value of 4-bit E2M1 codes (int32 0-15): bit 3 the sign, bits 1-2 the exponent,
    bit 0 the mantissa; exponent 0 is subnormal (0 or 0.5)."""
    magnitude = code & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    # 2^(e-1) * (1 + m/2) = 2^(e-1) * (2 + m) / 2, in integers: exact.
    normal = ((1 << tl.maximum(exponent - 1, 0)) * (2 + mantissa)).to(tl.float32) * 0.5
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where(code >= 8, -value, value)


@triton.jit
def e8m0(byte):
    """fp32 2^(byte - 127) of E8M0 scale bytes (int32): 0 is 2^-127, 255 NaN."""
    power = (byte << 23).to(tl.float32, bitcast=True)
    power = tl.where(byte == 0, 5.877471754111438e-39, power)
    return tl.where(byte == 255, float("nan"), power)


@triton.jit
def _codes_block(wq_ptr, rows, kb, N, K, stride_wn, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
    """The E2M1 values (unscaled) of w's rows ``rows`` over the 32 elements of K block ``kb``,
    (BLOCK_N, 32) in ``DTYPE`` (exact: each is 0-6 with one mantissa bit); the bytes' low
    nibbles are the even elements, the high ones the odd. Past N or K: zeros."""
    pairs = kb * (_BLOCK // 2) + tl.arange(0, _BLOCK // 2)
    packed = tl.load(wq_ptr + rows[:, None].to(tl.int64) * stride_wn + pairs[None, :],
                     mask=(rows < N)[:, None] & (pairs < K // 2)[None, :], other=0).to(tl.int32)
    values = tl.join(e2m1(packed & 15), e2m1(packed >> 4))
    return tl.reshape(values, (BLOCK_N, _BLOCK)).to(DTYPE)


@triton.jit
def _scales_block(s_ptr, rows, kb, R, K, stride):
    """fp32 scales of ``rows`` (of R) at K block ``kb``; past R or K: 2^-127, never read."""
    blocks = kb + tl.zeros_like(rows)  # as a vector: a scalar mask is not
    return e8m0(tl.load(s_ptr + rows.to(tl.int64) * stride + blocks,
                         mask=(rows < R) & (blocks < K // _BLOCK), other=0).to(tl.int32))


@triton.jit
def _codes_step(ptr, rows, step, R, K, stride, BLOCK_K: tl.constexpr):
    """Packed code bytes of ``rows`` (of R) over K step ``step``, (rows, BLOCK_K // 2) uint8 as
    ``tl.dot_scaled`` takes E2M1 (the lower-index element in the low nibble); past R or K: 0."""
    pairs = step * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + pairs[None, :],
                   mask=(rows < R)[:, None] & (pairs < K // 2)[None, :], other=0)


@triton.jit
def _scales_step(ptr, rows, step, R, K, stride, BLOCK_K: tl.constexpr):
    """E8M0 scale bytes of ``rows`` (of R) over K step ``step``, (rows, BLOCK_K // 32); past R
    or K: 0, where every code is 0 too."""
    blocks = step * (BLOCK_K // _BLOCK) + tl.arange(0, BLOCK_K // _BLOCK)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + blocks[None, :],
                   mask=(rows < R)[:, None] & (blocks < K // _BLOCK)[None, :], other=0)


@triton.jit
def _dot_scaled_step(acc, x_ptr, wq_ptr, ws_ptr, xs_ptr, rows_x, rows_w, step, M, N, K,
                     stride_xm, stride_wn, stride_sn, stride_xsm, BLOCK_K: tl.constexpr,
                     X_MXFP4: tl.constexpr):
    """``acc`` plus one K step's product through ``tl.dot_scaled``: Triton decodes the codes to
    bf16 and applies their scales there (exact, but for products below 2^-126 (scale bytes
    0-2), which the GPU flushes to zero, and infinite weights (bytes 253-254, which no finite
    weight quantises to), which meet x's zeros as NaN), then multiplies on the tensor cores
    into fp32 (at 16 rows of x, Triton itself makes w the MMA's left operand)."""
    w = _codes_step(wq_ptr, rows_w, step, N, K, stride_wn, BLOCK_K)
    w_scale = _scales_step(ws_ptr, rows_w, step, N, K, stride_sn, BLOCK_K)
    if X_MXFP4:
        x = _codes_step(x_ptr, rows_x, step, M, K, stride_xm, BLOCK_K)
        x_scale = _scales_step(xs_ptr, rows_x, step, M, K, stride_xsm, BLOCK_K)
        acc = tl.dot_scaled(x, x_scale, "e2m1", tl.trans(w), w_scale, "e2m1", acc)
    else:
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_x[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(rows_x < M)[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot_scaled(x, None, "bf16", tl.trans(w), w_scale, "e2m1", acc)
    return acc


@triton.jit
def _block_step(acc, x_ptr, wq_ptr, ws_ptr, xs_ptr, rows_x, rows_w, kb, M, N, K, stride_xm,
                stride_wn, stride_sn, stride_xsm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                X_MXFP4: tl.constexpr):
    """``acc`` plus one 32-element scale block's product: its codes times x on the tensor cores
    (exact products, fp32 sums), then its scale in fp32. Dequantising to x's dtype first would
    overflow or lose bits in fp16 beyond scales of 2^(+-13) or so."""
    scale = _scales_block(ws_ptr, rows_w, kb, N, K, stride_sn)
    if X_MXFP4:
        x = _codes_block(x_ptr, rows_x, kb, M, K, stride_xm, BLOCK_M, tl.float16)
        codes = _codes_block(wq_ptr, rows_w, kb, N, K, stride_wn, BLOCK_N, tl.float16)
        x_scale = _scales_block(xs_ptr, rows_x, kb, M, K, stride_xsm)
        # The two scales' product first (2^(a + b - 254), exact while that is an fp32
        # number): one huge and one tiny scale must not overflow on the way.
        acc += tl.dot(x, tl.trans(codes)) * (x_scale[:, None] * scale[None, :])
    else:
        k = kb * _BLOCK + tl.arange(0, _BLOCK)
        x = tl.load(x_ptr + rows_x[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(rows_x < M)[:, None] & (k < K)[None, :], other=0.0)
        codes = _codes_block(wq_ptr, rows_w, kb, N, K, stride_wn, BLOCK_N,
                             x_ptr.dtype.element_ty)
        acc += tl.dot(x, tl.trans(codes)) * scale[None, :]
    return acc


@triton.jit
def gemm_w4_kernel(x_ptr, wq_ptr, ws_ptr, xs_ptr, bias_ptr, y_ptr,
                   part_ptr, count_ptr,  # the splits' partials and counters (SPLIT_K > 1 only)
                   M, N, K, stride_xm, stride_wn, stride_sn, stride_xsm, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                   X_MXFP4: tl.constexpr, DOT_SCALED: tl.constexpr):
    """X_MXFP4: x is MXFP4 too (its codes at x_ptr, (M, K // 2) bytes, its scales at xs_ptr):
    both blocks' codes multiplied in fp16 (exact: products of E2M1 values and their sums of 32
    are), then scaled by the product of both scales in fp32 (exact while the scale bytes' sum
    is 105-381; beyond, the product under- or overflows fp32 where the true value nearly
    does); or, DOT_SCALED, both decoded and scaled in bf16 by ``tl.dot_scaled``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows_x = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_w = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in range(split * k_steps // SPLIT_K, (split + 1) * k_steps // SPLIT_K):
        if DOT_SCALED:
            acc = _dot_scaled_step(acc, x_ptr, wq_ptr, ws_ptr, xs_ptr, rows_x, rows_w, step, M,
                                   N, K, stride_xm, stride_wn, stride_sn, stride_xsm, BLOCK_K,
                                   X_MXFP4)
        else:
            for b in tl.static_range(BLOCK_K // _BLOCK):
                acc = _block_step(acc, x_ptr, wq_ptr, ws_ptr, xs_ptr, rows_x, rows_w,
                                  step * (BLOCK_K // _BLOCK) + b, M, N, K, stride_xm, stride_wn,
                                  stride_sn, stride_xsm, BLOCK_M, BLOCK_N, X_MXFP4)
    # The bias, the output's dtype and (split) the splits' sum: the split-K kernels' end, with
    # no scales (0: NO_SCALE).
    rows = tl.where(rows_x < M, rows_x, 0)
    cols = tl.where(rows_w < N, rows_w, 0)
    store_split_tile(acc, pid_m * tl.num_programs(1) + pid_n, split, SPLIT_K, part_ptr,
                     count_ptr, rows_x, rows_w, rows, cols, y_ptr, bias_ptr, x_ptr, x_ptr, M, N,
                     stride_ym, 1, 1, HAS_BIAS, 0, 0, SPLIT_K > 1, BLOCK_M, BLOCK_N,
                     SPLIT_CHUNK)


def w4_call(x, w, bias, out, scale_a, scale_b, config: W4Config,
            counters: torch.Tensor | None = None, warmup: bool = False,
            block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_w4`` as data (what a dispatch plan records and replays): x
    (M, K), w the packed codes (N, K // 2), scale_b their scales (N, K // 32), out (M, N); with
    scale_a, x is MXFP4 too: its codes (M, K // 2) and scale_a theirs (M, K // 32). Split
    launches take their partials and counters as the split-K kernel's (``_splits.workspace``)."""
    x_mxfp4 = scale_a is not None
    M, K = x.shape[0], x.shape[1] * (2 if x_mxfp4 else 1)
    N = w.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    scale_b = scale_b if scale_b.stride(1) == 1 else scale_b.contiguous()
    if x_mxfp4 and scale_a.stride(1) != 1:
        scale_a = scale_a.contiguous()
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    c = config
    m_tiles, n_tiles = triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n)
    parts, counters, per_call = workspace(x, out, m_tiles * n_tiles, c.block_m * c.block_n,
                                          c.split_k, counters, warmup)
    args = (x, w, scale_b, scale_a if x_mxfp4 else x, bias if bias is not None else x, out,
            parts, counters, M, N, K, x.stride(0), w.stride(0), scale_b.stride(0),
            scale_a.stride(0) if x_mxfp4 else 0, out.stride(0))
    constexprs = dict(HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                      BLOCK_K=c.block_k, SPLIT_K=c.split_k,
                      SPLIT_CHUNK=split_chunk(c.block_m, c.block_n, c.num_warps),
                      X_MXFP4=x_mxfp4, DOT_SCALED=bool(c.dot_scaled))
    return KernelCall(gemm_w4_kernel, (m_tiles, n_tiles, c.split_k), args, constexprs,
                      dict(num_warps=c.num_warps, num_stages=c.num_stages),
                      replayable=not per_call)


def launch_gemm_w4(x, w, bias, out, scale_a, scale_b, config: W4Config,
                   counters: torch.Tensor | None = None, warmup: bool = False,
                   block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0, its column stride 1."""
    launch(w4_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup), warmup)
    return out


def gemm_w4(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None = None, config: W4Config | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in x's dtype: x (M, K) bf16 or fp16, wq
    (N, K // 2) and w_scale (N, K // 32) uint8 as ``gemmtune.quant.mxfp4`` makes them, bias
    (N,). Validates everything, then launches."""
    return validated_launch("gemm_w4", launch_gemm_w4, default_config, why_not_supported, x, wq,
                            w_scale, bias, config, out)


# Called as every kernel module's validating launcher is (dispatchable)
gemm_w4_scaled = scaled_launcher("gemm_w4", gemm_w4)
