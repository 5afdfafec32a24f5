"""A register-direct MXFP4-weight decode GEMM, in Gluon: ``y = x @ dequant(wq, w_scale).T + bias``
for bf16 x, or MXFP4 x (``gemm_a4w4_blockscale``: its codes and scales, decoded the same way),
up to 32 rows of x a program (the tuner offers it to M = 128), each thread loading its own codes
of w straight into the registers the MMA takes its A operand from.

Swapped as ``triton.frag`` is (y.T = w @ x.T): a program's 64 rows of w are the MMA's M (4
warps, 16 rows each; or 2 warps of 32 rows, ``warps``), x's rows its N (BLOCK_M, 8-32). Every
warp loads x's whole block for its rows, so with fewer warps x crosses L1 fewer times for the
same w (Nsight Compute found the 4-warp kernel waiting on L1 two thirds of its stalls, x
replicated in each warp), for more registers a thread. Per 32-element scale block, each
thread holds one 32-bit word (8 codes) of each of its 2 rows of each 16; an inline-PTX decode
(``e2m1_to_bf16``: PRMT table lookups, 15 ALU instructions a word; for the packed layout,
whose bits ``mxfp4.prepack`` placed, masks and shifts: 7 ALU instructions, 4 integer
multiplies and 4 bf16 multiplies: 0.99-1.19x, 1.095x geomean on an H200) makes them bf16 in the A
layout (exact: E2M1 values are 0-6 with one mantissa bit); x's 32 x BLOCK_M block comes in the
B layout; ``mma.sync`` multiplies them from zero into fp32, and the product is scaled by the
block's power of two (of x's row too, for MXFP4 x with w as quantised) in fp32, exact for every
scale byte, before its add. A NaN scale (byte 255) makes its row's outputs NaN. As quantised,
there is no shared memory in the loop and no barrier.

As quantised, both operands use the MMA's K order with 8 consecutive elements a thread
(``k_width`` 8): the sum over K is the same in any order, so w's codes load as one 32-bit word
a row and block, x's as 16-byte vectors (MXFP4 x: a word), and a row's scale bytes of 4 blocks
as one word. The loop takes two groups of 4 blocks an iteration in a software pipeline (each
group's loads issued while the group before it is multiplied); many small programs (about
60-100 registers a thread) keep the weight stream wide.

Packed by ``mxfp4.prepack``, a thread's words of 4 blocks come in one 16-byte load, each word
holding the block's elements 8 r + 2 t and 8 r + 2 t + 1 (r = 0-3): the MMA's natural fragment
(``k_width`` 2), what ``triton.w4wg``'s warpgroup MMA takes too, so that one layout serves both
kernels. x must then come in K order, which global loads straight into registers would take 4
bytes at a time: it goes through shared memory instead, a group of 4 blocks at a time, loaded
once a program (not once a warp) while the group before it multiplies, stored once every warp
has read the slot (two barriers a group) and read by ``ldmatrix``; MXFP4 x's codes are decoded
and scaled (in bf16, exactly: its range is fp32's) as they are stored, once a program instead
of once a warp, so that each block's product takes w's scale alone as with bf16 x (1.07-1.14x
the best config per shape where x was scaled in each product, H200, docs/benchmarks.md,
session 40). As with bf16 x, a block's sum of x's values times w's codes (at most 6) must then
stay within fp32's range before w's scale multiplies it: from x's scale byte 245 or so (|x|
past 2^118) it can overflow to infinity where the reference's is finite. An x past bf16's
range is infinite before the MMA, its outputs infinite or NaN, as in the fp32 reference's
matmul.

Why: the ``tl.dot_scaled`` route (``triton.w4`` DS1) spends about 11 instructions a weight
element in its scale broadcast and layout changes and reached 0.6 TB/s; Triton's own E2M1
upcast (``gl.fp4_to_fp``) took 24 instructions a word (docs/benchmarks.md, sessions 23-24). K
split over the grid's second axis, x's row blocks on its third, and the end (bias, output
dtype, the splits' sum in order or added) is ``_swapped.finish_tile``.

Hopper (sm_90) only, compiled (Gluon does not run in Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from gemmtune.kernels import mxfp4
from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (PDL_OFF, launch_variants, split_for,
                                             why_not_wait_pdl)
from gemmtune.kernels.triton._swapped import (BLOCK_N, NUM_WARPS, barrier, finish_tile,
                                              release_then_wait, split_steps,
                                              why_not_add_splits, why_not_grid)
from gemmtune.kernels.triton._e2m1_ptx import E2M1_TO_BF16_ASM, e2m1_tables, placed_to_bf16
from gemmtune.kernels.triton._w4_gluon import (halves, in_k_order, joined_codes, packed_blocks,
                                               split_k_call, x_group_loads, x_in_bf16,
                                               x_staged, x_words)
from gemmtune.kernels.triton._mxfp4_calls import (scaled_launcher, validated_launch,
                                                  why_not_gluon_call, why_not_gluon_x)
from gemmtune.kernels.triton.gemm_w4deq import W4DeqConfig, dequantize

KERNEL_PREFIX = "triton.w4frag"
_BN = gl.constexpr(BLOCK_N)
_BLOCK = gl.constexpr(mxfp4.BLOCK)
# x's rows per program: the MMA's N in blocks of 8. From 64, x's step alone would take 128
# registers a thread (each warp holds all of it).
BLOCK_MS = (8, 16, 32)
BLOCK_KS = (32, 64, 128, 256)  # K per step: whole scale blocks, unrolled
MAX_SPLIT_K = 32
# Warps a program: 2 beat 4 at 1-8 rows of x on narrow weights (H100); 1 (64 rows a warp) lost
# to 2 on every shape timed (docs/benchmarks.md, session 28)
WARPS = (2, 4)
_MOST_ROWS_OF_X = {2: 16, 4: 32}  # block_m each warp count takes without spilling
# Rows of x up to which the tuner offers the kernel: past 32 in tiles of x's rows, each decoding
# the same w again (from L2), which can still beat the prefill kernels to M of about a hundred
MAX_M = 128


@dataclass(frozen=True)
class W4FragConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.w4frag:BM8.BK128.SK4.P1.R1``."""

    NAME_CODEC = NameCodec("register-direct MXFP4 config", KERNEL_PREFIX, (
        Field("BM", "block_m"), Field("BK", "block_k"), Field("SK", "split_k"),
        Field("P", "pdl", default=PDL_OFF), Field("R", "add_splits", default=0),
        Field("L", "packed", default=0), Field("X", "x_first", default=0),
        Field("W", "warps", default=NUM_WARPS), Field("XB", "x_by_block", default=0)))

    block_m: int
    block_k: int
    split_k: int
    # PDL_OFF or PDL_WAIT (with block_k 128-256 w's first group loads before the wait, the rest
    # after it: x may be the previous kernel's output; a w copied by w4frag_call goes without)
    pdl: int = PDL_OFF
    # 1: the splits add their partials into one fp32 sum per tile (_swapped.finish_tile)
    add_splits: int = 0
    # 1: w in the packed layout (``mxfp4.prepack``): each thread's codes of 4 blocks of a row
    # in one 16-byte load; 0: as ``mxfp4.quantize`` makes it (a 4-byte load a block)
    packed: int = 0
    # MXFP4 x only. 1: x dequantised to bf16 by a launch of its own first (exact), then the
    # bf16-x kernel: each program's 4 warps no longer decode the same x, for a second launch;
    # 0: x's codes decoded in the loop. Two launches are not replayed (``replayed``).
    x_first: int = 0
    # Warps a program (``WARPS``), its 64 rows of w split among them (16 rows an MMA): each
    # warp loads the whole of x's block for its rows, so fewer warps with more rows each load
    # x (L1 traffic) fewer times for the same w
    warps: int = NUM_WARPS
    # Packed only. 1: each block's B operand read from shared memory just before its MMA;
    # 0: the group's 4 blocks read at once. With 2 warps and bf16 x, a block at a time gained
    # up to 1.3x on some configs and lost up to 1.4x on others (docs/benchmarks.md, session 39)
    x_by_block: int = 0


def why_not_fits(config: W4FragConfig, M: int, N: int, K: int,
                 dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM with ``dtype`` x, or None."""
    c = config
    why = why_not_gluon_x("register-direct MXFP4 kernel", dtype)
    if why is not None:
        return why
    if c.block_m not in BLOCK_MS:
        return f"block_m={c.block_m} must be one of {BLOCK_MS}"
    if c.block_k not in BLOCK_KS:
        return f"block_k={c.block_k} must be one of {BLOCK_KS}"
    problem = why_not_wait_pdl(c.pdl) or why_not_add_splits(c) or mxfp4.why_not_quantisable(K)
    if problem is not None:
        return problem
    if c.packed not in (0, 1):
        return f"packed={c.packed} must be 0 (w as quantised) or 1 (w packed: mxfp4.prepack)"
    if c.x_first not in (0, 1) or (c.x_first and dtype != torch.uint8):
        return (f"x_first={c.x_first}: 1 dequantises MXFP4 x first (x of {dtype} here), 0 "
                f"decodes it in the loop")
    if c.x_by_block not in (0, 1) or (c.x_by_block and not c.packed):
        return (f"x_by_block={c.x_by_block}: 1 reads x's blocks from shared memory one at a "
                f"time, which only a packed config (packed=1) stages x in; else 0")
    if c.packed and c.block_k % mxfp4.PACK_GROUP:
        return (f"block_k={c.block_k}: a packed w is read in groups of {mxfp4.PACK_GROUP} of K; "
                f"use block_k 128 or 256")
    if K % c.block_k:
        return f"K={K} is not a multiple of block_k={c.block_k}: use a block_k that divides it"
    if c.warps not in WARPS:
        return (f"warps={c.warps} must be one of {WARPS} (a program's 64 rows of w, 16 rows an "
                f"MMA, split among its warps)")
    if c.block_m > _MOST_ROWS_OF_X[c.warps]:
        # ptxas: 2 warps at 32 rows of x spilled 20 B
        return (f"warps={c.warps} with block_m={c.block_m}: a thread's share of x's rows and of "
                f"w's spills registers; {c.warps} warps take block_m <= "
                f"{_MOST_ROWS_OF_X[c.warps]}")
    return why_not_grid(c, M, K, K // c.block_k, MAX_SPLIT_K)


def why_not_supported(config: W4FragConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output (x's dtype; with MXFP4 x, ``dtype`` uint8, bf16, fp16 or
    fp32), and whether the kernel can run here."""
    return (why_not_gluon_call("register-direct MXFP4 kernel", dtype, out_dtype)
            or why_not_fits(config, M, N, K, dtype))


# Programs per SM the splits aim at (a program streams 64 rows x BLOCK_K / 2 bytes a step).
_PROGRAMS_PER_SM = (1, 2, 4, 8)


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF, packed: bool = False) -> list[W4FragConfig]:
    """The configs to tune one shape with, for M <= MAX_M, for w as quantised or (``packed``) as
    ``mxfp4.prepack`` stores it: block_m covering M (past 32, tiles of 32 rows of x); each
    block_k of 64-256 (packed: 128-256) dividing K (32 where none does); K split to reach each
    of ``_PROGRAMS_PER_SM``; without PDL and with ``pdl``; split sums in order and added; MXFP4
    x (``dtype`` uint8) decoded in the loop and dequantised first; packed with 2 warps and bf16
    x, x's blocks read at once and one at a time. Only configs that fit."""
    if M > MAX_M or dtype not in (torch.bfloat16, torch.uint8):
        return []
    num_sms = num_sms or _checks.sm_count()
    bm = next((b for b in BLOCK_MS if b >= M), BLOCK_MS[-1])
    steps = [bk for bk in BLOCK_KS[1:] if K % bk == 0 and bk % (
        mxfp4.PACK_GROUP if packed else 1) == 0] or ([] if packed else [BLOCK_KS[0]])
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, bm)
    found = {}
    for bk in steps:
        for per_sm in _PROGRAMS_PER_SM:
            split = split_for(tiles, K // bk, per_sm * num_sms, MAX_SPLIT_K)
            for mode, add in launch_variants(split, pdl):
                for x_first in (0, 1) if dtype == torch.uint8 else (0,):
                    for warps in _warps_to_try(bm, mode == pdl and add == int(split > 1)):
                        for by_block in _x_by_block_to_try(packed, warps, dtype):
                            cfg = W4FragConfig(bm, bk, split, mode, add, int(packed), x_first,
                                               warps, by_block)
                            if why_not_fits(cfg, M, N, K, dtype) is None:
                                found[cfg] = None
    return list(found)


def _warps_to_try(block_m: int, beside_pdl_and_added: bool) -> tuple[int, ...]:
    """4 warps a program; beside PDL with the splits added (the 4-warp winners), to 16 rows of
    x, also 2 (ptxas: 91 and 128 registers at 8 rows, 128 at 16 for 2 warps)."""
    if not beside_pdl_and_added or block_m > _MOST_ROWS_OF_X[2]:
        return (NUM_WARPS,)
    return (NUM_WARPS, 2)


def _x_by_block_to_try(packed: bool, warps: int, dtype: torch.dtype) -> tuple[int, ...]:
    """x's group read at once; packed with 2 warps and bf16 x, also a block at a time (where it
    changes the code ptxas makes: 4 warps, and MXFP4 x, ran the same or slower)."""
    return (0, 1) if packed and warps == 2 and dtype == torch.bfloat16 else (0,)


def replayed(config: W4FragConfig) -> bool:
    """Whether dispatch may replay a recording of the config's launch: not where x is
    dequantised by a launch of its own first."""
    return not config.x_first


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> W4FragConfig:
    """Reasonable untuned: 128 of K a step where it divides K (else 32), K split until there
    are 4 programs per SM."""
    num_sms = num_sms or _checks.sm_count()
    bm = next((b for b in BLOCK_MS if b >= M), BLOCK_MS[-1])
    bk = 128 if K % 128 == 0 else 32
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(M, bm)
    return W4FragConfig(bm, bk, split_for(tiles, max(1, K // bk), 4 * num_sms, MAX_SPLIT_K))


@gluon.jit
def _block_scale(word, j: gl.constexpr):
    """2^(byte - 127) in fp32 for byte ``j`` of the rows' scale words (int32): shifted into
    the exponent field, byte 0 made 2^-127 (subnormal: the maximum with its bit pattern).
    Byte 255 (NaN) comes out infinite here: ``_nan_scales`` marks its rows."""
    if j == 3:
        field = (word >> 1) & 0x7F800000
    else:
        field = (word << (23 - 8 * j)) & 0x7F800000
    return gl.maximum(field, 0x00400000).to(gl.float32, bitcast=True)


@gluon.jit
def _scale_word(ptrs, step, SCALE_BYTES: gl.constexpr):
    """A step's 1 or 2 scale bytes of each row (uint8 / int16 loads) as int32."""
    word = gl.load(ptrs + step).to(gl.int32)
    if SCALE_BYTES == 2:  # int16, sign-extended
        word = word & 0xFFFF
    return word


@gluon.jit
def _nan_scales(seen, word):
    """``seen`` with bit 7 of a byte set where that byte of ``word`` is 255 (an E8M0 NaN).
    Exact for whether a word has one, not for which byte (a borrow can flag a higher byte):
    a row is NaN where any of its scales is, so that is all that is needed."""
    return seen | ((~word - 0x01010101) & word & -0x7F7F7F80)  # 0x80808080 as int32


@gluon.jit
def _e2m1_codes(words, tables, PLACED: gl.constexpr):
    """(R, T) int32 words of 8 codes each -> (R, T, 2, 2, 2) bf16, code i of a word at
    (i % 2, i // 2 % 2, i // 4), in the word's thread. ``PLACED``: the packed layout's words
    (their bits placed: masks and shifts decode them), else words as quantised (PRMT look-ups
    in ``tables``)."""
    if PLACED:
        r = placed_to_bf16(words)
    else:
        r = gl.inline_asm_elementwise(E2M1_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r",
                                      [words, tables[0], tables[1]], dtype=(gl.int32,) * 4,
                                      is_pure=True, pack=1)
    return joined_codes(r)


@gluon.jit
def e2m1_to_bf16(words, tables, PLACED: gl.constexpr):
    """(R, T) int32 words of 8 codes each -> (R, 8 T) bf16: word t's codes are elements 8 t to
    8 t + 7 (the MMA's K order, whichever K of w they are), in the word's thread (``PLACED``:
    as ``_e2m1_codes``)."""
    # (R, T, i // 4, ..., i % 2)
    codes = gl.permute(_e2m1_codes(words, tables, PLACED), [0, 1, 4, 3, 2])
    return gl.reshape(codes, [words.shape[0], 8 * words.shape[1]])


@gluon.jit
def _x_codes_bf16(words, tables, b_layout: gl.constexpr):
    """A block of MXFP4 x's words (4, BLOCK_M): thread t of a column its word t, 8 codes) as
    (32, BLOCK_M) bf16 in the B layout, unscaled."""
    # (t, i // 4, ..., i % 2, m)
    codes = gl.permute(_e2m1_codes(words, tables, False), [0, 4, 3, 2, 1])
    return gl.convert_layout(gl.reshape(codes, [8 * words.shape[0], words.shape[1]]), b_layout,
                             assert_trivial=True)


@gluon.jit
def _add_block(acc, words, scale, x, x_scale, a_layout: gl.constexpr, b_layout: gl.constexpr,
               tables, X_MXFP4: gl.constexpr, PACKED: gl.constexpr, X_BY_BLOCK: gl.constexpr):
    """``acc`` plus one 32-element scale block's product: ``words`` (64, 4) int32 (each
    thread's 8 codes of a row), ``scale`` (64,) fp32, ``x`` x's words (``_load_x``; with
    ``X_MXFP4`` x's codes; ``PACKED``, x's block as the B operand, ``_x_blocks``, or with
    ``X_BY_BLOCK`` its place in shared memory, read here), ``x_scale`` (BLOCK_M,) fp32 x's
    scales with ``X_MXFP4`` (else unused). ``tables``: e2m1_tables for w's words and for
    x's."""
    if PACKED:
        w = gl.convert_layout(in_k_order(_e2m1_codes(words, tables[0], True)), a_layout,
                              assert_trivial=True)
    else:
        w = gl.convert_layout(e2m1_to_bf16(words, tables[0], False), a_layout,
                              assert_trivial=True)
    # From zero per block: the block's scales multiply its product exactly in fp32. Packed,
    # x is already the B operand (from shared memory, ``_x_blocks``; MXFP4 x's codes decoded
    # and scaled: the caller passes X_MXFP4 false).
    if X_BY_BLOCK:
        xb = x.permute((1, 0)).load(b_layout)
    elif PACKED:
        xb = x
    elif X_MXFP4:
        xb = _x_codes_bf16(x, tables[1], b_layout)
    else:
        xb = _x_bf16(x, b_layout)
    product = mma_v2(w, xb, gl.zeros_like(acc))
    if X_MXFP4:
        acc = acc + product * (scale[:, None] * x_scale[None, :])
    else:
        acc = acc + product * scale[:, None]
    return acc


@gluon.jit
def _x_scale_word(xs_ptrs, group, no_scales, X_MXFP4: gl.constexpr):
    """MXFP4 x's rows' 4 scale bytes of a group as one word (else ``no_scales``)."""
    if X_MXFP4:
        word = gl.load(xs_ptrs + group)
    else:
        word = no_scales
    return word


@gluon.jit
def _x_blocks(tile, BLOCK_M: gl.constexpr, b_layout: gl.constexpr):
    """The 4 blocks of x's group in shared memory (``tile``: block j's rows at j BLOCK_M) as
    B operands (32, BLOCK_M) in K order."""
    x0, x1, x2, x3 = _x_places(tile, BLOCK_M)
    return (x0.permute((1, 0)).load(b_layout), x1.permute((1, 0)).load(b_layout),
            x2.permute((1, 0)).load(b_layout), x3.permute((1, 0)).load(b_layout))


@gluon.jit
def _x_places(tile, BLOCK_M: gl.constexpr):
    """The 4 blocks of x's group in shared memory (``tile``: block j's rows at j BLOCK_M), not
    yet read (``_add_block`` reads each as its B operand)."""
    return (tile.slice(0, BLOCK_M), tile.slice(BLOCK_M, BLOCK_M),
            tile.slice(2 * BLOCK_M, BLOCK_M), tile.slice(3 * BLOCK_M, BLOCK_M))


@gluon.jit
def _load_x(x_ptrs, block, X_MXFP4: gl.constexpr):
    """x's 32-element block as int32 words (so that a block carried to the next iteration
    stays whole registers): (16, BLOCK_M), two bf16 a word; with ``X_MXFP4`` (4, BLOCK_M), 8
    codes a word."""
    return gl.load(x_ptrs + block.to(gl.int64) * x_words(X_MXFP4))


@gluon.jit
def _x_bf16(words, b_layout: gl.constexpr):
    """A block of x's words (16, BLOCK_M) as (32, BLOCK_M) bf16 in the B layout (no
    instruction: the conversion is checked trivial)."""
    pairs = gl.permute(halves(words), [0, 2, 1])  # (word, half, row)
    return gl.convert_layout(gl.reshape(pairs, [2 * words.shape[0], words.shape[1]]), b_layout,
                             assert_trivial=True)


@gluon.jit
def _add_group(acc, nan_seen, word, c0, c1, c2, c3, x0, x1, x2, x3, x_word,
               a_layout: gl.constexpr, b_layout: gl.constexpr, tables, X_MXFP4: gl.constexpr,
               PACKED: gl.constexpr, X_BY_BLOCK: gl.constexpr):
    """``acc`` and ``nan_seen`` with a group of 4 blocks added: ``word`` the rows' 4 scale
    bytes, c0-c3 the blocks' code words (``PACKED``: the packed layout's), x0-x3 x's blocks
    (``_add_block``: ``X_BY_BLOCK``, their places in shared memory), ``x_word`` x's rows' 4
    scale bytes with ``X_MXFP4`` (else unused). ``nan_seen``: (w's rows' flags, x's rows'
    flags)."""
    acc = _add_block(acc, c0, _block_scale(word, 0), x0, _block_scale(x_word, 0), a_layout,
                     b_layout, tables, X_MXFP4, PACKED, X_BY_BLOCK)
    acc = _add_block(acc, c1, _block_scale(word, 1), x1, _block_scale(x_word, 1), a_layout,
                     b_layout, tables, X_MXFP4, PACKED, X_BY_BLOCK)
    acc = _add_block(acc, c2, _block_scale(word, 2), x2, _block_scale(x_word, 2), a_layout,
                     b_layout, tables, X_MXFP4, PACKED, X_BY_BLOCK)
    acc = _add_block(acc, c3, _block_scale(word, 3), x3, _block_scale(x_word, 3), a_layout,
                     b_layout, tables, X_MXFP4, PACKED, X_BY_BLOCK)
    return acc, (_nan_scales(nan_seen[0], word), _nan_scales(nan_seen[1], x_word))


@gluon.jit
def _load_group(w_ptrs, s_ptrs, group, PACKED: gl.constexpr, word_layout: gl.constexpr):
    """A group's scale words (a row's 4 bytes) and its 4 blocks' code words (64, 4) each: packed
    (mxfp4.prepack), one 16-byte load a row; as quantised, a word a row and block."""
    word = gl.load(s_ptrs + group)
    if PACKED:
        # First to leave the caches: w's codes are read once, x again by every program.
        # H200, bf16 and MXFP4 x: 1.00-1.10x the best config per shape (1.04 geomean); on
        # weights as quantised 0.93-1.05x by config, not taken (docs/benchmarks.md, session 37).
        codes = gl.load(w_ptrs + group.to(gl.int64) * 16, eviction_policy="evict_first")
        c0, c1, c2, c3 = packed_blocks(codes, _BN, word_layout)
    else:
        c0 = gl.load(w_ptrs + (group * 16).to(gl.int64))
        c1 = gl.load(w_ptrs + (group * 16 + 4).to(gl.int64))
        c2 = gl.load(w_ptrs + (group * 16 + 8).to(gl.int64))
        c3 = gl.load(w_ptrs + (group * 16 + 12).to(gl.int64))
    return word, c0, c1, c2, c3


@gluon.jit
def _load_x_group(x_ptrs, xs_ptrs, group, no_scales, X_MXFP4: gl.constexpr):
    """x's 4 blocks of a group (``_load_x``) and, with ``X_MXFP4``, its rows' 4 scale bytes as
    one word (``_x_scale_word``)."""
    return (_load_x(x_ptrs, group * 4, X_MXFP4), _load_x(x_ptrs, group * 4 + 1, X_MXFP4),
            _load_x(x_ptrs, group * 4 + 2, X_MXFP4), _load_x(x_ptrs, group * 4 + 3, X_MXFP4),
            _x_scale_word(xs_ptrs, group, no_scales, X_MXFP4))


@gluon.constexpr_function
def _x_per_word(x_mxfp4):
    """x's elements a word: 2 bf16, MXFP4 x 4 code bytes."""
    return 4 if x_mxfp4 else 2


@gluon.constexpr_function
def _x_layout(block_m, x_mxfp4, warps):
    """Where a block of x's words sits: in the B layout's places (each thread 8 consecutive of
    K of a row of x; rows past 8 in registers), a word two bf16 (16, BLOCK_M) or, MXFP4 x, 8
    codes (4, BLOCK_M)."""
    rows = [[0, 8 << i] for i in range(block_m.bit_length() - 4)]
    every_warp = [[0, 0]] * (warps.bit_length() - 1)  # each warp holds all of it
    if x_mxfp4:
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0]] + rows, lane_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=every_warp, block_bases=[], shape=[4, block_m])
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [0, 0]] + rows,
        lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]], warp_bases=every_warp,
        block_bases=[], shape=[16, block_m])


@gluon.constexpr_function
def _rows_on(warps, reg_bases, lane_bases, shape):
    """A layout of (64 rows, ...) words as the MMA's A operand places a program's rows: rows
    16 and 32 apart on the warps as far as there are warps, the rest on registers (the MMA's
    repetitions down M), ``reg_bases`` and ``lane_bases`` within a warp's 16 rows."""
    rows = [[16, 0], [32, 0]]
    on_warps = warps.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=reg_bases + rows[on_warps:], lane_bases=lane_bases,
        warp_bases=rows[:on_warps], block_bases=[], shape=shape)


@gluon.constexpr_function
def _word_layout(warps):
    """A block's words (64 rows, 4): each thread its word t of rows g and g + 8 of its 16
    (lane = 4 g + t), as the MMA's A operand holds them."""
    return _rows_on(warps, [[8, 0]], [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [64, 4])


@gluon.constexpr_function
def _group_layout(warps):
    """A packed group (64 rows, 16 stored words): each thread's 4 contiguous words (its word of
    each of 4 blocks) of rows g and g + 8."""
    return _rows_on(warps, [[0, 1], [0, 2], [8, 0]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                    [64, 16])


@gluon.jit(do_not_specialize=["M"])
def gemm_w4frag_kernel(
    x_ptr,  # (M, K) bf16, K contiguous; X_MXFP4: (M, K // 2) uint8 codes
    # (N, K // 2) uint8: two E2M1 codes a byte, the lower-index one in the low nibble; PACKED:
    # each row's 64-byte groups as mxfp4.prepack stores them
    wq_ptr,
    ws_ptr,  # (N, K // 32) uint8: E8M0 scales
    xs_ptr,  # X_MXFP4: (M, K // 32) uint8, x's scales; else unused
    y_ptr,  # (M, N)
    bias_ptr,  # (N,) or unused
    # (tiles, SPLIT_K, BLOCK_M, 64) fp32, or with ADD_SPLITS (tiles, BLOCK_M, 64) zeroed and
    # left zero; unused unless SPLIT_K > 1
    part_ptr,
    count_ptr,  # (tiles,) int32, zero on entry and left zero; unused unless SPLIT_K > 1
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_xsm, stride_ym, stride_bias,
    HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr, PDL: gl.constexpr, PER_LOAD: gl.constexpr,
    ADD_SPLITS: gl.constexpr, PACKED: gl.constexpr, X_MXFP4: gl.constexpr,
    X_BY_BLOCK: gl.constexpr,
):
    WARPS_HERE: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_HERE, 1],
                                                  instr_shape=[16, 8])
    # Each thread's 8 codes of a row and block (one 32-bit word, thread t of a row's 4 holding
    # word t of its 32-element block) become the A operand's 8 consecutive bf16; x's B operand
    # takes the same K order. Rows g and g + 8 of a warp's 16 (lane = 4 g + t), as the MMA's.
    # Packed, a word holds the block's elements 8 r + 2 t and 8 r + 2 t + 1: the MMA's natural
    # fragments, the operands in K order (k_width 2).
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma,
                                                 k_width=2 if PACKED else 8)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma,
                                                 k_width=2 if PACKED else 8)
    word_layout: gl.constexpr = _word_layout(WARPS_HERE)
    # A packed group (64 rows, 16 stored words): each thread's 4 contiguous words (its word of
    # each of 4 blocks) of rows g and g + 8.
    group_layout: gl.constexpr = _group_layout(WARPS_HERE)
    BLOCKS: gl.constexpr = BLOCK_K // _BLOCK
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    pid_m = gl.program_id(2)
    step_lo, step_hi = split_steps(split, K, BLOCK_K, SPLIT_K)

    # Rows past N read row 0 (their outputs are never stored): no mask in the loop.
    # w as 32-bit words (rows 4-byte aligned: w4frag_call); a block's row is 4 words.
    wq_words = wq_ptr.to(gl.pointer_type(gl.int32))
    if PACKED:
        n = pid_n * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, group_layout))
        w_ptrs = wq_words + gl.where(n < N, n, 0).to(gl.int64)[:, None] * (stride_wn // 4) \
            + gl.arange(0, 16, layout=gl.SliceLayout(0, group_layout))[None, :]
    else:
        n = pid_n * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, word_layout))
        w_ptrs = wq_words + gl.where(n < N, n, 0).to(gl.int64)[:, None] * (stride_wn // 4) \
            + gl.arange(0, 4, layout=gl.SliceLayout(0, word_layout))[None, :]
    # A step's scale bytes of a row load together, up to 4 (one 32-bit word) at once.
    SCALE_BYTES: gl.constexpr = 4 if BLOCKS >= 4 else BLOCKS
    word_type: gl.constexpr = gl.int32 if SCALE_BYTES == 4 else (
        gl.int16 if SCALE_BYTES == 2 else gl.uint8)
    sn = pid_n * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, mma))
    s_ptrs = ws_ptr.to(gl.pointer_type(word_type)) \
        + gl.where(sn < N, sn, 0).to(gl.int64) * (stride_sn // SCALE_BYTES)
    if SCALE_BYTES == 4:  # groups of 4 blocks (block_k 128 or 256; packed w always)
        g_lo = step_lo * (BLOCKS // 4)
        last = step_hi * (BLOCKS // 4) - 1
        # w is not the previous kernel's output (weights are written long before; w4frag_call
        # launches a copy of its own without PDL): its first group loads before the PDL wait,
        # so that the load's latency passes under that kernel's end
        word, c0, c1, c2, c3 = _load_group(w_ptrs, s_ptrs, g_lo, PACKED, word_layout)
    if PDL:  # before any other load: x may be the previous kernel's output
        release_then_wait()
    # x as 32-bit words, two bf16 or 8 codes each (rows 4-byte aligned: w4frag_call), in the
    # B layout's places. Rows of x past M read row M - 1 (their outputs are never stored): no
    # mask in the loop.
    x_layout: gl.constexpr = _x_layout(BLOCK_M, X_MXFP4, WARPS_HERE)
    X_ROW_WORDS: gl.constexpr = x_words(X_MXFP4)
    xm = gl.minimum(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, x_layout)),
                    M - 1)
    x_ptrs = x_ptr.to(gl.pointer_type(gl.int32)) \
        + xm.to(gl.int64)[None, :] * (stride_xm // _x_per_word(X_MXFP4)) \
        + gl.arange(0, X_ROW_WORDS, layout=gl.SliceLayout(1, x_layout))[:, None]
    # MXFP4 x's scale bytes of a step, a row, as one word (as w's)
    xsm = gl.minimum(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma)),
                     M - 1)
    xs_ptrs = xs_ptr.to(gl.pointer_type(word_type)) \
        + xsm.to(gl.int64) * (stride_xsm // SCALE_BYTES)
    acc = gl.zeros([_BN, BLOCK_M], gl.float32, layout=mma)
    # Rows of w, and of x, with a NaN scale (_nan_scales)
    no_scales = gl.zeros([BLOCK_M], gl.int32, layout=gl.SliceLayout(0, mma))  # bf16 x's
    nan_seen = (gl.zeros([_BN], gl.int32, layout=gl.SliceLayout(1, mma)), no_scales)
    # K >> 31 is 0 (K > 0), unknown to the compiler; x's only used with MXFP4 x
    tables = (e2m1_tables(gl.full([_BN, 4], 0, gl.int32, word_layout) + (K >> 31)),
              e2m1_tables(gl.full([X_ROW_WORDS, BLOCK_M], 0, gl.int32, x_layout) + (K >> 31)))
    if PACKED:
        # x in K order through shared memory, a group of 4 blocks a slot, two slots: the
        # program's threads load the group ahead while this one multiplies (bf16 x 16 bytes
        # each; MXFP4 x a word of 8 codes each, decoded once a program instead of once a warp)
        # and store it once every warp has read its slot; each warp reads its B operands by
        # ldmatrix. x crosses L1 once a program, not once a warp. Two barriers a group: the
        # one below, and one Triton adds before the store (the slot is chosen at run time, so
        # it cannot tell the slots apart). A group an iteration: two, as below, with the slots
        # fixed (one barrier a group), took more registers and lost up to 1.4x (H200).
        # MXFP4 x's codes scaled as they are stored (exact in bf16): the MMAs then take x as
        # they take bf16 x, each block's product scaled by w's row's scale alone
        tiles, tile_ptrs, xs_tile_ptrs, x_tables = x_staged(
            x_ptr, xs_ptr, pid_m, M, K, stride_xm, stride_xsm, g_lo, BLOCK_M, X_MXFP4)
        for group in range(g_lo, last + 1):
            ahead = gl.minimum(group + 1, last)
            word_b, b0, b1, b2, b3 = _load_group(w_ptrs, s_ptrs, ahead, PACKED, word_layout)
            x_ahead, xs_ahead = x_group_loads(tile_ptrs, xs_tile_ptrs, ahead, X_MXFP4)
            slot = (group - g_lo) % 2
            barrier()  # the slot's stores done, and the other slot's reads
            if X_BY_BLOCK:  # read by _add_block, each just before its MMA
                x0, x1, x2, x3 = _x_places(tiles.index(slot), BLOCK_M)
            else:
                x0, x1, x2, x3 = _x_blocks(tiles.index(slot), BLOCK_M, b_layout)
            acc, nan_seen = _add_group(acc, nan_seen, word, c0, c1, c2, c3, x0, x1, x2, x3,
                                       no_scales, a_layout, b_layout, tables, False, PACKED,
                                       X_BY_BLOCK)
            tiles.index(1 - slot).store(x_in_bf16(x_ahead, xs_ahead, x_tables, X_MXFP4))
            word, c0, c1, c2, c3 = word_b, b0, b1, b2, b3
    elif SCALE_BYTES == 4:
        # Groups of 4 blocks, two an iteration in a software pipeline: each group's loads
        # (w's, the HBM stream, and up to 16 rows of x's) are issued before the group ahead of
        # it is multiplied; 32 rows of x load as their group starts (held a group longer,
        # they would take 64 more registers a thread). Past the split's last group the loads
        # read that group again (no branch).
        X_AHEAD: gl.constexpr = BLOCK_M <= 16
        x0, x1, x2, x3, xw = _load_x_group(x_ptrs, xs_ptrs, g_lo, no_scales, X_MXFP4)
        for group in range(g_lo, last + 1, 2):
            ahead = gl.minimum(group + 1, last)
            word_b, b0, b1, b2, b3 = _load_group(w_ptrs, s_ptrs, ahead, PACKED, word_layout)
            if X_AHEAD:
                y0, y1, y2, y3, yw = _load_x_group(x_ptrs, xs_ptrs, ahead, no_scales, X_MXFP4)
            else:
                x0, x1, x2, x3, xw = _load_x_group(x_ptrs, xs_ptrs, group, no_scales, X_MXFP4)
            acc, nan_seen = _add_group(acc, nan_seen, word, c0, c1, c2, c3, x0, x1, x2, x3, xw,
                                       a_layout, b_layout, tables, X_MXFP4, PACKED, False)
            ahead = gl.minimum(group + 2, last)
            word, c0, c1, c2, c3 = _load_group(w_ptrs, s_ptrs, ahead, PACKED, word_layout)
            if X_AHEAD:
                x0, x1, x2, x3, xw = _load_x_group(x_ptrs, xs_ptrs, ahead, no_scales, X_MXFP4)
            if group < last:
                if not X_AHEAD:
                    y0, y1, y2, y3, yw = _load_x_group(x_ptrs, xs_ptrs, group + 1, no_scales,
                                                       X_MXFP4)
                acc, nan_seen = _add_group(acc, nan_seen, word_b, b0, b1, b2, b3, y0, y1, y2,
                                           y3, yw, a_layout, b_layout, tables, X_MXFP4,
                                           PACKED, False)
    else:  # block_k 32 or 64: a step's 1-2 scale bytes a row as one uint8 / int16
        for step in range(step_lo, step_hi):
            word = _scale_word(s_ptrs, step, SCALE_BYTES)
            if X_MXFP4:
                x_word = _scale_word(xs_ptrs, step, SCALE_BYTES)
            else:
                x_word = no_scales
            nan_seen = (_nan_scales(nan_seen[0], word), _nan_scales(nan_seen[1], x_word))
            for j in gl.static_range(SCALE_BYTES):
                block = step * SCALE_BYTES + j
                codes = gl.load(w_ptrs + block.to(gl.int64) * 4)
                acc = _add_block(acc, codes, _block_scale(word, j),
                                 _load_x(x_ptrs, block, X_MXFP4), _block_scale(x_word, j),
                                 a_layout, b_layout, tables, X_MXFP4, PACKED, False)
    # A NaN scale of w's row n or x's row m makes output (m, n) NaN.
    acc = gl.where((nan_seen[0] != 0)[:, None] | (nan_seen[1] != 0)[None, :], float("nan"),
                   acc)

    finish_tile(acc, pid_n, split, pid_m, y_ptr, bias_ptr, x_ptr, x_ptr, part_ptr, count_ptr,
                M, N, stride_ym, 1, stride_bias, HAS_BIAS, 0, 0, SPLIT_K, _BN, BLOCK_M,
                PER_LOAD, ADD_SPLITS)


def w4frag_call(x, w, bias, out, scale_a, scale_b, config: W4FragConfig,
                counters: torch.Tensor | None = None, warmup: bool = False,
                block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_w4frag`` as data (what a dispatch plan records and
    replays): x (M, K) bf16, w the codes (two a byte, (N, K // 2); in the packed layout for a
    packed config), scale_b their scales (N, K // 32), out (M, N); scale_a None, or x's scales
    (M, K // 32) with x MXFP4 too, its codes (M, K // 2)."""
    c = config
    return split_k_call(gemm_w4frag_kernel, x, w, bias, out, scale_a, scale_b, c, BLOCK_N,
                        c.block_m, counters, warmup, BLOCK_M=c.block_m, BLOCK_K=c.block_k,
                        PACKED=bool(c.packed), X_BY_BLOCK=bool(c.x_by_block))


# x's dequantising launch of x_first configs: programs of 8 rows x 512 elements (M <= 32),
# decoded by PTX (this kernel runs compiled only)
_X_FIRST = W4DeqConfig(8, 512, 4, asm=1)


def launch_gemm_w4frag(x, w, bias, out, scale_a, scale_b, config: W4FragConfig,
                       counters: torch.Tensor | None = None, warmup: bool = False,
                       block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0, its column stride 1. An ``x_first`` config with MXFP4 x launches x's
    dequantisation to bf16 first (``gemm_w4deq.dequantize``), then the bf16-x kernel."""
    if config.x_first and scale_a is not None:
        x, scale_a = dequantize(x, scale_a, torch.bfloat16, _X_FIRST, warmup), None
    launch(w4frag_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup), warmup)
    return out


def gemm_w4frag(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, config: W4FragConfig | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in bf16: x (M, K) bf16, wq (N, K // 2) and
    w_scale (N, K // 32) uint8 as ``gemmtune.quant.mxfp4`` makes them, or wq as
    ``gemmtune.quant.prepack_mxfp4`` packs it with a ``packed`` config (the layout is the
    config's: the default reads wq as quantised), bias (N,). Validates everything, then
    launches."""
    return validated_launch("gemm_w4frag", launch_gemm_w4frag, default_config, why_not_supported,
                            x, wq, w_scale, bias, config, out)


# Called as every kernel module's validating launcher is (dispatchable)
gemm_w4frag_scaled = scaled_launcher("gemm_w4frag", gemm_w4frag)
