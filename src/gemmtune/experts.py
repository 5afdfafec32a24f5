"""gemmtune as a transformers experts backend: ``experts_implementation="gemmtune"`` and
``patch_moe(model)``.

transformers (5.x) runs a MoE layer's experts through its ``ExpertsInterface``, with the experts
stored fused: ``gate_up_proj`` (E, 2I, D) and ``down_proj`` (E, D, I), which are ``fused_moe``'s
``w1`` and ``w2`` as they are, so nothing is copied. The model's router, its top-k and its
routing-weight normalisation (and a DeepSeek-V3 layer's shared experts) stay the model's own: only
the routed experts' compute changes.

``import gemmtune`` registers the backend once transformers loads its MoE integration (an import
hook: importing transformers here would add seconds to every ``import gemmtune``), so
``from_pretrained(..., experts_implementation="gemmtune")`` works after it. Transformers' own
decode switch from ``grouped_mm`` to ``batched_mm`` rewrites only ``grouped_mm``, so it leaves
this backend in place.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
import warnings

import torch
from torch import nn

from gemmtune import quant
from gemmtune.families.fmoe.op import fused_moe
from gemmtune.tables.values import ActivationType, QuantType

NAME = "gemmtune"
EXPERTS_MODULE = "transformers.integrations.moe"
# What runs the calls this backend cannot: transformers' own default.
FALLBACK = "grouped_mm"
_ACTIVATIONS = {"silu": ActivationType.Silu, "swish": ActivationType.Silu,
                "gelu": ActivationType.Gelu}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one MoE layer through ``fused_moe``: hidden_states (T, D), top_k_index
    (T, k) expert ids (the number of local experts for another rank's, under expert
    parallelism), top_k_weights (T, k) as the model's router made them. Calls it cannot take
    (gradients, biases, transposed or interleaved weights, a model's own gating, another
    activation or dtype) run transformers' ``grouped_mm``, with one warning per reason."""
    fp8 = _fp8_scales(module)
    why = why_not(module, hidden_states, top_k_weights, fp8 is not None)
    if why and fp8 is not None:  # transformers' backends cannot run FP8 experts
        raise RuntimeError(f"gemmtune experts: {why}, and this layer's experts were made FP8 by "
                           f"patch_moe(model, quant='fp8'): only gemmtune runs them")
    if why:
        return _fallback(why)(module, hidden_states, top_k_index, top_k_weights)
    experts = module.gate_up_proj.shape[0]
    scales = {} if fp8 is None else dict(quant_type=QuantType.per_Token, w1_scale=fp8[0],
                                         w2_scale=fp8[1])
    return fused_moe(hidden_states, module.gate_up_proj, module.down_proj,
                     top_k_weights.to(torch.float32), top_k_index.to(torch.int32),
                     activation=_ACTIVATIONS[module.config.hidden_act],
                     expert_mask=_sentinel_mask(experts, hidden_states.device)
                     if _expert_parallel(module) else None, **scales)


def why_not(module: nn.Module, hidden_states: torch.Tensor, top_k_weights: torch.Tensor,
            fp8: bool = False) -> str | None:
    """Why ``experts_forward`` hands this call to transformers' default, or None (``fp8``:
    the module's experts were made FP8 by ``patch_moe``)."""
    layout = why_not_layout(module)
    if layout:
        return layout
    weights = (module.gate_up_proj, module.down_proj)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad
                                    or any(w.requires_grad for w in weights)):
        return "gradients (fused_moe is inference-only; run under torch.no_grad() for it)"
    expert_dtype = quant.FP8_DTYPE if fp8 else hidden_states.dtype
    if hidden_states.dtype not in _DTYPES or any(w.dtype != expert_dtype for w in weights):
        return (f"{hidden_states.dtype} activations with {weights[0].dtype} experts (fused_moe "
                f"takes one dtype of bf16, fp16 or fp32, or FP8 experts from patch_moe)")
    return None


def why_not_layout(module: nn.Module) -> str | None:
    """Why ``experts_forward`` can never run this experts module (its layout, gating or
    activation), or None."""
    if not (getattr(module, "has_gate", False) and hasattr(module, "gate_up_proj")):
        return "experts without a fused gate_up_proj"
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False) \
            or not getattr(module, "is_concatenated", True):
        return "experts with biases, or transposed or interleaved weights"
    if getattr(type(module), "_apply_gate", None) is not _default_gate():
        return f"{type(module).__name__}'s own gating"
    act = getattr(module.config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        return f"activation {act!r} (fused_moe takes {', '.join(sorted(_ACTIVATIONS))})"
    return None


def _expert_parallel(module: nn.Module) -> bool:
    distributed = getattr(module.config, "distributed_config", None)
    return bool(getattr(distributed, "enable_expert_parallel", False))


_masks: dict[tuple, torch.Tensor] = {}


def _sentinel_mask(experts: int, device: torch.device) -> torch.Tensor:
    """Under expert parallelism transformers gives another rank's experts the id ``experts``
    (one past the local ones): as fused_moe's global experts, the local ones and one that is
    elsewhere."""
    key = (experts, device)
    mask = _masks.get(key)
    if mask is None:
        mask = torch.ones(experts + 1, dtype=torch.bool, device=device)
        mask[experts] = False
        _masks[key] = mask
    return mask


_warned: set[str] = set()


def _fallback(why: str):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"gemmtune experts: {why}: these calls run transformers' {FALLBACK}",
                      stacklevel=3)
    return ALL_EXPERTS_FUNCTIONS[FALLBACK]


@functools.cache
def _default_gate():
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def register() -> None:
    """Make ``experts_implementation="gemmtune"`` known to transformers (imports its MoE
    integration)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)


def patch_moe(model: nn.Module, quant: str | None = None) -> nn.Module:
    """Run ``model``'s experts through gemmtune (``model.set_experts_implementation``) and
    return it. Its other modules (shared experts, attention), and models without experts, are
    left as they are.

    ``quant="fp8"``: every layer's routed experts that gemmtune can run (``why_not_layout``)
    are quantised once, FP8 e4m3 per output channel (``gemmtune.quant.quantize_experts``, ``per_Token``; activations per token inside
    the op), replacing ``gate_up_proj`` / ``down_proj`` (their scales kept beside them). Such
    experts run only through gemmtune, for inference."""
    if quant not in (None, "fp8"):
        raise ValueError(f"patch_moe: quant={quant!r}; expected None or 'fp8'")
    register()
    if quant == "fp8":  # experts gemmtune can run (the others stay as they are)
        for module in model.modules():
            if hasattr(module, "gate_up_proj") and why_not_layout(module) is None \
                    and _fp8_scales(module) is None:
                _quantise_experts(module)
    model.set_experts_implementation(NAME)
    return model


# The buffers (moved by .to(), not saved) where patch_moe(quant="fp8") keeps the scales of a
# module's FP8 experts, w1's then w2's.
FP8_SCALES = ("gemmtune_gate_up_proj_scale", "gemmtune_down_proj_scale")


def _fp8_scales(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    buffers = module._buffers
    return (buffers[FP8_SCALES[0]], buffers[FP8_SCALES[1]]) if FP8_SCALES[1] in buffers \
        else None


def _quantise_experts(module: nn.Module) -> None:
    with torch.no_grad():
        for name, scale_name in zip(("gate_up_proj", "down_proj"), FP8_SCALES):
            q, scale = quant.quantize_experts(getattr(module, name), QuantType.per_Token)
            setattr(module, name, nn.Parameter(q, requires_grad=False))
            module.register_buffer(scale_name, scale, persistent=False)


def _register_into(module) -> None:
    """Register into a loaded ``transformers.integrations.moe``; a transformers without the
    interface gets a warning, never a failed import."""
    try:
        module.ExpertsInterface.register(NAME, experts_forward)
    except Exception as e:  # an interface this transformers does not have, or another shape
        warnings.warn(f"gemmtune: experts_implementation={NAME!r} is not available with this "
                      f"transformers ({type(e).__name__}: {e}); gemmtune.patch_moe says why",
                      stacklevel=2)


class _RegisteringLoader(importlib.abc.Loader):
    """The found loader of transformers' MoE integration, followed by the registration (a
    loader of its own: the found one may serve other modules too, as zip importers' do)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_source, get_filename, ...: the found loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_into(module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds transformers' MoE integration with the other finders and gives it a loader that
    registers the backend after running it."""

    gemmtune_experts_hook = True  # how hooks of reloaded copies of this module are told apart
    _inside = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != EXPERTS_MODULE or getattr(self._inside, "finding", False):
            return None
        self._inside.finding = True  # other finders may ask the meta path in turn
        try:
            spec = None
            for finder in sys.meta_path:
                if getattr(finder, "gemmtune_experts_hook", False) \
                        or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._inside.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


_hook_lock = threading.Lock()


def register_when_loaded() -> None:
    """Register now if transformers' MoE integration is loaded, else when it is (once)."""
    loaded = sys.modules.get(EXPERTS_MODULE)
    if loaded is not None:
        _register_into(loaded)
        return
    with _hook_lock:
        if not any(getattr(f, "gemmtune_experts_hook", False) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport())
