"""``gemm_a8w8(xq, wq, x_scale, w_scale, bias, dtype) = (xq @ wq.T) * x_scale * w_scale + bias``.

FP8 (e4m3fn) or INT8 operands; ``x_scale`` per tensor (one value) or per token (one per row of
x), ``w_scale`` per tensor or per channel (one per row of w), fp32. Dispatched per shape through
``a8w8_tuned_gemm.csv`` (key ``A8w8Key``); a shape without a row runs the torch backend.
Registered as the custom op ``torch.ops.gemmtune.gemm_a8w8`` (shapes-only fake), so
``torch.compile(fullgraph=True)`` traces it; no autograd (quantised inference).
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
from gemmtune.kernels.torch_ref import TORCH_SCALED_MM, bind_scaled_mm, scaled_mm_torch
from gemmtune.kernels.triton.dispatchable import PREFIXES as TRITON_PREFIXES
from gemmtune.tables.schema import Column, Kind
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype

Q_DTYPES = (torch.float8_e4m3fn, torch.int8)


class A8w8Key(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: str  # canonical dtype name of x and w (torch.float8_e4m3fn or torch.int8)


SCHEMA = gemm_schema(
    "a8w8", "a8w8_tuned_gemm.csv", "a8w8_untuned_gemm.csv", A8w8Key,
    (Column("q_dtype_w", Kind.DTYPE, default="torch.float8_e4m3fn"),),
    ("GEMMTUNE_CONFIG_A8W8", "GEMMTUNE_CONFIG_GEMM_A8W8", "AITER_CONFIG_GEMM_A8W8"))

# Tags of the Triton JSON config files (gemmtune tune-triton) a shape without a row may use.
JSON_TAGS = {torch.float8_e4m3fn: "A8W8", torch.int8: "A8W8_INT8"}


def problem_of(key: A8w8Key) -> GemmProblem:
    """A row serves calls with per-tensor and per-row scales alike, bf16 out and no bias (what
    the tuner times); a call with another output dtype or a bias asks the kernel at run time."""
    return GemmProblem(key.M, key.N, key.K, to_torch_dtype(key.q_dtype_w), TUNED_OUT_DTYPE,
                       scaling=Scaling.rowwise)


REGISTRY = gemm_registry("a8w8", TORCH_SCALED_MM, scaled_mm_torch, TRITON_PREFIXES,
                         cublaslt="scaled", torch_bind=bind_scaled_mm)


def _to_table_key(raw: tuple) -> A8w8Key:
    m, n, k, q_dtype, *_checked = raw
    return A8w8Key(m, n, k, DTYPE_NAMES[q_dtype])


def _default_kernel(key: A8w8Key, device: DeviceId) -> str:
    # torch, unless a Triton JSON config file (gemmtune tune-triton), the (N, K)'s own or the
    # default, names a kernel for M.
    problem = problem_of(key)
    tag = JSON_TAGS.get(problem.dtype)
    if tag is None:
        return TORCH_SCALED_MM
    return json_config_or(TORCH_SCALED_MM, REGISTRY, problem, device, tag)


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


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


def _plan(xq, wq, x_scale, w_scale, bias, dtype, kernel):
    args = (xq, wq, x_scale, w_scale, bias, dtype)
    try:
        k = xq.shape[-1]
        m = xq.numel() // k if k else math.prod(xq.shape[:-1])
        # The plan key holds everything the checks depend on but the scales' contiguity, which
        # the call key holds (and reshape(-1) in _run makes good for the checked path).
        device = xq.get_device()
        key = (m, wq.shape[0], k, xq.dtype, wq.dtype, wq.dim(), wq.shape[-1], wq.get_device(),
               x_scale.numel(), x_scale.dtype, x_scale.get_device(),
               w_scale.numel(), w_scale.dtype, w_scale.get_device(),
               None if bias is None else (bias.dtype, tuple(bias.shape), bias.get_device()),
               dtype, device)
    except (AttributeError, IndexError, ValueError):
        _check(*args)
        raise
    return DISPATCH.plan_for(key, device, kernel, _check, args)


def _run(xq, wq, x_scale, w_scale, bias, dtype, kernel):
    plan = _plan(xq, wq, x_scale, w_scale, bias, dtype, kernel)
    return plan.run(xq, wq, bias, dtype, x_scale.reshape(-1), w_scale.reshape(-1))


def _run_and_remember(call_key: tuple, xq, wq, x_scale, w_scale, bias, dtype, kernel):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's kernel
    bound to the key for the calls after it."""
    _check(xq, wq, x_scale, w_scale, bias, dtype)
    plan = _plan(xq, wq, x_scale, w_scale, bias, dtype, kernel)
    run = DISPATCH.remember(call_key, plan, (xq, wq, bias, dtype, x_scale, w_scale))
    return run(xq, wq, bias, x_scale, w_scale)


@torch.library.custom_op("gemmtune::gemm_a8w8", mutates_args=())
def _gemm_a8w8_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                  w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                  dtype: torch.dtype, kernel_name: Optional[str] = None) -> torch.Tensor:
    return _run(xq, wq, x_scale, w_scale, bias, dtype, kernel_name)


@_gemm_a8w8_op.register_fake
def _(xq, wq, x_scale, w_scale, bias, dtype, kernel_name=None):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a8w8(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.bfloat16,
              kernel: Optional[str] = None) -> torch.Tensor:
    """``(xq @ wq.T) * x_scale * w_scale + bias`` with the kernel the a8w8 table names for this
    shape on this GPU.

    xq: (..., K) and wq: (N, K), both float8_e4m3fn or both int8 (``gemmtune.quant`` makes them);
    x_scale: fp32, 1 value or one per token (e.g. (M, 1)); w_scale: fp32, 1 value or one per
    channel (e.g. (N, 1)); bias: (N,) float; dtype: output dtype; kernel: a kernelName to run
    instead of the table's choice, checked like a table row (an error if it cannot run the
    shape). Returns (..., N).
    """
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return _gemm_a8w8_op(xq, wq, x_scale, w_scale, bias, dtype, kernel)
    # The eager hot path: everything the checks and the plan depend on (the scales'
    # contiguity included: _check refuses strided scales), one dict hit, the kernel bound to
    # this key (Dispatcher.remember).
    call_key = (xq.shape, wq.shape, x_scale.shape, w_scale.shape, xq.dtype, wq.dtype,
                x_scale.dtype, w_scale.dtype, xq.get_device(), wq.get_device(),
                x_scale.get_device(), w_scale.get_device(), x_scale.is_contiguous(),
                w_scale.is_contiguous(), dtype, kernel,
                None if bias is None else (bias.shape, bias.dtype, bias.get_device()))
    run = _CALLS.get(call_key)
    if run is None:
        return _run_and_remember(call_key, xq, wq, x_scale, w_scale, bias, dtype, kernel)
    return run(xq, wq, bias, x_scale, w_scale)
