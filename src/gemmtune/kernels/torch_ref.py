"""The ``torch`` backends (the floor every tuned kernel must beat) and the fp32 references of
every GEMM op: ``gemm_a16w16`` (``F.linear``), ``gemm_a8w8`` (``torch._scaled_mm`` /
``torch._int_mm``), ``gemm_a8w8_bpreshuffle`` (the weight unshuffled, then as ``gemm_a8w8``) and
``gemm_a8w8_blockscale`` (``torch._scaled_mm`` with block scales).

A backend is called as dispatch calls every kernel: ``(x, w, bias, out_dtype, scale_a, scale_b,
out=None)`` with x (..., K) and w (N, K); ``out`` (the tuner's NaN-poisoned buffer) receives a
copy. A ``*_ref`` function computes the same product in fp32, cast to ``out_dtype``.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gemmtune.kernels import mxfp4
from gemmtune.kernels.preshuffle import unshuffle

# The names tables give the torch backends (kernelName).
TORCH_LINEAR = "torch.linear"
TORCH_SCALED_MM = "torch.scaled_mm"
TORCH_BLOCKSCALE = "torch.scaled_mm_blockwise"
TORCH_UNSHUFFLED = "torch.unshuffle_scaled_mm"

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
# torch.mm(..., out_dtype=) (bf16/fp16 in, fp32 out) arrived in torch 2.8; older ones take the
# reference path for that combination.
_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., k) as (rows, k), the rows counted: ``reshape(-1, k)`` is ambiguous for an
    empty ``t`` with k = 0 (a GEMM with K = 0 is valid: its product is zeros, plus any bias)."""
    k = t.shape[-1]
    # The rows are counted only where k = 0: on the eager hot path (3-D x) -1 costs less
    return t.reshape(-1, k) if k else t.reshape(math.prod(t.shape[:-1]), 0)

def gemm_a16w16_ref(x, w, bias=None, out_dtype=None, scale_a=None, scale_b=None):
    """``x @ w.T * scale_a * scale_b + bias`` computed in fp32, cast to ``out_dtype``."""
    y = x.float() @ w.float().t()
    if scale_a is not None:
        y = y * scale_a.float()
    if scale_b is not None:
        y = y * scale_b.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or _default_out_dtype(x.dtype))


def _default_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype in _FP8 else dtype


def linear_torch(x, w, bias, out_dtype, scale_a, scale_b, out=None):  # x (..., K), w (N, K)
    """cuBLAS through torch, as a model would call it; ``out`` (the tuner's NaN-poisoned buffer)
    receives a copy, since F.linear has no out argument."""
    if out is None and out_dtype == x.dtype and scale_a is None and scale_b is None and (
            bias is None or bias.dtype == x.dtype):
        return F.linear(x, w, bias)  # the common case, first: this is every default dispatch
    y = _linear_torch(x, w, bias, out_dtype, scale_a, scale_b)
    return y if out is None else out.copy_(y)


def bind_linear(x, w, bias, out_dtype, scale_a, scale_b):
    """``linear_torch`` for calls like this one (dispatch's ``bind``): ``F.linear`` itself
    where the call is its common case, so the op's hot path adds nothing to it."""
    if out_dtype == x.dtype and scale_a is None and scale_b is None and (
            bias is None or bias.dtype == x.dtype):
        return F.linear

    def run(x, w, bias, scale_a=None, scale_b=None):
        return _linear_torch(x, w, bias, out_dtype, scale_a, scale_b)

    return run


def _linear_torch(x, w, bias, out_dtype, scale_a, scale_b):
    """cuBLAS through torch, as a model would call it. Unusual combinations (fp32 output from
    16-bit inputs on the CPU, per-tensor scales on 16-bit inputs) take the fp32 reference path:
    correct, and rare enough that their speed does not matter."""
    scaled = scale_a is not None or scale_b is not None
    if not scaled and out_dtype == x.dtype:
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, w, bias)
    k, n = x.shape[-1], w.shape[0]
    if scaled and x.dtype == torch.float8_e4m3fn and x.is_cuda and k % 16 == 0 and n % 16 == 0:
        # torch._scaled_mm needs 16-aligned K and N, a row-major x and a column-major w.T;
        # other shapes take the reference path.
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(
            as_rows(x).contiguous(), w.contiguous().t(),
            scale_a=scale_a.reshape(()) if scale_a is not None else one,
            scale_b=scale_b.reshape(()) if scale_b is not None else one,
            out_dtype=torch.float32 if bias is not None else out_dtype,
        )
        y = (y + bias.float()).to(out_dtype) if bias is not None else y
        return y.view(*x.shape[:-1], n)
    if not scaled and x.is_cuda and out_dtype == torch.float32 and x.dtype in (
            torch.bfloat16, torch.float16) and _MM_HAS_OUT_DTYPE:
        # cuBLAS writes the fp32 accumulator directly: no rounding through the input dtype.
        y = torch.mm(as_rows(x), w.t(), out_dtype=torch.float32)
        y = y + bias.float() if bias is not None else y
        return y.view(*x.shape[:-1], n)
    return gemm_a16w16_ref(x, w, bias, out_dtype, scale_a, scale_b)


def gemm_a8w8_ref(xq, wq, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    """The dequantised product in fp32, cast to ``out_dtype``: what every backend must match."""
    n = wq.shape[0]
    y = (as_rows(xq).float() @ wq.float().t()) * x_scale.reshape(-1, 1).float() \
        * w_scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).view(*xq.shape[:-1], n)


def torch_fast_path(m: int, n: int, k: int, q_dtype: torch.dtype, cuda: bool = True) -> bool:
    """Whether the torch backend runs (M, N, K) through cuBLAS (``_scaled_mm`` needs N and K
    multiples of 16, ``_int_mm`` M > 16 and N, K multiples of 8), not the fp32 reference."""
    if not cuda or not (m and n and k):  # _int_mm refuses empty operands
        return False
    if q_dtype == torch.float8_e4m3fn:
        return k % 16 == 0 and n % 16 == 0
    return m > 16 and k % 8 == 0 and n % 8 == 0


def scaled_mm_torch(xq, wq, bias, out_dtype, x_scale, w_scale, out=None):  # xq (..., K), wq (N, K)
    """The torch backend: ``torch._scaled_mm`` (FP8; tensor-wise or row-wise scales) and
    ``torch._int_mm`` (INT8) on CUDA where their shape rules hold, the fp32 reference elsewhere.
    Bias is added after the product (``_scaled_mm``'s own bias does not take every scale layout)."""
    k, n = xq.shape[-1], wq.shape[0]
    x2 = as_rows(xq)
    m = x2.shape[0]
    y = None
    fast = torch_fast_path(m, n, k, xq.dtype, xq.is_cuda)
    if fast and xq.dtype == torch.float8_e4m3fn:
        sa, sb = x_scale.reshape(-1), w_scale.reshape(-1)
        if sa.numel() == 1 and sb.numel() == 1:
            sa, sb = sa.reshape(()), sb.reshape(())
        else:  # row-wise: an (M, 1) and a (1, N) scale
            sa = sa.reshape(-1, 1).expand(m, 1).contiguous()
            sb = sb.reshape(1, -1).expand(1, n).contiguous()
        y = torch._scaled_mm(x2.contiguous(), wq.contiguous().t(), scale_a=sa, scale_b=sb,
                             out_dtype=out_dtype if bias is None else torch.float32)
    elif fast:
        acc = torch._int_mm(x2.contiguous(), wq.contiguous().t())  # int32, exact
        y = acc.float() * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
        y = y if bias is not None else y.to(out_dtype)
    if y is None:
        y = gemm_a8w8_ref(x2, wq, x_scale, w_scale, bias, out_dtype)
    elif bias is not None:
        y = (y + bias.float()).to(out_dtype)
    y = y.view(*xq.shape[:-1], n)
    return y if out is None else out.copy_(y)


def unshuffled_scaled_mm_torch(xq, wq, bias, out_dtype, x_scale, w_scale, out=None):
    """The torch backend of pre-shuffled weights (``gemmtune.kernels.preshuffle``): the weight
    put back in rows (a copy of it per call), then ``scaled_mm_torch``. The reference the
    tuned kernels are checked against, not a fast path."""
    return scaled_mm_torch(xq, unshuffle(wq), bias, out_dtype, x_scale, w_scale, out)


def bind_scaled_mm(xq, wq, bias, out_dtype, x_scale, w_scale):
    """``scaled_mm_torch`` for calls like this one (dispatch's ``bind``): for 2-D FP8 x with
    per-tensor scales, or a per-token (M, 1) and a per-channel (N, 1) scale, without bias,
    ``torch._scaled_mm`` with only the views and layouts it needs made per call (each a no-op
    for contiguous operands); None (the plain call) otherwise."""
    k, n = xq.shape[-1], wq.shape[0]
    m = xq.numel() // k if k else 0
    if (bias is not None or xq.dim() != 2 or xq.dtype != torch.float8_e4m3fn
            or not torch_fast_path(m, n, k, xq.dtype, xq.is_cuda)):
        return None
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        def run(xq, wq, bias, x_scale, w_scale):
            return torch._scaled_mm(xq.contiguous(), wq.contiguous().t(),
                                    scale_a=x_scale.reshape(()),
                                    scale_b=w_scale.reshape(()), out_dtype=out_dtype)
        return run
    if x_scale.shape != (m, 1) or w_scale.shape != (n, 1):
        return None

    def run(xq, wq, bias, x_scale, w_scale):  # row-wise: an (M, 1) and a (1, N) scale
        return torch._scaled_mm(xq.contiguous(), wq.contiguous().t(),
                                scale_a=x_scale.contiguous(),
                                scale_b=w_scale.view(1, n), out_dtype=out_dtype)

    return run


_BLOCK = 128  # K extent of an FP8 block scale (x per 1x128, w per 128x128)


def gemm_a8w8_blockscale_ref(xq, wq, x_scale, w_scale, out_dtype=torch.bfloat16):
    """The dequantised product in fp32 (each element times its block's scale), cast."""
    k, n = xq.shape[-1], wq.shape[0]
    x2, xs = as_rows(xq).float(), as_rows(x_scale)
    x_deq = x2 * xs.repeat_interleave(_BLOCK, dim=1)[:, :k]
    w_deq = wq.float() * w_scale.repeat_interleave(_BLOCK, dim=0)[:n].repeat_interleave(
        _BLOCK, dim=1)[:, :k]
    return (x_deq @ w_deq.t()).to(out_dtype).view(*xq.shape[:-1], n)


# (N, K) whose block-wise torch._scaled_mm raised here: they take the reference from then on.
_refused: set[tuple[int, int]] = set()


def cublas_block_wise(n: int, k: int) -> bool:
    """Whether the torch backend runs (N, K) through cuBLAS's block-wise FP8 GEMM. Measured on
    H100 (torch 2.11, cuBLAS 13.1): it needs N and K multiples of 128 and K/128 a multiple of 4
    (K = 256 and 2304 returned wrong numbers with no error; padding w's scale rows to 4 was
    refused as an invalid scaling configuration)."""
    return k > 0 and n % _BLOCK == 0 and k % (4 * _BLOCK) == 0 and (n, k) not in _refused


def blockscale_torch(xq, wq, bias, out_dtype, x_scale, w_scale, out=None):
    """The torch backend: ``torch._scaled_mm`` with 1x128 x 128x128 scales where cuBLAS takes
    the shape (``cublas_block_wise``; x's scales M-major with M padded to a multiple of 4, w's
    as (K/128, N/128)); elsewhere the dequantised fp32 reference, correct and slow."""
    k, n = xq.shape[-1], wq.shape[0]
    # cuBLAS takes a row-major x and a column-major w.T (no-ops for contiguous operands).
    x2, xs = as_rows(xq).contiguous(), as_rows(x_scale)
    wq = wq.contiguous()
    m = x2.shape[0]
    y = None
    if xq.is_cuda and cublas_block_wise(n, k):
        pad = -m % 4
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, k)])
            xs = torch.cat([xs, xs.new_ones(pad, xs.shape[1])])
        try:
            y = torch._scaled_mm(x2, wq.t(), scale_a=xs.t().contiguous().t(),
                                 scale_b=w_scale.t(), out_dtype=out_dtype)[:m]
        except (RuntimeError, ValueError) as e:
            _refused.add((n, k))
            warnings.warn(f"gemm_a8w8_blockscale: torch._scaled_mm refused block scales for "
                          f"N={n} K={k} ({e}); the torch backend uses the dequantised reference "
                          f"for this shape", stacklevel=2)
    if y is None:
        y = gemm_a8w8_blockscale_ref(x2[:m], wq, xs[:m], w_scale, out_dtype)
    y = y.view(*xq.shape[:-1], n)
    return y if out is None else out.copy_(y)


def bind_blockscale(xq, wq, bias, out_dtype, x_scale, w_scale):
    """``blockscale_torch`` for calls like this one (dispatch's ``bind``): for 2-D x with M a
    multiple of 4 (no padding) on a shape cuBLAS takes, ``torch._scaled_mm`` with only the
    scales' layouts made per call (x's M-major copy, w's transposed view); None (the plain call)
    otherwise. A refusal by cuBLAS goes the plain way, which records it and warns."""
    k, n = xq.shape[-1], wq.shape[0]
    if (bias is not None or xq.dim() != 2 or xq.shape[0] % 4 or not xq.is_cuda
            or not cublas_block_wise(n, k)):
        return None

    def run(xq, wq, bias, x_scale, w_scale):
        # The op's key pins shapes, not layouts: the operands as cuBLAS takes them (no-ops for
        # contiguous ones, the case bound for).
        xq, wq = xq.contiguous(), wq.contiguous()
        try:
            return torch._scaled_mm(xq, wq.t(), scale_a=x_scale.t().contiguous().t(),
                                    scale_b=w_scale.t(), out_dtype=out_dtype)
        except (RuntimeError, ValueError):
            return blockscale_torch(xq, wq, None, out_dtype, x_scale, w_scale)

    return run


# ------------------------------------------------------------------------------ MXFP4 weights
TORCH_DEQUANT_LINEAR = "torch.dequant_linear"
# The same for a weight in the packed layout (gemmtune.quant.prepack_mxfp4): unpacked first.
TORCH_UNPACK_DEQUANT_LINEAR = "torch.unpack_dequant_linear"


def gemm_a16w4_ref(x, wq, w_scale, bias=None, out_dtype=torch.float32):
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in fp32, then ``out_dtype``: the reference
    of ``gemm_a16w4``."""
    y = x.float() @ mxfp4.dequantize(wq, w_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def dequant_linear_torch(x, wq, bias, out_dtype, scale_a, scale_b, out=None):
    """``gemm_a16w4``'s torch backend: the MXFP4 weight (``wq``, its scales ``scale_b``)
    dequantised to x's dtype on every call, then ``F.linear`` (the reference a real kernel is
    measured against, not a fast path). In fp16 a block whose values pass 65504 becomes inf, as
    any fp16 copy of the weight would. A bias of x's dtype is added by ``F.linear``; another
    one in fp32, then rounded once, as the Triton kernel adds it."""
    w = mxfp4.dequantize(wq, scale_b).to(x.dtype)
    if bias is None or bias.dtype == x.dtype:
        y = F.linear(x, w, bias)
    else:
        y = (F.linear(x, w).float() + bias.float()).to(x.dtype)
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y if out is None else out.copy_(y)


TORCH_DEQUANT_MM = "torch.dequant_mm"
# The same for a weight in the packed layout (gemmtune.quant.prepack_mxfp4): unpacked first.
TORCH_UNPACK_DEQUANT_MM = "torch.unpack_dequant_mm"


def gemm_a4w4_ref(xq, wq, x_scale, w_scale, out_dtype=torch.float32):
    """``dequant_mxfp4(xq, x_scale) @ dequant_mxfp4(wq, w_scale).T`` in fp32, then
    ``out_dtype``: the reference of ``gemm_a4w4_blockscale``."""
    return (mxfp4.dequantize(xq, x_scale) @ mxfp4.dequantize(wq, w_scale).T).to(out_dtype)


def dequant_mm_torch(xq, wq, bias, out_dtype, scale_a, scale_b, out=None):
    """``gemm_a4w4_blockscale``'s torch backend: both MXFP4 operands dequantised on every call
    (to bf16 for a bf16 output, exact but for scales past bf16's range; else fp32), then
    ``F.linear`` (the reference a real kernel is measured against, not a fast path)."""
    dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    x = mxfp4.dequantize(as_rows(xq), as_rows(scale_a))
    y = F.linear(x.to(dtype), mxfp4.dequantize(wq, scale_b).to(dtype))
    y = y.reshape(*xq.shape[:-1], wq.shape[0])
    if bias is not None:
        y = y.float() + bias.float()
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y if out is None else out.copy_(y)


# ------------------------------------------------------------------------------- fused MoE
TORCH_MOE = "torch.moe"


def moe_act(gate: torch.Tensor, activation) -> torch.Tensor:
    """A fused MoE's gate activation (``Activation`` or its name): exact GELU or SiLU."""
    return F.gelu(gate) if str(getattr(activation, "value", activation)) == "gelu" else F.silu(gate)


def _moe_pairs(topk_ids, expert_map, experts: int):
    """(local expert of every pair, flattened; the pairs of local experts, grouped by expert
    in pair order; their tokens)."""
    topk = topk_ids.shape[1]
    local = expert_map[topk_ids.reshape(-1).long()].long()
    order = torch.argsort(torch.where(local >= 0, local, experts), stable=True)
    chosen = order[local[order] >= 0]
    return local, chosen, chosen // topk


def fused_moe_ref(hidden, w1, w2, topk_weight, topk_ids, expert_map, activation="silu",
                  doweight_stage1=False, out_dtype=torch.float32):
    """The fused MoE in fp32, expert by expert: for each token, the sum over its slots k of
    ``weight_k * w2[e_k] @ (act(w1_gate[e_k] @ x) * (w1_up[e_k] @ x))`` (the weight applied to
    stage 1's output instead with ``doweight_stage1``); pairs routed to another rank's expert
    (``expert_map`` -1) add nothing."""
    inter_dim = w2.shape[2]
    local, chosen, tokens = _moe_pairs(topk_ids, expert_map, w1.shape[0])
    weights = topk_weight.reshape(-1).float()
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32,
                      device=hidden.device)
    for e in range(w1.shape[0]):
        pairs = chosen[local[chosen] == e]
        if pairs.numel() == 0:
            continue
        x = hidden[tokens[local[chosen] == e]].float()
        w = weights[pairs][:, None]
        h = x @ w1[e].float().t()
        h = moe_act(h[:, :inter_dim], activation) * h[:, inter_dim:]
        h = h * w if doweight_stage1 else h
        y = h @ w2[e].float().t()
        out.index_add_(0, tokens[local[chosen] == e], y if doweight_stage1 else y * w)
    return out.to(out_dtype)


class GroupedPairs(NamedTuple):
    """The routed pairs sorted by local expert for a grouped GEMM: other ranks' pairs sort last,
    past the last group, so nothing is selected by value (no host read: graph-capturable)."""

    order: torch.Tensor  # (pairs,) pair ids by expert
    offsets: torch.Tensor  # (E,) int32: where each expert's group ends
    kept: torch.Tensor  # (pairs, 1) bool, in ``order``: a local expert's pair
    weights: torch.Tensor  # (pairs, 1) fp32 routing weights, in ``order``


def grouped_pairs(topk_weight, topk_ids, expert_map, experts: int) -> GroupedPairs:
    local = expert_map[topk_ids.reshape(-1).long()].long()
    group = torch.where(local >= 0, local, experts)  # other ranks' pairs: one group past the end
    order = torch.argsort(group, stable=True)
    sizes = torch.zeros(experts + 1, dtype=torch.long, device=topk_ids.device)
    sizes.scatter_add_(0, group, torch.ones_like(group))
    offsets = torch.cumsum(sizes[:experts], 0).to(torch.int32)
    return GroupedPairs(order, offsets, (local[order] >= 0)[:, None],
                        topk_weight.reshape(-1)[order].float()[:, None])


def combine_pairs(y: torch.Tensor, pairs: GroupedPairs, doweight_stage1: bool,
                  topk: int) -> torch.Tensor:
    """Stage 2's rows (in ``pairs.order``, fp32) times their routing weights unless stage 1
    applied them, back in pair order and summed over each token's slots: (T, D) fp32."""
    # Rows past the last group are never written by the grouped GEMM: where(), not a product.
    y = torch.where(pairs.kept, y if doweight_stage1 else y * pairs.weights, 0.0)
    per_pair = torch.empty_like(y).index_copy_(0, pairs.order, y)  # back to pair order
    return per_pair.view(-1, topk, y.shape[1]).sum(1)


def fused_moe_torch(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem, out=None):
    """The torch backend, as a torch user would write it: pairs sorted by expert (argsort),
    gathered, ``torch._grouped_mm`` for both stages (bf16 with 8-aligned dims; elsewhere the
    fp32 reference), the activation, the routing weight, then each token's slots summed. Nothing
    is selected by value (pairs of other ranks' experts sort last, past the grouped GEMMs' last
    group, and are zeroed), so no step needs the host to read a device value: meant to be
    captured in a CUDA graph (tests/test_fused_moe.py checks that on the GPU)."""
    dtype, inter_dim = hidden.dtype, w2.shape[2]
    if dtype != torch.bfloat16 or hidden.shape[1] % 8 or inter_dim % 8 or hidden.shape[0] == 0:
        y = fused_moe_ref(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                          problem.activation, problem.doweight_stage1, dtype)
        return y if out is None else out.copy_(y)
    topk = topk_ids.shape[1]
    pairs = grouped_pairs(topk_weight, topk_ids, expert_map, w1.shape[0])
    h = torch._grouped_mm(hidden[pairs.order // topk], w1.transpose(1, 2), offs=pairs.offsets)
    h = moe_act(h[:, :inter_dim].float(), problem.activation) * h[:, inter_dim:].float()
    h = (h * pairs.weights if problem.doweight_stage1 else h).to(dtype)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=pairs.offsets).float()
    total = combine_pairs(y, pairs, problem.doweight_stage1, topk)
    return total.to(dtype) if out is None else out.copy_(total)
