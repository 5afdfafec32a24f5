"""The plain description of a GEMM that kernels check once per shape: sizes, dtypes and flags.

Families turn their table key into a ``GemmProblem``; a kernel never sees a table key, so kernels
know nothing of tables or of how a family spells its columns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


class Scaling(str, enum.Enum):
    """How a call scales the product ``x @ w.T``."""

    none = "none"
    tensor = "tensor"  # one fp32 value per operand (gemm_a16w16's scale_a / scale_b)
    rowwise = "rowwise"  # per tensor or per row of x / of w, as each call brings (gemm_a8w8)
    block = "block"  # FP8 block scales: x per 1x128, w per 128x128 of K
    mxfp4 = "mxfp4"  # w MXFP4 (E2M1 codes, an E8M0 scale per 1x32 of K), x unscaled


@dataclass(frozen=True)
class GemmProblem:
    """``y (M, N) = x (M, K) @ w (N, K).T``, scaled as ``scaling`` says, plus a bias of N."""

    m: int
    n: int
    k: int
    dtype: torch.dtype  # of x and w
    out_dtype: torch.dtype
    has_bias: bool = False
    scaling: Scaling = Scaling.none
    preshuffled: bool = False  # w stored in a kernel-specific packed layout


class Activation(str, enum.Enum):
    """The gate activation of a fused MoE's first stage: act(gate) * up."""

    silu = "silu"
    gelu = "gelu"  # exact (erf), as torch.nn.functional.gelu


@dataclass(frozen=True)
class MoeProblem:
    """A fused MoE over ``tokens`` rows of ``model_dim``: ``experts`` (local) experts of
    ``inter_dim``, each token routed to ``topk``; SwiGLU-style gate/up in stage 1."""

    tokens: int
    model_dim: int
    inter_dim: int
    experts: int
    topk: int
    dtype: torch.dtype  # of the activations (and of the weights when not quantised)
    activation: Activation = Activation.silu
    doweight_stage1: bool = False  # the routing weight scales stage 1's output, not stage 2's
    # FP8 experts: weights and activations scaled per tensor, per row (token / output channel)
    # or per block (activations 1x128, weights 128x128), the intermediate requantised likewise.
    scaling: Scaling = Scaling.none


class MoeScales(NamedTuple):
    """The fp32 scales of a fused MoE's FP8 experts (``MoeProblem.scaling`` not none): the
    weights' per expert (E, 1, 1), per output channel (E, N, 1) or per 128x128 block
    (E, ceil(N/128), ceil(K/128)); with per-tensor scaling optionally a static activation scale
    for each stage's input (else each call measures its own)."""

    w1: torch.Tensor
    w2: torch.Tensor
    a1: Optional[torch.Tensor] = None
    a2: Optional[torch.Tensor] = None
