"""Quantisation helpers: produce the FP8 / INT8 inputs of the a8w8 ops, and their fp32 references.

Schemes (``QuantType`` is their spelling in tables and on the command line), for t (..., M, K):

    per_tensor_fp8/int8(t)           scale ()                            QuantType.per_Tensor
    per_token_fp8/int8(x)            scale (..., M, 1)                   QuantType.per_Token
    per_channel_fp8/int8(w)          scale (..., N, 1)                   QuantType.per_Token
    per_block_fp8(x, ACT_BLOCK)      scale (..., M, ceil(K/128))         QuantType.per_1x128
    per_block_fp8(w, WEIGHT_BLOCK)   scale (..., ceil(N/128), ceil(K/128))  QuantType.per_128x128

Conventions shared by every function here:

* A scale is float32 and is the *dequantisation* multiplier: ``t ~= q.float() * scale``. It is
  ``amax / qmax`` of its group (qmax = 448 for e4m3fn, 127 for int8), with amax floored at
  ``AMAX_FLOOR`` so an all-zero group gets a finite scale and quantises to zeros.
* Quantising divides by the scale in fp32 and rounds once, as the hardware converts:
  FP8 is ``cvt.rn.satfinite`` (nearest even, saturate to +-448, NaN stays NaN);
  INT8 is ``cvt.rni`` then saturation to the *symmetric* range [-127, 127].
  A kernel that multiplies by a precomputed ``1 / scale`` instead of dividing may land one step
  away on rare exact ties; compare such kernels to these references with that allowance.
* Non-finite inputs: FP8 propagates them. A NaN or +-Inf makes its group's amax, hence its scale,
  NaN or Inf, so the whole group (row, block or tensor) dequantises to NaN: loud, never a silently
  wrong finite number, and with no host sync. (A kernel's max-reduction must propagate NaN to
  match, e.g. ``tl.maximum(..., propagate_nan=tl.PropagateNan.ALL)``; CUDA's ``fmaxf`` drops NaN.)
  INT8 has no NaN to carry it, so the int8 functions raise ValueError instead (a host sync).
* Inputs are bf16, fp16 or fp32 (exactly representable in fp32, so the one fp32 rounding is the
  only one); any strides. Outputs are contiguous.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gemmtune.kernels import mxfp4 as _mx
from gemmtune.kernels import preshuffle
from gemmtune.tables.values import QuantType

__all__ = [
    "AMAX_FLOOR", "FP8_DTYPE", "FP8_MAX", "INT8_MAX", "ACT_BLOCK", "WEIGHT_BLOCK", "BLOCK_SHAPES",
    "per_tensor_fp8", "per_token_fp8", "per_channel_fp8", "per_block_fp8",
    "per_tensor_int8", "per_token_int8", "per_channel_int8",
    "quantize_fp8", "quantize_int8", "dequant", "dequant_per_block",
    "quantize", "dequantize",
    "token_channel_quantisers",
    "MOE_QUANT_TYPES", "quantize_experts", "dequantize_experts",
    "shuffle_weight", "unshuffle_weight",
    "mxfp4", "dequant_mxfp4", "prepack_mxfp4",
]

FP8_DTYPE = torch.float8_e4m3fn  # Hopper's FP8 compute format (no e4m3fnuz on NVIDIA)
FP8_MAX = 448.0  # largest finite e4m3fn: 1.75 * 2**8 (e4m3fn has no Inf; S.1111.111 is NaN)
# Symmetric int8: -128 is never produced, so -q is always representable and amax maps to +-127
# whichever its sign.
INT8_MAX = 127.0

# Floor on amax. 1e-12 keeps the scale (>= 2.2e-15 for FP8) a normal fp32 number whose reciprocal
# (<= 4.5e14) is finite, so a kernel that multiplies by 1/scale never meets Inf or a flushed
# denormal. The price: a group whose every |value| is below 1e-12 quantises relative to 1e-12
# (and mostly to zeros); next to real activations (~1e-3 .. 1e3) such a group is zero anyway.
AMAX_FLOOR = 1e-12

ACT_BLOCK = (1, 128)  # activations: one scale per token per 128 of K (DeepSeek-V3 style)
WEIGHT_BLOCK = (128, 128)  # weights: one scale per 128x128 tile of (N, K)
BLOCK_SHAPES: dict[QuantType, tuple[int, int]] = {
    QuantType.per_1x128: ACT_BLOCK,
    QuantType.per_128x128: WEIGHT_BLOCK,
}

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QMAX: dict[torch.dtype, float] = {FP8_DTYPE: FP8_MAX, torch.int8: INT8_MAX}


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def _check_input(t: torch.Tensor, what: str, min_ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INPUT_DTYPES:
        hint = " (it is already quantised)" if t.dtype in _QMAX else ""
        raise ValueError(
            f"{what}: expected a bf16, fp16 or fp32 tensor, got {t.dtype}{hint}; "
            f"cast with .to(torch.bfloat16) or .float() first")
    if t.ndim < min_ndim:
        shape = {1: "(..., K)", 2: "(..., N, K)"}[min_ndim]
        raise ValueError(f"{what}: expected a tensor of shape {shape} (at least {min_ndim}-D), "
                         f"got shape {tuple(t.shape)}")
    if t.ndim and t.shape[-1] == 0:
        raise ValueError(f"{what}: the last dimension (K) is 0; there is nothing to quantise "
                         f"along it (got shape {tuple(t.shape)})")


def _check_finite_for_int8(t: torch.Tensor, what: str) -> None:
    # int8 has no NaN/Inf: a NaN would become an arbitrary integer. One host sync per call.
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: input has NaN or Inf, which int8 cannot represent; "
                         f"find where it came from, or quantise to FP8 (which propagates NaN)")


def _check_scale(scale: torch.Tensor, shape: torch.Size, what: str) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{what}: scale must be a float32 tensor, got {got}")
    ok = scale.ndim <= len(shape) and all(
        s in (1, n) for s, n in zip(reversed(scale.shape), reversed(shape)))
    if not ok:
        raise ValueError(
            f"{what}: scale of shape {tuple(scale.shape)} does not broadcast to the data's shape "
            f"{tuple(shape)}; expected () per tensor or (..., M, 1) per row "
            f"(block scales go to dequant_per_block)")


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"block must be two positive ints (rows, cols), e.g. {ACT_BLOCK} for "
                         f"activations or {WEIGHT_BLOCK} for weights; got {block!r}")
    return int(block[0]), int(block[1])


def _check_quantised(q: torch.Tensor, what: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype not in _QMAX:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{what}: expected a float8_e4m3fn or int8 tensor, got {got}")


# --------------------------------------------------------------------------------------------
# The two conversions (given a scale) and the scale rule
# --------------------------------------------------------------------------------------------

def _scale_from_amax(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # clamp keeps NaN (a NaN group stays loud). The division is correctly rounded fp32 on every
    # device: divided by a tensor, since torch on CUDA multiplies by the reciprocal of a Python
    # number instead (1/448 is inexact: scales then differ from the CPU's in the last bit).
    amax = amax.float().clamp(min=AMAX_FLOOR)
    return amax / amax.new_full((), qmax)


def _saturating_fp8(v: torch.Tensor) -> torch.Tensor:  # v fp32, in scaled units
    # cvt.rn.satfinite: torch's cast rounds to nearest even, but whether it saturates or gives
    # NaN for |v| > 448 depends on the torch version and device, so clamp first. clamp maps
    # +-Inf to +-448 (as satfinite does) and keeps NaN.
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _saturating_int8(v: torch.Tensor) -> torch.Tensor:  # v fp32, finite, in scaled units
    # torch.round is round-half-to-even (cvt.rni); clamp after rounding so 127.4 -> 127 and
    # 127.6 -> 128 -> 127 both saturate to the symmetric bound.
    return torch.round(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` rounded to e4m3fn, saturating at +-448: static quantisation with a given
    (e.g. calibrated) float32 scale of shape () or broadcastable per row. NaN stays NaN."""
    _check_input(t, "quantize_fp8", min_ndim=0)
    _check_scale(scale, t.shape, "quantize_fp8")
    return _saturating_fp8(t.float() / scale).contiguous()


def quantize_int8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` rounded half-to-even to int8, saturating at +-127; raises on NaN/Inf."""
    _check_input(t, "quantize_int8", min_ndim=0)
    _check_scale(scale, t.shape, "quantize_int8")
    _check_finite_for_int8(t, "quantize_int8")
    return _saturating_int8(t.float() / scale).contiguous()


# --------------------------------------------------------------------------------------------
# Per tensor and per row (token / channel)
# --------------------------------------------------------------------------------------------

def _per_tensor(t: torch.Tensor, q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tf = t.float()
    # amax of an empty tensor (an expert that got no tokens) is 0: the floor gives its scale.
    amax = tf.abs().amax() if tf.numel() else tf.new_zeros(())
    scale = _scale_from_amax(amax, _QMAX[q_dtype])
    cast = _saturating_fp8 if q_dtype == FP8_DTYPE else _saturating_int8
    return cast(tf / scale).contiguous(), scale


def _per_row(t: torch.Tensor, q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tf = t.float()
    scale = _scale_from_amax(tf.abs().amax(dim=-1, keepdim=True), _QMAX[q_dtype])  # (..., 1)
    cast = _saturating_fp8 if q_dtype == FP8_DTYPE else _saturating_int8
    return cast(tf / scale).contiguous(), scale.contiguous()


def per_tensor_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: ``(q e4m3fn, same shape as t; scale fp32, shape ())``."""
    _check_input(t, "per_tensor_fp8", min_ndim=0)
    return _per_tensor(t, FP8_DTYPE)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x (..., M, K)
    """One scale per row of the activations: ``(xq e4m3fn (..., M, K), scale fp32 (..., M, 1))``."""
    _check_input(x, "per_token_fp8", min_ndim=1)
    return _per_row(x, FP8_DTYPE)


def per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # w (..., N, K)
    """One scale per output row of the weight: ``(wq e4m3fn (..., N, K), scale fp32 (..., N, 1))``.
    Leading dims are experts (MoE weights (E, N, K))."""
    _check_input(w, "per_channel_fp8", min_ndim=2)
    return _per_row(w, FP8_DTYPE)


def per_tensor_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale: ``(q int8, same shape as t; scale fp32, shape ())``."""
    _check_input(t, "per_tensor_int8", min_ndim=0)
    _check_finite_for_int8(t, "per_tensor_int8")
    return _per_tensor(t, torch.int8)


def per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x (..., M, K)
    """Symmetric int8, one scale per row: ``(xq int8 (..., M, K), scale fp32 (..., M, 1))``."""
    _check_input(x, "per_token_int8", min_ndim=1)
    _check_finite_for_int8(x, "per_token_int8")
    return _per_row(x, torch.int8)


def per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # w (..., N, K)
    """Symmetric int8, one scale per output row:
    ``(wq int8 (..., N, K), scale fp32 (..., N, 1))``."""
    _check_input(w, "per_channel_int8", min_ndim=2)
    _check_finite_for_int8(w, "per_channel_int8")
    return _per_row(w, torch.int8)


def token_channel_quantisers(q_dtype: torch.dtype):
    """``(per_token, per_channel)`` for ``q_dtype`` (float8_e4m3fn or int8): the activation and
    weight quantisers of a per-token x per-channel GEMM."""
    if q_dtype == FP8_DTYPE:
        return per_token_fp8, per_channel_fp8
    if q_dtype == torch.int8:
        return per_token_int8, per_channel_int8
    raise ValueError(f"no per-token/per-channel quantisers for {q_dtype}; use "
                     f"{FP8_DTYPE} or torch.int8")


# --------------------------------------------------------------------------------------------
# Per block (FP8 only: 1x128 activations, 128x128 weights)
# --------------------------------------------------------------------------------------------

def _expand_block_scale(scale: torch.Tensor, shape: torch.Size,
                        block: tuple[int, int]) -> torch.Tensor:
    """Block scales (..., ceil(M/bm), ceil(K/bk)) repeated to one per element (..., M, K)."""
    bm, bk = block
    m, k = shape[-2], shape[-1]
    return scale.repeat_interleave(bm, dim=-2)[..., :m, :].repeat_interleave(bk, dim=-1)[..., :k]


def per_block_fp8(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` = (rows, cols) tile of the last two dims of ``t`` (..., M, K).

    ``per_block_fp8(x, ACT_BLOCK)`` gives activation scales (..., M, ceil(K/128));
    ``per_block_fp8(w, WEIGHT_BLOCK)`` gives weight scales (..., ceil(N/128), ceil(K/128)).
    M and K need not be multiples of the block: the last block is partial and its amax covers only
    its real elements. A 1-D ``t`` (K,) is one row, allowed when the block has one row.
    Returns ``(q e4m3fn, same shape as t; scale fp32)``.
    """
    bm, bk = _check_block(block)
    if bm == 1 and isinstance(t, torch.Tensor) and t.ndim == 1:
        q, scale = per_block_fp8(t.unsqueeze(0), block)
        return q[0], scale[0]
    _check_input(t, "per_block_fp8", min_ndim=2)
    *lead, m, k = t.shape
    mb, kb = math.ceil(m / bm), math.ceil(k / bk)
    tf = t.float()
    # Padding |t| with zeros never raises a block's amax (|x| >= 0), so a partial block's amax is
    # that of its real elements only; NaN still propagates through amax.
    padded = F.pad(tf.abs(), (0, kb * bk - k, 0, mb * bm - m))
    amax = padded.reshape(*lead, mb, bm, kb, bk).amax(dim=(-3, -1))  # (..., mb, kb)
    scale = _scale_from_amax(amax, FP8_MAX).contiguous()
    q = _saturating_fp8(tf / _expand_block_scale(scale, t.shape, (bm, bk)))
    return q.contiguous(), scale


# --------------------------------------------------------------------------------------------
# Dequantisation references (fp32)
# --------------------------------------------------------------------------------------------

def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` in fp32, for a per-tensor (shape ()) or per-row ((..., M, 1)) scale."""
    _check_quantised(q, "dequant")
    _check_scale(scale, q.shape, "dequant")
    return q.float() * scale


def dequant_per_block(q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """``q.float()`` times each element's block scale, in fp32 (inverse of ``per_block_fp8``)."""
    bm, bk = _check_block(block)
    _check_quantised(q, "dequant_per_block")
    if bm == 1 and q.ndim == 1 and isinstance(scale, torch.Tensor):
        return dequant_per_block(q.unsqueeze(0), scale.unsqueeze(0), block)[0]
    if q.ndim < 2:
        raise ValueError(f"dequant_per_block: expected q of shape (..., M, K), "
                         f"got {tuple(q.shape)}")
    *lead, m, k = q.shape
    want = (*lead, math.ceil(m / bm), math.ceil(k / bk))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 \
            or tuple(scale.shape) != want:
        got = (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
               else type(scale).__name__)
        raise ValueError(f"dequant_per_block: for q {tuple(q.shape)} and block {block} expected a "
                         f"float32 scale of shape {want}, got {got}")
    return q.float() * _expand_block_scale(scale, q.shape, (bm, bk))


# --------------------------------------------------------------------------------------------
# By QuantType (as a table row or the CLI names the scheme)
# --------------------------------------------------------------------------------------------

def _quant_type(q_type: QuantType | str) -> QuantType:
    return q_type if isinstance(q_type, QuantType) else QuantType.from_str(q_type)


def quantize(t: torch.Tensor, q_type: QuantType | str,
             q_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``t`` by a table's scheme. ``per_Token`` means one scale per row: per token for
    activations, per output channel for weights (the same rule). Block schemes are FP8 only."""
    qt = _quant_type(q_type)
    if q_dtype not in _QMAX:
        raise ValueError(f"q_dtype must be torch.float8_e4m3fn or torch.int8, got {q_dtype}")
    if qt == QuantType.per_Tensor:
        return per_tensor_fp8(t) if q_dtype == FP8_DTYPE else per_tensor_int8(t)
    if qt == QuantType.per_Token:
        return per_token_fp8(t) if q_dtype == FP8_DTYPE else per_token_int8(t)
    if qt in BLOCK_SHAPES:
        if q_dtype != FP8_DTYPE:
            raise ValueError(f"{qt.canonical} is FP8 only; got q_dtype={q_dtype}")
        return per_block_fp8(t, BLOCK_SHAPES[qt])
    valid = (QuantType.per_Tensor, QuantType.per_Token, *BLOCK_SHAPES)
    raise ValueError(f"quantize does not implement {qt.canonical}; expected one of "
                     f"{', '.join(v.canonical for v in valid)}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, q_type: QuantType | str) -> torch.Tensor:
    """fp32 reference of what ``quantize(t, q_type)`` returned."""
    qt = _quant_type(q_type)
    if qt in BLOCK_SHAPES:
        return dequant_per_block(q, scale, BLOCK_SHAPES[qt])
    if qt in (QuantType.per_Tensor, QuantType.per_Token):
        return dequant(q, scale)
    raise ValueError(f"dequantize does not implement {qt.canonical}")


# --------------------------------------------------------------------------------------------
# MoE experts (E, N, K): the weight scales fused_moe takes for each QuantType
# --------------------------------------------------------------------------------------------

# fused_moe's quantised schemes, FP8 e4m3 weights and activations: the weights' scales (the
# activations are quantised inside the op, the same way per token / per 1x128 block, or per
# tensor) are per expert (E, 1, 1), per output channel (E, N, 1) or per 128x128 block
# (E, ceil(N/128), ceil(K/128)).
MOE_QUANT_TYPES = (QuantType.per_Tensor, QuantType.per_Token, QuantType.per_1x128)


def _experts_block(w: torch.Tensor, qt: QuantType) -> tuple[int, int]:
    """The tile one scale covers: a whole expert, one output channel, or 128x128."""
    if qt == QuantType.per_Tensor:
        return (max(1, w.shape[-2]), max(1, w.shape[-1]))
    if qt == QuantType.per_Token:
        return (1, max(1, w.shape[-1]))
    if qt == QuantType.per_1x128:
        return WEIGHT_BLOCK
    schemes = " or ".join(t.canonical for t in MOE_QUANT_TYPES)
    raise ValueError(f"MoE experts are quantised {schemes}, not {qt.canonical}")


def quantize_experts(w: torch.Tensor,
                     q_type: QuantType | str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts for ``fused_moe(..., quant_type=q_type)``: w (E, N, K) (w1 (E, 2I, D) or w2
    (E, D, I)) -> (q e4m3fn (E, N, K), scale fp32: (E, 1, 1) per_Tensor (one per expert),
    (E, N, 1) per_Token (one per output channel), (E, ceil(N/128), ceil(K/128)) per_1x128)."""
    _check_input(w, "quantize_experts", min_ndim=3)
    return per_block_fp8(w, _experts_block(w, _quant_type(q_type)))


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor,
                       q_type: QuantType | str) -> torch.Tensor:
    """fp32 experts from ``quantize_experts``'s output."""
    return dequant_per_block(q, scale, _experts_block(q, _quant_type(q_type)))


def shuffle_weight(wq: torch.Tensor) -> torch.Tensor:
    """An FP8 or INT8 weight (N, K) packed once for ``gemm_a8w8_bpreshuffle``: 16-row x
    128-byte tiles, each contiguous (``gemmtune.kernels.preshuffle``). Same shape and dtype,
    a new contiguous tensor; N must be a multiple of 16 and K of 128 (ValueError otherwise).
    Its scales (per channel of the row-major weight) are used as they are. The layout is
    gemmtune's own: a weight shuffled by AITER's ``shuffle_weight`` (a different layout) must be
    packed again from the row-major one."""
    return preshuffle.shuffle(wq)


def unshuffle_weight(wq_shuffled: torch.Tensor) -> torch.Tensor:
    """The row-major weight back from ``shuffle_weight``'s result."""
    return preshuffle.unshuffle(wq_shuffled)


def mxfp4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (..., K) in MXFP4 (OCP MX v1.0; ``gemmtune.kernels.mxfp4``): blocks of 32 along K,
    each with a power-of-two scale ``2^(floor(log2(amax)) - 2)`` stored as its E8M0 byte, the
    elements rounded to nearest-even on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} and
    saturated to +-6, two per byte (the lower-index element in the low nibble).

    Returns (elements (..., K // 2) uint8, scales (..., K // 32) uint8), contiguous. K must be a
    multiple of 32. An all-zero block gets the smallest scale (2^-127); a block with a NaN or an
    Inf gets the NaN scale (255), so it dequantises to NaN, never to a wrong finite number."""
    _check_input(t, "mxfp4", 1)
    why = _mx.why_not_quantisable(t.shape[-1])
    if why is not None:
        raise ValueError(f"mxfp4: {why} (got shape {tuple(t.shape)}); pad K with zeros")
    return _mx.quantize(t)


def dequant_mxfp4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 (..., K) from ``mxfp4``'s elements (..., K // 2) and scales (..., K // 32)."""
    if q.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"dequant_mxfp4: expected uint8 elements and scales (as mxfp4 returns "
                         f"them), got {q.dtype} and {scale.dtype}")
    expected = (*q.shape[:-1], q.shape[-1] * 2 // _mx.BLOCK) if q.ndim else None
    if q.ndim == 0 or (q.shape[-1] * 2) % _mx.BLOCK or tuple(scale.shape) != expected:
        raise ValueError(f"dequant_mxfp4: elements {tuple(q.shape)} and scales "
                         f"{tuple(scale.shape)} do not match: for (..., K // 2) elements with K "
                         f"a multiple of {_mx.BLOCK}, scales are (..., K // {_mx.BLOCK})")
    return _mx.dequantize(q, scale)


def _check_weight(op: str, wq: torch.Tensor, w_scale: torch.Tensor) -> None:
    """An MXFP4 weight as ``mxfp4`` returns it (uint8 codes (N, K // 2), scales (N, K // 32))
    whose K has the packed layout: ValueError saying what is wrong otherwise."""
    if wq.dtype != torch.uint8 or w_scale.dtype != torch.uint8 or wq.dim() != 2 \
            or w_scale.dim() != 2:
        raise ValueError(f"{op}: expected uint8 codes (N, K // 2) and scales (N, K // 32) as "
                         f"mxfp4 returns them, got {wq.dtype} {tuple(wq.shape)} and "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if tuple(w_scale.shape) != (wq.shape[0], wq.shape[1] * 2 // _mx.BLOCK):
        raise ValueError(f"{op}: codes {tuple(wq.shape)} and scales {tuple(w_scale.shape)} do "
                         f"not belong together")
    why = _mx.why_not_packable(wq.shape[1] * 2)
    if why is not None:
        raise ValueError(f"{op}: {why}")


def prepack_mxfp4(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 weight (``mxfp4``'s (N, K // 2) codes and (N, K // 32) scales) in the packed
    layout ``gemm_a16w4(..., packed=True)`` and ``gemm_a4w4_blockscale(..., packed=True)``
    take: each 4-byte word holds what one thread of the MMA's quad multiplies of a block, a
    thread's words of 4 blocks are 16 contiguous bytes (one load), and each word's bits are
    placed so that masks and shifts decode them (``gemmtune.kernels.mxfp4.prepack``); the
    scales are unchanged. K must be a multiple of 128. ``unpack_mxfp4`` undoes it, also for
    codes packed by an earlier gemmtune (``layout``: the version they were saved in)."""
    _check_weight("prepack_mxfp4", wq, w_scale)
    return _mx.prepack(wq), w_scale


def unpack_mxfp4(wq: torch.Tensor, w_scale: torch.Tensor,
                 layout: int = _mx.PACKED_LAYOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``prepack_mxfp4`` packed, as ``mxfp4`` made it: codes (N, K // 2) and the
    (unchanged) scales. ``layout``: the packed layout's version the codes were packed in
    (``gemmtune.kernels.mxfp4.PACKED_LAYOUTS``; 1 and 2 by a gemmtune from before 3)."""
    _check_weight("unpack_mxfp4", wq, w_scale)
    return _mx.unpack(wq, layout, "unpack_mxfp4"), w_scale
