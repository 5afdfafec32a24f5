"""What the Gluon MXFP4 kernels share (``triton.w4frag``, ``triton.w4xa``, ``triton.w4wg``):
the decode's registers as bf16 (pairs of codes put back together for the MMA), and x staged in
shared memory a group of 4 blocks at a time in two slots (``x_staged``, then each later group
by ``x_group_loads`` and ``x_in_bf16``), MXFP4 x decoded and scaled as it is stored; and the
launch of the two that split K (``split_k_call``).

A group of x as loaded is (4 BLOCK_M, 32): row j BLOCK_M + m is block j of x's row m (rows past
M read row M - 1), bf16 elements or MXFP4 x's 32-bit code words. Compiled only (Gluon does not
run in Triton's interpreter).
"""

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gemmtune.kernels import mxfp4
from gemmtune.kernels.triton._e2m1_ptx import e2m1_scaled_bf16, e2m1_tables
from gemmtune.kernels.triton._mxfp4_calls import word_operands
from gemmtune.kernels.triton._replay import KernelCall
from gemmtune.kernels.triton._splits import PDL_OFF, launch_mode, workspace
from gemmtune.kernels.triton._swapped import partials_per_load

_BLOCK = gl.constexpr(mxfp4.BLOCK)


@gluon.jit
def halves(pair):
    """An int32 tensor of bf16 pairs as (..., 2) bf16, the low half first."""
    return gl.join(pair.to(gl.int16).to(gl.bfloat16, bitcast=True),
                   (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))


@gluon.jit
def joined_codes(r):
    """4 int32 registers of bf16 pairs (register i: codes 2 i, low half, and 2 i + 1) of words
    (R, T) as (R, T, 2, 2, 2) bf16, code 2 i + h at (h, i % 2, i // 2): taken apart here, put
    back together as they were for the MMA (no instruction)."""
    return gl.join(gl.join(halves(r[0]), halves(r[1])), gl.join(halves(r[2]), halves(r[3])))


@gluon.jit
def in_k_order(codes):
    """(R, T, 2, 2, 2) bf16 codes (``joined_codes``) of packed words, which hold elements
    8 r + 2 t and 8 r + 2 t + 1 of a block as codes 2 r and 2 r + 1 -> (R, 8 T) in K order (the
    MMA's natural fragments, ``k_width`` 2)."""
    # (R, t, i % 2, r % 2, r // 2) -> (R, r // 2, r % 2, t, i % 2)
    codes = gl.permute(codes, [0, 4, 3, 1, 2])
    return gl.reshape(codes, [codes.shape[0], 8 * codes.shape[3]])


@gluon.jit
def packed_blocks(group, rows: gl.constexpr, word_layout: gl.constexpr):
    """A packed group's words (rows, 16; stored word 4 t + j is word t of block j,
    ``mxfp4.prepack``) as its 4 blocks' (rows, 4) words in ``word_layout``. Registers only:
    the conversions are checked trivial."""
    even, odd = gl.split(gl.reshape(group, [rows, 4, 2, 2]))  # (row, t, j // 2, j % 2)
    b0, b2 = gl.split(even)
    b1, b3 = gl.split(odd)
    return (gl.convert_layout(b0, word_layout, assert_trivial=True),
            gl.convert_layout(b1, word_layout, assert_trivial=True),
            gl.convert_layout(b2, word_layout, assert_trivial=True),
            gl.convert_layout(b3, word_layout, assert_trivial=True))


@gluon.jit
def _x_scaled_bf16(words, scale_bytes, tables):
    """MXFP4 x's words (rows, 4; word t holding elements 8 t to 8 t + 7, as quantised) times
    their rows' block scales (``scale_bytes``, int32, one a row) as (rows, 32) bf16 in K order:
    exact for every finite value, NaN for byte 255, infinite past bf16's range."""
    r = e2m1_scaled_bf16(words, tables, gl.broadcast(scale_bytes[:, None], words)[0])
    # (R, t, h, i % 2, i // 2) -> (R, t, i // 2, i % 2, h): element 8 t + 2 i + h
    codes = gl.permute(joined_codes(r), [0, 1, 4, 3, 2])
    return gl.reshape(codes, [words.shape[0], 32])


@gluon.constexpr_function
def _x_tile_layout(warps, x_mxfp4):
    """x's group (4 blocks x BLOCK_M rows, 32 elements) as the program's threads load it: bf16
    16 bytes a thread, a row's block over 4 threads; MXFP4 x's (.., 4) words of 8 codes, one a
    thread."""
    return gl.BlockedLayout([1, 1 if x_mxfp4 else 8], [8, 4], [warps, 1], [1, 0])


@gluon.constexpr_function
def x_words(x_mxfp4):
    """A row of x's words in a 32-element block: 16 (two bf16 each), MXFP4 x 4 (8 codes)."""
    return 4 if x_mxfp4 else 16


@gluon.jit
def _x_tile_pointers(x_ptr, pid_m, M, stride_xm, BLOCK_M: gl.constexpr, X_MXFP4: gl.constexpr,
                     tile_layout: gl.constexpr):
    """Where x's first group loads from, in ``tile_layout``: row j BLOCK_M + m is block j of
    x's row m (rows past M read row M - 1); bf16 elements, or MXFP4 x's 32-bit code words
    (rows 4-byte aligned: _mxfp4_calls.word_operands)."""
    row = gl.arange(0, 4 * BLOCK_M, layout=gl.SliceLayout(1, tile_layout))
    m = gl.minimum(pid_m * BLOCK_M + row % BLOCK_M, M - 1).to(gl.int64)
    per_block: gl.constexpr = x_words(X_MXFP4) if X_MXFP4 else _BLOCK
    col = gl.arange(0, per_block, layout=gl.SliceLayout(0, tile_layout))
    if X_MXFP4:
        ptrs = x_ptr.to(gl.pointer_type(gl.int32)) \
            + (m * (stride_xm // 4) + (row // BLOCK_M) * per_block)[:, None] + col[None, :]
    else:
        ptrs = x_ptr + (m * stride_xm + (row // BLOCK_M) * per_block)[:, None] + col[None, :]
    return ptrs


@gluon.constexpr_function
def _x_group_stride(x_mxfp4):
    """How far a group of x's pointers (``_x_tile_pointers``) move along K: 128 bf16, or 16
    words of MXFP4 codes."""
    return 16 if x_mxfp4 else 128


@gluon.jit
def _x_scale_pointers(xs_ptr, pid_m, M, stride_xsm, BLOCK_M: gl.constexpr,
                     tile_layout: gl.constexpr):
    """Where the scale bytes of x's first group load from, a row of the group as loaded
    (``_x_tile_pointers``: row j BLOCK_M + m is block j of x's row m; rows past M read row
    M - 1)."""
    row = gl.arange(0, 4 * BLOCK_M, layout=gl.SliceLayout(1, tile_layout))
    m = gl.minimum(pid_m * BLOCK_M + row % BLOCK_M, M - 1).to(gl.int64)
    return xs_ptr + m * stride_xsm + row // BLOCK_M


@gluon.jit
def _x_scale_bytes(xs_ptrs, group, X_MXFP4: gl.constexpr):
    """MXFP4 x's scale byte of each row of a group as loaded (``_x_scale_pointers``) as int32;
    0 (unused) without MXFP4 x."""
    if X_MXFP4:
        scale_bytes = gl.load(xs_ptrs + group * 4).to(gl.int32)
    else:
        scale_bytes = 0
    return scale_bytes


@gluon.jit
def x_in_bf16(raw, scale_bytes, tables, X_MXFP4: gl.constexpr):
    """A group of x as loaded (``_x_tile_pointers``) as (4 BLOCK_M, 32) bf16: MXFP4 x's codes
    decoded and times their rows' block scales (``scale_bytes``: ``_x_scale_bytes``), bf16 x as
    it is."""
    if X_MXFP4:
        tile = _x_scaled_bf16(raw, scale_bytes, tables)
    else:
        tile = raw
    return tile


@gluon.jit
def _x_tile(ptrs, xs_ptrs, group, tables, X_MXFP4: gl.constexpr):
    """Group ``group`` of x as (4 BLOCK_M, 32) bf16 (``x_in_bf16``)."""
    return x_in_bf16(gl.load(ptrs + group.to(gl.int64) * _x_group_stride(X_MXFP4)),
                     _x_scale_bytes(xs_ptrs, group, X_MXFP4), tables, X_MXFP4)


@gluon.jit
def x_staged(x_ptr, xs_ptr, pid_m, M, K, stride_xm, stride_xsm, first,
             BLOCK_M: gl.constexpr, X_MXFP4: gl.constexpr):
    """x's two slots of a group in shared memory, group ``first`` stored in slot 0 (rows of x
    past M read row M - 1, their outputs never stored), and what later groups load and decode
    with (``x_group_loads``, ``x_in_bf16``): (slots, x's pointers, its scales' pointers, the
    decode's tables)."""
    tile_layout: gl.constexpr = _x_tile_layout(gl.num_warps(), X_MXFP4)
    slots = gl.allocate_shared_memory(gl.bfloat16, [2, 4 * BLOCK_M, _BLOCK],
                                      gl.SwizzledSharedLayout(8, 2, 4, [1, 0]))
    tile_ptrs = _x_tile_pointers(x_ptr, pid_m, M, stride_xm, BLOCK_M, X_MXFP4, tile_layout)
    xs_ptrs = _x_scale_pointers(xs_ptr, pid_m, M, stride_xsm, BLOCK_M, tile_layout)
    # K >> 31 is 0 (K > 0), unknown to the compiler (e2m1_tables); used with MXFP4 x only
    tables = e2m1_tables(gl.full([4 * BLOCK_M, x_words(X_MXFP4)], 0, gl.int32, tile_layout)
                         + (K >> 31))
    slots.index(0).store(_x_tile(tile_ptrs, xs_ptrs, first, tables, X_MXFP4))
    return slots, tile_ptrs, xs_ptrs, tables


@gluon.jit
def x_group_loads(tile_ptrs, xs_ptrs, group, X_MXFP4: gl.constexpr):
    """Group ``group`` of x as loaded (``x_staged``'s pointers) and, MXFP4 x, its rows' scale
    bytes: what ``x_in_bf16`` stores."""
    return (gl.load(tile_ptrs + group.to(gl.int64) * _x_group_stride(X_MXFP4)),
            _x_scale_bytes(xs_ptrs, group, X_MXFP4))


def split_k_call(kernel, x, w, bias, out, scale_a, scale_b, config, block_n: int, block_m: int,
                 counters, warmup: bool, **constexprs) -> KernelCall:
    """The launch of a word-reading decode kernel that splits K (``triton.w4frag``,
    ``triton.w4xa``) as data: programs of ``block_n`` rows of w and ``block_m`` rows of x on the
    grid's first and third axes, ``config.split_k`` splits on its second (with ``config``'s
    ``pdl``, ``add_splits`` and ``warps``), the splits' workspace, and the constexprs both
    kernels take (HAS_BIAS, SPLIT_K, PDL, PER_LOAD, ADD_SPLITS, X_MXFP4) beside the kernel's
    own (``constexprs``). Operands as ``w4frag_call`` takes them."""
    ops = word_operands(x, w, bias, scale_a, scale_b)
    c = config
    n_tiles, m_tiles = triton.cdiv(ops.N, block_n), triton.cdiv(ops.M, block_m)
    parts, counters, per_call = workspace(ops.x, out, n_tiles * m_tiles, block_n * block_m,
                                          c.split_k, counters, warmup, bool(c.add_splits))
    pdl = launch_mode(c.pdl, ops.x.device, ops.copied_w)
    constexprs.update(HAS_BIAS=ops.bias is not None, SPLIT_K=c.split_k, PDL=pdl != PDL_OFF,
                      PER_LOAD=partials_per_load(c.split_k, block_n, block_m, c.warps),
                      ADD_SPLITS=bool(c.add_splits), X_MXFP4=scale_a is not None)
    return KernelCall(kernel, (n_tiles, c.split_k, m_tiles), ops.args(out, parts, counters),
                      constexprs, dict(num_warps=c.warps), launch_pdl=pdl != PDL_OFF,
                      replayable=not per_call)
