"""A prefill GEMM for MXFP4 weights and bf16 x on Hopper's warpgroup MMA, in Gluon:
``y = x @ dequant(wq, w_scale).T + bias`` with w decoded into the MMA's A registers
(``triton.w4wg``).

Swapped as the decode kernels are (y.T = w @ x.T): a program's BLOCK_N rows of w (64-256, one
or two warpgroups of 4 warps) are the MMA's M, x's BLOCK_M rows (64-256) its N. x arrives by TMA
into a ring of STAGES slots of (BLOCK_M, 64) bf16, every slot in flight before the first MMA
and each refilled once every warp has read it. w never goes through shared memory: for each
32-element block of each of its rows a thread loads the block's 16 bytes (the 4 threads of a
quad load the same bytes, from L1) and three PRMTs gather its own bytes t, t + 4, t + 8 and
t + 12 (t its place in the quad), which are exactly the codes of the A operand's natural
fragment (k_width 2: rows g and g + 8, K 2t, 2t + 1, 2t + 8, 2t + 9 of each 16). The E2M1
decode is ``triton.w4frag``'s inline PTX. Packed (``mxfp4.prepack``), a block's word t is
already those codes, its bits placed: each thread loads only its own words (a step's 2 in one
8-byte load) and decodes them by masks and shifts, no gather. The block's scale then
multiplies the 8 values in bf16 (``mul.rn.bf16x2``), exact for every finite result: bf16 has
fp32's exponent range and its subnormals reach 2^-133, below the smallest scaled value
(0.5 x 2^-127). A NaN scale (byte 255) makes its block NaN and so its row's outputs. The MMA
accumulates in fp32 over all of K, the scales already in: a weight too large for fp32 (from
4 x 2^126) is infinite, as in the dequantised weight itself, and times x's zeros NaN.

Why: dequantising into a bf16 weight first and calling cuBLAS (``triton.w4deq``) writes and
reads 2 bytes an element more, a third of the GEMM's time at M = 1024 (0.67x ``F.linear``,
docs/benchmarks.md, session 24); the decode here costs about 22 instructions a word of 8 codes
per program that reads it, which the tensor cores' time covers from a few hundred rows of x.

With one warpgroup (4 warps) two programs share an SM and take turns on the tensor cores, one
decoding while the other multiplies; with two (8 warps) they work in step on a taller tile of w,
sharing x's slots. Within a warpgroup the next step decodes only after its MMA is done: A
registers written while an MMA runs make ptxas serialise every MMA (its C7513), which the
compile test checks does not happen.

Rows of w past N read row N - 1 and x's past M read TMA's zeros; neither is stored. w as
quantised (a block's 16 bytes in one load) or in ``mxfp4.prepack``'s layout (the thread's
word of both blocks of a step in one 8-byte load); K a multiple of 64 (a step; packed, of
128).
Hopper (sm_90) only, compiled (Gluon does not run in Triton's interpreter); bf16 x only (the
scale multiply and the MMA are bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from gemmtune.kernels import mxfp4
from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._mxfp4_calls import scaled_launcher, validated_launch
from gemmtune.kernels.triton._replay import KernelCall, launch
from gemmtune.kernels.triton._swapped import barrier, why_not_here
from gemmtune.kernels.triton._e2m1_ptx import (e2m1_scaled_bf16, e2m1_tables,
                                               placed_scaled_bf16)
from gemmtune.kernels.triton._w4_gluon import halves

KERNEL_PREFIX = "triton.w4wg"
BLOCK_K = 64  # K a step: a TMA box row of x is 128 bytes (the widest swizzle)
_BK = gl.constexpr(BLOCK_K)
BLOCK_NS = (64, 128, 256)
BLOCK_MS = (64, 128, 256)
WARPS = (4, 8)  # one warpgroup or two, along w's rows
# fp32 accumulator registers a thread may hold (BLOCK_N x BLOCK_M / (32 x warps)): beyond 128
# the decode's registers no longer fit beside it
MAX_ACC_REGS = 128
MIN_M = 64  # below this the decode kernels (triton.w4frag) read w fewer times
_RING_BYTES = 160 * 1024  # shared memory the ring may take (the rest: the end's conversion)
# TMA's load into shared memory: tma.async_load from Triton 3.7 on, async_copy_global_to_shared
# in 3.6.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@dataclass(frozen=True)
class W4WgConfig(NamedConfig):
    """One point of the kernel's config space, e.g. ``triton.w4wg:BN128.BM128.W4.S4``."""

    NAME_CODEC = NameCodec("MXFP4 warpgroup-MMA config", KERNEL_PREFIX, (
        Field("BN", "block_n"), Field("BM", "block_m"), Field("W", "num_warps"),
        Field("S", "stages"), Field("L", "packed", default=0),
        Field("O", "overlap", default=0)))

    block_n: int  # rows of w a program (the MMA's M)
    block_m: int  # rows of x a program (the MMA's N)
    # 4: one warpgroup (two programs an SM take turns on the tensor cores); 8: two, in step
    num_warps: int
    stages: int  # slots of x's ring
    # 1: w in the packed layout (``mxfp4.prepack``: a step's word t of its 2 blocks in one
    # 8-byte load); 0: as ``mxfp4.quantize`` makes it (a block's 16 bytes in one load)
    packed: int = 0
    # 0: the next step decodes once this step's MMA is done; 1: while it runs (two sets of A
    # registers); 2: while it runs, queued behind the previous step's (two MMAs in flight)
    overlap: int = 0


def ring_bytes(config: W4WgConfig) -> int:
    return config.stages * config.block_m * BLOCK_K * 2


def why_not_fits(config: W4WgConfig, M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """The first constraint ``config`` breaks for an (M, N, K) GEMM with ``dtype`` x, or None."""
    c = config
    if dtype != torch.bfloat16:
        return (f"x of {dtype}: the MXFP4 warpgroup-MMA kernel takes bf16 x (its scale multiply "
                f"and MMA are bf16); use a triton.w4 config")
    if c.block_n not in BLOCK_NS or c.block_m not in BLOCK_MS:
        return f"block_n={c.block_n} must be one of {BLOCK_NS}, block_m={c.block_m} of {BLOCK_MS}"
    if c.num_warps not in WARPS or not 16 * c.num_warps <= c.block_n <= 32 * c.num_warps:
        return (f"num_warps={c.num_warps} must be one of {WARPS}, with 16 or 32 rows of w each "
                f"(block_n={c.block_n}; 64 a warp spill the decode's registers)")
    acc_regs = c.block_n * c.block_m // (32 * c.num_warps)
    if acc_regs > MAX_ACC_REGS:
        return (f"block_n x block_m = {c.block_n} x {c.block_m}: the fp32 accumulator would take "
                f"more than {MAX_ACC_REGS} registers a thread")
    if not 2 <= c.stages or ring_bytes(c) > _RING_BYTES:
        return (f"stages={c.stages}: 2 or more slots of {c.block_m * BLOCK_K * 2} bytes, at most "
                f"{_RING_BYTES} bytes in all")
    if c.packed not in (0, 1):
        return f"packed={c.packed} must be 0 (w as quantised) or 1 (w packed: mxfp4.prepack)"
    if c.overlap not in (0, 1, 2):
        return (f"overlap={c.overlap} must be 0 (decode after the MMA), 1 (beside it, two sets "
                f"of A registers) or 2 (beside it, two MMAs in flight)")
    if c.overlap == 2 and c.block_n == 32 * c.num_warps and acc_regs > MAX_ACC_REGS // 2:
        return (f"overlap=2 with 32 rows of w a warp and {acc_regs} accumulator registers a "
                f"thread spills registers (two MMAs in flight keep both A operands live); use "
                f"overlap=1, more warps or a smaller block_m")
    why = mxfp4.why_not_quantisable(K) or (mxfp4.why_not_packable(K) if c.packed else None)
    if why is not None:
        return why
    if K % BLOCK_K or not K:
        return (f"K={K} is not a positive multiple of {BLOCK_K}, the kernel's step (K=0, an "
                f"empty sum: the other MXFP4 kernels write the bias)")
    return None


def why_not_supported(config: W4WgConfig, M: int, N: int, K: int, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> str | None:
    """``why_not_fits``, the output (x's dtype), and whether the kernel can run here."""
    if out_dtype != dtype:
        return f"the MXFP4 warpgroup-MMA kernel writes x's dtype ({dtype}), not {out_dtype}"
    return (why_not_here("MXFP4 warpgroup-MMA kernel",
                         "a triton.w4deq config or torch.dequant_linear (packed weights: "
                         "torch.unpack_dequant_linear)")
            or why_not_fits(config, M, N, K, dtype))


def candidates(M: int, N: int, K: int, dtype: torch.dtype,
               packed: bool = False) -> list[W4WgConfig]:
    """The configs to tune one shape with, for M >= MIN_M and w as quantised or (``packed``) as
    ``mxfp4.prepack`` stores it: 64-256 rows of w, 64-256 of x (not past M's power of two), one
    warpgroup or two, 3 slots, the decode beside the MMA with one or two MMAs in flight (the
    decode after each MMA and 4 slots won no shape of seven, docs/benchmarks.md, session 26).
    Only configs that fit."""
    if M < MIN_M or dtype != torch.bfloat16:
        return []
    found = []
    for bn in BLOCK_NS:
        for bm in BLOCK_MS:
            if bm > max(MIN_M, triton.next_power_of_2(M)):
                continue
            for warps in WARPS:
                for overlap in (1, 2):
                    config = W4WgConfig(bn, bm, warps, 3, int(packed), overlap)
                    if why_not_fits(config, M, N, K, dtype) is None:
                        found.append(config)
    return found


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> W4WgConfig:
    """Reasonable untuned, two MMAs in flight, 3 slots: from 256 rows of x, 128 rows of w by
    256 of x on two warpgroups; below, 64 by 128 (64 for M <= 64) on one (the best tiles of
    the session-26 probe, docs/benchmarks.md)."""
    if M > 256:
        return W4WgConfig(128, 256, 8, 3, 0, 2)
    return W4WgConfig(64, 128 if M > 64 else 64, 4, 3, 0, 2)


@gluon.constexpr_function
def _row_bases(block_n, warps):
    """Where a thread's rows sit: lane 4 g + t holds rows g and g + 8 of its warp's 16, warps
    take 16 rows each, and rows past 16 x warps repeat in registers (as the MMA's layout)."""
    in_regs = [8] + [16 * warps << i for i in range((block_n // (16 * warps)).bit_length() - 1)]
    in_warps = [16 << i for i in range(warps.bit_length() - 1)]
    return in_regs, in_warps


@gluon.constexpr_function
def _words_layout(block_n, warps):
    """A step's code words of w as quantised, (BLOCK_N, 2 blocks, 4 places in a quad, 4 words
    of a block): thread 4 g + t of a warp holds all 4 words of both blocks of its rows
    (``_row_bases``), its quad's 4 threads the same words, at their own place t; in registers
    a block's words first (its 16 bytes are contiguous)."""
    in_regs, in_warps = _row_bases(block_n, warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0]] + [[r, 0, 0, 0] for r in in_regs],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[r, 0, 0, 0] for r in in_warps], block_bases=[],
        shape=[block_n, 2, 4, 4])


@gluon.constexpr_function
def _gathered_layout(block_n, warps):
    """The gathered words, (BLOCK_N, 2 blocks, 4 places): thread 4 g + t holds its own word of
    each block of its rows (packed, as loaded: a step's 2 words of a row are contiguous)."""
    in_regs, in_warps = _row_bases(block_n, warps)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0]] + [[r, 0, 0] for r in in_regs],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[r, 0, 0] for r in in_warps], block_bases=[], shape=[block_n, 2, 4])


# A thread's bytes t, t + 4, t + 8 and t + 12 of a block's 16 ($1-$4 its 4 words, $5 the
# selector t | (t + 4) << 4: byte t of the first word and of the second).
_GATHER_ASM = gl.constexpr(
    "{.reg .b32 lo, hi; prmt.b32 lo, $1, $2, $5; prmt.b32 hi, $3, $4, $5; "
    "prmt.b32 $0, lo, hi, 0x5410;}")
@gluon.jit
def _step_words(ptrs, step, PACKED: gl.constexpr):
    """Step ``step``'s code words, in the layout of ``ptrs``: as quantised, a row's 8 words at
    8 step (two 16-byte loads, ``_words_layout``); packed, the thread's word of both blocks,
    in the step's half of its group of 16 (one 8-byte load, ``_gathered_layout``)."""
    if PACKED:
        return gl.load(ptrs + ((step // 2) * 16 + (step % 2) * 2))
    return gl.load(ptrs + step * 8)


@gluon.jit
def _decode_step(words, scale_bytes, selector, tables, a_layout: gl.constexpr,
                 gathered_layout: gl.constexpr, PACKED: gl.constexpr):
    """A step's A operand (BLOCK_N, 64) bf16 in ``a_layout``: as quantised, each thread's
    bytes gathered from its rows' blocks (``words``; ``selector``, the PRMT's) and decoded;
    packed, each thread's own words decoded from their placed bits (mxfp4.prepack); scaled by
    ``scale_bytes`` (BLOCK_N, 2, 4) int32."""
    if PACKED:
        r = placed_scaled_bf16(words, scale_bytes)
    else:
        first, second = gl.split(gl.reshape(words, [words.shape[0], 2, 4, 2, 2]))  # word % 2
        w0, w2 = gl.split(first)
        w1, w3 = gl.split(second)
        w0 = gl.convert_layout(w0, gathered_layout, assert_trivial=True)
        w1 = gl.convert_layout(w1, gathered_layout, assert_trivial=True)
        w2 = gl.convert_layout(w2, gathered_layout, assert_trivial=True)
        w3 = gl.convert_layout(w3, gathered_layout, assert_trivial=True)
        mine = gl.inline_asm_elementwise(_GATHER_ASM, "=r,r,r,r,r,r",
                                         [w0, w1, w2, w3, selector], dtype=gl.int32,
                                         is_pure=True, pack=1)
        r = e2m1_scaled_bf16(mine, tables, scale_bytes)
    # Register i holds byte i's 2 codes: K 8 i + 2 t + (0, 1) of the block.
    codes = gl.join(gl.join(halves(r[0]), halves(r[1])), gl.join(halves(r[2]), halves(r[3])))
    # (row, block, t, code % 2, byte % 2, byte // 2) -> (row, block, byte // 2, byte % 2, t, ..)
    codes = gl.permute(codes, [0, 1, 5, 4, 2, 3])
    return gl.convert_layout(gl.reshape(codes, [words.shape[0], _BK]), a_layout,
                             assert_trivial=True)


@gluon.jit
def _issue(acc, a, i, x_ring, ready, w_ptrs, s_ptrs, steps, STAGES: gl.constexpr,
           PACKED: gl.constexpr):
    """Step i's MMA (A operand ``a``) on x's slot, once TMA has filled it, then the loads of
    step i + 2's words and scale bytes (the last steps load the final one again: no branch).
    Returns the accumulator (the MMA running) and those words and bytes."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    acc = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
    ahead = gl.minimum(i + 2, steps - 1)
    return (acc, _step_words(w_ptrs, ahead, PACKED),
            gl.load(s_ptrs + ahead * 2).to(gl.int32))


@gluon.jit
def _refill(x_desc, x_ring, ready, done, steps, pid_m, BLOCK_M: gl.constexpr,
            STAGES: gl.constexpr):
    """Step ``done``'s slot, which every warp's MMA has read (a barrier before this), loaded
    again with step done + STAGES where there is one (``done`` -1: none)."""
    barrier()
    nxt = done + STAGES
    slot = nxt % STAGES
    pred = (done >= 0) & (nxt < steps)
    mbarrier.expect(ready.index(slot), BLOCK_M * _BK * 2, pred=pred)
    _tma_load(x_desc, [pid_m * BLOCK_M, nxt * _BK], ready.index(slot), x_ring.index(slot),
              pred=pred)


@gluon.jit
def _step(acc, a, i, words, scale_bytes, OVERLAP: gl.constexpr, x_desc, x_ring, ready, w_ptrs,
          s_ptrs, selector, tables, steps, pid_m, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
          PACKED: gl.constexpr, a_layout: gl.constexpr,
          gathered_layout: gl.constexpr):
    """Step i: its MMA and step i + 2's loads (``_issue``), the decode of step i + 1's
    (``words``) into the next A operand, and the slot's refill. ``OVERLAP``: the decode runs
    beside the MMA, into registers of its own; otherwise once the MMA is done (into the same
    ones). Returns the accumulator, the next A operand and step i + 2's words and scale
    bytes."""
    acc, words_ahead, scales_ahead = _issue(acc, a, i, x_ring, ready, w_ptrs, s_ptrs, steps,
                                            STAGES, PACKED)
    if OVERLAP:
        a_next = _decode_step(words, scale_bytes, selector, tables, a_layout, gathered_layout,
                              PACKED)
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    else:
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        a_next = _decode_step(words, scale_bytes, selector, tables, a_layout, gathered_layout,
                              PACKED)
    _refill(x_desc, x_ring, ready, i, steps, pid_m, BLOCK_M, STAGES)
    return acc, a_next, words_ahead, scales_ahead


@gluon.jit
def _queued_step(acc, a, a_prev, i, words, scale_bytes, x_desc, x_ring, ready, w_ptrs, s_ptrs,
                 selector, tables, steps, pid_m, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                 PACKED: gl.constexpr, a_layout: gl.constexpr,
                 gathered_layout: gl.constexpr):
    """Step i with its MMA queued behind step i - 1's: once that one is done (its A operand
    ``a_prev`` free), step i + 1 decodes into its registers while this one runs, and step
    i - 1's slot is refilled. Returns the accumulator (this step's MMA still running), the next
    A operand, this one, and step i + 2's words and scale bytes."""
    acc, words_ahead, scales_ahead = _issue(acc, a, i, x_ring, ready, w_ptrs, s_ptrs, steps,
                                            STAGES, PACKED)
    acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
    a_next = _decode_step(words, scale_bytes, selector, tables, a_layout, gathered_layout,
                          PACKED)
    _refill(x_desc, x_ring, ready, i - 1, steps, pid_m, BLOCK_M, STAGES)
    return acc, a_next, a, words_ahead, scales_ahead


@gluon.jit(do_not_specialize=["M"])
def gemm_w4wg_kernel(
    x_desc,  # TMA descriptor of x (M, K) bf16 in (BLOCK_M, 64) boxes
    wq_ptr,  # (N, K // 2) uint8: two E2M1 codes a byte, the lower-index one in the low nibble
    ws_ptr,  # (N, K // 32) uint8: E8M0 scales
    y_ptr,  # (M, N) bf16, unit column stride
    bias_ptr,  # (N,) or unused
    M, N, K,
    stride_wn, stride_sn, stride_ym, stride_bias,
    HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, WARPS: gl.constexpr, PACKED: gl.constexpr,
    OVERLAP: gl.constexpr,  # 0, 1 or 2: W4WgConfig.overlap
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    words_layout: gl.constexpr = _words_layout(BLOCK_N, WARPS)
    gathered_layout: gl.constexpr = _gathered_layout(BLOCK_N, WARPS)
    pid_m = gl.program_id(0)  # x's blocks vary fastest: the programs of one w tile run together
    pid_n = gl.program_id(1)
    steps = K // _BK

    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, _BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(STAGES):
        pred = s < steps
        mbarrier.expect(ready.index(s), BLOCK_M * _BK * 2, pred=pred)
        _tma_load(x_desc, [pid_m * BLOCK_M, s * _BK], ready.index(s), x_ring.index(s),
                  pred=pred)

    # w as 32-bit words (rows 16-byte aligned: w4wg_call). Rows past N read row N - 1.
    w_words = wq_ptr.to(gl.pointer_type(gl.int32))
    # A step's 2 scale bytes of each row, in the gathered words' places
    sn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, gl.SliceLayout(2,
                                                                               gathered_layout)))
    step_layout: gl.constexpr = gl.SliceLayout(0, gathered_layout)  # (block, place)
    sblock = gl.arange(0, 2, gl.SliceLayout(1, step_layout))
    splace = gl.arange(0, 4, gl.SliceLayout(0, step_layout))
    s_rows = gl.minimum(sn, N - 1).to(gl.int64)
    s_ptrs = ws_ptr + (s_rows * stride_sn)[:, None, None] \
        + (sblock[:, None] + splace[None, :] * 0)[None, :, :]
    if PACKED:
        # mxfp4.prepack: the thread's word of a step's block b is word 4 t + b of the step's
        # half of a 16-word group
        w_ptrs = w_words + (s_rows * (stride_wn // 4))[:, None, None] \
            + (sblock[:, None] + splace[None, :] * 4)[None, :, :]
    else:
        # word t of a step's block b is word 4 b + t of its 8
        n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(
            1, gl.SliceLayout(2, gl.SliceLayout(3, words_layout))))
        in_row_layout: gl.constexpr = gl.SliceLayout(0, words_layout)  # (block, place, word)
        block = gl.arange(0, 2, gl.SliceLayout(1, gl.SliceLayout(2, in_row_layout)))
        place = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, in_row_layout)))
        word = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, in_row_layout)))
        in_row = block[:, None, None] * 4 + word[None, None, :] + place[None, :, None] * 0
        rows = gl.minimum(n, N - 1).to(gl.int64)
        w_ptrs = w_words + (rows * (stride_wn // 4))[:, None, None, None] + in_row[None, :, :, :]
    places = gl.zeros([BLOCK_N, 2, 4], gl.int32, gathered_layout) \
        + (sblock[:, None] * 0 + splace[None, :])[None, :, :]
    # PRMT's selector of byte t of two words (as quantised): t | (t + 4) << 4
    selector = places | ((places + 4) << 4)
    # K >> 31 is 0 (K > 0), unknown to the compiler (e2m1_tables)
    tables = e2m1_tables(gl.zeros([BLOCK_N, 2, 4], gl.int32, gathered_layout) + (K >> 31))

    a = _decode_step(_step_words(w_ptrs, 0, PACKED),
                     gl.load(s_ptrs).to(gl.int32), selector, tables, a_layout, gathered_layout,
                     PACKED)
    ahead = gl.minimum(1, steps - 1)
    words = _step_words(w_ptrs, ahead, PACKED)
    scale_bytes = gl.load(s_ptrs + ahead * 2).to(gl.int32)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    if OVERLAP == 2:
        # Two sets of A registers and two MMAs in flight: step i's queued behind step i - 1's,
        # whose registers step i + 1 decodes into once it is done (no register an MMA reads is
        # written while it runs: ptxas's C7513), so the tensor cores never wait for a decode.
        a_odd = gl.zeros([BLOCK_N, _BK], gl.bfloat16, a_layout)
        for pair in range(steps // 2):
            acc, a_odd, a, words, scale_bytes = _queued_step(
                acc, a, a_odd, 2 * pair, words, scale_bytes, x_desc, x_ring, ready, w_ptrs,
                s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED, a_layout,
                gathered_layout)
            acc, a, a_odd, words, scale_bytes = _queued_step(
                acc, a_odd, a, 2 * pair + 1, words, scale_bytes, x_desc, x_ring, ready,
                w_ptrs, s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED,
                a_layout, gathered_layout)
        if steps % 2:
            acc, a_odd, a, words, scale_bytes = _queued_step(
                acc, a, a_odd, steps - 1, words, scale_bytes, x_desc, x_ring, ready, w_ptrs,
                s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED, a_layout,
                gathered_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    elif OVERLAP == 1:
        # Two sets of A registers, each step's MMA reading one while the next step decodes
        # into the other: no register an MMA reads is written while it runs (ptxas's C7513).
        for pair in range(steps // 2):
            acc, a_odd, words, scale_bytes = _step(
                acc, a, 2 * pair, words, scale_bytes, True, x_desc, x_ring, ready, w_ptrs,
                s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED, a_layout,
                gathered_layout)
            acc, a, words, scale_bytes = _step(
                acc, a_odd, 2 * pair + 1, words, scale_bytes, True, x_desc, x_ring, ready,
                w_ptrs, s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED,
                a_layout, gathered_layout)
        if steps % 2:
            acc, a, words, scale_bytes = _step(
                acc, a, steps - 1, words, scale_bytes, True, x_desc, x_ring, ready, w_ptrs,
                s_ptrs, selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED, a_layout,
                gathered_layout)
    else:
        for i in range(steps):
            acc, a, words, scale_bytes = _step(
                acc, a, i, words, scale_bytes, False, x_desc, x_ring, ready, w_ptrs, s_ptrs,
                selector, tables, steps, pid_m, BLOCK_M, STAGES, PACKED, a_layout,
                gathered_layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    # y[m, n] = acc[n, m]: stored along n (y's rows are contiguous), 8 elements a thread.
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, WARPS], [0, 1])
    if HAS_BIAS:
        bn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, mma))
        bias = gl.load(bias_ptr + bn * stride_bias, mask=bn < N, other=0.0)
        acc = acc + bias.to(gl.float32)[:, None]
    out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout)
    yn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, out_layout))
    ym = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(0, out_layout))
    gl.store(y_ptr + ym.to(gl.int64)[None, :] * stride_ym + yn[:, None], out,
             mask=(yn < N)[:, None] & (ym < M)[None, :])


def descriptor(x: torch.Tensor, config: W4WgConfig):
    """Gluon's host TMA descriptor of x in (BLOCK_M, 64) boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    box = [config.block_m, BLOCK_K]
    return TensorDescriptor.from_tensor(x, box, gl.NVMMASharedLayout.get_default_for(
        box, gl.bfloat16))


def w4wg_call(x, w, bias, out, scale_a, scale_b, config: W4WgConfig,
              counters: torch.Tensor | None = None, warmup: bool = False,
              block_scales: bool = False) -> KernelCall:
    """The launch of ``launch_gemm_w4wg`` as data (what a dispatch plan records and replays,
    its TMA descriptor rebuilt around each later call's x): x (M, K) bf16, w the codes (N,
    K // 2; packed for a packed config), scale_b their scales (N, K // 32), out (M, N); scale_a
    None."""
    M, K = x.shape
    N = w.shape[0]
    x = _checks.tma_ready(x)
    # w is read as 16-byte (packed: 8-byte) vectors of a row and its scales by the byte: rows
    # 16-byte aligned.
    w = w if w.stride(1) == 1 and w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0 \
        else w.clone(memory_format=torch.contiguous_format)
    scale_b = scale_b if scale_b.stride(1) == 1 else scale_b.contiguous()
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    c = config
    args = (descriptor(x, c), w, scale_b, out, bias if bias is not None else out, M, N, K,
            w.stride(0), scale_b.stride(0), out.stride(0),
            bias.stride(0) if bias is not None else 0)
    constexprs = dict(HAS_BIAS=bias is not None, BLOCK_N=c.block_n, BLOCK_M=c.block_m,
                      STAGES=c.stages, WARPS=c.num_warps, PACKED=bool(c.packed),
                      OVERLAP=c.overlap)
    grid = (triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n))
    return KernelCall(gemm_w4wg_kernel, grid, args, constexprs, dict(num_warps=c.num_warps))


def launch_gemm_w4wg(x, w, bias, out, scale_a, scale_b, config: W4WgConfig,
                     counters: torch.Tensor | None = None, warmup: bool = False,
                     block_scales: bool = False) -> torch.Tensor:
    """The launch alone, for callers that validated once per shape (dispatch plans): ``out``
    (M, N) with M, N > 0, its column stride 1."""
    launch(w4wg_call(x, w, bias, out, scale_a, scale_b, config, counters, warmup), warmup)
    return out


def gemm_w4wg(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, config: W4WgConfig | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in bf16: x (M, K) bf16, wq (N, K // 2) and
    w_scale (N, K // 32) uint8 as ``gemmtune.quant.mxfp4`` makes them, or wq as
    ``gemmtune.quant.prepack_mxfp4`` packs it with a ``packed`` config, bias (N,). Validates
    everything, then launches."""
    return validated_launch("gemm_w4wg", launch_gemm_w4wg, default_config, why_not_supported,
                            x, wq, w_scale, bias, config, out)



# Called as every kernel module's validating launcher is (dispatchable)
gemm_w4wg_scaled = scaled_launcher("gemm_w4wg", gemm_w4wg)
