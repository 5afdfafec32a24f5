"""``fuse_siblings``: patched layers that read the same input (a transformer's q, k and v
projections; an MLP's gate and up) multiplied as one GEMM, as serving engines store them:
``Mxfp4Linear`` layers through ``gemm_a16w4``, ``TunedLinear`` ones through ``gemm_a16w16``.

Why: a model written with separate projections (Hugging Face transformers) runs three GEMMs
where one would do, and the small ones (k and v at 1024 x 4096) are far from their floor: a
launch costs about what reading their 2 MB weight does. The fused shapes are the presets'
(qkv 6144 x 4096, gate_up 28672 x 4096), which the shipped tables cover.

Which layers are siblings is seen, not guessed from names: one forward of the model with
example inputs records which patched layers receive the same tensor object; those of one kind
that receive it exactly once each, with the same in_features, become a group. Their weights
are concatenated along N into one (MXFP4: codes and scales, in the layout the a16w4 table
prefers for the fused shape), and each layer's weight, scales and bias become row views of it:
the ``state_dict`` keeps every layer's own names and values, and memory is not doubled.

At run time the first layer of a group called with an input computes the fused product; the
others called with that same tensor (same object, storage and version) take their columns of
it, a view (not contiguous: ``.view`` that splits the last dimension works, one that merges it
with another does not). A layer served twice before its siblings, or another input, computes
again, so the product of one call is never given for another; the product is dropped with its
input. Inference tensors (``torch.inference_mode``) have no version: an input changed in place
between two siblings' calls is not seen there. A model moved, cast or copied (its tensors no
longer rows of one storage) is regrouped on its next call, or its group dissolved where the
layers no longer match; the group holds no weight of its own, so a model moved off a GPU frees
it there. Layers run on their own where gradients are wanted (parameters that require them, or
such an input; the fused product would not reach them) and under torch.compile. Parameters keep
their objects (optimizers, ties); a layer tied to another module is not grouped. CUDA graphs:
capture whole forwards (a capture that starts between two siblings would record the product's
reads without the GEMM).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import nn

from gemmtune.families.a16w4.op import gemm_a16w4, packed_layout_tuned
from gemmtune.families.bf16.op import gemm_a16w16
from gemmtune.nn import Mxfp4Linear, TunedLinear, weight_layout_code
from gemmtune.quant import prepack_mxfp4, unpack_mxfp4


class SiblingGroup:
    """Layers reading one input, the layout of their fused tensors, and the product of the last
    input until each layer has taken its columns. The group holds no weight: the fused tensors
    are the storage the layers' own tensors are rows of (seen through the first layer's), so a
    model moved or offloaded frees them; the subclasses say which tensors and how the product
    is made."""

    def __init__(self, members: list[nn.Module], x_dtype: torch.dtype):
        self.members = members
        self.x_dtype = x_dtype
        self._build()

    def _build(self) -> None:
        """The fused tensors from the members' own, and the members' tensors rows of them (a
        parameter keeps its object: optimizers and ties to it stay right)."""
        with torch.inference_mode(False), torch.no_grad():
            fused = self._fuse()
            start = 0
            for m in self.members:
                n = m.out_features
                for name, (kind, tensor) in fused.items():
                    rows = tensor[start:start + n]
                    if kind == "buffer":
                        m._buffers[name] = rows
                    else:
                        m._parameters[name].data = rows
                m.fused_columns = (start, n)  # on the layer: a copy of the model keeps it right
                start += n
        # name -> (buffer or parameter, the fused tensor's shape and strides)
        self._layout = {name: (kind, tuple(t.shape), t.stride())
                        for name, (kind, t) in fused.items()}
        self._forget()

    def _fuse(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Name -> ("buffer" or "parameter", the members' tensors of that name concatenated)."""
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _bias(self) -> dict[str, tuple[str, torch.Tensor]]:
        biases = [m.bias for m in self.members]
        if biases[0] is None:
            return {}
        return {"bias": ("parameter", torch.cat([b.detach() for b in biases]))}

    @staticmethod
    def _own(member: nn.Module, kind: str, name: str) -> torch.Tensor:
        return (member._buffers if kind == "buffer" else member._parameters)[name]

    def tensor(self, name: str) -> torch.Tensor | None:
        """The fused tensor ``name`` (the members' rows of it), or None (no bias)."""
        if name not in self._layout:
            return None
        kind, shape, stride = self._layout[name]
        first = self._own(self.members[0], kind, name).detach()
        return first.new_empty(0).set_(first.untyped_storage(), 0, shape, stride)

    def _views_intact(self) -> bool:
        """Whether every member's tensors are still the rows of one storage, where they were
        made (not after ``model.to``, a copy, a load or a cast that replaced them)."""
        for name, (kind, shape, stride) in self._layout.items():
            storage = self._own(self.members[0], kind, name).untyped_storage()
            for m in self.members:
                mine = self._own(m, kind, name)
                start, n = m.fused_columns
                if (mine.untyped_storage().data_ptr() != storage.data_ptr()
                        or mine.storage_offset() != start * stride[0]
                        or tuple(mine.shape) != (n,) + shape[1:]
                        or mine.stride() != stride):
                    return False
        return True

    def _forget(self) -> None:
        self._input = self._key = self._y = None
        self._served: set[int] = set()  # the first columns of the layers served

    def _input_freed(self, ref) -> None:
        """The product dies with its input (a round some siblings skipped keeps nothing)."""
        if ref is self._input:
            self._forget()

    def _wants_grad(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or any(
            p is not None and p.requires_grad for m in self.members
            for p in m._parameters.values()))

    def run(self, member: nn.Module, x: torch.Tensor,
            cast: torch.dtype | None = None) -> torch.Tensor | None:
        """``member``'s output for ``x`` (multiplied in ``cast`` where autocast gives one): its
        columns of the fused product, computed where this is a new input or ``member`` was
        already served since. None where the layer is to run on its own: gradients wanted
        (the fused product would not reach the layers' parameters), or the group no longer
        fusable (a member cast or moved apart: it is dissolved)."""
        if self._wants_grad(x):
            return None
        # Inference tensors keep no version counter: within a round they are not changed
        key = (x.data_ptr(), 0 if x.is_inference() else x._version, tuple(x.shape), x.stride(),
               x.dtype, cast)
        start, n = member.fused_columns
        seen = self._input() if self._input is not None else None
        if seen is not x or self._key != key or start in self._served:
            if not self._views_intact():
                if not _fusable(self.members):
                    for m in self.members:
                        m.fused = None
                    return None
                self._build()
            self._y = self._product(x if cast is None else x.to(cast))
            self._input, self._key, self._served = weakref.ref(x, self._input_freed), key, set()
        out = self._y.narrow(-1, start, n)
        self._served.add(start)
        if len(self._served) == len(self.members):
            self._forget()
        return out


class Mxfp4Siblings(SiblingGroup):
    """``Mxfp4Linear`` layers: codes and scales concatenated (each as quantised, then packed
    where the a16w4 table prefers it for the fused shape), one ``gemm_a16w4``."""

    def _fuse(self):
        codes = torch.cat([unpack_mxfp4(m.weight_q, m.weight_scale)[0] if m.weight_packed
                           else m.weight_q for m in self.members])
        scales = torch.cat([m.weight_scale for m in self.members])
        self.packed = packed_layout_tuned(codes.shape[0], codes.shape[1] * 2, self.x_dtype)
        if self.packed:
            codes, scales = prepack_mxfp4(codes, scales)
        for m in self.members:
            m._buffers["weight_layout"].fill_(weight_layout_code(self.packed))
            m.weight_packed = self.packed
        return {"weight_q": ("buffer", codes), "weight_scale": ("buffer", scales),
                **self._bias()}

    def _product(self, x):
        return gemm_a16w4(x, self.tensor("weight_q"), self.tensor("weight_scale"),
                          self.tensor("bias"), packed=self.packed)


class TunedSiblings(SiblingGroup):
    """``TunedLinear`` layers (bf16 / fp16): weights concatenated, one ``gemm_a16w16``."""

    def _fuse(self):
        weight = torch.cat([m.weight.detach() for m in self.members])
        return {"weight": ("parameter", weight), **self._bias()}

    def _product(self, x):
        return gemm_a16w16(x, self.tensor("weight"), self.tensor("bias"))


def fuse_siblings(model: nn.Module, *args, **kwargs) -> list[list[str]]:
    """Group ``model``'s patched layers (``patch_linear`` first: ``Mxfp4Linear`` or
    ``TunedLinear``) that one forward with ``args``/``kwargs`` (example inputs; no gradients)
    shows reading the same input, each once, of one kind with the same in_features and all or
    none with a bias; multiply each group as one GEMM from then on. Returns the groups, as the
    layers' names."""
    patched = [m for m in model.modules() if type(m) in _GROUPS]
    if not patched:
        raise ValueError("fuse_siblings: the model has no patched layers; run "
                         "gemmtune.patch_linear(model) (or quant='mxfp4') first")
    # Left alone: layers already grouped (a second call keeps its groups) and layers with a
    # parameter another module holds too (a tied weight stays tied)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    layers = [m for m in patched if m.fused is None
              and all(uses[id(p)] == 1 for p in m._parameters.values() if p is not None)]
    inputs: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}
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
            group = _GROUPS[type(members[0])](members, x.dtype)
            for m in members:
                m.fused = group
            groups.append([names[id(m)] for m in members])
    return groups


def _fusable(members: list[nn.Module], calls: dict[int, int] | None = None) -> bool:
    """Layers of one kind (called once each, where ``calls`` counts them), with one in_features,
    weight dtype and device, and all or none with a bias."""
    first = members[0]

    def weight(m):
        return m.weight_q if isinstance(m, Mxfp4Linear) else m.weight

    return all(type(m) is type(first) and (calls is None or calls[id(m)] == 1)
               and m.in_features == first.in_features
               and weight(m).dtype == weight(first).dtype
               and weight(m).device == weight(first).device
               and (m.bias is None) == (first.bias is None)
               and (m.bias is None or m.bias.dtype == first.bias.dtype) for m in members)


# What each kind of patched layer is fused by
_GROUPS = {Mxfp4Linear: Mxfp4Siblings, TunedLinear: TunedSiblings}
