"""An MXFP4-weight decode GEMM with x as the MMA's A operand, in Gluon: ``y = x @ dequant(wq,
w_scale).T + bias`` for 9-16 rows of x (bf16 x, or MXFP4 x: ``gemm_a4w4_blockscale``), w packed
by ``mxfp4.prepack``.

``triton.w4frag`` swaps the product (w's rows the MMA's M, x's its N), so every warp reads all of
x's block for its 16 rows of w: at 16 rows of x, by ``ldmatrix``, four bytes of x for each byte
of w's codes, which kept L1's data pipe at 75% of its peak (docs/benchmarks.md, session 38).
Here x's 16 rows are the MMA's M and w's rows its N, 8 a tile: a warp reads x's A operand once a
block and multiplies it with each of its ``tiles`` tiles of w, so with 8 tiles (64 rows of w a
warp) x's bytes through L1 equal w's.

A program's ``warps`` warps take 8 x ``tiles`` rows of w each; x's group of 4 blocks goes
through shared memory once a program (two slots: the next group loads while this one
multiplies), MXFP4 x's codes decoded and scaled as they are stored. w's packed words are the
MMA's natural B fragments (word t of a block holds its elements 8 r + 2 t and 8 r + 2 t + 1),
decoded by masks and shifts and scaled by their block's power of
two in bf16 before the MMA (exact: bf16 has fp32's exponent range), so the MMA accumulates
across blocks and a NaN scale (byte 255) makes its values NaN. K split over the grid's second
axis, x's blocks of 16 rows on its third; the end (bias, output dtype, the splits' sum in order
or added) is ``_swapped.finish_tile``.

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
from gemmtune.kernels.triton._e2m1_ptx import placed_scaled_asm
from gemmtune.kernels.triton._mxfp4_calls import (scaled_launcher, validated_launch,
                                                  why_not_gluon_call, why_not_gluon_x)
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._splits import (PDL_OFF, launch_variants, split_for,
                                             why_not_wait_pdl)
from gemmtune.kernels.triton._swapped import (barrier, finish_tile, release_then_wait,
                                              split_steps, why_not_add_splits, why_not_grid)
from gemmtune.kernels.triton._w4_gluon import (in_k_order, joined_codes, packed_blocks,
                                               split_k_call, x_group_loads, x_in_bf16, x_staged)

KERNEL_PREFIX = "triton.w4xa"
ROWS_OF_X = 16  # the MMA's M: x's rows a program
_BM = gl.constexpr(ROWS_OF_X)
GROUP_K = mxfp4.PACK_GROUP  # K a loop step: a packed group of 4 blocks
_GROUP_K = gl.constexpr(GROUP_K)
TILES = (2, 4, 8)  # tiles of 8 rows of w a warp
WARPS = (1, 2, 4)
MIN_BLOCK_N = 32  # rows of w a program, at least (16 was never timed or tested)
MAX_SPLIT_K = 32
# Rows of x up to which the tuner offers it (past them the swapped kernels' blocks of x fit)
MAX_M = 16
MIN_M = 9  # to 8 rows the swapped kernel's MMA N of 8 wastes nothing


@dataclass(frozen=True)
class W4XaConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.w4xa:T8.W1.SK4.P1.R1``."""

    NAME_CODEC = NameCodec("x-as-A MXFP4 config", KERNEL_PREFIX, (
        Field("T", "tiles"), Field("W", "warps"), Field("SK", "split_k"),
        Field("P", "pdl", default=PDL_OFF), Field("R", "add_splits", default=0)))

    tiles: int  # tiles of 8 rows of w a warp (``TILES``)
    warps: int  # warps a program (``WARPS``): 8 x tiles x warps rows of w a program
    split_k: int
    # PDL_OFF or PDL_WAIT (w's first group loads before the wait: x may be the previous
    # kernel's output; a w copied by w4xa_call goes without)
    pdl: int = PDL_OFF
    # 1: the splits add their partials into one fp32 sum per tile (_swapped.finish_tile)
    add_splits: int = 0

    @property
    def block_n(self) -> int:
        """Rows of w a program."""
        return 8 * self.tiles * self.warps

    @property
    def packed(self) -> int:
        """1: w in ``mxfp4.prepack``'s layout, the only one the kernel reads (dispatch gives it
        the problems of that layout)."""
        return 1

    @property
    def block_m(self) -> int:
        return ROWS_OF_X

    @property
    def block_k(self) -> int:
        return GROUP_K


def why_not_fits(config: W4XaConfig, M: int, N: int, K: int,
                 dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM with ``dtype`` x, or None."""
    c = config
    why = why_not_gluon_x("x-as-A MXFP4 kernel", dtype)
    if why is not None:
        return why
    if c.tiles not in TILES:
        return f"tiles={c.tiles} must be one of {TILES} (tiles of 8 rows of w a warp)"
    if c.warps not in WARPS:
        return f"warps={c.warps} must be one of {WARPS}"
    if c.block_n < MIN_BLOCK_N:
        # A program of 16 rows (2 tiles on one warp) was never timed or run on a GPU
        return (f"tiles={c.tiles} with warps={c.warps}: {c.block_n} rows of w a program; the "
                f"kernel takes at least {MIN_BLOCK_N} (8 x tiles x warps)")
    problem = why_not_wait_pdl(c.pdl) or why_not_add_splits(c) or mxfp4.why_not_quantisable(K)
    if problem is not None:
        return problem
    if K % GROUP_K:
        return (f"K={K}: the kernel reads packed w (mxfp4.prepack) in groups of {GROUP_K} of K; "
                f"K must be a multiple of {GROUP_K}")
    return why_not_grid(c, M, K, K // GROUP_K, MAX_SPLIT_K)


def why_not_supported(config: W4XaConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output (x's dtype; with MXFP4 x, ``dtype`` uint8, bf16, fp16 or
    fp32), and whether the kernel can run here."""
    return (why_not_gluon_call("x-as-A MXFP4 kernel", dtype, out_dtype, packed_only=True)
            or why_not_fits(config, M, N, K, dtype))


# What the tuner offers: 16-32 rows of w a warp and 2-4 warps a program, K split for about 2, 4
# or 8 programs an SM. On an H200 at 9-16 rows of x the best configs were T4.W4, T2.W4 and T4.W2
# at 3-8 programs an SM; 8 tiles a warp (222-248 registers a thread) lost 5-30% to 4, one warp
# a program 10-60% to four (docs/benchmarks.md, session 40).
_TILES_OFFERED = (2, 4)
_WARPS_OFFERED = (2, 4)
_PROGRAMS_PER_SM = (2, 4, 8)


def candidates(M: int, N: int, K: int, dtype: torch.dtype, num_sms: int | None = None,
               pdl: int = PDL_OFF, packed: bool = True) -> list[W4XaConfig]:
    """The configs to tune one shape with, for MIN_M <= M <= MAX_M and packed w (none
    otherwise): each offered tile and warp count, K split to reach each of
    ``_PROGRAMS_PER_SM``, without PDL and with ``pdl``, split sums in order and added. Only
    configs that fit."""
    if not packed or not MIN_M <= M <= MAX_M or dtype not in (torch.bfloat16, torch.uint8):
        return []
    num_sms = num_sms or _checks.sm_count()
    found = {}
    for tiles in _TILES_OFFERED:
        for warps in _WARPS_OFFERED:
            n_tiles = triton.cdiv(N, 8 * tiles * warps)
            for per_sm in _PROGRAMS_PER_SM:
                split = split_for(n_tiles, max(1, K // GROUP_K), per_sm * num_sms, MAX_SPLIT_K)
                for mode, add in launch_variants(split, pdl):
                    cfg = W4XaConfig(tiles, warps, split, mode, add)
                    if why_not_fits(cfg, M, N, K, dtype) is None:
                        found[cfg] = None
    return list(found)


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   num_sms: int | None = None) -> W4XaConfig:
    """Reasonable untuned: 4 tiles a warp, 4 warps a program, K split until there are 4
    programs an SM."""
    num_sms = num_sms or _checks.sm_count()
    return W4XaConfig(4, 4, split_for(triton.cdiv(N, 128), max(1, K // GROUP_K), 4 * num_sms,
                                      MAX_SPLIT_K))


@gluon.constexpr_function
def _row_bases(tiles, warps):
    """A program's rows of w (8 tiles x warps of them) as the MMA's N places them: row g of a
    tile on lanes 4-16 (lane = 4 g + t), the warps' tiles side by side (8 rows apart), a warp's
    tiles 8 x warps rows apart on registers."""
    on_warps = [[8 << i, 0] for i in range(warps.bit_length() - 1)]
    on_regs = [[(8 * warps) << i, 0] for i in range(tiles.bit_length() - 1)]
    return on_regs, on_warps


@gluon.constexpr_function
def _word_layout(tiles, warps):
    """A block's words (rows, 4): each thread its word t of its row of each tile, as the MMA's
    B operand (k_width 2) holds them."""
    on_regs, on_warps = _row_bases(tiles, warps)
    return gl.DistributedLinearLayout(
        reg_bases=on_regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=on_warps, block_bases=[], shape=[8 * tiles * warps, 4])


@gluon.constexpr_function
def _group_layout(tiles, warps):
    """A packed group (rows, 16 stored words, word 4 t + j being word t of block j): each
    thread's 4 contiguous words of its row of each tile."""
    on_regs, on_warps = _row_bases(tiles, warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + on_regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=on_warps, block_bases=[], shape=[8 * tiles * warps, 16])


# The scaled decode's PTX by the scale word's byte (a block's place in its group of 4)
_PLACED_SCALED = gl.constexpr(tuple(placed_scaled_asm(j) for j in range(4)))


@gluon.jit
def _w_operand(words, scale_word, j: gl.constexpr, b_layout: gl.constexpr):
    """Block ``j`` of a group of w: its packed words (rows, 4) decoded and times the block's
    scales (byte ``j`` of each row's ``scale_word``) in one PTX block, as the (32, rows) bf16 B
    operand in K order."""
    r = gl.inline_asm_elementwise(_PLACED_SCALED[j], "=r,=r,=r,=r,r,r",
                                  [words, gl.broadcast(scale_word[:, None], words)[0]],
                                  dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    return gl.convert_layout(gl.permute(in_k_order(joined_codes(r)), [1, 0]), b_layout,
                             assert_trivial=True)


@gluon.jit
def _load_w_group(w_ptrs, s_ptrs, group, rows: gl.constexpr, word_layout: gl.constexpr):
    """A group's scale words (a row's 4 bytes) and its 4 blocks' words."""
    scales = gl.load(s_ptrs + group)
    # First to leave the caches: w is read once, x again by every program.
    codes = gl.load(w_ptrs + group.to(gl.int64) * 16, eviction_policy="evict_first")
    c0, c1, c2, c3 = packed_blocks(codes, rows, word_layout)
    return scales, c0, c1, c2, c3


@gluon.jit
def _add_group(acc, scales, c0, c1, c2, c3, tile, a_layout: gl.constexpr,
               b_layout: gl.constexpr):
    """``acc`` plus a group's 4 blocks: x's (4 x 16 rows, 32) bf16 in shared memory ``tile``
    (block j's rows at 16 j) times w's blocks (words c0-c3, the rows' scale bytes ``scales``)."""
    acc = mma_v2(tile.slice(0, _BM).load(a_layout), _w_operand(c0, scales, 0, b_layout), acc)
    acc = mma_v2(tile.slice(_BM, _BM).load(a_layout), _w_operand(c1, scales, 1, b_layout), acc)
    acc = mma_v2(tile.slice(2 * _BM, _BM).load(a_layout), _w_operand(c2, scales, 2, b_layout),
                 acc)
    acc = mma_v2(tile.slice(3 * _BM, _BM).load(a_layout), _w_operand(c3, scales, 3, b_layout),
                 acc)
    return acc


@gluon.jit(do_not_specialize=["M"])
def gemm_w4xa_kernel(
    x_ptr,  # (M, K) bf16, K contiguous; X_MXFP4: (M, K // 2) uint8 codes
    wq_ptr,  # (N, K // 2) uint8: two E2M1 codes a byte in mxfp4.prepack's layout
    ws_ptr,  # (N, K // 32) uint8: E8M0 scales
    xs_ptr,  # X_MXFP4: (M, K // 32) uint8, x's scales; else unused
    y_ptr,  # (M, N)
    bias_ptr,  # (N,) or unused
    # (tiles, SPLIT_K, 16, BLOCK_N) fp32, or with ADD_SPLITS (tiles, 16, BLOCK_N) zeroed and
    # left zero; unused unless SPLIT_K > 1
    part_ptr,
    count_ptr,  # (tiles,) int32, zero on entry and left zero; unused unless SPLIT_K > 1
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_xsm, stride_ym, stride_bias,
    HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, TILES: gl.constexpr, PDL: gl.constexpr,
    PER_LOAD: gl.constexpr, ADD_SPLITS: gl.constexpr, X_MXFP4: gl.constexpr,
):
    WARPS: gl.constexpr = gl.num_warps()
    BLOCK_N: gl.constexpr = 8 * TILES * WARPS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    word_layout: gl.constexpr = _word_layout(TILES, WARPS)
    group_layout: gl.constexpr = _group_layout(TILES, WARPS)
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    pid_m = gl.program_id(2)
    g_lo, g_hi = split_steps(split, K, _GROUP_K, SPLIT_K)
    last = g_hi - 1

    # Rows past N read row 0 (their outputs are never stored): no mask in the loop. w as
    # 32-bit words (rows 4-byte aligned: w4xa_call), a group of a row 16 of them.
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, group_layout))
    w_ptrs = wq_ptr.to(gl.pointer_type(gl.int32)) \
        + gl.where(n < N, n, 0).to(gl.int64)[:, None] * (stride_wn // 4) \
        + gl.arange(0, 16, layout=gl.SliceLayout(0, group_layout))[None, :]
    sn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, word_layout))
    s_ptrs = ws_ptr.to(gl.pointer_type(gl.int32)) \
        + gl.where(sn < N, sn, 0).to(gl.int64) * (stride_sn // 4)
    # w is not the previous kernel's output (weights are written long before; w4xa_call
    # launches a copy of its own without PDL): its first group loads before the PDL wait.
    scales, c0, c1, c2, c3 = _load_w_group(w_ptrs, s_ptrs, g_lo, BLOCK_N, word_layout)
    if PDL:  # before any other load: x may be the previous kernel's output
        release_then_wait()
    # x through shared memory, a group of 4 blocks a slot, two slots: the program loads the
    # next group while this one multiplies and stores it once every warp has read its slot.
    # Rows of x past M read row M - 1 (their outputs are never stored).
    x_slots, tile_ptrs, xs_ptrs, x_tables = x_staged(x_ptr, xs_ptr, pid_m, M, K, stride_xm,
                                                     stride_xsm, g_lo, _BM, X_MXFP4)
    acc = gl.zeros([_BM, BLOCK_N], gl.float32, layout=mma)
    for group in range(g_lo, last + 1):
        ahead = gl.minimum(group + 1, last)
        scales_b, b0, b1, b2, b3 = _load_w_group(w_ptrs, s_ptrs, ahead, BLOCK_N, word_layout)
        x_ahead, xs_ahead = x_group_loads(tile_ptrs, xs_ptrs, ahead, X_MXFP4)
        slot = (group - g_lo) % 2
        barrier()  # the slot's stores done, and the other slot's reads
        acc = _add_group(acc, scales, c0, c1, c2, c3, x_slots.index(slot), a_layout, b_layout)
        x_slots.index(1 - slot).store(x_in_bf16(x_ahead, xs_ahead, x_tables, X_MXFP4))
        scales, c0, c1, c2, c3 = scales_b, b0, b1, b2, b3

    finish_tile(gl.permute(acc, [1, 0]), pid_n, split, pid_m, y_ptr, bias_ptr, x_ptr, x_ptr,
                part_ptr, count_ptr, M, N, stride_ym, 1, stride_bias, HAS_BIAS, 0, 0, SPLIT_K,
                BLOCK_N, _BM, PER_LOAD, ADD_SPLITS)


def w4xa_call(x, w, bias, out, scale_a, scale_b, config: W4XaConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_w4xa`` as data (what a dispatch plan records and replays):
    x (M, K) bf16, w the packed codes (``mxfp4.prepack``), scale_b their scales (N, K // 32),
    out (M, N); scale_a None, or x's scales (M, K // 32) with x MXFP4 too, its codes
    (M, K // 2)."""
    return split_k_call(gemm_w4xa_kernel, x, w, bias, out, scale_a, scale_b, config,
                        config.block_n, ROWS_OF_X, counters, warmup, TILES=config.tiles)


def launch_gemm_w4xa(x, w, bias, out, scale_a, scale_b, config: W4XaConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0, its column stride 1."""
    launch(w4xa_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup), warmup)
    return out


def gemm_w4xa(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, config: W4XaConfig | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in x's dtype: x (M, K) bf16, wq as
    ``gemmtune.quant.prepack_mxfp4`` packs it, w_scale (N, K // 32) uint8, bias (N,).
    Validates everything, then launches."""
    return validated_launch("gemm_w4xa", launch_gemm_w4xa, default_config, why_not_supported,
                            x, wq, w_scale, bias, config, out)


# Called as every kernel module's validating launcher is (dispatchable)
gemm_w4xa_scaled = scaled_launcher("gemm_w4xa", gemm_w4xa)
