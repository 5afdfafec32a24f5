"""``gemm_a8w8_blockscale(xq, wq, x_scale, w_scale, dtype)``: FP8 GEMM with DeepSeek-style block
scales, x per 1x128 and w per 128x128 of K, applied per K block in the main loop.

xq (..., K) and wq (N, K) float8_e4m3fn; x_scale (..., ceil(K/128)), w_scale (ceil(N/128),
ceil(K/128)), fp32 (``gemmtune.quant.per_block_fp8`` with ACT_BLOCK / WEIGHT_BLOCK makes them).
Dispatched per shape through ``a8w8_blockscale_tuned_gemm.csv`` (key ``BlockscaleKey``); a shape
without a row runs what a Triton JSON config file (tag ``A8W8_BLOCKSCALE``) names for it, else the
torch backend. Registered as ``torch.ops.gemmtune.gemm_a8w8_blockscale``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import (OUT_DTYPES, TUNED_OUT_DTYPE, check_multiply,
                                     check_out_dtype_and_device, gemm_registry, gemm_schema,
                                     json_config_or)
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import (TORCH_BLOCKSCALE, as_rows, bind_blockscale,
                                        blockscale_torch)



class BlockscaleKey(NamedTuple):
    M: int
    N: int
    K: int


SCHEMA = gemm_schema(
    "a8w8_blockscale", "a8w8_blockscale_tuned_gemm.csv", "a8w8_blockscale_untuned_gemm.csv",
    BlockscaleKey, (),
    ("GEMMTUNE_CONFIG_A8W8_BLOCKSCALE", "GEMMTUNE_CONFIG_GEMM_A8W8_BLOCKSCALE",
     "AITER_CONFIG_GEMM_A8W8_BLOCKSCALE"))


def problem_of(key: BlockscaleKey) -> GemmProblem:
    return GemmProblem(key.M, key.N, key.K, torch.float8_e4m3fn, TUNED_OUT_DTYPE,
                       scaling=Scaling.block)


# The tag of the Triton JSON config files (gemmtune tune-triton) a shape without a row may use.
JSON_TAG = "A8W8_BLOCKSCALE"
# No persistent kernel: it takes no block scales. The Gluon kernels (triton.frag, triton.ring,
# triton.wsring) scale each K step of 128 (Hopper only).
REGISTRY = gemm_registry("a8w8_blockscale", TORCH_BLOCKSCALE, blockscale_torch,
                         ("triton.tile", "triton.splitk", "triton.gemv", "triton.frag",
                          "triton.ring", "triton.wsring"), block_scales=True,
                         torch_bind=bind_blockscale)


def _to_table_key(raw: tuple) -> BlockscaleKey:
    m, n, k, *_checked = raw
    return BlockscaleKey(m, n, k)


def _default_kernel(key: BlockscaleKey, device: DeviceId) -> str:
    # torch, unless a Triton JSON config file (gemmtune tune-triton), the (N, K)'s own or the
    # default, names a kernel for M.
    return json_config_or(TORCH_BLOCKSCALE, REGISTRY, problem_of(key), device, JSON_TAG)


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


def _check(xq, wq, x_scale, w_scale, dtype) -> None:
    # Imported here, not at the top: importing a Triton kernel module fixes, for the process,
    # whether its kernels are interpreted (TRITON_INTERPRET), and tuner workers import this
    # module before they set that variable.
    from gemmtune.kernels.triton._checks import validate_block_scales

    check_multiply("gemm_a8w8_blockscale", xq, wq)
    check_out_dtype_and_device("gemm_a8w8_blockscale", xq, wq, dtype, OUT_DTYPES)
    x2 = as_rows(xq)
    xs = as_rows(x_scale) if isinstance(x_scale, torch.Tensor) \
        and x_scale.dim() >= 1 else x_scale
    validate_block_scales("gemm_a8w8_blockscale", x2, wq, xs, w_scale)


def _plan(xq, wq, x_scale, w_scale, dtype, kernel):
    args = (xq, wq, x_scale, w_scale, dtype)
    try:
        k = xq.shape[-1]
        m = xq.numel() // k if k else math.prod(xq.shape[:-1])
        # Everything _check depends on, so that a cached plan never runs what it would refuse
        # (a column-major scale would be read as row-major by the kernels).
        device = xq.get_device()
        key = (m, wq.shape[0], k, xq.dtype, wq.dtype, wq.dim(), wq.shape[-1], wq.get_device(),
               tuple(x_scale.shape), x_scale.dtype, x_scale.get_device(),
               x_scale.is_contiguous(), tuple(w_scale.shape), w_scale.dtype,
               w_scale.get_device(), w_scale.is_contiguous(), dtype, device)
    except (AttributeError, IndexError, ValueError):
        _check(*args)
        raise
    return DISPATCH.plan_for(key, device, kernel, _check, args)


def _run(xq, wq, x_scale, w_scale, dtype, kernel):
    plan = _plan(xq, wq, x_scale, w_scale, dtype, kernel)
    xs = as_rows(x_scale)
    return plan.run(xq, wq, None, dtype, xs, w_scale)


def _run_and_remember(call_key: tuple, xq, wq, x_scale, w_scale, dtype, kernel):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's kernel
    bound to the key for the calls after it (x_scale as the kernels take it: (M, K/128))."""
    _check(xq, wq, x_scale, w_scale, dtype)
    plan = _plan(xq, wq, x_scale, w_scale, dtype, kernel)
    xs = as_rows(x_scale)
    run = DISPATCH.remember(call_key, plan, (xq, wq, None, dtype, xs, w_scale))
    return run(xq, wq, None, xs, w_scale)


@torch.library.custom_op("gemmtune::gemm_a8w8_blockscale", mutates_args=())
def _gemm_a8w8_blockscale_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                             w_scale: torch.Tensor, dtype: torch.dtype,
                             kernel_name: Optional[str] = None) -> torch.Tensor:
    return _run(xq, wq, x_scale, w_scale, dtype, kernel_name)


@_gemm_a8w8_blockscale_op.register_fake
def _(xq, wq, x_scale, w_scale, dtype, kernel_name=None):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a8w8_blockscale(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                         w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         kernel: Optional[str] = None) -> torch.Tensor:
    """``xq @ wq.T`` with each 1x128 block of x and 128x128 block of w scaled by its own fp32
    scale, using the kernel the a8w8_blockscale table names for this shape on this GPU (or
    ``kernel``, a kernelName checked like a table row). Returns (..., N) in ``dtype``."""
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return _gemm_a8w8_blockscale_op(xq, wq, x_scale, w_scale, dtype, kernel)
    # The eager hot path: everything the checks and the plan depend on (the scales' layout
    # included), one dict hit, the kernel bound to this key (Dispatcher.remember).
    call_key = (xq.shape, wq.shape, x_scale.shape, w_scale.shape, xq.dtype, wq.dtype,
                x_scale.dtype, w_scale.dtype, xq.get_device(), wq.get_device(),
                x_scale.get_device(), w_scale.get_device(), x_scale.is_contiguous(),
                w_scale.is_contiguous(), dtype, kernel)
    run = _CALLS.get(call_key)
    if run is None:
        return _run_and_remember(call_key, xq, wq, x_scale, w_scale, dtype, kernel)
    if xq.dim() != 2:  # a reshape, as _run_and_remember's: a strided scale may not view
        x_scale = as_rows(x_scale)
    return run(xq, wq, None, x_scale, w_scale)
