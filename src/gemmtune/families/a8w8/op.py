"""``gemm_a8w8(xq, wq, x_scale, w_scale, bias, dtype) = (xq @ wq.T) * x_scale * w_scale + bias``.

FP8 (e4m3fn) or INT8 operands; ``x_scale`` per tensor (one value) or per token (one per row of
x), ``w_scale`` per tensor or per channel (one per row of w), fp32. Dispatched per shape through
``a8w8_tuned_gemm.csv`` (key ``A8w8Key``); a shape without a row runs the torch backend.
Registered as the custom op ``torch.ops.gemmtune.gemm_a8w8`` (shapes-only fake), so
``torch.compile(fullgraph=True)`` traces it; no autograd (quantised inference).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import TUNED_OUT_DTYPE, gemm_registry, gemm_schema, json_config_or
from gemmtune.families._scaled_op import RowwiseScaledOp, check_rowwise_scaled
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import TORCH_SCALED_MM, bind_scaled_mm, scaled_mm_torch
from gemmtune.kernels.triton.dispatchable import PREFIXES as TRITON_PREFIXES
from gemmtune.tables.schema import Column, Kind
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype

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
    check_rowwise_scaled("gemm_a8w8", xq, wq, x_scale, w_scale, bias, dtype)


_OP = RowwiseScaledOp(DISPATCH, _check)


@torch.library.custom_op("gemmtune::gemm_a8w8", mutates_args=())
def _gemm_a8w8_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                  w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                  dtype: torch.dtype, kernel_name: Optional[str] = None) -> torch.Tensor:
    return _OP.run(xq, wq, x_scale, w_scale, bias, dtype, kernel_name)


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
        return _OP.run_and_remember(call_key, xq, wq, x_scale, w_scale, bias, dtype, kernel)
    return run(xq, wq, bias, x_scale, w_scale)
