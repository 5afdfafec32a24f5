"""The inline PTX that turns MXFP4 codes and scales into bf16, shared by the kernels that
decode in registers (``triton.w4frag``, ``triton.w4xa``, ``triton.w4wg``, ``triton.w4deq``'s bf16
copy).

Two decodes: of words as quantised (PRMT table look-ups) and of the packed layout's words,
whose bits ``mxfp4.prepack`` placed so that masks and shifts decode them; the packed one also
times its block's scale in the same asm block (``placed_scaled_asm``, ``triton.w4xa``'s). The
asm texts are constexprs (Triton and Gluon take them alike); the helpers are ``triton.jit``
functions, which Gluon kernels call too. None of it runs in Triton's interpreter;
``tests/test_mxfp4_ptx_decode.py`` runs the texts on the CPU through a small PTX emulator, bit
for bit against ``mxfp4.e2m1_values``.
"""

import triton
import triton.language as tl

# E2M1 codes to bf16: a 32-bit word of 8 codes c0-c7 ($4: 4 bytes, the lower-index code in
# each byte's low nibble) to 4 registers of 2 bf16 each, register i holding codes 2 i (low half)
# and 2 i + 1, the pairs the MMA takes in one register. PRMT looks up the low and the high byte
# of each code's magnitude ($5, $6 and the immediates: two 8-byte tables), PRMT's
# sign-replicating selectors spread the codes' signs (bit 3) to bit 7 of the high bytes, and a
# last PRMT pairs low and high bytes: 15 instructions for 8 codes (Triton's fp4_to_fp, whose
# tables are also copied into registers before each use: about 24).
E2M1_TO_BF16_ASM = tl.constexpr("""{
.reg .b32 m, mh, la, ha, lb, hb, q4, sa, sb;
and.b32 m, $4, 0x77777777;
shr.b32 mh, m, 16;
shl.b32 q4, $4, 4;
prmt.b32 la, $5, 0xC0804000, m;
prmt.b32 ha, $6, 0x40404040, m;
prmt.b32 lb, $5, 0xC0804000, mh;
prmt.b32 hb, $6, 0x40404040, mh;
prmt.b32 sa, q4, $4, 0xD9C8;
prmt.b32 sb, q4, $4, 0xFBEA;
lop3.b32 ha, ha, sa, 0x80808080, 0xF8;
lop3.b32 hb, hb, sb, 0x80808080, 0xF8;
prmt.b32 $0, la, ha, 0x5140;
prmt.b32 $1, la, ha, 0x7362;
prmt.b32 $2, lb, hb, 0x5140;
prmt.b32 $3, lb, hb, 0x7362;
}""")

# The packed layout's words (``mxfp4.PLACES``: each code's bits placed) to the same 4 registers:
# a mask (register 0), a shift left by 3 and a mask (1), the magnitudes shifted left 6 and the
# signs left 1 (2), the magnitudes right 3 and the signs left 2 (3): bf16 bits 6-8 and 15 hold
# the value times 2^-126 (subnormal for 0.5), which mul.rn.bf16x2 by 2^126 (0x7E80) makes
# exact. 7 ALU instructions and 4 integer multiplies (left shifts on the FMA pipe) a word; the
# ALU issues a warp instruction every other cycle, and PRMT's decode is all ALU.
_PLACED_REGS = ".reg .b32 a, b, t, c;"
_PLACED_BODY = """
mov.b32 c, 0x7E807E80;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, c;
mul.lo.u32 a, $4, 8;
and.b32 t, a, 0x81C081C0;
mul.rn.bf16x2 $1, t, c;
mul.lo.u32 a, $4, 64;
mul.lo.u32 b, $4, 2;
and.b32 t, a, 0x01C001C0;
lop3.b32 t, t, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $2, t, c;
shr.b32 a, $4, 3;
mul.lo.u32 b, $4, 4;
and.b32 t, a, 0x01C001C0;
lop3.b32 t, t, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $3, t, c;
"""
PLACED_TO_BF16_ASM = tl.constexpr("{\n" + _PLACED_REGS + _PLACED_BODY + "}")

# 4 registers of 2 bf16 each ($4-$7) times a pair of bf16 scales ($8): exact for every finite
# result (bf16 has fp32's exponent range, and its subnormals reach 2^-133, below the smallest
# scaled value 0.5 x 2^-127)
SCALE_BF16X2_ASM = tl.constexpr(
    "mul.rn.bf16x2 $0, $4, $8; mul.rn.bf16x2 $1, $5, $8; mul.rn.bf16x2 $2, $6, $8; "
    "mul.rn.bf16x2 $3, $7, $8;")


def _scale_pair(word: str, byte: int) -> str:
    """PTX that makes register p a pair of bf16 2^(b - 127) of byte ``byte`` (0-3) b of the
    32-bit register ``word``: b in both halves' exponent fields (PRMT, then a shift), byte 0
    made 2^-127 (bf16 subnormal 0x0040, by a 16-bit max), byte 255 made NaN (0x7FC0: only
    there does adding 0x80 carry into bit 15). 7 instructions, u a scratch register.
    ``bf16_scale_pairs`` makes the same pairs in Triton, from a byte already taken out of its
    word; taking it out and spreading it by one PRMT inside the decode's asm block cut
    ``triton.w4xa``'s loop from 28.2 to 26.8 instructions a word (SASS, 8 tiles on one warp,
    bf16 x; session 40)."""
    selector = 0x4040 | byte << 8 | byte
    return (f"prmt.b32 p, {word}, 0, {selector:#06x};\nshl.b32 p, p, 7;\n"
            "mov.b32 u, 0x00400040;\nmax.u16x2 p, p, u;\nadd.u32 u, p, 0x00800080;\n"
            "shr.b32 u, u, 9;\nlop3.b32 p, p, u, 0x00400040, 0xF8;\n")


_TIMES_PAIR = ("mul.rn.bf16x2 $0, $0, p;\nmul.rn.bf16x2 $1, $1, p;\nmul.rn.bf16x2 $2, $2, p;\n"
               "mul.rn.bf16x2 $3, $3, p;\n")


def placed_scaled_asm(byte: int) -> str:
    """PLACED_TO_BF16_ASM's decode of a packed word ($4) times the scale of byte ``byte`` of
    the scale word $5 (``_scale_pair``): the 4 registers exact for every finite value, NaN
    for byte 255, infinite past bf16's range."""
    return ("{\n" + _PLACED_REGS + "\n.reg .b32 p, u;\n" + _scale_pair("$5", byte)
            + _PLACED_BODY + _TIMES_PAIR + "}")


@triton.jit
def e2m1_tables(zeros):
    """The lookup words of E2M1_TO_BF16_ASM in int32 tensors shaped as ``zeros`` (int32 zeros
    the compiler cannot know are zero): the lane id times those zeros makes them values of each
    thread, so ptxas holds them in registers instead of copying them out of uniform registers
    before every use (a third more instructions in the loop)."""
    return tl.inline_asm_elementwise(
        "{.reg .u32 t; mov.u32 t, %laneid; mul.lo.u32 t, t, $2; or.b32 $0, t, 0xC0800000; "
        "or.b32 $1, t, 0x3F3F3F00;}", "=r,=r,r", [zeros], dtype=(tl.int32, tl.int32),
        is_pure=True, pack=1)


@triton.jit
def bf16_scale_pairs(byte):
    """Pairs of bf16 2^(byte - 127) (int32: the same bf16 in both halves) of E8M0 bytes (int32):
    the byte shifted into the exponent field, byte 0 2^-127 (bf16 subnormal 0x0040), byte 255
    NaN (0x7FC0)."""
    s = tl.maximum(byte << 7, 0x40) | (((byte + 1) >> 8) << 6)
    return s | (s << 16)


@triton.jit
def e2m1_scaled_bf16(words, tables, scale_bytes):
    """Words of 8 E2M1 codes (int32) times their blocks' E8M0 scales (``scale_bytes``, int32
    bytes, shaped as ``words``) as 4 int32 tensors of bf16 pairs, register i holding codes 2 i
    (low half) and 2 i + 1, exact for every finite result. ``tables``: ``e2m1_tables``."""
    r = tl.inline_asm_elementwise(E2M1_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r",
                                  [words, tables[0], tables[1]], dtype=(tl.int32,) * 4,
                                  is_pure=True, pack=1)
    return scaled_bf16(r[0], r[1], r[2], r[3], scale_bytes)


@triton.jit
def placed_to_bf16(words):
    """Packed words of 8 codes (int32, bits as ``mxfp4.PLACES``) as 4 int32 tensors of bf16
    pairs, register i holding codes 2 i (low half) and 2 i + 1, as ``e2m1_scaled_bf16``'s
    decode."""
    return tl.inline_asm_elementwise(PLACED_TO_BF16_ASM, "=r,=r,=r,=r,r", [words],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def scaled_bf16(r0, r1, r2, r3, scale_bytes):
    """4 int32 tensors of bf16 pairs times their blocks' E8M0 scales (``scale_bytes``, int32),
    exact for every finite result."""
    return tl.inline_asm_elementwise(SCALE_BF16X2_ASM, "=r,=r,=r,=r,r,r,r,r,r",
                                     [r0, r1, r2, r3, bf16_scale_pairs(scale_bytes)],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)


@triton.jit
def placed_scaled_bf16(words, scale_bytes):
    """``e2m1_scaled_bf16`` for packed words (bits as ``mxfp4.PLACES``)."""
    r = placed_to_bf16(words)
    return scaled_bf16(r[0], r[1], r[2], r[3], scale_bytes)

