"""``gemm_a4w4_blockscale(xq, wq, x_scale, w_scale, dtype, packed=False)``: both operands
MXFP4 (AITER's A4W4 block-scale GEMM), the output in ``dtype``.

xq (..., K // 2) and wq (N, K // 2) uint8 E2M1 codes, x_scale (..., K // 32) and w_scale
(N, K // 32) uint8 E8M0 scales, as ``gemmtune.quant.mxfp4`` makes them (x quantised per token
row), or with ``packed`` wq as ``gemmtune.quant.prepack_mxfp4`` reorders it (the register-direct
kernel reads it in 16-byte loads and decodes it with fewer instructions). Dispatched per shape
through ``a4w4_blockscale_tuned_gemm.csv`` (key ``A4w4Key``: M, N, K, with K the elements,
twice xq's last dimension, and the weight's layout, ``packed``); a shape without a row runs the
family default (``_mxfp4_default``: on a Hopper a Triton kernel's default config, else the
torch backend, both dequantised on every call, a packed weight unpacked first). Registered as
``torch.ops.gemmtune.gemm_a4w4_blockscale``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import (OUT_DTYPES, TUNED_OUT_DTYPE, check_out_dtype_and_device,
                                     gemm_schema)
from gemmtune.families._mxfp4_default import default_kernel_name
from gemmtune.families._mxfp4_layout import PACKED_COLUMN, TorchBackends, mxfp4_registry
from gemmtune.families._mxfp4_layout import packed_layout_tuned as layout_tuned
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.kernels import mxfp4
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM, as_rows,
                                        dequant_mm_torch)
from gemmtune.kernels.triton.dispatchable import (W4_PREFIX, W4DEQ_PREFIX, W4FRAG_PREFIX,
                                                  W4XA_PREFIX)


class A4w4Key(NamedTuple):
    M: int
    N: int
    K: int  # elements along K (twice the operands' last dimension: two codes a byte)
    packed: bool = False  # wq in the packed layout (gemmtune.quant.prepack_mxfp4)


SCHEMA = gemm_schema(
    "a4w4_blockscale", "a4w4_blockscale_tuned_gemm.csv", "a4w4_blockscale_untuned_gemm.csv",
    A4w4Key, (PACKED_COLUMN,), ("GEMMTUNE_CONFIG_A4W4_BLOCKSCALE", "GEMMTUNE_CONFIG_GEMM_A4W4",
                  "AITER_CONFIG_GEMM_A4W4"))


def problem_of(key: A4w4Key) -> GemmProblem:
    # x's storage dtype (uint8 codes) tells the MXFP4 kernel that x is MXFP4 too.
    return GemmProblem(key.M, key.N, key.K, torch.uint8, TUNED_OUT_DTYPE, scaling=Scaling.mxfp4,
                       preshuffled=key.packed)


_TORCH = TorchBackends(TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM)
# The MXFP4 kernels that take MXFP4 x too (not triton.w4wg)
REGISTRY = mxfp4_registry("a4w4_blockscale", _TORCH, dequant_mm_torch,
                          (W4_PREFIX, W4FRAG_PREFIX, W4DEQ_PREFIX, W4XA_PREFIX))


def _to_table_key(raw: tuple) -> A4w4Key:
    m, n, k, packed, *_checked = raw
    return A4w4Key(m, n, k, packed)


def _default_kernel(key: A4w4Key, device: DeviceId) -> str:
    return default_kernel_name(REGISTRY, _TORCH, problem_of(key), device)


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


def packed_layout_tuned(n: int, k: int) -> bool:
    """Whether an (N, K) weight is best stored packed, by the a4w4_blockscale table's rows
    (``_mxfp4_layout.packed_layout_tuned``)."""
    return layout_tuned(SCHEMA, _TORCH, n, k)


def _check(xq, wq, x_scale, w_scale, dtype, packed) -> None:
    op = "gemm_a4w4_blockscale"
    if not all(isinstance(t, torch.Tensor) for t in (xq, wq, x_scale, w_scale)):
        raise TypeError(f"{op}: xq, wq, x_scale and w_scale must be tensors")
    if any(t.dtype != torch.uint8 for t in (xq, wq, x_scale, w_scale)):
        raise TypeError(f"{op}: xq, wq, x_scale and w_scale must be uint8 (MXFP4 codes and "
                        f"scales, as gemmtune.quant.mxfp4 makes them), got {xq.dtype}, "
                        f"{wq.dtype}, {x_scale.dtype}, {w_scale.dtype}")
    if xq.dim() < 1 or wq.dim() != 2 or x_scale.dim() != xq.dim() or w_scale.dim() != 2:
        raise ValueError(f"{op}: expected xq (..., K // 2), wq (N, K // 2), x_scale "
                         f"(..., K // 32), w_scale (N, K // 32); got {tuple(xq.shape)}, "
                         f"{tuple(wq.shape)}, {tuple(x_scale.shape)}, {tuple(w_scale.shape)}")
    k = xq.shape[-1] * 2
    n = wq.shape[0]
    if k % mxfp4.BLOCK or wq.shape[1] * 2 != k or tuple(x_scale.shape) != (
            *xq.shape[:-1], k // mxfp4.BLOCK) or tuple(w_scale.shape) != (n, k // mxfp4.BLOCK):
        raise ValueError(f"{op}: K={k} (twice xq's last dimension, a multiple of "
                         f"{mxfp4.BLOCK}) needs wq (N, {k // 2}), x_scale (..., "
                         f"{k // mxfp4.BLOCK}) and w_scale (N, {k // mxfp4.BLOCK}); got "
                         f"{tuple(xq.shape)}, {tuple(wq.shape)}, {tuple(x_scale.shape)}, "
                         f"{tuple(w_scale.shape)}")
    check_out_dtype_and_device(op, xq, wq, dtype, OUT_DTYPES)
    if x_scale.device != xq.device or w_scale.device != xq.device:
        raise ValueError(f"{op}: put xq, wq, x_scale and w_scale on one device")
    why = mxfp4.why_not_packable(k) if packed else None
    if why is not None:
        raise ValueError(f"{op}: packed=True, but {why}")


def _plan(xq, wq, x_scale, w_scale, dtype, kernel, packed):
    args = (xq, wq, x_scale, w_scale, dtype, packed)
    try:
        k = xq.shape[-1] * 2
        m = math.prod(xq.shape[:-1])
        device = xq.get_device()
        # Everything _check depends on, so that a cached plan never runs what it would refuse.
        key = (m, wq.shape[0], k, bool(packed), xq.dtype, tuple(wq.shape), wq.dtype,
               wq.get_device(),
               tuple(x_scale.shape), x_scale.dtype, x_scale.get_device(),
               tuple(w_scale.shape), w_scale.dtype, w_scale.get_device(), dtype, device)
    except (AttributeError, IndexError, ValueError, TypeError):
        _check(*args)
        raise
    return DISPATCH.plan_for(key, device, kernel, _check, args)


def _run(xq, wq, x_scale, w_scale, dtype, kernel, packed):
    plan = _plan(xq, wq, x_scale, w_scale, dtype, kernel, packed)
    return plan.run(xq, wq, None, dtype, as_rows(x_scale), w_scale)


def _run_and_remember(call_key: tuple, xq, wq, x_scale, w_scale, dtype, kernel, packed):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's kernel
    bound to the key for the calls after it (x_scale as the kernels take it: (M, K / 32))."""
    _check(xq, wq, x_scale, w_scale, dtype, packed)
    plan = _plan(xq, wq, x_scale, w_scale, dtype, kernel, packed)
    xs = as_rows(x_scale)
    run = DISPATCH.remember(call_key, plan, (xq, wq, None, dtype, xs, w_scale))
    return run(xq, wq, None, xs, w_scale)


@torch.library.custom_op("gemmtune::gemm_a4w4_blockscale", mutates_args=())
def _gemm_a4w4_blockscale_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                             w_scale: torch.Tensor, dtype: torch.dtype,
                             kernel_name: Optional[str] = None,
                             packed: bool = False) -> torch.Tensor:
    return _run(xq, wq, x_scale, w_scale, dtype, kernel_name, packed)


@_gemm_a4w4_blockscale_op.register_fake
def _(xq, wq, x_scale, w_scale, dtype, kernel_name=None, packed=False):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a4w4_blockscale(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                         w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         kernel: Optional[str] = None, packed: bool = False) -> torch.Tensor:
    """``dequant_mxfp4(xq, x_scale) @ dequant_mxfp4(wq, w_scale).T`` in ``dtype`` (bf16, fp16 or
    fp32), with the kernel the a4w4_blockscale table names for this shape and weight layout on
    this GPU (or ``kernel``, a kernelName checked like a table row). With ``packed``, wq comes
    from ``gemmtune.quant.prepack_mxfp4`` (K a multiple of 128). Returns (..., N)."""
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return _gemm_a4w4_blockscale_op(xq, wq, x_scale, w_scale, dtype, kernel, packed)
    # The eager hot path: everything the checks and the plan depend on, one dict hit, the kernel
    # bound to this key (Dispatcher.remember).
    call_key = (xq.shape, wq.shape, x_scale.shape, w_scale.shape, xq.dtype, wq.dtype,
                x_scale.dtype, w_scale.dtype, xq.get_device(), wq.get_device(),
                x_scale.get_device(), w_scale.get_device(), dtype, kernel, packed)
    run = _CALLS.get(call_key)
    if run is None:
        return _run_and_remember(call_key, xq, wq, x_scale, w_scale, dtype, kernel, packed)
    return run(xq, wq, None, as_rows(x_scale), w_scale)
