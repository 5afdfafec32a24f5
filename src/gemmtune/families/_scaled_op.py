"""The run-time path the ops with per-tensor or per-row scales share (``gemm_a8w8``,
``gemm_a8w8_bpreshuffle``): their operand checks, and checking, planning and remembering a call
around the family's Dispatcher. Each op keeps its own eager hot path (its call key, one dict hit)
and custom op."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gemmtune.dispatch import Dispatcher, Plan
from gemmtune.families._gemm import OUT_DTYPES, check_multiply, check_out_dtype_and_device

Q_DTYPES = (torch.float8_e4m3fn, torch.int8)


def check_rowwise_scaled(op: str, xq, wq, x_scale, w_scale, bias, dtype) -> None:
    """Refuse, saying what is wrong, a call whose operands the kernels cannot take: 8-bit x and
    w of one dtype that multiply, an fp32 scale of 1 value or one per row of each, a bias of N."""
    check_multiply(op, xq, wq)
    if xq.dtype not in Q_DTYPES or wq.dtype != xq.dtype:
        raise TypeError(f"{op}: xq is {xq.dtype} and wq {wq.dtype}; both must be one of "
                        f"{', '.join(str(d) for d in Q_DTYPES)} (quantise with gemmtune.quant)")
    check_out_dtype_and_device(op, xq, wq, dtype, OUT_DTYPES)
    m = math.prod(xq.shape[:-1])
    for name, s, count, per in (("x_scale", x_scale, m, "token (row of xq)"),
                                ("w_scale", w_scale, wq.shape[0], "output channel (N)")):
        if (not isinstance(s, torch.Tensor) or s.dtype != torch.float32
                or s.device != xq.device or s.numel() not in (1, count)
                or not s.is_contiguous()):
            got = (f"{tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, torch.Tensor)
                   else type(s).__name__)
            raise ValueError(f"{op}: {name} must be contiguous float32 on {xq.device} with "
                             f"1 value (per tensor) or {count} (one per {per}); got {got}")
    if bias is not None and (bias.shape != (wq.shape[0],) or bias.device != xq.device
                             or not bias.is_floating_point()):
        raise ValueError(f"{op}: bias must be a float ({wq.shape[0]},) tensor on "
                         f"{xq.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")


class RowwiseScaledOp:
    """``check`` (all of an op's operand checks) and the family's ``dispatch``: the custom op's
    path (``run``) and the eager path's first call of a key (``run_and_remember``)."""

    def __init__(self, dispatch: Dispatcher, check: Callable):
        self.dispatch = dispatch
        self.check = check

    def plan(self, xq, wq, x_scale, w_scale, bias, dtype, kernel) -> Plan:
        args = (xq, wq, x_scale, w_scale, bias, dtype)
        try:
            k = xq.shape[-1]
            m = xq.numel() // k if k else math.prod(xq.shape[:-1])
            # The plan key holds everything the checks depend on but the scales' contiguity,
            # which the call key holds (and reshape(-1) in run makes good for the checked path).
            device = xq.get_device()
            key = (m, wq.shape[0], k, xq.dtype, wq.dtype, wq.dim(), wq.shape[-1],
                   wq.get_device(), wq.is_contiguous(),
                   x_scale.numel(), x_scale.dtype, x_scale.get_device(),
                   w_scale.numel(), w_scale.dtype, w_scale.get_device(),
                   None if bias is None else (bias.dtype, tuple(bias.shape), bias.get_device()),
                   dtype, device)
        except (AttributeError, IndexError, ValueError):
            self.check(*args)
            raise
        return self.dispatch.plan_for(key, device, kernel, self.check, args)

    def run(self, xq, wq, x_scale, w_scale, bias, dtype, kernel):
        plan = self.plan(xq, wq, x_scale, w_scale, bias, dtype, kernel)
        return plan.run(xq, wq, bias, dtype, x_scale.reshape(-1), w_scale.reshape(-1))

    def run_and_remember(self, call_key: tuple, xq, wq, x_scale, w_scale, bias, dtype, kernel):
        """The first eager call with ``call_key``: checked in full, planned, and its plan's
        kernel bound to the key for the calls after it."""
        self.check(xq, wq, x_scale, w_scale, bias, dtype)
        plan = self.plan(xq, wq, x_scale, w_scale, bias, dtype, kernel)
        run = self.dispatch.remember(call_key, plan, (xq, wq, bias, dtype, x_scale, w_scale))
        return run(xq, wq, bias, x_scale, w_scale)
