"""What the fused-MoE Triton kernels share: programmatic dependent launch between launches,
stage 1's gate/up sums over model_dim, the gated activation, and the cache of the workspaces a
launch leaves zero for the next."""

from __future__ import annotations

from typing import Callable, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks

SILU, GELU = 0, 1  # the ACT constexpr
# Each launch waits on the one before with programmatic dependent launch (Hopper+; the
# interpreter has none): the next grid is scheduled while the previous one drains.
PDL = not _checks.interpreted()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the kernels this one reads from have
    finished (this grid was scheduled while they drained)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """With programmatic dependent launch: this program's loads are done, so the next kernel's
    grid may be scheduled (it waits for this grid to finish before reading). Not earlier: its
    waiting programs would hold SMs this grid's later programs need."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def global_time_ns(anything):
    """The GPU's global nanosecond timer, for the kernels' TRACE timelines (``anything`` gives the
    asm a shape)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anything],
                                     dtype=tl.int64, is_pure=False, pack=1)


SCALE_BLOCK = tl.constexpr(128)  # K extent of FP8 block scales (constexpr: jitted code reads it)
# SCALED: how FP8 operands' scales apply. Rows: after the sums, one per row of the activations
# (or one per tensor: stride 0) times one per output channel of the expert (or one per expert).
# Blocks: at each K step, the activations' 1x128 block scale times the weights' 128x128 one.
# (constexpr: jitted code may read no other global)
SCALING_NONE, SCALING_ROWS, SCALING_BLOCKS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def rows_and_channels_scaled(acc, xs_ptr, rows, real, stride_xs, ws_ptr, expert, cols,
                             stride_se, stride_sn):
    """FP8 sums (BLOCK_M, BLOCK_N) times each row's activation scale (``xs_ptr`` by row; rows
    not ``real`` get 0) and each output channel's weight scale (``ws_ptr`` by expert, column)."""
    return acc * tl.load(xs_ptr + rows * stride_xs, mask=real, other=0.0)[:, None] \
        * tl.load(ws_ptr + expert * stride_se + cols * stride_sn)[None, :]


@triton.jit
def block_scales(xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr, expert, cols, stride_se,
                 stride_sn, stride_sk, k0):
    """The 1x128 and 128x128 block scales of the K step at ``k0`` (it lies in one block: block_k
    divides 128), as (BLOCK_M, 1) activation and (1, BLOCK_N) weight factors."""
    block = k0 // SCALE_BLOCK
    xs = tl.load(xs_ptr + rows * stride_xs + block * stride_xk, mask=real, other=0.0)
    ws = tl.load(ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sn
                 + block * stride_sk)
    return xs[:, None], ws[None, :]


@triton.jit
def gate_up_sums(x_ptr, w1_ptr, rows, row_real, expert, cols, k_lo, k_hi, I, stride_xt,
                 stride_xd, stride_we, stride_wn, stride_wd, xs_ptr, ws_ptr, stride_xs,
                 stride_xk, stride_se, stride_sn, stride_sk, INPUT_PRECISION: tl.constexpr,
                 BLOCK_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Stage 1's two GEMMs over model_dim columns [k_lo, k_hi) (k_lo a multiple of BLOCK_K, k_hi
    model_dim or one) in one pass: fp32 (BLOCK_M, BLOCK_N) tiles of
    ``x[rows] @ w1[expert, cols].T`` (gate) and of the same columns + I (up); rows not
    ``row_real`` read as zeros. ``BLOCK_SCALED`` (FP8 x and w1): each K step's products (one
    128 block: block_k divides 128) times x's 1x128 scale (``xs_ptr``, strides per row and K
    block) and w1's 128x128 one (``ws_ptr``, strides per expert, N block, K block); the scale
    arguments are unread otherwise."""
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xd
    w_base = w1_ptr + expert * stride_we + offs_k[:, None] * stride_wd
    gate_ptrs = w_base + cols[None, :] * stride_wn  # (BK, BN): rows [0, I) of w1[e], transposed
    up_ptrs = w_base + (cols + I)[None, :] * stride_wn  # rows [I, 2I)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lane = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_left = k_hi - k0
        a = tl.load(x_ptrs, mask=row_real[:, None] & (lane[None, :] < k_left), other=0.0)
        wg = tl.load(gate_ptrs, mask=lane[:, None] < k_left, other=0.0)
        wu = tl.load(up_ptrs, mask=lane[:, None] < k_left, other=0.0)
        if BLOCK_SCALED:
            gate, up = gate_up_block_step(gate, up, a, wg, wu, xs_ptr, rows, row_real, stride_xs,
                                          stride_xk, ws_ptr, expert, cols, I, stride_se,
                                          stride_sn, stride_sk, k0, INPUT_PRECISION)
        else:
            gate = tl.dot(a, wg, gate, input_precision=INPUT_PRECISION)
            up = tl.dot(a, wu, up, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd
    return gate, up


@triton.jit
def block_scaled_dot(acc, a, b, xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr, expert, cols,
                     stride_se, stride_sn, stride_sk, k0, INPUT_PRECISION: tl.constexpr):
    """One K step with 1x128 / 128x128 block scales: ``acc + (a @ b) * scales`` (a (BM, BK),
    b (BK, BN) of output columns ``cols``)."""
    xs, ws = block_scales(xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr, expert, cols,
                          stride_se, stride_sn, stride_sk, k0)
    return acc + tl.dot(a, b, input_precision=INPUT_PRECISION) * xs * ws


@triton.jit
def gate_up_block_step(gate, up, a, wg, wu, xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr,
                       expert, cols, I, stride_se, stride_sn, stride_sk, k0,
                       INPUT_PRECISION: tl.constexpr):
    """One K step of stage 1's sums with block scales: ``a @ wg`` and ``a @ wu`` (the weights
    (BK, BN), up's columns I on) scaled and added to gate and up."""
    gate = block_scaled_dot(gate, a, wg, xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr,
                            expert, cols, stride_se, stride_sn, stride_sk, k0, INPUT_PRECISION)
    up = block_scaled_dot(up, a, wu, xs_ptr, rows, real, stride_xs, stride_xk, ws_ptr, expert,
                          cols + I, stride_se, stride_sn, stride_sk, k0, INPUT_PRECISION)
    return gate, up


@triton.jit
def gated_activation(gate, up, ACT: tl.constexpr):
    """``act(gate) * up`` in fp32: ACT 0 SiLU, 1 exact GELU."""
    gate = gate.to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return act * up.to(tl.float32)


class StageScales(NamedTuple):
    """An FP8 stage's scales as its kernels take them: the activations' and the weights', the
    kind (SCALING_*) and their strides (activations by row and K block, weights by expert, row
    or N block and K block; 0 where one scale covers many)."""

    x: torch.Tensor
    w: torch.Tensor
    kind: int
    strides: tuple[int, int, int, int, int]

    @classmethod
    def of(cls, x_scale, w_scale, stand_in: torch.Tensor) -> "StageScales":
        """From a stage's activation scales ((T,) or () per row or tensor, (T, K/128) per
        block, or None for bf16: ``stand_in`` takes the unread pointers' places) and weight
        scales."""
        if x_scale is None:
            return cls(stand_in, stand_in, SCALING_NONE.value, (0, 0, 0, 0, 0))
        kind = SCALING_BLOCKS if x_scale.dim() == 2 else SCALING_ROWS
        x_strides = [x_scale.stride(d) if x_scale.dim() > d and x_scale.shape[d] > 1 else 0
                     for d in (0, 1)]
        w_strides = [w_scale.stride(d) if w_scale.shape[d] > 1 else 0 for d in (0, 1, 2)]
        return cls(x_scale, w_scale, kind.value, (*x_strides, *w_strides))


Workspace = TypeVar("Workspace")
# (kernel module, device, stream, shape...) -> a workspace every launch leaves as it found it.
_WORKSPACES: dict[tuple, object] = {}


def stream_workspace(key: tuple, device: torch.device, make: Callable[[], Workspace],
                     fits: Callable[[Workspace], bool] | None = None) -> Workspace:
    """The workspace cached for ``key`` on this device's current stream (made by ``make``;
    made again, and kept instead, where the cached one does not ``fits``). Inside a CUDA-graph
    capture with none cached that fits, a fresh one: its zero fill becomes part of the graph (a
    cached one made there would not be zero until the graph first ran)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    full_key = (device, stream) + key
    found = _WORKSPACES.get(full_key)
    if found is None or (fits is not None and not fits(found)):
        found = make()
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _WORKSPACES[full_key] = found
    return found


def cached_workspaces(kind: str) -> list:
    """The workspaces cached for keys starting with ``kind`` (what tests inspect)."""
    return [w for key, w in _WORKSPACES.items() if key[2] == kind]
