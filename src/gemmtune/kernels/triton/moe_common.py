"""What the fused-MoE Triton kernels share: programmatic dependent launch between launches,
stage 1's gate/up sums over model_dim, the gated activation, and the cache of the workspaces a
launch leaves zero for the next."""

from __future__ import annotations

from typing import Callable, TypeVar

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
    x_scales = xs_ptr + rows.to(tl.int64) * stride_xs
    gate_scales = ws_ptr + expert * stride_se + (cols // SCALE_BLOCK) * stride_sn
    up_scales = ws_ptr + expert * stride_se + ((cols + I) // SCALE_BLOCK) * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lane = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_left = k_hi - k0
        a = tl.load(x_ptrs, mask=row_real[:, None] & (lane[None, :] < k_left), other=0.0)
        wg = tl.load(gate_ptrs, mask=lane[:, None] < k_left, other=0.0)
        wu = tl.load(up_ptrs, mask=lane[:, None] < k_left, other=0.0)
        if BLOCK_SCALED:
            block = k0 // SCALE_BLOCK
            xs = tl.load(x_scales + block * stride_xk, mask=row_real, other=0.0)[:, None]
            gate += tl.dot(a, wg, input_precision=INPUT_PRECISION) * xs \
                * tl.load(gate_scales + block * stride_sk)[None, :]
            up += tl.dot(a, wu, input_precision=INPUT_PRECISION) * xs \
                * tl.load(up_scales + block * stride_sk)[None, :]
        else:
            gate = tl.dot(a, wg, gate, input_precision=INPUT_PRECISION)
            up = tl.dot(a, wu, up, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd
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


Workspace = TypeVar("Workspace")
# (kernel module, device, stream, shape...) -> a workspace every launch leaves as it found it.
_WORKSPACES: dict[tuple, object] = {}


def stream_workspace(key: tuple, device: torch.device, make: Callable[[], Workspace]) -> Workspace:
    """The workspace cached for ``key`` on this device's current stream (made by ``make``).
    Inside a CUDA-graph capture with none cached, a fresh one: its zero fill becomes part of
    the graph (a cached one made there would not be zero until the graph first ran)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    full_key = (device, stream) + key
    found = _WORKSPACES.get(full_key)
    if found is None:
        found = make()
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _WORKSPACES[full_key] = found
    return found


def cached_workspaces(kind: str) -> list:
    """The workspaces cached for keys starting with ``kind`` (what tests inspect)."""
    return [w for key, w in _WORKSPACES.items() if key[2] == kind]
