"""FP8 experts in ``fused_moe``: the scales a call brings (checked), and the torch backend for
them.

Schemes (``quant_type``), FP8 e4m3 weights from ``gemmtune.quant.quantize_experts``:

    per_Tensor   w scale per expert (E, 1, 1) or (E,); activations per tensor (dynamic, or the
                 static ``a1_scale`` / ``a2_scale``, one value each)
    per_Token    w scale per output channel (E, N, 1) or (E, N); activations per token
    per_1x128    w scale per 128x128 block (E, ceil(N/128), ceil(K/128)); activations per 1x128

Stage 1's input is ``hidden`` quantised by the scheme; its output (after the activation, and the
routing weight with ``doweight_stage1``) is quantised again the same way for stage 2. The torch
backend runs per-token and per-tensor experts through torch's FP8 grouped GEMM on Hopper
(``fused_moe_fp8_grouped``: the comparison a torch user has); elsewhere it does the scheme's
arithmetic with ``gemmtune.quant`` and the rest in fp32: correct, and as slow as dequantising
every expert per call (the bar FP8 kernels are checked against, not a fast path). The accuracy
reference of the scheme is the fp32 MoE of the dequantised experts with unquantised activations
(``reference``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from gemmtune import quant
from gemmtune.kernels.problem import Activation, MoeProblem, MoeScales, Scaling
from gemmtune.kernels.torch_ref import combine_pairs, fused_moe_ref, grouped_pairs, moe_act
from gemmtune.tables.values import QuantType

SCALINGS = {QuantType.per_Tensor: Scaling.tensor, QuantType.per_Token: Scaling.rowwise,
            QuantType.per_1x128: Scaling.block}
QUANT_TYPES = {scaling: q_type for q_type, scaling in SCALINGS.items()}
# (atol, rtol, ||out - ref|| / ||ref|| bound) against ``reference``: e4m3 keeps 3 mantissa bits, so
# quantising each stage's input costs ~2-3% rms per stage; measured 0.046-0.048 (tests, every
# scheme). The bound is what tells a right kernel from a wrong one; elements outside
# atol + rtol * |ref| are the row's errRatio.
FP8_TOLERANCE = (0.1, 0.1, 0.08)


def checked_scales(quant_type: QuantType, hidden: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w1_scale, w2_scale, a1_scale, a2_scale) -> MoeScales:
    """The call's scales as the backends take them (a per-expert (E,) or per-channel (E, N)
    scale viewed as (E, 1, 1) / (E, N, 1)); ValueError saying what is wrong otherwise."""
    op = f"fused_moe({quant_type.canonical})"
    if quant_type not in SCALINGS:
        raise ValueError(f"{op}: not supported; quantised experts take "
                         f"{', '.join(q.canonical for q in SCALINGS)}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != quant.FP8_DTYPE:
            raise TypeError(f"{op}: {name} must be {quant.FP8_DTYPE} (gemmtune.quant."
                            f"quantize_experts makes it), got {w.dtype}")
    scales = (_weight_scale(op, "w1_scale", w1_scale, w1, quant_type),
              _weight_scale(op, "w2_scale", w2_scale, w2, quant_type))
    for name, s in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if s is None:
            continue
        if quant_type != QuantType.per_Tensor:
            raise ValueError(f"{op}: {name} is a static per-tensor activation scale; "
                             f"{quant_type.canonical} quantises activations per call")
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32 \
                or s.device != hidden.device:
            raise ValueError(f"{op}: {name} must be one float32 value on {hidden.device}")
    return MoeScales(*scales, a1_scale, a2_scale)


def _weight_scale(op: str, name: str, scale, w: torch.Tensor,
                  quant_type: QuantType) -> torch.Tensor:
    experts, n, k = w.shape
    if quant_type == QuantType.per_Tensor:
        accepted = [(experts, 1, 1), (experts,)]
    elif quant_type == QuantType.per_Token:
        accepted = [(experts, n, 1), (experts, n)]
    else:
        rows, cols = quant.WEIGHT_BLOCK
        accepted = [(experts, math.ceil(n / rows), math.ceil(k / cols))]
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) not in accepted \
            or scale.dtype != torch.float32 or scale.device != w.device:
        got = (f"{type(scale).__name__}" if not isinstance(scale, torch.Tensor)
               else f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")
        raise ValueError(f"{op}: {name} must be float32 of shape "
                         f"{' or '.join(map(str, accepted))} on {w.device}, got {got}")
    return scale.reshape(accepted[0])


def _activations(t: torch.Tensor, quant_type: QuantType,
                 static: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` as the scheme quantises a stage's input, back in fp32."""
    if quant_type == QuantType.per_Tensor and static is not None:
        scale = static.reshape(())
        return quant.dequant(quant.quantize_fp8(t, scale), scale)
    q, scale = quant.quantize(t, quant_type)
    return quant.dequantize(q, scale, quant_type)


def why_not_scaled_grouped_mm(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                               scaling: Scaling) -> str | None:
    """Why torch's row-wise FP8 grouped GEMM (``torch._scaled_grouped_mm``, Hopper) cannot run
    these experts; None if it can."""
    if scaling not in (Scaling.rowwise, Scaling.tensor):
        return f"{scaling.value} scales: torch's FP8 grouped GEMM takes row-wise scales only"
    if not hidden.is_cuda or torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return "torch's FP8 grouped GEMM runs on Hopper (sm_90) only"
    if hidden.dtype != torch.bfloat16:
        return f"{hidden.dtype} activations: torch's FP8 grouped GEMM writes bf16"
    if any(d % 16 for d in (*w1.shape[1:], *w2.shape[1:])):
        return "torch's FP8 grouped GEMM wants model_dim and inter_dim multiples of 16"
    return None


def fused_moe_fp8_grouped(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                          problem: MoeProblem, scales: MoeScales, out=None):
    """FP8 experts as a torch user would run them on Hopper: the pairs sorted by expert,
    gathered, ``torch._scaled_grouped_mm`` with row-wise scales for both stages (a per-tensor
    scale repeated per row), the activation in fp32 on its bf16 output, the intermediate
    requantised; nothing read back on the host, so it captures in a CUDA graph."""
    quant_type = QUANT_TYPES[problem.scaling]
    topk = topk_ids.shape[1]
    experts, two_inter, _ = w1.shape
    inter_dim = two_inter // 2
    pairs = grouped_pairs(topk_weight, topk_ids, expert_map, experts)

    def rowwise(t, static):  # (rows, K) -> (fp8 rows, one fp32 scale per row)
        if quant_type == QuantType.per_Tensor:
            q, scale = ((quant.quantize_fp8(t, static.reshape(())), static.reshape(()))
                        if static is not None else quant.per_tensor_fp8(t))
            return q, scale.expand(t.shape[0]).contiguous()
        q, scale = quant.per_token_fp8(t)
        return q, scale.reshape(-1)

    xq, x_scale = rowwise(hidden, scales.a1)
    rows = pairs.order // topk
    h = torch._scaled_grouped_mm(xq[rows], w1.transpose(1, 2), x_scale[rows],
                                 scales.w1.reshape(experts, -1).expand(experts, two_inter)
                                 .contiguous(), offs=pairs.offsets, out_dtype=torch.bfloat16)
    h = moe_act(h[:, :inter_dim].float(), problem.activation) * h[:, inter_dim:].float()
    h = torch.where(pairs.kept, h * pairs.weights if problem.doweight_stage1 else h, 0.0)
    hq, h_scale = rowwise(h, scales.a2)
    y = torch._scaled_grouped_mm(hq, w2.transpose(1, 2), h_scale,
                                 scales.w2.reshape(experts, -1).expand(experts, w2.shape[1])
                                 .contiguous(), offs=pairs.offsets,
                                 out_dtype=torch.bfloat16).float()
    total = combine_pairs(y, pairs, problem.doweight_stage1, topk)
    return total.to(hidden.dtype) if out is None else out.copy_(total)


def fused_moe_fp8_torch(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                        problem: MoeProblem, scales: MoeScales, out=None):
    """The torch backend of FP8 experts: torch's FP8 grouped GEMM where it runs them
    (``fused_moe_fp8_grouped``), else each stage's input quantised as the scheme says and
    everything else in fp32 (experts dequantised, one expert at a time)."""
    if why_not_scaled_grouped_mm(hidden, w1, w2, problem.scaling) is None:
        return fused_moe_fp8_grouped(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                                     problem, scales, out)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fused_moe: these FP8 experts through torch's backend cannot be captured in a CUDA "
            "graph (without a grouped GEMM for them, it selects each expert's pairs by value, "
            "which waits for the GPU); run them "
            "eagerly, or name a two-stage Triton kernel (kernel='triton.moe1:...+triton.moe2:"
            "...')")
    quant_type = QUANT_TYPES[problem.scaling]
    tokens, topk = topk_ids.shape
    inter_dim = w2.shape[2]
    x = _activations(hidden, quant_type, scales.a1)
    local = expert_map[topk_ids.reshape(-1).long()].long()  # per pair, -1: another rank's
    weights = topk_weight.reshape(-1).float()
    inter = torch.zeros(tokens * topk, inter_dim, dtype=torch.float32, device=hidden.device)
    for e in range(w1.shape[0]):
        pairs = (local == e).nonzero().flatten()
        if pairs.numel():
            w = quant.dequantize_experts(w1[e:e + 1], scales.w1[e:e + 1], quant_type)[0]
            h = x[pairs // topk] @ w.t()
            h = moe_act(h[:, :inter_dim], problem.activation) * h[:, inter_dim:]
            inter[pairs] = h * weights[pairs, None] if problem.doweight_stage1 else h
    inter = _activations(inter, quant_type, scales.a2)
    y = torch.zeros(tokens * topk, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for e in range(w2.shape[0]):
        pairs = (local == e).nonzero().flatten()
        if pairs.numel():
            w = quant.dequantize_experts(w2[e:e + 1], scales.w2[e:e + 1], quant_type)[0]
            y[pairs] = inter[pairs] @ w.t()
    if not problem.doweight_stage1:
        y = y * weights[:, None]
    y = y.view(tokens, topk, -1).sum(1).to(hidden.dtype)
    return y if out is None else out.copy_(y)


def reference(hidden, w1, w2, topk_weight, topk_ids, expert_map, quant_type: QuantType,
              scales: MoeScales, activation=Activation.silu, doweight_stage1=False):
    """The scheme's accuracy reference, fp32: the dequantised experts, activations as they
    come. One expert at a time: the fp32 copy of every expert would be 4x the FP8 weights."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    for e in range(w1.shape[0]):
        only_e = torch.where(expert_map == e, 0, -1).to(expert_map.dtype)
        out += fused_moe_ref(x, quant.dequantize_experts(w1[e:e + 1], scales.w1[e:e + 1],
                                                         quant_type),
                             quant.dequantize_experts(w2[e:e + 1], scales.w2[e:e + 1],
                                                      quant_type),
                             topk_weight, topk_ids, only_e, activation, doweight_stage1,
                             torch.float32)
    return out
