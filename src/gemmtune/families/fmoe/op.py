"""``fused_moe(hidden, w1, w2, topk_weight, topk_ids, ...)``: a mixture-of-experts layer's experts
in one op, dispatched per shape through ``tuned_fmoe.csv`` (the seeds' columns, key ``FmoeKey``).

out[t] = sum over slots k of ``topk_weight[t, k] * w2[e] @ (act(w1_gate[e] @ x) * (w1_up[e] @ x))``
with ``e = topk_ids[t, k]``; ``w1`` (E, 2I, D) holds the gate rows ``[0, I)`` and the up rows
``[I, 2I)``, ``w2`` (E, D, I). With ``doweight_stage1`` the weight scales stage 1's output
instead. Expert parallelism: ``topk_ids`` hold global expert ids, ``w1``/``w2`` the local experts
only, and ``expert_mask`` (bool, one per global expert) marks the local ones in order; pairs
routed elsewhere add nothing. Registered as ``torch.ops.gemmtune.fused_moe`` (shapes-only fake).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from gemmtune.device import CPU_ARCH, DeviceId
from gemmtune.dispatch import Dispatcher, KernelRegistry
from gemmtune.families._gemm import model_config_glob
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.families.fmoe.quantised import SCALINGS, checked_scales, fused_moe_fp8_torch
from gemmtune.kernels.problem import Activation, MoeProblem, MoeScales, Scaling
from gemmtune.kernels.torch_ref import TORCH_MOE, fused_moe_torch
from gemmtune.kernels.triton._chain import ChainCall
from gemmtune.kernels.triton.moe_configs import (GROUPED_MM_NAME, ONE_STAGE_PREFIX, STAGE1_PREFIX,
                                                 STREAM_PREFIX, default_two_stage)
from gemmtune.tables.schema import FMOE_RESULT_COLUMNS, Column, Kind, Schema, int_columns
from gemmtune.tables.values import DTYPE_NAMES, ActivationType, QuantType, to_torch_dtype

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ACTIVATIONS = {ActivationType.Silu: Activation.silu, ActivationType.Gelu: Activation.gelu}


class FmoeKey(NamedTuple):
    token: int
    model_dim: int
    inter_dim: int
    expert: int  # local experts (w1.shape[0])
    topk: int
    act_type: str  # ActivationType.Silu
    dtype: str
    q_dtype_a: str
    q_dtype_w: str
    q_type: str  # QuantType.No
    use_g1u1: bool  # gate and up fused in w1 (the only layout here)
    doweight_stage1: bool


SCHEMA = Schema(
    "fmoe", "tuned_fmoe.csv", "untuned_fmoe.csv",
    int_columns("token", "model_dim", "inter_dim", "expert", "topk") + (
        Column("act_type", Kind.ACTIVATION, default="ActivationType.Silu"),
        Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_dtype_a", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_dtype_w", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_type", Kind.QUANT, default="QuantType.No"),
        Column("use_g1u1", Kind.BOOL, default="True"),
        Column("doweight_stage1", Kind.BOOL, default="False"),
    ),
    FmoeKey, FMOE_RESULT_COLUMNS, "token", ("kernelName1", "kernelName2"),
    ("GEMMTUNE_CONFIG_FMOE", "AITER_CONFIG_FMOE"), model_config_glob("tuned_fmoe.csv"))


@functools.lru_cache(maxsize=1024)
def problem_of(key: FmoeKey) -> MoeProblem:
    """The plain problem of a key; cached, since every call passes it to its kernel."""
    q_type = QuantType.from_str(key.q_type)
    return MoeProblem(key.token, key.model_dim, key.inter_dim, key.expert, key.topk,
                      to_torch_dtype(key.dtype),
                      _ACTIVATIONS[ActivationType.from_str(key.act_type)], key.doweight_stage1,
                      SCALINGS.get(q_type, Scaling.none))


def row_kernel(names: tuple[str, ...]) -> str:
    """One solution from a row's kernelName1 and kernelName2: a two-stage row names both
    stages (``stage1+stage2``), a 1-stage row only the first."""
    return "+".join(name for name in names if name)


def _two_stage(name: str):
    # Imported here: the @triton.jit modules fix the interpreter setting when first imported.
    from gemmtune.kernels.triton.fused_moe import TritonTwoStageMoe

    return TritonTwoStageMoe(name)


def _grouped_mm(name: str):
    if name != GROUPED_MM_NAME:
        raise ValueError(f"unknown kernel {name!r}; expected {GROUPED_MM_NAME!r} (it has no "
                         f"config)")
    from gemmtune.kernels.triton.fused_moe import TritonGroupedMmMoe

    return TritonGroupedMmMoe()


def _one_stage(name: str):
    from gemmtune.kernels.triton.fused_moe import TritonOneStageMoe

    return TritonOneStageMoe(name)


def _stream(name: str):
    from gemmtune.kernels.triton.fused_moe import TritonStreamMoe

    return TritonStreamMoe(name)


def torch_backend(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem: MoeProblem,
                  out=None, scales: Optional[MoeScales] = None):
    """``torch.moe``: torch's grouped GEMMs, or for FP8 experts their torch backend."""
    if problem.scaling is Scaling.none:
        return fused_moe_torch(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem, out)
    return fused_moe_fp8_torch(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem,
                               scales, out)


REGISTRY = KernelRegistry("fmoe")
REGISTRY.register_exact(TORCH_MOE, torch_backend)
REGISTRY.register(STAGE1_PREFIX, _two_stage)
REGISTRY.register(ONE_STAGE_PREFIX, _one_stage)
REGISTRY.register(STREAM_PREFIX, _stream)
REGISTRY.register(GROUPED_MM_NAME, _grouped_mm)


def _to_table_key(raw: tuple) -> FmoeKey:
    tokens, model_dim, inter_dim, experts, topk, dtype, activation, doweight_stage1, *rest = raw
    quant_type = rest[0] if rest else QuantType.No  # the call key's next part
    name = DTYPE_NAMES[dtype]
    q_name = name if quant_type is QuantType.No else DTYPE_NAMES[torch.float8_e4m3fn]
    return FmoeKey(tokens, model_dim, inter_dim, experts, topk, activation.canonical, name,
                   q_name, q_name, quant_type.canonical, True, doweight_stage1)


def _default_kernel(key: FmoeKey, device: DeviceId) -> str:
    # The Triton pair sized for the shape on a GPU (torch's backend where it cannot run the
    # shape); on the CPU torch (the interpreter is slow).
    if device.arch == CPU_ARCH:
        return TORCH_MOE
    problem = problem_of(key)
    name = default_two_stage(problem)
    return name if REGISTRY.resolve(name).check(problem) is None else TORCH_MOE


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, _default_kernel,
                      row_kernel=row_kernel)
_CALLS = DISPATCH.calls  # the eager hot path's dict (Dispatcher.remember_bound)


@functools.lru_cache(maxsize=64)
def _identity_map(experts: int, device: torch.device) -> torch.Tensor:
    return torch.arange(experts, dtype=torch.int32, device=device)


def expert_map_of(expert_mask: Optional[torch.Tensor], experts: int,
                  device: torch.device) -> torch.Tensor:
    """Global expert id -> local index (int32, -1 for another rank's expert)."""
    if expert_mask is None:
        return _identity_map(experts, device)
    local = torch.cumsum(expert_mask.to(torch.int32), 0, dtype=torch.int32) - 1
    return torch.where(expert_mask, local, -1).to(torch.int32)


def _check(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, expert_mask) -> None:
    op = "fused_moe"
    if quant_type is not QuantType.No and quant_type not in SCALINGS:
        raise ValueError(f"{op}: quant_type={quant_type.canonical} is not supported; use "
                         f"QuantType.No or FP8 experts: "
                         f"{', '.join(q.canonical for q in SCALINGS)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{op}: activation {activation.canonical} is not supported; use "
                         f"{' or '.join(a.canonical for a in _ACTIVATIONS)}")
    for name, t in (("hidden", hidden), ("w1", w1), ("w2", w2), ("topk_weight", topk_weight),
                    ("topk_ids", topk_ids), ("expert_mask", expert_mask)):
        if not isinstance(t, torch.Tensor) and (t is not None or name != "expert_mask"):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{op}: expected hidden (T, D), w1 (E, 2I, D) and w2 (E, D, I), got "
                         f"{tuple(hidden.shape)}, {tuple(w1.shape)} and {tuple(w2.shape)}")
    tokens, model_dim = hidden.shape
    experts, two_inter, _ = w1.shape
    if w1.shape[2] != model_dim or two_inter % 2 or w2.shape != (experts, model_dim,
                                                                 two_inter // 2):
        raise ValueError(f"{op}: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not fit hidden "
                         f"{tuple(hidden.shape)}: expected w1 (E, 2I, {model_dim}) and w2 "
                         f"(E, {model_dim}, I)")
    if quant_type is not QuantType.No:
        if hidden.dtype not in DTYPES:
            raise TypeError(f"{op}: hidden must be one of {', '.join(map(str, DTYPES))} "
                            f"(FP8 experts quantise it inside the op), got {hidden.dtype}")
    elif hidden.dtype not in DTYPES or w1.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden, w1 and w2 must share one dtype of "
                        f"{', '.join(map(str, DTYPES))}; got {hidden.dtype}, {w1.dtype}, "
                        f"{w2.dtype} (FP8 experts take a quant_type and their scales)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype != torch.int32:
        raise ValueError(f"{op}: topk_ids must be int32 (T={tokens}, topk), got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weight.shape != topk_ids.shape or topk_weight.dtype != torch.float32:
        raise ValueError(f"{op}: topk_weight must be float32 {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weight.shape)} {topk_weight.dtype}")
    tensors = [w1, w2, topk_weight, topk_ids] + ([expert_mask] if expert_mask is not None else [])
    if any(t.device != hidden.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on {hidden.device}")
    if expert_mask is not None and (expert_mask.dtype != torch.bool or expert_mask.dim() != 1):
        raise ValueError(f"{op}: expert_mask must be a bool vector over the global experts, got "
                         f"{tuple(expert_mask.shape)} {expert_mask.dtype}")


def _plan(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, doweight_stage1,
          expert_mask, kernel):
    args = (hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, expert_mask)
    try:
        device = hidden.get_device()
        key = (hidden.shape[0], hidden.shape[1], w2.shape[2], w1.shape[0], topk_ids.shape[1],
               hidden.dtype, activation, doweight_stage1, quant_type, hidden.dim(),
               tuple(w1.shape), tuple(w2.shape), w1.dtype, w2.dtype, topk_weight.dtype,
               topk_ids.dtype, tuple(topk_ids.shape), tuple(topk_weight.shape),
               None if expert_mask is None else (expert_mask.dtype, expert_mask.dim()), device)
    except (AttributeError, IndexError):
        _check(*args)
        raise
    return DISPATCH.plan_for(key, device, kernel, _check, args)


def _run(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, doweight_stage1,
         expert_mask, kernel, scales: Optional[MoeScales] = None):
    plan = _plan(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, doweight_stage1,
                 expert_mask, kernel)
    expert_map = expert_map_of(expert_mask, w1.shape[0], hidden.device)
    problem = problem_of(plan.decision.key)
    if scales is None:
        return plan.run(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem)
    return plan.run(hidden, w1, w2, topk_weight, topk_ids, expert_map, problem, scales=scales)


class MoeRoles(NamedTuple):
    """A call's tensors as its recorded chain places them (``_chain``): the scales None
    without FP8 experts."""

    hidden: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weight: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    a1_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None


def _bound(plan, hidden: torch.Tensor, experts: int, scales: Optional[MoeScales]):
    """``plan``'s solution for the calls of one call key (each tensor's shape, dtype and
    device, the options) as ``run(hidden, w1, w2, topk_weight, topk_ids, expert_mask,
    w1_scale, w2_scale, a1_scale, a2_scale)``: its chain of launches replayed once recorded
    (``_chain``); ``scales``: the first call's checked scales, whose shapes the later ones'
    take."""
    solution, problem = plan.run, problem_of(plan.decision.key)
    identity = _identity_map(experts, hidden.device)
    scale_shapes = None if scales is None else tuple(
        None if s is None else s.shape for s in scales)

    def launch(roles: MoeRoles) -> torch.Tensor:
        operands = (roles.hidden, roles.w1, roles.w2, roles.topk_weight, roles.topk_ids,
                    roles.expert_map)
        if scale_shapes is None:
            return solution(*operands, problem)
        return solution(*operands, problem, scales=MoeScales(
            roles.w1_scale, roles.w2_scale, roles.a1_scale, roles.a2_scale))

    # fp32 operands' dot precision follows torch's tf32 switch at each launch (a recording
    # would keep the one it saw).
    refusal = ("fp32 operands (their dot precision follows torch's tf32 switch)"
               if hidden.dtype == torch.float32 else None)
    chain = ChainCall(launch, hidden.get_device(), refusal)

    def run(hidden, w1, w2, topk_weight, topk_ids, expert_mask, *raw_scales):
        expert_map = identity if expert_mask is None else \
            expert_map_of(expert_mask, experts, hidden.device)
        if scale_shapes is None:
            return chain(MoeRoles(hidden, w1, w2, topk_weight, topk_ids, expert_map))
        return chain(MoeRoles(hidden, w1, w2, topk_weight, topk_ids, expert_map, *(
            None if s is None else s.reshape(shape)
            for s, shape in zip(raw_scales, scale_shapes))))

    run.chain = chain  # (what tests and benchmarks ask: recorded, or why not)
    return run


def _remember(call_key: tuple, hidden, w1, w2, topk_weight, topk_ids, activation, quant_type,
              doweight_stage1, expert_mask, kernel, scales: Optional[MoeScales]):
    """The first eager call with ``call_key``: checked in full, planned, and its plan's
    solution bound to the key (``_bound``) for the calls after it; -> the bound call, for the
    call at hand too (which ``plan_for`` counted)."""
    _check(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, expert_mask)
    plan = _plan(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, doweight_stage1,
                 expert_mask, kernel)
    return DISPATCH.remember_bound(call_key, plan, _bound(plan, hidden, w1.shape[0], scales))


def _layout(t) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.get_device())


def _call_key(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type, doweight_stage1,
              expert_mask, kernel, raw_scales: tuple) -> tuple | None:
    """Everything the checks and the plan depend on (every tensor's shape, dtype and device,
    the options); None where an argument is not a tensor (the checked path says which)."""
    try:
        return (hidden.shape, w1.shape, w2.shape, topk_weight.shape, topk_ids.shape,
                hidden.dtype, w1.dtype, w2.dtype, topk_weight.dtype, topk_ids.dtype,
                hidden.get_device(), w1.get_device(), w2.get_device(), topk_weight.get_device(),
                topk_ids.get_device(), activation, quant_type, doweight_stage1, kernel,
                _layout(expert_mask), *map(_layout, raw_scales))
    except AttributeError:
        return None


@torch.library.custom_op("gemmtune::fused_moe", mutates_args=())
def _fused_moe_op(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weight: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                  doweight_stage1: bool, expert_mask: Optional[torch.Tensor],
                  kernel_name: Optional[str] = None, quant_type: str = "No",
                  w1_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None,
                  a1_scale: Optional[torch.Tensor] = None,
                  a2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    q_type = QuantType.from_str(quant_type)
    scales = None if q_type is QuantType.No else MoeScales(w1_scale, w2_scale, a1_scale, a2_scale)
    return _run(hidden, w1, w2, topk_weight, topk_ids, ActivationType.from_str(activation),
                q_type, doweight_stage1, expert_mask, kernel_name, scales)


@_fused_moe_op.register_fake
def _(hidden, w1, w2, topk_weight, topk_ids, activation, doweight_stage1, expert_mask,
      kernel_name=None, quant_type="No", w1_scale=None, w2_scale=None, a1_scale=None,
      a2_scale=None):
    return torch.empty_like(hidden)


def _text(name: str, value, enum_type: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"fused_moe: {name} must be an {enum_type.__name__} or its name, got "
                        f"{type(value).__name__}")
    return value


def fused_moe(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weight: torch.Tensor, topk_ids: torch.Tensor,
              activation: ActivationType = ActivationType.Silu,
              quant_type: QuantType = QuantType.No, doweight_stage1: bool = False,
              w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
              expert_mask: Optional[torch.Tensor] = None,
              kernel: Optional[str] = None) -> torch.Tensor:
    """The experts of an MoE layer with the kernels the fmoe table names for this shape on this
    GPU (or ``kernel``, a kernelName checked like a table row). hidden (T, D) bf16/fp16/fp32;
    w1 (E, 2I, D); w2 (E, D, I); topk_weight (T, topk) fp32; topk_ids (T, topk) int32 global
    expert ids; expert_mask (E_global,) bool for expert parallelism. Returns (T, D) in
    hidden's dtype.

    FP8 experts (``quant_type`` per_Tensor, per_Token or per_1x128; families/fmoe/quantised.py):
    w1 and w2 e4m3fn with ``w1_scale`` / ``w2_scale`` as ``gemmtune.quant.quantize_experts``
    makes them; hidden is quantised inside the op by the same scheme, and the intermediate
    again for stage 2 (per_Tensor: dynamically, or by the static ``a1_scale`` / ``a2_scale``)."""
    # The enums are str subclasses: only plain strings are parsed (torch.compile traces no
    # str method called on an enum member).
    if not isinstance(activation, ActivationType):
        activation = ActivationType.from_str(_text("activation", activation, ActivationType))
    if not isinstance(quant_type, QuantType):
        quant_type = QuantType.from_str(_text("quant_type", quant_type, QuantType))
    raw_scales = (w1_scale, w2_scale, a1_scale, a2_scale)
    compiling = _dynamo_compiling() or _compiler._is_compiling_flag
    if not compiling:
        # The eager hot path: one dict hit, then the solution bound to this key (_bound), whose
        # launches are replayed: 18-71 µs of host time per call on an H100 host, against
        # 81-570 µs for the checked path below (docs/benchmarks.md, session 16).
        call_key = _call_key(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type,
                             doweight_stage1, expert_mask, kernel, raw_scales)
        run = _CALLS.get(call_key)
        if run is not None:
            return run(hidden, w1, w2, topk_weight, topk_ids, expert_mask, *raw_scales)
    if quant_type is QuantType.No:
        if any(s is not None for s in (w1_scale, w2_scale, a1_scale, a2_scale)):
            raise ValueError("fused_moe: scales are for FP8 experts; pass the quant_type they "
                             "were made for (e.g. QuantType.per_Token)")
        scales = None
    else:
        scales = checked_scales(quant_type, hidden, w1, w2, w1_scale, w2_scale, a1_scale,
                                a2_scale)
    if compiling:
        return _fused_moe_op(hidden, w1, w2, topk_weight, topk_ids, activation.value,
                             doweight_stage1, expert_mask, kernel, quant_type.value,
                             *(scales or (None, None, None, None)))
    if call_key is None:
        return _run(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type,
                    doweight_stage1, expert_mask, kernel, scales)
    run = _remember(call_key, hidden, w1, w2, topk_weight, topk_ids, activation, quant_type,
                    doweight_stage1, expert_mask, kernel, scales)
    return run(hidden, w1, w2, topk_weight, topk_ids, expert_mask, *raw_scales)


def bound_call(hidden, w1, w2, topk_weight, topk_ids, activation=ActivationType.Silu,
               quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None,
               a1_scale=None, a2_scale=None, expert_mask=None, kernel=None):
    """The eager hot path's bound call for fused_moe's arguments (None before their first
    call): what tests and benchmarks ask of its chain (``.chain``)."""
    return _CALLS.get(_call_key(hidden, w1, w2, topk_weight, topk_ids, activation, quant_type,
                                doweight_stage1, expert_mask, kernel,
                                (w1_scale, w2_scale, a1_scale, a2_scale)))
