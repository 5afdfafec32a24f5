"""``TunedLinear`` and ``patch_linear``: run a model's ``nn.Linear`` layers through gemm_a16w16."""

from __future__ import annotations

import torch
from torch import nn

from gemmtune.families._switches import any_autocast as _any_autocast
from gemmtune.families._switches import compiler as _compiler
from gemmtune.families._switches import dynamo_compiling as _dynamo_compiling
from gemmtune.families._switches import grad_enabled as _grad_enabled
from gemmtune.families.bf16.op import bound_linear, gemm_a16w16

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


def patch_linear(model: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` inside ``model`` (itself included) into a TunedLinear in
    place and return how many were changed. Only the class changes: the module object, its
    parameters, buffers and hooks stay exactly as they were. Left alone: subclasses of nn.Linear
    (quantised or LoRA layers compute something else) and layers whose ``forward`` was replaced
    on the instance (offloading wrappers), since those wrappers call the original forward."""
    patched = 0
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.__class__ = TunedLinear
            patched += 1
    return patched
