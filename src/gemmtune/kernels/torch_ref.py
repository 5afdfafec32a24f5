"""The ``torch`` backend (the floor every tuned kernel must beat) and the fp32 references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TORCH_LINEAR = "torch.linear"

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
# torch.mm(..., out_dtype=) (bf16/fp16 in, fp32 out) arrived in torch 2.8; older ones take the
# reference path for that combination.
_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


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
            x.reshape(-1, k).contiguous(), w.contiguous().t(),
            scale_a=scale_a.reshape(()) if scale_a is not None else one,
            scale_b=scale_b.reshape(()) if scale_b is not None else one,
            out_dtype=torch.float32 if bias is not None else out_dtype,
        )
        y = (y + bias.float()).to(out_dtype) if bias is not None else y
        return y.view(*x.shape[:-1], n)
    if not scaled and x.is_cuda and out_dtype == torch.float32 and x.dtype in (
            torch.bfloat16, torch.float16) and _MM_HAS_OUT_DTYPE:
        # cuBLAS writes the fp32 accumulator directly: no rounding through the input dtype.
        y = torch.mm(x.reshape(-1, k), w.t(), out_dtype=torch.float32)
        y = y + bias.float() if bias is not None else y
        return y.view(*x.shape[:-1], n)
    return gemm_a16w16_ref(x, w, bias, out_dtype, scale_a, scale_b)
