"""``TunedLinear`` and ``patch_linear``: run a model's ``nn.Linear`` layers through gemm_a16w16."""

from __future__ import annotations

import torch
from torch import nn

from gemmtune.ops.gemm_a16w16 import gemm_a16w16


class TunedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is dispatched through the tuned tables. It is still an
    ``nn.Linear`` (same parameters, same ``state_dict``), so code that inspects layers keeps
    working."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_a16w16(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "TunedLinear":
        """A TunedLinear sharing ``linear``'s weight and bias tensors (no copy, no new memory)."""
        tuned = cls.__new__(cls)
        nn.Module.__init__(tuned)
        tuned.in_features = linear.in_features
        tuned.out_features = linear.out_features
        tuned.weight = linear.weight
        tuned.bias = linear.bias
        tuned.train(linear.training)
        return tuned


def patch_linear(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` inside ``model`` by a weight-sharing TunedLinear, in
    place. Returns how many layers were replaced. Subclasses of nn.Linear with their own forward
    (quantised or LoRA layers) are left alone: their forward is not a plain ``x @ W.T + b``."""
    replaced = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, TunedLinear.from_linear(child))
                replaced += 1
    return replaced
