"""``gemm_a16w16(x, w, bias, otype, scale_a, scale_b) = x @ w.T (+ bias)``, dispatched per shape.

The table is ``bf16_tuned_gemm.csv`` (key ``Bf16Key``). Eager calls go straight to the planned
kernel; under ``torch.compile`` or autograd the call goes through the registered custom op
``torch.ops.gemmtune.gemm_a16w16``, whose fake implementation gives shapes only, so
``torch.compile(fullgraph=True)`` traces it without a graph break.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import gemm_registry, gemm_schema, json_config_or
from gemmtune.families._switches import any_autocast as _any_autocast
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.families._switches import grad_enabled as _grad_enabled
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import TORCH_LINEAR, as_rows, bind_linear, linear_torch
from gemmtune.kernels.triton.dispatchable import PREFIXES as TRITON_PREFIXES
from gemmtune.tables.schema import Column, Kind
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype


class Bf16Key(NamedTuple):
    M: int
    N: int
    K: int
    bias: bool
    dtype: str  # canonical dtype names (torch.bfloat16)
    outdtype: str
    scaleAB: bool  # per-tensor scale_a / scale_b (fp8 inputs)
    bpreshuffle: bool


SCHEMA = gemm_schema(
    "bf16", "bf16_tuned_gemm.csv", "bf16_untuned_gemm.csv", Bf16Key, (
        Column("bias", Kind.BOOL, default="False"),
        Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
        Column("outdtype", Kind.DTYPE, default="torch.bfloat16"),
        Column("scaleAB", Kind.BOOL, default="False"),
        Column("bpreshuffle", Kind.BOOL, default="False"),
    ), ("GEMMTUNE_CONFIG_BF16", "GEMMTUNE_CONFIG_GEMM_BF16", "AITER_CONFIG_GEMM_BF16"))

_INPUT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}
# e4m3fn only: the Triton kernel takes no other, and torch._scaled_mm has no e5m2 x e5m2 GEMM.
_FP8_DTYPES = {torch.float8_e4m3fn}
# Tags of the Triton JSON config files (gemmtune tune-triton) a shape without a row may use.
JSON_TAGS = {torch.bfloat16: "A16W16", torch.float16: "A16W16_FP16"}


def problem_of(key: Bf16Key) -> GemmProblem:
    return GemmProblem(key.M, key.N, key.K, to_torch_dtype(key.dtype),
                       to_torch_dtype(key.outdtype), key.bias,
                       Scaling.tensor if key.scaleAB else Scaling.none, key.bpreshuffle)


REGISTRY = gemm_registry("bf16", TORCH_LINEAR, linear_torch, TRITON_PREFIXES, cublaslt="unscaled",
                         torch_bind=bind_linear)


def _to_table_key(raw: tuple) -> Bf16Key:
    m, n, k, has_bias, dtype, out_dtype, scaled, preshuffled, _device = raw
    return Bf16Key(m, n, k, has_bias, DTYPE_NAMES[dtype], DTYPE_NAMES[out_dtype], scaled,
                   preshuffled)


def _default_kernel(key: Bf16Key, device: DeviceId) -> str:
    # cuBLAS's own heuristic is right for every shape and the baseline tuned rows must beat;
    # a shape without a row runs it, unless a Triton JSON config file (the (N, K)'s own or the
    # default) names a kernel for M.
    problem = problem_of(key)
    tag = JSON_TAGS.get(problem.dtype)
    if tag is None or key.outdtype != key.dtype or key.scaleAB or key.bpreshuffle:
        return TORCH_LINEAR
    return json_config_or(TORCH_LINEAR, REGISTRY, problem, device, tag)


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


def _out_dtype(dtype: torch.dtype, otype: Optional[torch.dtype]) -> torch.dtype:
    if otype is not None:
        return otype
    return torch.bfloat16 if dtype in _FP8_DTYPES else dtype


def _check(x: torch.Tensor, w: torch.Tensor, bias, scale_a, scale_b) -> None:
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"gemm_a16w16: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply; expected "
            f"x (..., K) and w (N, K) (w as stored by nn.Linear)")
    if x.dtype != w.dtype:
        raise TypeError(f"gemm_a16w16: x is {x.dtype} but w is {w.dtype}; cast one to match")
    scaled = scale_a is not None or scale_b is not None
    if x.dtype not in _INPUT_DTYPES and not (scaled and x.dtype in _FP8_DTYPES):
        raise TypeError(
            f"gemm_a16w16: {x.dtype} inputs are not supported; use bf16, fp16 or fp32 (fp8 "
            f"e4m3fn only with per-tensor scale_a/scale_b)")
    if x.device != w.device:
        raise ValueError(f"gemm_a16w16: x is on {x.device} but w is on {w.device}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.device != x.device):
        raise ValueError(f"gemm_a16w16: bias has shape {tuple(bias.shape)} on {bias.device}; "
                         f"expected ({w.shape[0]},) on {x.device}")
    _check_scales(x, scale_a, scale_b)


def _check_scales(x: torch.Tensor, scale_a, scale_b) -> None:
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s is not None and (s.numel() != 1 or s.dtype != torch.float32 or s.device != x.device):
            raise ValueError(
                f"gemm_a16w16: {name} must be a one-element float32 per-tensor scale on "
                f"{x.device}, got shape {tuple(s.shape)} {s.dtype} on {s.device}")


def _plan(x, w, bias, otype, scale_a, scale_b, kernel):
    """The plan for this call and its output dtype. Full validation runs once per shape key
    (on a plan miss); a cached plan checks only what the key does not pin (w's K and dtype,
    bias length)."""
    try:
        n, k = w.shape
        xk = x.shape[-1]
    except (ValueError, IndexError):
        _check(x, w, bias, scale_a, scale_b)
        raise
    m = x.numel() // xk if xk else math.prod(x.shape[:-1])
    dtype = x.dtype
    out_dtype = _out_dtype(dtype, otype)
    scaled = scale_a is not None or scale_b is not None
    device = x.get_device()
    key = (m, n, xk, bias is not None, dtype, out_dtype, scaled, False, device)
    plan = DISPATCH.plan_for(key, device, kernel, _check, (x, w, bias, scale_a, scale_b))
    if k != xk or w.dtype != dtype or (bias is not None and bias.shape[0] != n):
        _check(x, w, bias, scale_a, scale_b)
    elif scaled:
        _check_scales(x, scale_a, scale_b)
    return plan, out_dtype


def _run(x, w, bias, otype, scale_a, scale_b, kernel):
    plan, out_dtype = _plan(x, w, bias, otype, scale_a, scale_b, kernel)
    # Kernels take x with its leading dims: torch's F.linear flattens them in C++ for free, where
    # a reshape and a view here would cost ~3 µs of host time per call (measured on H100).
    return plan.run(x, w, bias, out_dtype, scale_a, scale_b)


def _run_and_remember(call_key: tuple, x, w, bias, otype, kernel):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's kernel
    bound to the key for the calls after it."""
    _check(x, w, bias, None, None)
    plan, out_dtype = _plan(x, w, bias, otype, None, None, kernel)
    return DISPATCH.remember(call_key, plan, (x, w, bias, out_dtype, None, None))(x, w, bias)


# The forced kernel travels as ``kernel_name``: an op argument called ``kernel`` collides with
# inductor's own FallbackKernel.create(kernel, ...) when it lowers the op (torch 2.11).
@torch.library.custom_op("gemmtune::gemm_a16w16", mutates_args=())
def _gemm_a16w16_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                    otype: Optional[torch.dtype], scale_a: Optional[torch.Tensor],
                    scale_b: Optional[torch.Tensor],
                    kernel_name: Optional[str] = None) -> torch.Tensor:
    return _run(x, w, bias, otype, scale_a, scale_b, kernel_name)


@_gemm_a16w16_op.register_fake
def _(x, w, bias, otype, scale_a, scale_b, kernel_name=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=_out_dtype(x.dtype, otype))


def _setup_context(ctx, inputs, output):
    x, w, bias, otype, scale_a, scale_b, kernel_name = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None
    ctx.scaled = scale_a is not None or scale_b is not None


def _backward(ctx, grad):
    if ctx.scaled:
        raise RuntimeError("gemm_a16w16: no gradient through per-tensor-scaled (fp8) inputs")
    x, w = ctx.saved_tensors
    g = as_rows(grad).to(x.dtype)  # (M, N)
    grad_x = (g @ w).view(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = g.t() @ as_rows(x) if ctx.needs_input_grad[1] else None
    grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None, None, None, None


_gemm_a16w16_op.register_autograd(_backward, setup_context=_setup_context)


def gemm_a16w16(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                otype: Optional[torch.dtype] = None, scale_a: Optional[torch.Tensor] = None,
                scale_b: Optional[torch.Tensor] = None,
                kernel: Optional[str] = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with the kernel the tables name for this shape on this GPU.

    x: (..., K) bf16/fp16/fp32 (or fp8 with per-tensor ``scale_a``/``scale_b``); w: (N, K);
    bias: (N,); otype: output dtype (default: x's, bf16 for fp8 inputs); kernel: a kernelName
    to run instead of the table's choice (e.g. ``"cublaslt:id66..."``, the seeds'
    ``solution_index``), checked like a table row: a kernel that cannot run the shape is an
    error. Returns (..., N).
    """
    # The eager hot path, ~1 µs of host time beside F.linear's 14 µs (H100 host, 16x256x256;
    # benchmarks/dispatch_overhead.py): three switches, the call key, one dict hit, the kernel.
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        x, w, bias = _autocast(x, w, bias, scale_a, scale_b)
        return _gemm_a16w16_op(x, w, bias, otype, scale_a, scale_b, kernel)
    if _any_autocast():  # ~0.05 µs; the device-specific check costs more
        x, w, bias = _autocast(x, w, bias, scale_a, scale_b)
    if _grad_enabled() and (
            x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return _gemm_a16w16_op(x, w, bias, otype, scale_a, scale_b, kernel)
    if scale_a is not None or scale_b is not None:
        return _run(x, w, bias, otype, scale_a, scale_b, kernel)
    # Everything the checks and the plan depend on: a call found here needs neither.
    call_key = (x.shape, w.shape, x.dtype, w.dtype, x.get_device(), w.get_device(), otype,
                kernel, None if bias is None else (bias.shape, bias.dtype, bias.get_device()))
    run = _CALLS.get(call_key)
    if run is None:
        return _run_and_remember(call_key, x, w, bias, otype, kernel)
    return run(x, w, bias)


def bound_linear(x: torch.Tensor, w: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> Optional[Callable]:
    """The kernel bound to eager calls ``gemm_a16w16(x', w', bias')`` with tensors of these
    shapes, dtypes and devices, as ``run(x', w', bias')``: one such call made it (or it does
    not exist); None before, or after the tables change."""
    return _CALLS.get((x.shape, w.shape, x.dtype, w.dtype, x.get_device(), w.get_device(), None,
                       None, None if bias is None else (bias.shape, bias.dtype,
                                                        bias.get_device())))


def _autocast(x, w, bias, scale_a, scale_b):
    """Cast like ``F.linear`` under ``torch.autocast``: float inputs to the autocast dtype. A
    kernel launched with PDL may read w before it waits for the kernel launched just before it,
    whose writes it may not see yet: so w is cast first and, where it was, x is cast (or copied)
    last, a kernel between w's cast and the GEMM."""
    device = x.device.type
    if scale_a is not None or scale_b is not None or not torch.is_autocast_enabled(device):
        return x, w, bias
    dtype = torch.get_autocast_dtype(device)
    cast_w = w.is_floating_point() and w.dtype != dtype
    w = w.to(dtype) if cast_w else w
    bias = bias.to(dtype) if bias is not None and bias.is_floating_point() else bias
    x = x.to(dtype, copy=cast_w) if x.is_floating_point() else x
    return x, w, bias
