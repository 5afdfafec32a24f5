"""``gemm_a8w8_blockscale(xq, wq, x_scale, w_scale, dtype)``: FP8 GEMM with DeepSeek-style block
scales, x per 1x128 and w per 128x128 of K, applied per K block in the main loop.

xq (..., K) and wq (N, K) float8_e4m3fn; x_scale (..., ceil(K/128)), w_scale (ceil(N/128),
ceil(K/128)), fp32 (``gemmtune.quant.per_block_fp8`` with ACT_BLOCK / WEIGHT_BLOCK makes them).
Dispatched per shape through ``a8w8_blockscale_tuned_gemm.csv`` (key M, N, K); a shape without
a row runs the torch backend. Registered as ``torch.ops.gemmtune.gemm_a8w8_blockscale``.
"""

from __future__ import annotations

import math
import warnings

import torch

from gemmtune.device import DeviceId
from gemmtune.ops._dispatch import Dispatcher, KernelRegistry, count_miss
from gemmtune.ops._operands import check_multiply, check_out_dtype_and_device
from gemmtune.ops._triton import TritonKernel
from gemmtune.tables.schema import Family

TORCH_BLOCKSCALE = "torch.scaled_mm_blockwise"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 128


def gemm_a8w8_blockscale_ref(xq, wq, x_scale, w_scale, out_dtype=torch.bfloat16):
    """The dequantised product in fp32 (each element times its block's scale), cast."""
    k, n = xq.shape[-1], wq.shape[0]
    x2, xs = xq.reshape(-1, k).float(), x_scale.reshape(-1, x_scale.shape[-1])
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
    return n % _BLOCK == 0 and k % (4 * _BLOCK) == 0 and (n, k) not in _refused


def blockscale_torch(xq, wq, bias, out_dtype, x_scale, w_scale, out=None):
    """The torch backend: ``torch._scaled_mm`` with 1x128 x 128x128 scales where cuBLAS takes
    the shape (``cublas_block_wise``; x's scales M-major with M padded to a multiple of 4, w's
    as (K/128, N/128)); elsewhere the dequantised fp32 reference, correct and slow."""
    k, n = xq.shape[-1], wq.shape[0]
    x2, xs = xq.reshape(-1, k), x_scale.reshape(-1, x_scale.shape[-1])
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


def _shape_of(key: tuple) -> tuple:
    m, n, k = key
    return m, n, k, torch.float8_e4m3fn, torch.bfloat16


REGISTRY = KernelRegistry(Family.a8w8_blockscale)
REGISTRY.register_exact(TORCH_BLOCKSCALE, blockscale_torch)
REGISTRY.register("triton.tile",
                  lambda name: TritonKernel.tile(name, _shape_of, block_scales=True))
REGISTRY.register("triton.splitk",
                  lambda name: TritonKernel.splitk(name, _shape_of, block_scales=True))


def _default_kernel(key: tuple, device: DeviceId) -> str:
    return TORCH_BLOCKSCALE


DISPATCH = Dispatcher(Family.a8w8_blockscale, REGISTRY, lambda raw: raw[:3], _default_kernel)


def _check(xq, wq, x_scale, w_scale, dtype) -> None:
    # Imported here, not at the top: importing a Triton kernel module fixes, for the process,
    # whether its kernels are interpreted (TRITON_INTERPRET), and tuner workers import this
    # module before they set that variable.
    from gemmtune.kernels.triton._checks import validate_block_scales

    check_multiply("gemm_a8w8_blockscale", xq, wq)
    check_out_dtype_and_device("gemm_a8w8_blockscale", xq, wq, dtype, OUT_DTYPES)
    x2 = xq.reshape(-1, xq.shape[-1])
    xs = x_scale.reshape(-1, x_scale.shape[-1]) if isinstance(x_scale, torch.Tensor) \
        and x_scale.dim() >= 1 else x_scale
    validate_block_scales("gemm_a8w8_blockscale", x2, wq, xs, w_scale)


def _run(xq, wq, x_scale, w_scale, dtype):
    try:
        k = xq.shape[-1]
        m = xq.numel() // k if k else math.prod(xq.shape[:-1])
        # Everything _check depends on, so that a cached plan never runs what it would refuse
        # (a column-major scale would be read as row-major by the kernels).
        key = (m, wq.shape[0], k, xq.dtype, wq.dtype, wq.dim(), wq.shape[-1], wq.get_device(),
               tuple(x_scale.shape), x_scale.dtype, x_scale.get_device(),
               x_scale.is_contiguous(), tuple(w_scale.shape), w_scale.dtype,
               w_scale.get_device(), w_scale.is_contiguous(), dtype, xq.get_device())
    except (AttributeError, IndexError, ValueError):
        _check(xq, wq, x_scale, w_scale, dtype)
        raise
    plan = DISPATCH.plans.get(key)
    if plan is None:
        _check(xq, wq, x_scale, w_scale, dtype)
        plan = DISPATCH.plan(key, key[-1])
    if plan.miss:
        count_miss(plan)
    xs = x_scale.reshape(-1, x_scale.shape[-1])
    return plan.run(xq, wq, None, dtype, xs, w_scale)


@torch.library.custom_op("gemmtune::gemm_a8w8_blockscale", mutates_args=())
def _gemm_a8w8_blockscale_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                             w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _run(xq, wq, x_scale, w_scale, dtype)


@_gemm_a8w8_blockscale_op.register_fake
def _(xq, wq, x_scale, w_scale, dtype):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a8w8_blockscale(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                         w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                         ) -> torch.Tensor:
    """``xq @ wq.T`` with each 1x128 block of x and 128x128 block of w scaled by its own fp32
    scale, using the kernel the a8w8_blockscale table names for this shape on this GPU.
    Returns (..., N) in ``dtype``."""
    if torch.compiler.is_compiling():
        return _gemm_a8w8_blockscale_op(xq, wq, x_scale, w_scale, dtype)
    return _run(xq, wq, x_scale, w_scale, dtype)
