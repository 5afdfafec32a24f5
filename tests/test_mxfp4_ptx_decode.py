"""The inline PTX that decodes E2M1 codes in the Gluon MXFP4 kernels (``gemm_w4frag``'s
``E2M1_TO_BF16_ASM``), run on the CPU by a small emulator of the PTX instructions it uses
(``and``, ``shr``, ``shl``, ``prmt``, ``lop3``, ``mov``, ``mul.lo``, ``add.u32``,
``max.u16x2``, ``mul.rn.bf16x2``, with the PTX ISA's semantics), bit for bit against
``mxfp4.e2m1_values`` in bf16: every code at every place of a word, and random words, as
quantised and packed (their bits placed); ``gemm_w4wg``'s byte gather and bf16 scale multiply
around it; and the packed decode that scales in the same block (``placed_scaled_asm``) at
every scale byte, at each byte of the scale word. The GPU tests
run the real instructions; this catches an edit of the asm text without a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from gemmtune.kernels import mxfp4
from gemmtune.kernels.triton._e2m1_ptx import (E2M1_TO_BF16_ASM, PLACED_TO_BF16_ASM,
                                               SCALE_BF16X2_ASM, placed_scaled_asm)

MASK = np.uint64(0xFFFFFFFF)


def _prmt(a, b, selector):
    """prmt.b32 (default mode): byte i of the result is byte (selector nibble i) & 7 of the 8
    bytes {a, b}, or with the nibble's bit 3 set, that byte's sign bit copied to all 8 bits."""
    pool = (a & MASK) | ((b & MASK) << np.uint64(32))
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> ((nibble & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= np.where(nibble & np.uint64(8), sign, byte) << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut):
    """lop3.b32: each bit of the result is bit (a b c as a 3-bit index) of ``lut``."""
    out = np.zeros_like(a)
    for index in range(8):
        if lut >> index & 1:
            pick = [x if index >> shift & 1 else ~x & MASK
                    for x, shift in ((a, 2), (b, 1), (c, 0))]
            out |= pick[0] & pick[1] & pick[2]
    return out


def run_ptx(asm: str, operands: dict[str, np.ndarray], muls=None) -> dict[str, np.ndarray]:
    """Run the instructions of an inline-asm block on uint64 arrays holding 32-bit values:
    ``operands`` the inputs by name ($4 ...), the result every register written by name;
    ``muls`` emulates mul.rn.bf16x2 where the block has it."""
    regs = dict(operands)

    def value(token):
        token = token.strip()
        if token.startswith("0x") or token.isdigit():
            return np.uint64(int(token, 0))
        return regs[token]

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dest, *srcs = [a.strip() for a in args.split(",")]
        v = [value(s) for s in srcs]
        if op == "and.b32":
            out = v[0] & v[1]
        elif op == "mov.b32":
            out = v[0] + 0 * next(iter(operands.values()))
        elif op == "mul.lo.u32":
            out = (v[0] * v[1]) & MASK
        elif op == "shr.b32":
            out = (v[0] & MASK) >> v[1]
        elif op == "shl.b32":
            out = (v[0] << v[1]) & MASK
        elif op == "prmt.b32":
            out = _prmt(v[0], v[1], v[2] & np.uint64(0xFFFF))
        elif op == "lop3.b32":
            out = _lop3(v[0], v[1], v[2], int(v[3]))
        elif op == "add.u32":
            out = (v[0] + v[1]) & MASK
        elif op == "max.u16x2":
            halves = [np.maximum((v[0] >> np.uint64(h)) & np.uint64(0xFFFF),
                                 (v[1] >> np.uint64(h)) & np.uint64(0xFFFF)) for h in (0, 16)]
            out = halves[0] | halves[1] << np.uint64(16)
        elif op == "mul.rn.bf16x2":
            out = (muls or _mul_bf16x2)(v[0], v[1])
        else:
            raise NotImplementedError(f"the emulator has no {op}")
        regs[dest] = out & MASK
    return regs


def _bf16_bits(values: torch.Tensor) -> np.ndarray:
    return (values.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF) \
        .astype(np.uint64)


def _decode(words: np.ndarray) -> np.ndarray:
    """The asm's 4 output registers of each word, as (words, 8) bf16 bit patterns in code
    order: register i holds codes 2 i (low half) and 2 i + 1."""
    # e2m1_tables: the lane id times zeros, or'd with the two table words
    regs = run_ptx(E2M1_TO_BF16_ASM.value, {"$4": words, "$5": np.uint64(0xC0800000) + 0 * words,
                                             "$6": np.uint64(0x3F3F3F00) + 0 * words})
    out = np.stack([regs[f"${i}"] for i in range(4)], axis=1)
    return np.stack([out & np.uint64(0xFFFF), out >> np.uint64(16)], axis=2).reshape(-1, 8)


def _expected(words: np.ndarray) -> np.ndarray:
    codes = torch.from_numpy(((words[:, None] >> (4 * np.arange(8, dtype=np.uint64)))
                              & np.uint64(0xF)).astype(np.int64))
    return _bf16_bits(mxfp4.e2m1_values(codes))


def _every_code_at_every_place() -> np.ndarray:
    """Words with code c at place i, every other place the code c + 1 + i (so neighbours
    differ)."""
    words = []
    for place in range(8):
        for code in range(16):
            others = [(code + 1 + i) % 16 for i in range(8)]
            others[place] = code
            words.append(sum(c << (4 * i) for i, c in enumerate(others)))
    return np.array(words, dtype=np.uint64)


def test_every_code_at_every_place_of_a_word():
    words = _every_code_at_every_place()
    np.testing.assert_array_equal(_decode(words), _expected(words))


def test_random_words():
    words = np.random.default_rng(0).integers(0, 2**32, size=100_000, dtype=np.uint64)
    np.testing.assert_array_equal(_decode(words), _expected(words))


def test_the_emulator_follows_the_ptx_isa():
    """prmt's sign replication and lop3's look-up table, on values whose answers the PTX ISA
    spells out."""
    a, b = np.array([0x80FF7F01], dtype=np.uint64), np.array([0x04030201], dtype=np.uint64)
    assert _prmt(a, b, np.uint64(0x7654))[0] == 0x04030201  # b's bytes
    assert _prmt(a, b, np.uint64(0x8B9A))[0] == 0x00FF00FF  # signs of a's bytes 2, 1, 3, 0
    x, y, z = (np.array([v], dtype=np.uint64) for v in (0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA))
    assert _lop3(x, y, z, 0x80)[0] == 0x80808080  # a & b & c
    assert _lop3(x, y, z, 0xF8)[0] == 0xF8F8F8F8  # a | (b & c)
    regs = run_ptx("max.u16x2 d, $1, $2;", {"$1": np.array([0x8000_0001], dtype=np.uint64),
                                             "$2": np.array([0x7FFF_0040], dtype=np.uint64)})
    assert regs["d"][0] == 0x8000_0040  # each half unsigned
    assert re.search(r"lop3\.b32 \w+, \w+, \w+, 0x80808080, 0xF8", E2M1_TO_BF16_ASM.value)


def _mul_bf16x2(a, b):
    """mul.rn.bf16x2: each half a bf16 product rounded to nearest even, subnormals kept."""
    out = np.zeros_like(a)
    for shift in (np.uint64(0), np.uint64(16)):
        fa = ((a >> shift) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
        fb = ((b >> shift) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
        with np.errstate(over="ignore", invalid="ignore"):
            product = (fa.view(np.float32) * fb.view(np.float32)).view(np.uint32)
        rounded = (product.astype(np.uint64) + np.uint64(0x7FFF)
                   + ((product.astype(np.uint64) >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        nan = np.isnan(product.view(np.float32))
        out |= np.where(nan, np.uint64(0x7FC0), rounded & np.uint64(0xFFFF)) << shift
    return out


def test_the_prefill_kernels_gather_decode_and_scale():
    """triton.w4wg's three asm blocks on a block row of 16 bytes: thread t of a quad gathers
    bytes t, t + 4, t + 8, t + 12, the decode makes register i its codes at K 8 i + 2 t and
    8 i + 2 t + 1 of the block (wgmma's A fragment), and the bf16 scale multiply gives the
    dequantised value bit for bit at every scale byte up to 252 (6 x 2^125), infinity past it
    where the value is past fp32's range, NaN at byte 255."""
    from gemmtune.kernels.triton.gemm_w4wg import _GATHER_ASM

    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, size=(4096, 16), dtype=np.uint64)
    rows[:256, 0] = np.arange(256, dtype=np.uint64)  # every byte at a place at least once
    words = [rows[:, 4 * j] | rows[:, 4 * j + 1] << np.uint64(8) | rows[:, 4 * j + 2]
             << np.uint64(16) | rows[:, 4 * j + 3] << np.uint64(24) for j in range(4)]
    codes = torch.from_numpy(np.stack([rows & np.uint64(15), rows >> np.uint64(4)], axis=2)
                             .reshape(-1, 32).astype(np.int64))  # element k of each block
    scale_bytes = torch.arange(256)
    scales = torch.where(scale_bytes == 255, torch.nan, torch.pow(2.0, scale_bytes - 127.0))
    scale_bits = _bf16_bits(scales)
    for t in range(4):
        selector = np.uint64(t | (t + 4) << 4) + 0 * words[0]
        mine = run_ptx(_GATHER_ASM.value,
                       {"$1": words[0], "$2": words[1], "$3": words[2], "$4": words[3],
                        "$5": selector})["$0"]
        decoded = _decode(mine).reshape(-1, 4, 2)  # (row, register i, half)
        k = 8 * np.arange(4)[:, None] + 2 * t + np.arange(2)[None, :]
        np.testing.assert_array_equal(decoded, _bf16_bits(mxfp4.e2m1_values(codes[:, k])))
        for byte in (0, 1, 2, 7, 126, 127, 128, 200, 252, 253, 254, 255):
            pair = np.uint64(int(scale_bits[byte]) * 0x10001) + 0 * mine
            regs = {f"${4 + i}": (decoded[:, i, 0] | decoded[:, i, 1] << np.uint64(16))
                    for i in range(4)}
            scaled = run_ptx(SCALE_BF16X2_ASM.value, {**regs, "$8": pair}, muls=_mul_bf16x2)
            got = np.stack([scaled[f"${i}"] for i in range(4)], axis=1)
            got = np.stack([got & np.uint64(0xFFFF), got >> np.uint64(16)], axis=2)
            want = mxfp4.e2m1_values(codes[:, k]) * scales[byte]
            want_bits = _bf16_bits(want)
            same = (got == want_bits) | (np.isnan(want.numpy()) & ((got & np.uint64(0x7FFF))
                                                                  > np.uint64(0x7F80)))
            assert same.all(), (t, byte)


def _placed(words: np.ndarray) -> np.ndarray:
    """Words of 8 codes as quantised -> the packed layout's words (``mxfp4.PLACES``)."""
    placed = np.zeros_like(words)
    for i, (magnitude, sign) in enumerate(mxfp4.PLACES):
        code = (words >> np.uint64(4 * i)) & np.uint64(15)
        placed |= ((code & np.uint64(7)) << np.uint64(magnitude)) \
            | ((code >> np.uint64(3)) << np.uint64(sign))
    return placed


def _places_test_words() -> np.ndarray:
    random = np.random.default_rng(2).integers(0, 2**32, size=50_000, dtype=np.uint64)
    return np.concatenate([_every_code_at_every_place(), random])


def test_packed_words_decode_from_their_placed_bits():
    """PLACED_TO_BF16_ASM on the packed layout's words (mxfp4.prepack's bit placing, as here
    and as ``_placed`` checks against prepack): the 4 registers the PRMT decode makes of the
    same codes, bit for bit: every code at every place, zeros and 0.5 (subnormal before the
    multiply by 2^126) included."""
    words = _places_test_words()
    regs = run_ptx(PLACED_TO_BF16_ASM.value, {"$4": _placed(words)})
    out = np.stack([regs[f"${i}"] for i in range(4)], axis=1)
    got = np.stack([out & np.uint64(0xFFFF), out >> np.uint64(16)], axis=2).reshape(-1, 8)
    np.testing.assert_array_equal(got, _expected(words))
    # the same placing as mxfp4.prepack's (a 64-byte group of one row: its 16 words)
    group = words[:16].astype(np.uint32).view(np.uint8)  # 4 blocks of 16 bytes
    codes = torch.from_numpy(group.copy()).reshape(1, 64)
    packed = mxfp4.prepack(torch.cat([codes, codes], dim=1))[0, :64].view(torch.int32)
    # word t of block j: its bytes t, t + 4, t + 8 and t + 12, stored at 4 t + j
    gathered = group.reshape(4, 4, 4).transpose(0, 2, 1).copy().view(np.uint32).reshape(4, 4)
    stored = gathered.T.reshape(16).astype(np.uint64)
    np.testing.assert_array_equal(packed.numpy().astype(np.int64) & 0xFFFFFFFF,
                                  _placed(stored).astype(np.int64))


def _scaled_expected(words: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """Each word's 8 codes times 2^(byte - 127) (NaN for byte 255) rounded once to bf16."""
    codes = torch.from_numpy(((words[:, None] >> (4 * np.arange(8, dtype=np.uint64)))
                              & np.uint64(0xF)).astype(np.int64))
    exponent = torch.from_numpy(scale_bytes.astype(np.int64))[:, None]
    scales = torch.where(exponent == 255, torch.nan, torch.pow(2.0, exponent - 127.0))
    return _bf16_bits(mxfp4.e2m1_values(codes) * scales)


def _registers(regs) -> np.ndarray:
    out = np.stack([regs[f"${i}"] for i in range(4)], axis=1)
    return np.stack([out & np.uint64(0xFFFF), out >> np.uint64(16)], axis=2).reshape(-1, 8)


def _same_or_both_nan(got: np.ndarray, want: np.ndarray) -> None:
    nan = (want & np.uint64(0x7FFF)) > np.uint64(0x7F80)
    assert ((got == want) | (nan & ((got & np.uint64(0x7FFF)) > np.uint64(0x7F80)))).all()


def test_the_scaled_packed_decode_gives_every_value_at_every_scale_byte():
    """placed_scaled_asm(j) (a packed word and a scale word whose byte j is its block's): the
    codes times 2^(byte - 127) rounded once to bf16 for every byte, 2^-127's multiples (byte
    0: bf16 subnormals) and the values past bf16's range (infinite) included, NaN for byte
    255; the scale word's other bytes do not matter."""
    words = np.concatenate([np.tile(_every_code_at_every_place(), 2), np.random.default_rng(
        3).integers(0, 2**32, size=4096, dtype=np.uint64)])
    noise = np.random.default_rng(4).integers(0, 2**32, size=words.size, dtype=np.uint64)
    for byte in range(256):
        scale_bytes = np.full(words.size, byte, dtype=np.uint64)
        want = _scaled_expected(words, scale_bytes)
        for j in range(4):
            place = np.uint64(8 * j)
            scale_word = (noise & ~(np.uint64(0xFF) << place)) | (scale_bytes << place)
            got = _registers(run_ptx(placed_scaled_asm(j), {"$4": _placed(words),
                                                            "$5": scale_word}))
            _same_or_both_nan(got, want)
