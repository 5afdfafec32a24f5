"""``gemm_a16w4(x, wq, w_scale, bias=None, packed=False)``: x (bf16 or fp16) times an MXFP4
weight, in x's dtype.

wq (N, K // 2) and w_scale (N, K // 32) uint8 as ``gemmtune.quant.mxfp4`` makes them (two E2M1
elements per byte, one E8M0 scale per 32 along K), or with ``packed`` wq as
``gemmtune.quant.prepack_mxfp4`` reorders it (the register-direct kernel reads it in 16-byte
loads); x (..., K); bias (N,). Dispatched per shape through ``a16w4_tuned_gemm.csv`` (key
``A16w4Key``: M, N, K, x's dtype and the weight's layout, ``packed``: one layout per (N, K) is
what a model stores, ``patch_linear`` picks it from the table); a shape without a row runs the
family default (``_mxfp4_default``: on a Hopper a Triton kernel's default config, else the
torch backend, the weight dequantised on every call, unpacked first if packed, then
``F.linear``). Registered as ``torch.ops.gemmtune.gemm_a16w4``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import gemm_schema
from gemmtune.families._mxfp4_default import default_kernel_name
from gemmtune.families._mxfp4_layout import PACKED_COLUMN, TorchBackends, mxfp4_registry
from gemmtune.families._mxfp4_layout import packed_layout_tuned as layout_tuned
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.families._switches import grad_enabled as _grad_enabled
from gemmtune.kernels import mxfp4
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_LINEAR,
                                        as_rows, dequant_linear_torch)
from gemmtune.kernels.triton.dispatchable import MXFP4_PREFIXES
from gemmtune.tables.schema import Column, Kind
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype


class A16w4Key(NamedTuple):
    M: int
    N: int
    K: int
    dtype: str  # x's (and the output's), canonical name (torch.bfloat16)
    packed: bool  # wq in the packed layout (gemmtune.quant.prepack_mxfp4)


SCHEMA = gemm_schema(
    "a16w4", "a16w4_tuned_gemm.csv", "a16w4_untuned_gemm.csv", A16w4Key,
    (Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
     PACKED_COLUMN), ("GEMMTUNE_CONFIG_A16W4",))


def problem_of(key: A16w4Key) -> GemmProblem:
    dtype = to_torch_dtype(key.dtype)
    return GemmProblem(key.M, key.N, key.K, dtype, dtype, scaling=Scaling.mxfp4,
                       preshuffled=key.packed)


_TORCH = TorchBackends(TORCH_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_LINEAR)
REGISTRY = mxfp4_registry("a16w4", _TORCH, dequant_linear_torch, MXFP4_PREFIXES)


def _to_table_key(raw: tuple) -> A16w4Key:
    m, n, k, dtype, packed, *_checked = raw
    return A16w4Key(m, n, k, DTYPE_NAMES[dtype], packed)


def _default_kernel(key: A16w4Key, device: DeviceId) -> str:
    return default_kernel_name(REGISTRY, _TORCH, problem_of(key), device)


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


def packed_layout_tuned(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether an (N, K) weight for x of ``dtype`` is best stored packed, by the a16w4 table's
    rows for x of that dtype (``_mxfp4_layout.packed_layout_tuned``)."""
    if dtype not in DTYPE_NAMES:
        return False
    name = DTYPE_NAMES[dtype]
    return layout_tuned(SCHEMA, _TORCH, n, k, lambda key: key.dtype == name)


def _check(x, wq, w_scale, bias, packed) -> None:
    # Imported here, not at the top: importing a Triton kernel module fixes, for the process,
    # whether its kernels are interpreted (TRITON_INTERPRET), and tuner workers import this
    # module before they set that variable.
    from gemmtune.kernels.triton._mxfp4_calls import check_operands

    if not all(isinstance(t, torch.Tensor) for t in (x, wq, w_scale)):
        raise TypeError("gemm_a16w4: x (..., K), wq (N, K // 2) and w_scale (N, K // 32) must "
                        "be tensors")
    check_operands("gemm_a16w4", x, wq, w_scale, bias)
    why = mxfp4.why_not_packable(x.shape[-1]) if packed else None
    if why is not None:
        raise ValueError(f"gemm_a16w4: packed=True, but {why}")


def _plan(x, wq, w_scale, bias, kernel, packed):
    args = (x, wq, w_scale, bias, packed)
    try:
        k = x.shape[-1]
        m = x.numel() // k if k else math.prod(x.shape[:-1])
        device = x.get_device()
        # Everything _check depends on, so that a cached plan never runs what it would refuse.
        key = (m, wq.shape[0], k, x.dtype, bool(packed), tuple(wq.shape), wq.dtype,
               wq.get_device(), tuple(w_scale.shape), w_scale.dtype, w_scale.get_device(),
               None if bias is None else (tuple(bias.shape), bias.get_device()), device)
    except (AttributeError, IndexError, ValueError, TypeError):
        _check(*args)
        raise
    return DISPATCH.plan_for(key, device, kernel, _check, args)


def _run(x, wq, w_scale, bias, kernel, packed):
    return _plan(x, wq, w_scale, bias, kernel, packed).run(x, wq, bias, x.dtype, None, w_scale)


def _run_and_remember(call_key: tuple, x, wq, w_scale, bias, kernel, packed):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's kernel
    bound to the key for the calls after it."""
    _check(x, wq, w_scale, bias, packed)
    plan = _plan(x, wq, w_scale, bias, kernel, packed)
    run = DISPATCH.remember(call_key, plan, (x, wq, bias, x.dtype, None, w_scale))
    return run(x, wq, bias, None, w_scale)


@torch.library.custom_op("gemmtune::gemm_a16w4", mutates_args=())
def _gemm_a16w4_op(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, kernel_name: Optional[str] = None,
                   packed: bool = False) -> torch.Tensor:
    return _run(x, wq, w_scale, bias, kernel_name, packed)


@_gemm_a16w4_op.register_fake
def _(x, wq, w_scale, bias=None, kernel_name=None, packed=False):
    return x.new_empty((*x.shape[:-1], wq.shape[0]))


def _setup_context(ctx, inputs, output):
    x, wq, w_scale, bias, kernel_name, packed = inputs
    ctx.save_for_backward(wq, w_scale)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.packed = packed


def _backward(ctx, grad):
    """Gradients of x (through the dequantised weight, in grad's dtype) and of the bias; none
    of the quantised weight."""
    wq, w_scale = ctx.saved_tensors
    codes = mxfp4.unpack(wq) if ctx.packed else wq
    grad_x = grad @ mxfp4.dequantize(codes, w_scale).to(grad.dtype)
    grad_bias = as_rows(grad).sum(0).to(ctx.bias_dtype) \
        if ctx.has_bias else None
    return grad_x, None, None, grad_bias, None, None


_gemm_a16w4_op.register_autograd(_backward, setup_context=_setup_context)


def gemm_a16w4(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, kernel: Optional[str] = None,
               packed: bool = False) -> torch.Tensor:
    """``x @ dequant_mxfp4(wq, w_scale).T + bias`` in x's dtype (bf16 or fp16), with the kernel
    the a16w4 table names for this shape and weight layout on this GPU (or ``kernel``, a
    kernelName checked like a table row). x (..., K); wq (N, K // 2) and w_scale (N, K // 32)
    uint8 from ``gemmtune.quant.mxfp4``, or with ``packed`` wq from
    ``gemmtune.quant.prepack_mxfp4`` (K a multiple of 128); bias (N,). Returns (..., N)."""
    if _dynamo_compiling() or _compiler._is_compiling_flag or (_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))):
        # Compiled or differentiated: the custom op (its fake, its gradients), whichever kernel
        # runs the forward.
        return _gemm_a16w4_op(x, wq, w_scale, bias, kernel, packed)
    # The eager hot path: everything the checks and the plan depend on, one dict hit, the kernel
    # bound to this key (Dispatcher.remember).
    call_key = (x.shape, wq.shape, w_scale.shape, x.dtype, wq.dtype, w_scale.dtype,
                x.get_device(), wq.get_device(), w_scale.get_device(),
                None if bias is None else (bias.shape, bias.dtype, bias.get_device()), kernel,
                packed)
    run = _CALLS.get(call_key)
    if run is None:
        return _run_and_remember(call_key, x, wq, w_scale, bias, kernel, packed)
    return run(x, wq, bias, None, w_scale)
