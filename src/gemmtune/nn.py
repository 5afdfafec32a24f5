"""``TunedLinear`` and ``patch_linear``: run a model's ``nn.Linear`` layers through gemm_a16w16."""

from __future__ import annotations

import torch
from torch import nn

from gemmtune.families.bf16.op import linear


class TunedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is dispatched through the tuned tables. It is still an
    ``nn.Linear`` (same parameters, same ``state_dict``), so code that inspects layers keeps
    working."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
