"""``gemm_a8w8_bpreshuffle(xq, wq, x_scale, w_scale, dtype) = (xq @ w.T) * x_scale * w_scale``
with ``wq = gemmtune.quant.shuffle_weight(w)``: the weight packed once into 16-row x 128-byte
tiles (``gemmtune.kernels.preshuffle``), read by the split-K, tile and GEMV kernels built for
it and by ``triton.frag``, a Gluon kernel that loads each thread's warpgroup-MMA fragments of w
straight into registers (FP8 on Hopper).

Scales and dtypes as ``gemm_a8w8``'s (FP8 or INT8; x_scale per tensor or per token, w_scale per
tensor or per channel, fp32); N a multiple of 16 and K of 128. Dispatched per shape through
``a8w8_bpreshuffle_tuned_gemm.csv`` (key ``BpreshuffleKey``: AITER's table's columns; its
layout and kernel names are gemmtune's own, not AITER's); a shape without a row runs the
split-K kernel's (M <= 256) or the tile kernel's default config, and the torch backend (which
puts the weight back in rows on every call) only where neither can. Registered as
``torch.ops.gemmtune.gemm_a8w8_bpreshuffle`` (shapes-only fake); no autograd.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gemmtune.device import DeviceId
from gemmtune.dispatch import Dispatcher
from gemmtune.families._gemm import TUNED_OUT_DTYPE, gemm_registry, gemm_schema
from gemmtune.families._scaled_op import RowwiseScaledOp, check_rowwise_scaled
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.kernels.preshuffle import why_not_shufflable
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import TORCH_UNSHUFFLED, unshuffled_scaled_mm_torch
from gemmtune.tables.schema import Column, Kind
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype


class BpreshuffleKey(NamedTuple):
    M: int
    N: int
    K: int
    q_dtype_w: str  # canonical dtype name of x and w (torch.float8_e4m3fn or torch.int8)


SCHEMA = gemm_schema(
    "a8w8_bpreshuffle", "a8w8_bpreshuffle_tuned_gemm.csv", "a8w8_bpreshuffle_untuned_gemm.csv",
    BpreshuffleKey, (Column("q_dtype_w", Kind.DTYPE, default="torch.float8_e4m3fn"),),
    ("GEMMTUNE_CONFIG_A8W8_BPRESHUFFLE", "GEMMTUNE_CONFIG_GEMM_A8W8_BPRESHUFFLE",
     "AITER_CONFIG_GEMM_A8W8_BPRESHUFFLE"))


def problem_of(key: BpreshuffleKey) -> GemmProblem:
    """As ``gemm_a8w8``'s rows: per-tensor and per-row scales alike, bf16 out, no bias."""
    return GemmProblem(key.M, key.N, key.K, to_torch_dtype(key.q_dtype_w), TUNED_OUT_DTYPE,
                       scaling=Scaling.rowwise, preshuffled=True)


# Only the kernels that read the tiled layout (gemmtune.kernels.triton._wlayout, and
# triton.frag).
REGISTRY = gemm_registry("a8w8_bpreshuffle", TORCH_UNSHUFFLED, unshuffled_scaled_mm_torch,
                         ("triton.frag", "triton.splitk", "triton.tile", "triton.gemv"),
                         w_tiled=True)


def _to_table_key(raw: tuple) -> BpreshuffleKey:
    m, n, k, q_dtype, *_checked = raw
    return BpreshuffleKey(m, n, k, DTYPE_NAMES[q_dtype])


# Where the tuners stop trying split-K (families._gemm_tuner.SPLITK_MAX_M, which the run-time
# path does not import).
_SPLITK_DEFAULT_MAX_M = 256


def default_kernel_name(problem: GemmProblem) -> str:
    """The kernel of a shape without a row: the split-K kernel's default config up to M = 256,
    the tile kernel's above (each as it would run row-major weights), where it reads the tiled
    weight; else the torch backend."""
    from gemmtune.kernels.triton import gemm_splitk, gemm_tile

    m, n, k, dtype = problem.m, problem.n, problem.k, problem.dtype
    module = gemm_splitk if m <= _SPLITK_DEFAULT_MAX_M else gemm_tile
    name = module.default_config(m, n, k, dtype).name
    return name if REGISTRY.can_run(name, problem) else TORCH_UNSHUFFLED


def _default_kernel(key: BpreshuffleKey, device: DeviceId) -> str:
    return default_kernel_name(problem_of(key))


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember)


def _check(xq, wq, x_scale, w_scale, bias, dtype) -> None:
    check_rowwise_scaled("gemm_a8w8_bpreshuffle", xq, wq, x_scale, w_scale, bias, dtype)
    why = why_not_shufflable(*wq.shape, wq.dtype)
    if why is not None:
        raise ValueError(f"gemm_a8w8_bpreshuffle: {why}")
    if not wq.is_contiguous():
        raise ValueError("gemm_a8w8_bpreshuffle: wq must be contiguous, as "
                         "gemmtune.quant.shuffle_weight returns it (the kernels ignore strides)")


_OP = RowwiseScaledOp(DISPATCH, _check)


@torch.library.custom_op("gemmtune::gemm_a8w8_bpreshuffle", mutates_args=())
def _gemm_a8w8_bpreshuffle_op(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                              w_scale: torch.Tensor, dtype: torch.dtype,
                              kernel_name: Optional[str] = None) -> torch.Tensor:
    return _OP.run(xq, wq, x_scale, w_scale, None, dtype, kernel_name)


@_gemm_a8w8_bpreshuffle_op.register_fake
def _(xq, wq, x_scale, w_scale, dtype, kernel_name=None):
    return xq.new_empty((*xq.shape[:-1], wq.shape[0]), dtype=dtype)


def gemm_a8w8_bpreshuffle(xq: torch.Tensor, wq: torch.Tensor, x_scale: torch.Tensor,
                          w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          kernel: Optional[str] = None) -> torch.Tensor:
    """``(xq @ w.T) * x_scale * w_scale`` where ``wq = gemmtune.quant.shuffle_weight(w)``, with
    the kernel the a8w8_bpreshuffle table names for this shape on this GPU.

    xq: (..., K) and wq: (N, K), both float8_e4m3fn or both int8, wq pre-shuffled by
    ``gemmtune.quant.shuffle_weight`` (a row-major weight, or one AITER shuffled, gives a wrong
    result: only its shape can be checked); x_scale: fp32, 1 value or one
    per token; w_scale: fp32, 1 value or one per channel (of w's rows, not shuffled); dtype: the
    output dtype; kernel: a kernelName to run instead of the table's choice. Returns (..., N).
    """
    if _dynamo_compiling() or _compiler._is_compiling_flag:
        return _gemm_a8w8_bpreshuffle_op(xq, wq, x_scale, w_scale, dtype, kernel)
    # The eager hot path, as gemm_a8w8's; wq's contiguity too (the kernels ignore its strides).
    call_key = (xq.shape, wq.shape, x_scale.shape, w_scale.shape, xq.dtype, wq.dtype,
                x_scale.dtype, w_scale.dtype, xq.get_device(), wq.get_device(),
                x_scale.get_device(), w_scale.get_device(), x_scale.is_contiguous(),
                w_scale.is_contiguous(), wq.is_contiguous(), dtype, kernel)
    run = _CALLS.get(call_key)
    if run is None:
        return _OP.run_and_remember(call_key, xq, wq, x_scale, w_scale, None, dtype, kernel)
    return run(xq, wq, None, x_scale, w_scale)
