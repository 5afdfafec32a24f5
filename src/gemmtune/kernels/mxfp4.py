"""MXFP4 (OCP Microscaling Formats v1.0): 4-bit E2M1 elements in blocks of 32 along K, each
block with one shared power-of-two scale stored as E8M0.

- Block scale: ``X = 2^(floor(log2(amax)) - 2)`` (2 is E2M1's largest exponent, so amax / X
  lies in [4, 8)), stored as its biased exponent byte ``floor(log2(amax)) - 2 + 127``, clamped
  to [0, 254]. An all-zero block gets the smallest scale, byte 0 (2^-127). Byte 255 is E8M0's
  NaN: a block holding a NaN or an Inf gets it, so the whole block dequantises to NaN (never a
  wrong finite number).
- Elements: ``v / X`` rounded to the nearest value of {0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the
  even encoding, i.e. the one whose last mantissa bit is 0), saturated to +-6; encoded as sign
  bit 3 and magnitude bits 0-2 (0 0.0, 1 0.5, 2 1.0, 3 1.5, 4 2.0, 5 3.0, 6 4.0, 7 6.0). -0 keeps
  its sign bit.
- Packing: two elements per uint8, the lower-index element in the low nibble.

Tensors (..., K) with K a multiple of 32 give elements (..., K // 2) uint8 and scales
(..., K // 32) uint8. Everything here is exact in fp32: the scale is a power of two, so dividing
by it and multiplying by it round nothing.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per shared scale, along K
SCALE_BIAS = 127  # E8M0: the byte e means 2^(e - 127)
SCALE_NAN = 255
ELEMENT_EMAX = 2  # E2M1's largest exponent: 6 = 1.5 x 2^2
ELEMENT_MAX = 6.0
# E2M1 magnitudes by their 3-bit code.
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# The packed layout (``prepack``) reorders each row's codes within groups of this many elements
# of K (64 bytes: 4 blocks of 16).
PACK_GROUP = 128
# Where a packed 32-bit word puts each of its 8 codes (word t of a block holds its elements
# 2 t + 8 r and 2 t + 8 r + 1 as codes 2 r and 2 r + 1, the MMA operand fragment of thread t
# of a quad): (the bit its 3 magnitude bits start at, its sign bit). Code 2 r lands, by one
# mask, or by a shift or two and a mask, on bits 6-8 and 15 of a bf16 (the exponent's low two
# bits and the mantissa's top one: the value times 2^-126), code 2 r + 1 on bits 22-24 and 31:
# register r of the decode (``_e2m1_ptx.PLACED_TO_BF16_ASM``) shifts the word left 0, 3, 6 (the
# signs 1) or right 3 (the signs left 2).
PLACES = ((6, 15), (22, 31), (3, 12), (19, 28), (0, 14), (16, 30), (9, 13), (25, 29))
# The packed layout's versions, as ``nn.Mxfp4Linear``'s state_dict records them: 1 the words
# only transposed (codes two a byte, as quantised), 2 their bits placed too (``PLACES``), 3 a
# word's bytes gathered first (word t of a block: its bytes t, t + 4, t + 8 and t + 12), so that
# a word is one thread's fragment of the MMA operand. ``PACKED_LAYOUT`` is what ``prepack``
# writes.
PACKED_LAYOUTS = (1, 2, 3)
PACKED_LAYOUT = 3


def why_not_quantisable(k: int) -> str | None:
    """Why a tensor with K = ``k`` has no MXFP4 form, or None."""
    if k % BLOCK:
        return f"K={k} is not a multiple of {BLOCK}, the MXFP4 block"
    return None


def block_exponents(t: torch.Tensor) -> torch.Tensor:
    """Per block of 32 along the last dim of fp32 ``t`` (..., K // 32, 32): the scale bytes."""
    amax = t.abs().amax(dim=-1)
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
    _, exponent = torch.frexp(amax)
    byte = (exponent.to(torch.int32) - 1 - ELEMENT_EMAX + SCALE_BIAS).clamp(0, 254)
    byte = torch.where(amax == 0, 0, byte)
    return torch.where(torch.isfinite(amax), byte, SCALE_NAN).to(torch.uint8)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0-15) of fp32 ``v``, already divided by its block's scale: nearest
    E2M1 value, ties to even, saturated to +-6. NaN is not expected (its block's scale is NaN)."""
    mag = v.abs().clamp(max=ELEMENT_MAX)
    # The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4 on; torch.round rounds half to
    # even, which on each stretch is the even encoding (the stretches' ends are even codes).
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    rounded = torch.round(mag / step) * step
    # The grid's value -> its code, stretch by stretch (no table: a host-made tensor would be a
    # copy, which a CUDA graph's capture refuses): 0-1.5 -> 0-3, 2-3 -> 4-5, 4-6 -> 6-7.
    code = torch.where(rounded < 2, rounded * 2, torch.where(rounded < 4, rounded + 2,
                                                             rounded / 2 + 4))
    negative = torch.signbit(v)
    return (code.to(torch.int32) + torch.where(negative, 8, 0)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes (uint8, 0-15), computed rather than looked up (a host-made
    table would be a copy, which a CUDA graph's capture refuses): exponent bits 1-2, mantissa
    bit 0, exponent 0 subnormal (0 or 0.5), bit 3 the sign."""
    magnitude = (codes & 7).to(torch.int32)
    exponent, mantissa = magnitude >> 1, (magnitude & 1).float()
    normal = torch.ldexp(1 + mantissa / 2, (exponent - 1).float())
    value = torch.where(exponent == 0, mantissa / 2, normal)
    return torch.where(codes >= 8, -value, value)


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (..., K) as MXFP4: (elements (..., K // 2) uint8, scales (..., K // 32) uint8)."""
    k = t.shape[-1]
    blocks = t.float().reshape(*t.shape[:-1], k // BLOCK, BLOCK)
    scales = block_exponents(blocks)
    # Divide by 2^(byte - 127) exactly; a NaN scale's block is encoded from zeros (its scale
    # makes it NaN when dequantised).
    shift = scales.to(torch.int32) - SCALE_BIAS
    finite = (scales != SCALE_NAN)[..., None]
    scaled = torch.where(finite, torch.ldexp(blocks, -shift[..., None].float()), 0.0)
    codes = e2m1_codes(scaled).reshape(*t.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scales.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 (..., K) from ``quantize``'s elements (..., K // 2) and scales (..., K // 32)."""
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    values = e2m1_values(codes)
    k = values.shape[-1]
    blocks = values.reshape(*q.shape[:-1], k // BLOCK, BLOCK)
    exponent = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(blocks, exponent[..., None].float())
    out = torch.where((scales == SCALE_NAN)[..., None], float("nan"), out)
    return out.reshape(*q.shape[:-1], k)


def why_not_packable(k: int) -> str | None:
    """Why a weight with K = ``k`` has no packed layout (``prepack``), or None."""
    if k % PACK_GROUP:
        return (f"K={k} is not a multiple of {PACK_GROUP}: the packed layout reorders codes in "
                f"groups of {PACK_GROUP} along K; keep this weight as quantised")
    return None


def prepack(codes: torch.Tensor) -> torch.Tensor:
    """``quantize``'s codes (N, K // 2) in the register-direct kernels' packed layout: in each
    16-byte block, word t gathers bytes t, t + 4, t + 8 and t + 12 (elements 2 t + 8 r and
    2 t + 8 r + 1, r = 0-3: what thread t of a quad holds of an MMA operand); within each
    row's 64-byte groups (128 elements, 4 blocks), word t of block j moves to word 4 t + j, so
    the 4 words one thread multiplies (word t of each block) are 16 contiguous bytes; and each
    word's 8 codes have their bits placed as ``PLACES`` says. ``unpack`` undoes all three. The
    scales keep their layout."""
    _check_packable(codes, "prepack")
    return _place_bits(_transpose_words(_transpose_bytes(codes)))


def unpack(packed: torch.Tensor, layout: int = PACKED_LAYOUT,
           caller: str = "unpack") -> torch.Tensor:
    """``prepack``'s inverse: packed codes (N, K // 2) as ``quantize`` makes them; ``layout``
    an earlier version of the packed layout (``PACKED_LAYOUTS``) that codes were saved in.
    ``caller`` names the function in errors."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"{caller}: layout={layout}: the packed layouts are {PACKED_LAYOUTS} "
                         f"(1 words transposed, 2 their bits placed too, 3 their bytes gathered "
                         f"first)")
    _check_packable(packed, caller)
    codes = _transpose_words(packed if layout == 1 else _unplace_bits(packed))
    return _transpose_bytes(codes) if layout == 3 else codes


def _check_packable(codes: torch.Tensor, caller: str) -> None:
    why = why_not_packable(codes.shape[-1] * 2)
    if why is not None:
        raise ValueError(f"{caller}: {why}")


def _transpose_words(codes: torch.Tensor) -> torch.Tensor:
    """Word t of block j of each 64-byte group <-> word 4 t + j (a 4 x 4 transpose: its own
    inverse). ``codes`` checked packable by the caller."""
    n, half_k = codes.shape
    groups = codes.reshape(n, half_k // 64, 4, 4, 4)  # (row, group, block j, word t, byte i)
    return groups.transpose(2, 3).reshape(n, half_k).contiguous()


def _transpose_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Byte i of word t of each 16-byte block <-> byte t of word i (a 4 x 4 transpose: its own
    inverse). ``codes`` checked packable by the caller."""
    n, half_k = codes.shape
    blocks = codes.reshape(n, half_k // 16, 4, 4)  # (row, block, word t, byte i)
    return blocks.transpose(2, 3).reshape(n, half_k).contiguous()


# The bits are moved in int32 (two's complement: a shift right then a mask takes bits out
# whatever the sign; a shift left into bit 31 wraps), in place, so a weight's codes take about
# three times their size while they move.
def _place_bits(codes: torch.Tensor) -> torch.Tensor:
    words = codes.contiguous().view(torch.int32)
    placed, code = torch.zeros_like(words), torch.empty_like(words)
    for i, (magnitude, sign) in enumerate(PLACES):
        torch.bitwise_right_shift(words, 4 * i, out=code)
        code.bitwise_and_(15)
        placed.bitwise_or_((code & 7).bitwise_left_shift_(magnitude))
        placed.bitwise_or_(code.bitwise_right_shift_(3).bitwise_left_shift_(sign))
    return placed.view(torch.uint8).reshape(codes.shape)


def _unplace_bits(packed: torch.Tensor) -> torch.Tensor:
    words = packed.contiguous().view(torch.int32)
    codes, part = torch.zeros_like(words), torch.empty_like(words)
    for i, (magnitude, sign) in enumerate(PLACES):
        torch.bitwise_right_shift(words, magnitude, out=part)
        codes.bitwise_or_(part.bitwise_and_(7).bitwise_left_shift_(4 * i))
        torch.bitwise_right_shift(words, sign, out=part)
        codes.bitwise_or_(part.bitwise_and_(1).bitwise_left_shift_(4 * i + 3))
    return codes.view(torch.uint8).reshape(packed.shape)
