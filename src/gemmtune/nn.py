"""``TunedLinear`` and ``patch_linear``: run a model's ``nn.Linear`` layers through gemm_a16w16,
or with ``quant="mxfp4"`` their weights quantised once to MXFP4 through gemm_a16w4
(``Mxfp4Linear``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from gemmtune.families._switches import any_autocast as _any_autocast
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.families._switches import grad_enabled as _grad_enabled
from gemmtune.families.a16w4.op import gemm_a16w4, packed_layout_tuned
from gemmtune.families.bf16.op import bound_linear, gemm_a16w16
from gemmtune.kernels.mxfp4 import (PACKED_LAYOUT, PACKED_LAYOUTS, prepack, unpack,
                                    why_not_quantisable)
from gemmtune.quant import mxfp4 as quantise_mxfp4
from gemmtune.quant import prepack_mxfp4

_MISSING = object()


class TunedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is dispatched through the tuned tables. It is still an
    ``nn.Linear`` (same parameters, same ``state_dict``), so code that inspects layers keeps
    working.

    A plain eager call (no grad, autocast or compile) whose tensors are like an earlier call's
    runs the kernel the op bound to such calls (``bound_linear``: one dict hit keyed by every
    tensor's shape, dtype and device, so a weight changed in place or replaced is simply
    another key), with the parameters read from the module's own dict. In a model each Python
    step of this call costs several times what it does in a loop (docs/benchmarks.md, session
    12), so it takes as few as it can."""

    # The group whose fused GEMM serves this layer (``gemmtune.fuse_siblings``), or None, and
    # the layer's columns of it (first, count)
    fused = None
    fused_columns: tuple[int, int] = (0, 0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        x = input
        if self.fused is not None and not (_dynamo_compiling() or _compiler._is_compiling_flag):
            out = self.fused.run(self, x)
            if out is not None:  # else this layer on its own (gemmtune.fuse_siblings)
                return out
        if (type(self) is TunedLinear and not (
                _dynamo_compiling() or _compiler._is_compiling_flag or _grad_enabled()
                or _any_autocast())):
            # ``self.weight`` goes through nn.Module.__getattr__ (a Python call each): read the
            # parameters' dict instead. With both names in it, neither is in the instance's
            # dict (nn.Module keeps them apart), and the class is TunedLinear itself (no
            # property over them), so these are what ``self.weight``/``self.bias`` would be.
            params = self._parameters
            w, bias = params.get("weight"), params.get("bias", _MISSING)
            if w is not None and bias is not _MISSING:
                run = bound_linear(x, w, bias)
                if run is not None:
                    return run(x, w, bias)
        return gemm_a16w16(x, self.weight, self.bias)


class Mxfp4Linear(nn.Module):
    """A linear layer whose weight is held in MXFP4 (``gemmtune.quant.mxfp4``: the buffers
    ``weight_q`` (out, in / 2) and ``weight_scale`` (out, in / 32), uint8) and multiplied by
    ``gemm_a16w4``: x in bf16 or fp16, the output in x's dtype. ``patch_linear(quant="mxfp4")``
    makes one from an ``nn.Linear`` in place (the module object, its bias and hooks kept; its
    weight replaced by the buffers); the weight is no longer trained. ``weight_packed``:
    ``weight_q`` is in the packed layout (``gemmtune.quant.prepack_mxfp4``); the buffer
    ``weight_layout`` holds the same in the state_dict (``weight_layout_code``: 0 as quantised,
    else the packed layout's version), so codes loaded from one are read in the layout they
    were saved in (earlier versions', 1 and 2, converted)."""

    in_features: int
    out_features: int
    weight_packed: bool = False
    # The group whose fused GEMM serves this layer (``gemmtune.fuse_siblings``), or None, and
    # the layer's columns of it (first, count)
    fused = None
    fused_columns: tuple[int, int] = (0, 0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        x = input
        # As nn.Linear under torch.autocast: x in the autocast dtype (so is the output).
        cast = torch.get_autocast_dtype(x.device.type) if _any_autocast() \
            and torch.is_autocast_enabled(x.device.type) else None
        if self.fused is not None and not (_dynamo_compiling() or _compiler._is_compiling_flag):
            out = self.fused.run(self, x, cast)  # the siblings' input before its cast
            if out is not None:  # else this layer on its own (gemmtune.fuse_siblings)
                return out
        if cast is not None:
            x = x.to(cast)
        return gemm_a16w4(x, self.weight_q, self.weight_scale, self.bias,
                          packed=self.weight_packed)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key, saved = prefix + "weight_q", state_dict.get(prefix + "weight_layout")
        codes = state_dict.get(key)
        # Codes of this buffer's shape (others fail torch's own size check, as they are)
        convertible = codes is not None and not codes.is_meta \
            and codes.shape == self.weight_q.shape
        if saved is not None and not saved.is_meta:
            layout = int(saved.item())
            if layout not in _LAYOUTS:
                raise ValueError(f"{prefix}weight_layout is {layout}: this gemmtune reads MXFP4 "
                                 f"codes saved in layouts {sorted(_LAYOUTS)} (0 as quantised, "
                                 f"{PACKED_LAYOUT} packed); save them again with it")
            # A fused layer keeps its group's layout; codes saved in another one (or in an
            # earlier version of the packed layout) are converted before they are copied in.
            packed = self.weight_packed if self.fused is not None else layout != 0
            if layout != weight_layout_code(packed) and convertible:
                state_dict[key] = _codes_in_layout(codes, layout, packed)
                state_dict[prefix + "weight_layout"] = torch.tensor(
                    weight_layout_code(packed), dtype=torch.uint8)
                saved = state_dict[prefix + "weight_layout"]
        elif saved is None and codes is not None:
            then = "packed (the packed layout of then)" if self.weight_packed else "as quantised"
            warnings.warn(f"{key} loaded without {prefix}weight_layout (a state_dict saved "
                          f"before layouts were recorded): its codes are read {then}, as this "
                          f"layer stores them; patch_linear the model that saved it the same "
                          f"way", stacklevel=2)
            if self.weight_packed and convertible:  # then packed meant layout 1
                state_dict[key] = _codes_in_layout(codes, 1, True)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if saved is not None and not saved.is_meta:
            self.weight_packed = bool(saved.item())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=mxfp4"
                f"{' (packed)' if self.weight_packed else ''}")


QUANTS = ("mxfp4",)  # what patch_linear's quant takes, besides None


def patch_linear(model: nn.Module, quant: str | None = None) -> int:
    """Turn every plain ``nn.Linear`` inside ``model`` (itself included) into a TunedLinear in
    place and return how many were changed. Only the class changes: the module object, its
    parameters, buffers and hooks stay exactly as they were. Left alone: subclasses of nn.Linear
    (quantised or LoRA layers compute something else) and layers whose ``forward`` was replaced
    on the instance (offloading wrappers), since those wrappers call the original forward.

    ``quant="mxfp4"``: each such layer's weight (bf16 or fp16) is quantised once to MXFP4 and
    the layer becomes an ``Mxfp4Linear`` (``gemm_a16w4``); a layer whose in_features is not a
    multiple of 32 (MXFP4's block) becomes a TunedLinear instead. Its weight is stored packed
    (``quant.prepack_mxfp4``) where the a16w4 table's packed rows for its (N, K) and dtype on
    this GPU read packed weights themselves and are no slower than its other rows
    (``packed_layout_tuned``: one layout per weight, chosen when it is quantised).
    Weights of other dtypes are refused before any layer changes: cast the model to bf16 or
    fp16 first."""
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"patch_linear: quant={quant!r}; expected None or one of {QUANTS}")
    layers = [m for m in model.modules()
              if type(m) is nn.Linear and "forward" not in m.__dict__]
    quantised = {}
    if quant == "mxfp4":
        bad = sorted({str(m.weight.dtype) for m in layers
                      if m.weight.dtype not in (torch.bfloat16, torch.float16)})
        if bad:
            raise TypeError(f"patch_linear(quant='mxfp4'): weights of {', '.join(bad)}; MXFP4 "
                            f"layers take bf16 or fp16 activations: cast the model first "
                            f"(model.to(torch.bfloat16))")
        # Every weight quantised before any layer changes: an error (a name taken, memory)
        # leaves the model as it was.
        quantised = {id(m): _quantised_weight(m) for m in layers
                     if why_not_quantisable(m.in_features) is None}
    for module in layers:
        if id(module) in quantised:
            _to_mxfp4(module, *quantised[id(module)])
        else:
            module.__class__ = TunedLinear
    return len(layers)


_MXFP4_BUFFERS = ("weight_q", "weight_scale", "weight_layout")
# weight_layout's values: as quantised, and the packed layout's versions (mxfp4.PACKED_LAYOUTS,
# the last the present one)
_LAYOUTS = (0, *PACKED_LAYOUTS)


def weight_layout_code(packed: bool) -> int:
    """What ``Mxfp4Linear``'s ``weight_layout`` buffer holds for codes as quantised (0) or
    packed (the packed layout's version)."""
    return PACKED_LAYOUT if packed else 0


def _codes_in_layout(codes: torch.Tensor, layout: int, packed: bool) -> torch.Tensor:
    """Codes saved in ``layout`` (``_LAYOUTS``) as quantised, or (``packed``) packed."""
    if layout != 0:
        codes = unpack(codes, layout)
    return prepack(codes) if packed else codes


def _quantised_weight(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``module``'s weight in MXFP4, once its buffers' names are known to be free: codes,
    scales, and whether the codes are packed."""
    taken = [name for name in _MXFP4_BUFFERS if hasattr(module, name)]
    if taken:
        raise ValueError(f"patch_linear(quant='mxfp4'): a Linear already has "
                         f"{', '.join(taken)}; its MXFP4 weight would take that name")
    weight = module.weight
    with torch.no_grad():
        wq, w_scale = quantise_mxfp4(weight)
        packed = packed_layout_tuned(weight.shape[0], weight.shape[1], weight.dtype)
        if packed:
            wq, w_scale = prepack_mxfp4(wq, w_scale)
    return wq, w_scale, packed


def _to_mxfp4(module: nn.Linear, wq: torch.Tensor, w_scale: torch.Tensor,
              packed: bool) -> None:
    """``module`` as an Mxfp4Linear, in place: its weight replaced by ``wq`` and ``w_scale``
    (``packed``: in the packed layout)."""
    module.register_buffer(_MXFP4_BUFFERS[0], wq)
    module.register_buffer(_MXFP4_BUFFERS[1], w_scale)
    module.register_buffer(_MXFP4_BUFFERS[2], torch.tensor(weight_layout_code(packed),
                                                           dtype=torch.uint8, device=wq.device))
    del module._parameters["weight"]
    module.__class__ = Mxfp4Linear
    module.weight_packed = packed
