"""``fuse_siblings``: MXFP4 layers that read the same input (a transformer's q, k and v
projections; an MLP's gate and up) multiplied as one GEMM, as serving engines store them.

Why: a model written with separate projections (Hugging Face transformers) runs three GEMMs
where one would do, and the small ones (k and v at 1024 x 4096) are far from their floor: a
launch costs about what reading their 2 MB weight does. The fused shapes are the presets'
(qkv 6144 x 4096, gate_up 28672 x 4096), which the shipped tables cover.

Which layers are siblings is seen, not guessed from names: one forward of the model with
example inputs records which ``Mxfp4Linear`` layers receive the same tensor object; those that
receive it exactly once each, with the same in_features, become a group. Their codes and scales
are concatenated along N into one weight (in the layout the a16w4 table prefers for the fused
shape), and each layer's buffers become row views of it: the ``state_dict`` keeps every layer's
own names and values, and memory is not doubled.

At run time the first layer of a group called with an input computes the fused product; the
others called with that same tensor (same object, storage and version) take their columns of
it, a view. A layer served twice before its siblings, or another input, computes again, so the
product of one call is never given for another. A model moved or copied (its buffers no longer
views of the group's weight) is regrouped on its next call. Under torch.compile the layers run
on their own (views of the fused weight).
"""

from __future__ import annotations

import torch
from torch import nn

from gemmtune.families.a16w4.op import gemm_a16w4, packed_layout_tuned
from gemmtune.nn import Mxfp4Linear
from gemmtune.quant import prepack_mxfp4, unpack_mxfp4


class SiblingGroup:
    """Layers reading one input, their fused MXFP4 weight, and the product of the last input
    until each layer has taken its columns."""

    def __init__(self, members: list[Mxfp4Linear], x_dtype: torch.dtype):
        self.members = members
        self.x_dtype = x_dtype
        self._build()

    def _build(self) -> None:
        """The fused weight from the members' own (each as quantised, concatenated, packed where
        the table prefers it for the fused shape), and the members' buffers views of it."""
        codes = torch.cat([unpack_mxfp4(m.weight_q, m.weight_scale)[0] if m.weight_packed
                           else m.weight_q for m in self.members])
        scales = torch.cat([m.weight_scale for m in self.members])
        self.packed = packed_layout_tuned(codes.shape[0], codes.shape[1] * 2, self.x_dtype)
        if self.packed:
            codes, scales = prepack_mxfp4(codes, scales)
        biases = [m.bias for m in self.members]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.codes, self.scales = codes, scales
        start = 0
        for m in self.members:
            n = m.out_features
            m._buffers["weight_q"] = codes[start:start + n]
            m._buffers["weight_scale"] = scales[start:start + n]
            m._buffers["weight_layout"].fill_(int(self.packed))
            m.weight_packed = self.packed
            if self.bias is not None:
                m._parameters["bias"] = nn.Parameter(self.bias[start:start + n],
                                                     requires_grad=m.bias.requires_grad)
            m.fused_columns = (start, n)  # on the layer: a copy of the model keeps it right
            start += n
        self._forget()

    def _forget(self) -> None:
        self._x = self._key = self._y = None
        self._served: set[int] = set()  # the first columns of the layers served

    def _views_intact(self) -> bool:
        """Whether every member's buffers are still the rows of the fused weight they were made
        (not after ``model.to``, a copy or a load that replaced them)."""
        row_bytes = self.codes.stride(0) * self.codes.element_size()
        scale_bytes = self.scales.stride(0) * self.scales.element_size()
        for m in self.members:
            start, _ = m.fused_columns
            if (m._buffers["weight_q"].data_ptr() != self.codes.data_ptr() + start * row_bytes
                    or m._buffers["weight_scale"].data_ptr()
                    != self.scales.data_ptr() + start * scale_bytes
                    or (self.bias is not None and m.bias.data_ptr()
                        != self.bias.data_ptr() + start * self.bias.element_size())):
                return False
        return True

    def run(self, member: Mxfp4Linear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s output for ``x``: its columns of the fused product, computed where this
        is a new input or ``member`` was already served since."""
        key = (x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype)
        start, n = member.fused_columns
        if self._x is not x or self._key != key or start in self._served:
            if not self._views_intact():
                self._build()
            self._y = gemm_a16w4(x, self.codes, self.scales, self.bias, packed=self.packed)
            self._x, self._key, self._served = x, key, set()
        out = self._y.narrow(-1, start, n)
        self._served.add(start)
        if len(self._served) == len(self.members):
            self._forget()
        return out


def fuse_siblings(model: nn.Module, *args, **kwargs) -> list[list[str]]:
    """Group ``model``'s ``Mxfp4Linear`` layers (``patch_linear(quant="mxfp4")`` first) that
    one forward with ``args``/``kwargs`` (example inputs; no gradients) shows reading the same
    input, each once, with the same in_features and all or none with a bias; multiply each
    group as one GEMM from then on. Returns the groups, as the layers' names."""
    mxfp4 = [m for m in model.modules() if isinstance(m, Mxfp4Linear)]
    if not mxfp4:
        raise ValueError("fuse_siblings: the model has no MXFP4 layers; run "
                         "gemmtune.patch_linear(model, quant='mxfp4') first")
    layers = [m for m in mxfp4 if m.fused is None]  # a second call leaves groups as they are
    inputs: dict[int, tuple[torch.Tensor, list[Mxfp4Linear]]] = {}
    calls: dict[int, int] = {}

    def record(module, module_args):
        calls[id(module)] = calls.get(id(module), 0) + 1
        if module_args:  # an input passed by keyword is left out of every group
            inputs.setdefault(id(module_args[0]), (module_args[0], []))[1].append(module)

    handles = [m.register_forward_pre_hook(record) for m in layers]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    names = {id(m): name for name, m in model.named_modules()}
    groups = []
    for x, members in inputs.values():
        if len(members) > 1 and _fusable(members, calls):
            group = SiblingGroup(members, x.dtype)
            for m in members:
                m.fused = group
            groups.append([names[id(m)] for m in members])
    return groups


def _fusable(members: list[Mxfp4Linear], calls: dict[int, int]) -> bool:
    """Layers called once each, with one in_features, device, and all or none with a bias."""
    first = members[0]
    return all(calls[id(m)] == 1 and m.in_features == first.in_features
               and m.weight_q.device == first.weight_q.device
               and (m.bias is None) == (first.bias is None)
               and (m.bias is None or m.bias.dtype == first.bias.dtype) for m in members)
