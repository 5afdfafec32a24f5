"""MXFP4-weight GEMMs for many rows of x (prefill): ``y = x @ dequant(wq, w_scale).T + bias``
as a Triton kernel that dequantises the weight into a bf16 / fp16 copy, then cuBLAS
(``torch.mm``) on that copy; with MXFP4 x too (``gemm_a4w4_blockscale``), x is dequantised to
bf16 the same way first.

From M of about a thousand a GEMM is bound by the tensor cores, where cuBLAS is at its best and
a kernel that decodes the codes in its main loop pays for the decode on every tile of x's rows.
Dequantising once per call reads the 4.25-bit weight and writes a 16-bit one (2.5 bytes an
element: about 14 µs for 4096 x 4096 at 3 TB/s) and leaves the rest to cuBLAS; the copy is the
price, and it shrinks against the GEMM as M grows. The copy is only that cheap if it is bound
by bandwidth: decoded in Triton it takes about 27 instructions an element, more issue than
the bytes' time, so bf16 copies on a GPU are also offered through the register-decoding
kernels' PTX (``asm``: under 9 instructions an element).

The dequantised values are exact in bf16 (an E2M1 value times a power of two has two
significant bits, within bf16's range); in fp16 a weight past 65504 becomes inf and tiny ones
round, as any fp16 copy of the weight would (the torch backend's too). Weights as
``gemmtune.quant.mxfp4`` makes them or, ``packed``, as ``prepack_mxfp4`` reorders them. The bias
is added by cuBLAS where it has x's dtype, else to the product (already rounded to x's dtype) in
fp32 and rounded again, as the torch backend adds it.

MXFP4 x (its codes (M, K // 2) and scales (M, K // 32), as quantised): both operands exact in
bf16, multiplied by cuBLAS into bf16, or into fp32 then rounded to fp16 or kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gemmtune.kernels import mxfp4
from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._e2m1_ptx import e2m1_scaled_bf16, e2m1_tables, placed_scaled_bf16
from gemmtune.kernels.triton._mxfp4_calls import scaled_launcher, validated_launch
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._swapped import runs_here, why_not_here
from gemmtune.kernels.triton.gemm_w4 import e2m1, e8m0

KERNEL_PREFIX = "triton.w4deq"
_X_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES_OF_MXFP4_X = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = tl.constexpr(mxfp4.BLOCK)
_PLACES = tl.constexpr(mxfp4.PLACES)  # as the jitted code reads them
# x's rows from which the tuner offers it: below, the decode kernels move several times fewer
# bytes (the 4.25-bit weight once, against its 16-bit copy written and read again).
MIN_M = 64
MAX_BLOCK_ELEMENTS = 16384


@dataclass(frozen=True)
class W4DeqConfig(NamedConfig):
    """One point of the config space, e.g. ``triton.w4deq:BN32.BK256.W4`` (the dequantising
    kernel's blocks; cuBLAS picks its own for the GEMM)."""

    NAME_CODEC = NameCodec("MXFP4 dequantise-then-cuBLAS config", KERNEL_PREFIX, (
        Field("BN", "block_n"), Field("BK", "block_k"), Field("W", "num_warps"),
        Field("L", "packed", default=0), Field("A", "asm", default=0)))

    block_n: int
    block_k: int  # elements of K a program dequantises per row
    num_warps: int
    packed: int = 0  # 1: w in the packed layout (mxfp4.prepack)
    # 1: a bf16 copy decoded by the inline PTX of the register-decoding kernels (a code word to
    # 16 bytes of output in one store; compiled only, not in the interpreter); 0: in Triton
    asm: int = 0


def why_not_fits(config: W4DeqConfig, M: int, N: int, K: int,
                 dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM with ``dtype`` x, or None."""
    c = config
    if dtype not in _X_DTYPES and dtype != torch.uint8:
        return (f"x of {dtype}: the dequantise-then-cuBLAS kernel takes bf16 or fp16 x (the "
                f"weight is dequantised to x's dtype) or MXFP4 x (uint8 codes)")
    for name, value in (("block_n", c.block_n), ("block_k", c.block_k)):
        if value < 1 or value & (value - 1):
            return f"{name}={value} must be a power of two"
    if c.block_k < mxfp4.BLOCK:
        return f"block_k={c.block_k} must take whole scale blocks (>= {mxfp4.BLOCK})"
    if c.block_n * c.block_k > MAX_BLOCK_ELEMENTS:
        return (f"block_n x block_k = {c.block_n * c.block_k} elements a program; at most "
                f"{MAX_BLOCK_ELEMENTS} (its values live in registers)")
    if c.num_warps not in (1, 2, 4, 8):
        return f"num_warps={c.num_warps} must be 1, 2, 4 or 8"
    if c.packed not in (0, 1):
        return f"packed={c.packed} must be 0 (w as quantised) or 1 (w packed: mxfp4.prepack)"
    if c.asm not in (0, 1):
        return f"asm={c.asm} must be 0 (decode in Triton) or 1 (by inline PTX, bf16 only)"
    if c.asm and dtype == torch.float16:
        return "asm=1 decodes to bf16; fp16 x takes asm=0"
    if c.asm and c.packed and c.block_k % mxfp4.PACK_GROUP:
        return (f"block_k={c.block_k}: asm=1 reads a packed w in whole groups of "
                f"{mxfp4.PACK_GROUP} of K; use block_k 128 or more")
    return mxfp4.why_not_quantisable(K) or (mxfp4.why_not_packable(K) if c.packed else None)


def why_not_supported(config: W4DeqConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, and the output: x's dtype, or with MXFP4 x (``dtype`` uint8, its
    storage) bf16, fp16 or fp32."""
    if dtype == torch.uint8:
        if out_dtype not in _OUT_DTYPES_OF_MXFP4_X:
            return f"with MXFP4 x the kernel writes bf16, fp16 or fp32, not {out_dtype}"
    elif out_dtype != dtype:
        return f"the dequantise-then-cuBLAS kernel writes x's dtype ({dtype}), not {out_dtype}"
    return _why_not_asm_here(config) or why_not_fits(config, M, N, K, dtype)


def _why_not_asm_here(config: W4DeqConfig) -> str | None:
    """Why an ``asm`` config's PTX decode cannot run in this process (Triton's interpreter, or
    a GPU before Hopper: ``mul.rn.bf16x2`` is sm_90's), or None."""
    if not config.asm:
        return None
    return why_not_here("dequantising kernel's PTX decode (asm=1)", "the same config with asm=0")


def candidates(M: int, N: int, K: int, dtype: torch.dtype,
               packed: bool = False) -> list[W4DeqConfig]:
    """For M >= MIN_M: two shapes of the dequantising programs (8 rows of 512 elements or 32 of
    128: 2 KiB of codes each), decoding in Triton or (compiled, bf16) by inline PTX. Only
    configs that fit."""
    if M < MIN_M:
        return []
    configs = [W4DeqConfig(8, 512, 4, int(packed), asm) for asm in (0, 1)] \
        + [W4DeqConfig(32, 128, 4, int(packed), asm) for asm in (0, 1)]
    if _checks.interpreted() or not runs_here():  # the PTX decode only where it can run
        configs = [c for c in configs if not c.asm]
    return [c for c in configs if why_not_fits(c, M, N, K, dtype) is None]


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> W4DeqConfig:
    return W4DeqConfig(32, 128, 4)


@triton.jit
def dequant_mxfp4_kernel(wq_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr):
    """out (N, K) = the MXFP4 weight in out's dtype, one (BLOCK_N, BLOCK_K) block a program:
    its BLOCK_K / 32 scale blocks of 16 code bytes each (a scale load per block, the codes in
    16-byte loads; packed, in 4-byte words, rows 4-byte aligned, each word's codes taken from
    their places, ``mxfp4.PLACES``)."""
    BLOCKS: tl.constexpr = BLOCK_K // _BLOCK
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    in_n = (rows < N)[:, None]
    in_k = blocks < K // _BLOCK
    row_offsets = rows[:, None].to(tl.int64)
    scale = e8m0(tl.load(ws_ptr + row_offsets * stride_sn + blocks[None, :],
                         mask=in_n & in_k[None, :], other=0).to(tl.int32))[:, :, None]
    if PACKED:
        # mxfp4.prepack: in each 16-word group (4 blocks), word t of block j is stored at
        # 4 t + j; its codes 2 r and 2 r + 1 are elements 8 r + 2 t and 8 r + 2 t + 1 of the
        # block.
        word = tl.arange(0, 4)
        stored = (blocks // 4 * 16 + blocks % 4)[:, None] + (word * 4)[None, :]
        words = tl.load(wq_ptr.to(tl.pointer_type(tl.int32)) + row_offsets[:, :, None]
                        * (stride_wn // 4) + stored[None, :, :],
                        mask=in_n[:, :, None] & in_k[None, :, None], other=0)
        values = _placed_values(words, scale[:, :, :, None])  # (row, block, t, code)
        values = tl.permute(tl.reshape(values, (BLOCK_N, BLOCKS, 4, 4, 2)), (0, 1, 3, 2, 4))
    else:
        byte = tl.arange(0, _BLOCK // 2)  # of a block: elements 2 byte and 2 byte + 1
        stored = blocks[:, None] * (_BLOCK // 2) + byte[None, :]
        codes = tl.load(wq_ptr + row_offsets[:, :, None] * stride_wn + stored[None, :, :],
                        mask=in_n[:, :, None] & in_k[None, :, None], other=0).to(tl.int32)
        values = tl.join(e2m1(codes & 15) * scale, e2m1(codes >> 4) * scale)
    values = tl.reshape(values, (BLOCK_N, BLOCK_K))
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + row_offsets * stride_on + ks[None, :],
             values.to(out_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & (ks < K)[None, :])


@triton.jit
def _placed_code(words, I: tl.constexpr):
    """Code I of each packed word (its bits where ``mxfp4.PLACES`` put them), as E2M1 value."""
    code = ((words >> _PLACES[I][0]) & 7) | (((words >> _PLACES[I][1]) & 1) << 3)
    return e2m1(code)


@triton.jit
def _placed_values(words, scale):
    """The packed words' 8 codes each (bits as ``mxfp4.PLACES``), times ``scale``: (..., 8)
    fp32, code i at i."""
    # join stacks on a new last axis: (..., i % 2, i // 2 % 2, i // 4) -> code order
    codes = tl.join(tl.join(tl.join(_placed_code(words, 0), _placed_code(words, 1)),
                            tl.join(_placed_code(words, 2), _placed_code(words, 3))),
                    tl.join(tl.join(_placed_code(words, 4), _placed_code(words, 5)),
                            tl.join(_placed_code(words, 6), _placed_code(words, 7))))
    codes = tl.permute(codes, [0, 1, 2, 5, 4, 3])
    return tl.reshape(codes, (words.shape[0], words.shape[1], words.shape[2], 8)) * scale


@triton.jit
def dequant_mxfp4_bf16_kernel(wq_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PACKED: tl.constexpr):
    """``dequant_mxfp4_kernel`` into bf16 by the register-decoding kernels' inline PTX: each
    32-bit word of 8 codes becomes 4 registers of bf16 pairs, times its block's scale
    (``mul.rn.bf16x2``, exact), stored as 16 contiguous bytes (packed, once each block's pairs
    are put in order). Rows 4-byte aligned (codes) and out unit-stride along K."""
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    inside = (rows < N)[:, None] & (words < K // 8)[None, :]
    row_offsets = rows[:, None].to(tl.int64)
    codes = tl.load(wq_ptr.to(tl.pointer_type(tl.int32)) + row_offsets * (stride_wn // 4)
                    + words[None, :], mask=inside, other=0)
    if PACKED:
        # mxfp4.prepack: word 4 t + j of a 16-word group is block j's word t
        first = (words // 16 * 4 + words % 4) * _BLOCK
    else:
        first = words * 8  # the word's first element along K
    scale_bytes = tl.load(ws_ptr + row_offsets * stride_sn + (first // _BLOCK)[None, :],
                          mask=inside, other=0).to(tl.int32)
    if PACKED:
        r = placed_scaled_bf16(codes, scale_bytes)
    else:
        tables = e2m1_tables(tl.zeros_like(codes) + (K >> 31))  # K >> 31 is 0, unknown
        r = e2m1_scaled_bf16(codes, tables, scale_bytes)
    # register i holds elements 2 i and 2 i + 1 (packed: 8 i + 2 t and 8 i + 2 t + 1 of word
    # t of a block): in order along the last axis
    pairs = tl.reshape(tl.join(tl.join(r[0], r[2]), tl.join(r[1], r[3])),
                       (BLOCK_N, WORDS, 4))
    if PACKED:
        # (row, group, t, j, i) -> (row, group, j, i, t): each block's pairs in order, then
        # stored as words as quantised would be (inside or not by the group, as before)
        pairs = tl.reshape(tl.permute(tl.reshape(pairs, (BLOCK_N, WORDS // 16, 4, 4, 4)),
                                      (0, 1, 3, 4, 2)), (BLOCK_N, WORDS, 4))
        first = words * 8
    offsets = row_offsets[:, :, None] * (stride_on // 2) + (first // 2)[None, :, None] \
        + tl.arange(0, 4)[None, None, :]
    tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + offsets, pairs, mask=inside[:, :, None])


def dequantize(wq: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype,
               config: W4DeqConfig, warmup: bool = False) -> torch.Tensor:
    """The weight (N, K) in ``dtype``, by ``dequant_mxfp4_kernel`` (``config.packed``: wq in
    the packed layout); MXFP4 activations the same way. The kernel reads the codes and scales
    along K with unit stride: others are copied first."""
    c = config
    ptx = bool(c.asm and dtype == torch.bfloat16)  # the PTX decode into bf16
    words = ptx or bool(c.packed)  # codes read as 32-bit words: rows 4-byte aligned
    wq = wq if wq.stride(1) == 1 and not (words and (wq.stride(0) % 4 or wq.data_ptr() % 4)) \
        else wq.clone(memory_format=torch.contiguous_format)
    w_scale = w_scale if w_scale.stride(1) == 1 else w_scale.contiguous()
    n, k = wq.shape[0], wq.shape[1] * 2
    out = torch.empty(n, k, dtype=dtype, device=wq.device)
    if n and k:
        kernel = dequant_mxfp4_bf16_kernel if ptx else dequant_mxfp4_kernel
        launch(KernelCall(kernel, (triton.cdiv(n, c.block_n),
                                                 triton.cdiv(k, c.block_k)),
                          (wq, w_scale, out, n, k, wq.stride(0), w_scale.stride(0),
                           out.stride(0)),
                          dict(BLOCK_N=c.block_n, BLOCK_K=c.block_k, PACKED=bool(c.packed)),
                          dict(num_warps=c.num_warps)), warmup)
    return out


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` for bf16 a and b: cuBLAS's bf16 output where out is bf16 (as torch.mm
    computes it: fp32 sums, or bf16 partial sums where torch allows a reduced-precision
    reduction); otherwise fp32 output (torch's dtype-output mm on CUDA, the exact bf16 values
    multiplied in fp32 on the CPU), rounded to out's dtype."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif a.is_cuda and out.dtype == torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif a.is_cuda:
        out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        out.copy_(torch.mm(a.float(), b.float()))


def launch_gemm_w4deq(x, w, bias, out, scale_a, scale_b, config: W4DeqConfig,
                      counters: torch.Tensor | None = None, warmup: bool = False,
                      block_scales: bool = False) -> torch.Tensor:
    """The launches alone, for callers that validated once per shape (dispatch plans): x (M, K),
    w the codes (two a byte; packed for a packed config), scale_b their scales, ``out`` (M, N)
    in x's dtype, its column stride 1. With ``scale_a`` x is MXFP4 too (its codes (M, K // 2),
    scale_a their scales (M, K // 32)), ``out`` bf16, fp16 or fp32, and bias None."""
    if scale_a is not None:
        if bias is not None:
            raise ValueError("gemm_w4deq: with MXFP4 x (gemm_a4w4_blockscale's) there is no "
                             "bias; add it to the output")
        # x's codes as quantised, whatever w's layout
        activations = dequantize(x, scale_a, torch.bfloat16,
                                 dataclasses.replace(config, packed=0), warmup)
        weight = dequantize(w, scale_b, torch.bfloat16, config, warmup)
        if not warmup:
            _mm_into(out, activations, weight.t())
        return out
    weight = dequantize(w, scale_b, x.dtype, config, warmup)
    if warmup:
        return out
    if bias is not None and bias.dtype == x.dtype:
        torch.addmm(bias, x, weight.t(), out=out)
    else:
        torch.mm(x, weight.t(), out=out)
        if bias is not None:
            out.copy_(out.float() + bias.float())
    return out


def gemm_w4deq(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, config: W4DeqConfig | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in x's dtype: x (M, K) bf16 or fp16, wq
    (N, K // 2) and w_scale (N, K // 32) uint8 (wq packed for a packed config), bias (N,).
    Validates everything, then launches."""
    return validated_launch("gemm_w4deq", launch_gemm_w4deq, default_config, why_not_supported, x,
                            wq, w_scale, bias, config, out)



# Called as every kernel module's validating launcher is (dispatchable)
gemm_w4deq_scaled = scaled_launcher("gemm_w4deq", gemm_w4deq)
