"""``gemm_a8w8(xq, wq, x_scale, w_scale, bias, dtype) = (xq @ wq.T) * x_scale * w_scale + bias``.

FP8 (e4m3fn) or INT8 operands; ``x_scale`` per tensor (one value) or per token (one per row of
x), ``w_scale`` per tensor or per channel (one per row of w), fp32. Dispatched per shape through
``a8w8_tuned_gemm.csv`` (key ``M, N, K, q_dtype_w``); a shape without a row runs the torch
backend. Registered as the custom op ``torch.ops.gemmtune.gemm_a8w8`` (shapes-only fake), so
``torch.compile(fullgraph=True)`` traces it; no autograd (quantised inference).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.ops._dispatch import Dispatcher, KernelRegistry, count_miss
from gemmtune.ops._operands import check_multiply, check_out_dtype_and_device
from gemmtune.ops._triton import TritonKernel, json_config_or
from gemmtune.tables.schema import Family
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype

Q_DTYPES = (torch.float8_e4m3fn, torch.int8)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TORCH_SCALED_MM = "torch.scaled_mm"


def gemm_a8w8_ref(xq, wq, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    """The dequantised product in fp32, cast to ``out_dtype``: what every backend must match."""
    k, n = xq.shape[-1], wq.shape[0]
    y = (xq.reshape(-1, k).float() @ wq.float().t()) * x_scale.reshape(-1, 1).float() \
        * w_scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).view(*xq.shape[:-1], n)


def torch_fast_path(m: int, n: int, k: int, q_dtype: torch.dtype, cuda: bool = True) -> bool:
    """Whether the torch backend runs (M, N, K) through cuBLAS (``_scaled_mm`` needs N and K
    multiples of 16, ``_int_mm`` M > 16 and N, K multiples of 8), not the fp32 reference."""
    if not cuda:
        return False
    if q_dtype == torch.float8_e4m3fn:
        return k % 16 == 0 and n % 16 == 0
    return m > 16 and k % 8 == 0 and n % 8 == 0


def scaled_mm_torch(xq, wq, bias, out_dtype, x_scale, w_scale, out=None):  # xq (..., K), wq (N, K)
    """The torch backend: ``torch._scaled_mm`` (FP8; tensor-wise or row-wise scales) and
    ``torch._int_mm`` (INT8) on CUDA where their shape rules hold, the fp32 reference elsewhere.
    Bias is added after the product (``_scaled_mm``'s own bias does not take every scale layout)."""
    k, n = xq.shape[-1], wq.shape[0]
    x2 = xq.reshape(-1, k)
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


def _shape_of(key: tuple) -> tuple:
    m, n, k, q_dtype = key
    return m, n, k, to_torch_dtype(q_dtype), torch.bfloat16


REGISTRY = KernelRegistry(Family.a8w8)
REGISTRY.register_exact(TORCH_SCALED_MM, scaled_mm_torch)
REGISTRY.register("triton.tile", lambda name: TritonKernel.tile(name, _shape_of))
REGISTRY.register("triton.splitk", lambda name: TritonKernel.splitk(name, _shape_of))
REGISTRY.register("triton.persistent", lambda name: TritonKernel.persistent(name, _shape_of))


def _parse_cublaslt(name: str):
    from gemmtune.kernels.cublaslt import CublasLtScaledKernel

    return CublasLtScaledKernel(name)


REGISTRY.register("cublaslt", _parse_cublaslt)


def _to_table_key(raw: tuple) -> tuple:
    m, n, k, q_dtype = raw[:4]
    return m, n, k, DTYPE_NAMES[q_dtype]


_JSON_TAGS = {"torch.float8_e4m3fn": "A8W8", "torch.int8": "A8W8_INT8"}


def _default_kernel(key: tuple, device: DeviceId) -> str:
    # torch, unless a per-(N, K) Triton JSON config file (gemmtune tune-triton) names a kernel.
    m, n, k, q_dtype = key
    tag = _JSON_TAGS.get(q_dtype)
    if tag is None:
        return TORCH_SCALED_MM
    return json_config_or(TORCH_SCALED_MM, REGISTRY, key, device.arch, tag, m, n, k)


DISPATCH = Dispatcher(Family.a8w8, REGISTRY, _to_table_key, _default_kernel)


def _check(xq, wq, x_scale, w_scale, bias, dtype) -> None:
    check_multiply("gemm_a8w8", xq, wq)
    if xq.dtype not in Q_DTYPES or wq.dtype != xq.dtype:
        raise TypeError(f"gemm_a8w8: xq is {xq.dtype} and wq {wq.dtype}; both must be one of "
                        f"{', '.join(str(d) for d in Q_DTYPES)} (quantise with gemmtune.quant)")
    check_out_dtype_and_device("gemm_a8w8", xq, wq, dtype, OUT_DTYPES)
    m = math.prod(xq.shape[:-1])
    for name, s, count, per in (("x_scale", x_scale, m, "token (row of xq)"),
                                ("w_scale", w_scale, wq.shape[0], "channel (row of wq)")):
        if (not isinstance(s, torch.Tensor) or s.dtype != torch.float32
                or s.device != xq.device or s.numel() not in (1, count)
                or not s.is_contiguous()):
            got = (f"{tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, torch.Tensor)
                   else type(s).__name__)
            raise ValueError(f"gemm_a8w8: {name} must be contiguous float32 on {xq.device} with "
                             f"1 value (per tensor) or {count} (one per {per}); got {got}")
    if bias is not None and (bias.shape != (wq.shape[0],) or bias.device != xq.device
                             or not bias.is_floating_point()):
        raise ValueError(f"gemm_a8w8: bias must be a float ({wq.shape[0]},) tensor on "
                         f"{xq.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")


def _run(xq, wq, x_scale, w_scale, bias, dtype):
    try:
        k = xq.shape[-1]
        m = xq.numel() // k if k else math.prod(xq.shape[:-1])
        # The plan key holds everything the checks depend on (but the scales' contiguity, which
        # reshape(-1) below makes good), so a cached call needs no checks.
        key = (m, wq.shape[0], k, xq.dtype, wq.dtype, wq.dim(), wq.shape[-1], wq.get_device(),
               x_scale.numel(), x_scale.dtype, x_scale.get_device(),
               w_scale.numel(), w_scale.dtype, w_scale.get_device(),
               None if bias is None else (bias.dtype, tuple(bias.shape), bias.get_device()),
               dtype, xq.get_device())
    except (AttributeError, IndexError, ValueError):
        _check(xq, wq, x_scale, w_scale, bias, dtype)
        raise
    plan = DISPATCH.plans.get(key)
    if plan is None:
        _check(xq, wq, x_scale, w_scale, bias, dtype)
        plan = DISPATCH.plan(key, key[-1])
    if plan.miss:
        count_miss(plan)
    return plan.run(xq, wq, bias, dtype, x_scale.reshape(-1), w_scale.reshape(-1))


@torch.library.custom_op("gemmtune::gemm_a8w8", mutates_args=())
def _gemm_a8w8_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                  w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    return _run(xq, wq, x_scale, w_scale, bias, dtype)


@_gemm_a8w8_op.register_fake
def _(xq, wq, x_scale, w_scale, bias, dtype):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a8w8(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(xq @ wq.T) * x_scale * w_scale + bias`` with the kernel the a8w8 table names for this
    shape on this GPU.

    xq: (..., K) and wq: (N, K), both float8_e4m3fn or both int8 (``gemmtune.quant`` makes them);
    x_scale: fp32, 1 value or one per token (e.g. (M, 1)); w_scale: fp32, 1 value or one per
    channel (e.g. (N, 1)); bias: (N,) float; dtype: output dtype. Returns (..., N).
    """
    if torch.compiler.is_compiling():
        return _gemm_a8w8_op(xq, wq, x_scale, w_scale, bias, dtype)
    return _run(xq, wq, x_scale, w_scale, bias, dtype)
