"""``TunedLinear`` and ``patch_linear``: run a model's ``nn.Linear`` layers through gemm_a16w16."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from gemmtune.families.bf16.op import DISPATCH, bound_linear, gemm_a16w16

# The switches that send a call the op's full way, looked up once (gemm_a16w16 reads the same).
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch.compiler
_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
if not hasattr(_compiler, "_is_compiling_flag"):  # a torch without it: is_compiling's answer
    _dynamo_compiling = torch.compiler.is_compiling
    _compiler = type("_NeverCompiling", (), {"_is_compiling_flag": False})

_MISSING = object()
# A layer keeps at most this many inputs' bound calls (a server meets many prefill lengths).
_MAX_BOUND_PER_LAYER = 256


class _LayerCalls:
    """A TunedLinear's bound calls by its input's (shape, dtype, device), made for the
    weight and bias objects it held then, from the tables of ``generation``."""

    __slots__ = ("weight", "bias", "generation", "runs")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, generation: int):
        self.weight, self.bias, self.generation = weight, bias, generation
        self.runs: dict[tuple, Callable] = {}


class TunedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is dispatched through the tuned tables. It is still an
    ``nn.Linear`` (same parameters, same ``state_dict``), so code that inspects layers keeps
    working.

    In a model most eager time is Python on the host, and a layer's calls repeat a few input
    shapes: so a layer keeps, per input shape, dtype and device, the kernel the op bound to such
    calls, and a later plain eager call (no grad, autocast or compile) runs it after one dict
    hit, without rebuilding the op's call key from the weight and bias. What is kept is
    dropped when the tables change (the dispatcher's generation), when the weight or bias is
    another object, and when ``.to()``/``.half()``/``.cuda()`` convert the layer in place."""

    _gemmtune_calls: _LayerCalls | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (type(self) is not TunedLinear or _dynamo_compiling() or _compiler._is_compiling_flag
                or _grad_enabled() or _any_autocast()):
            return gemm_a16w16(x, self.weight, self.bias)
        calls = self._gemmtune_calls
        if calls is not None and calls.generation == DISPATCH.generation:
            # ``self.weight`` goes through nn.Module.__getattr__ (about 0.3-0.8 µs each): read
            # the parameters' dict instead. With both names in it, neither is in the instance's
            # dict (nn.Module keeps them apart), and the class is TunedLinear itself (no
            # property over them), so these are what ``self.weight``/``self.bias`` would be.
            params = self._parameters
            w, bias = params.get("weight"), params.get("bias", _MISSING)
            if w is calls.weight and bias is calls.bias:
                run = calls.runs.get((x.shape, x.dtype, x.get_device()))
                if run is not None:
                    return run(x, w, bias)
        return self._first_call(x, self.weight, self.bias)

    def _first_call(self, x, w, bias):
        """A plain eager call this layer has no bound call for: through the op, then the kernel
        it bound kept for the next call like it."""
        generation = DISPATCH.generation
        y = gemm_a16w16(x, w, bias)
        run = bound_linear(x, w, bias)
        if run is not None:
            calls = self._gemmtune_calls
            if (calls is None or calls.weight is not w or calls.bias is not bias
                    or calls.generation != generation
                    or len(calls.runs) >= _MAX_BOUND_PER_LAYER):
                calls = _LayerCalls(w, bias, generation)
                self.__dict__["_gemmtune_calls"] = calls
            calls.runs[(x.shape, x.dtype, x.get_device())] = run
        return y

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() may convert the parameters in place (the same objects).
        self.__dict__.pop("_gemmtune_calls", None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        # Bound calls are closures of this process (not picklable, not for a copy's tensors).
        state = super().__getstate__()
        state.pop("_gemmtune_calls", None)
        return state


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
