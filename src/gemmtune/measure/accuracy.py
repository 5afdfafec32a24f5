"""The correctness gate every candidate passes before it is timed (DESIGN: Correctness gate),
and the tolerances by output dtype that the tuner and the bench share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (atol, rtol, ||out - ref|| / ||ref|| bound) by output dtype, for outputs of unit scale (inputs
# are N(0, 1) and W is scaled by 1/sqrt(K)). bf16 output rounding alone is 2^-9 relative per
# element (rel. norm ~2e-3); fp16's 2^-12; fp32 without tf32 accumulates exactly to ~1e-6.
TOLERANCES = {
    torch.bfloat16: (1e-2, 1e-2, 1e-2),
    torch.float16: (2e-3, 2e-3, 2e-3),
    torch.float32: (1e-4, 1e-4, 1e-4),
}


@dataclass(frozen=True)
class GateResult:
    ok: bool
    err_ratio: float  # fraction of elements outside atol + rtol * |ref|
    rel_err: float  # ||out - ref|| / ||ref||
    detail: str


def gate(out: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float, max_err_ratio: float,
         rel_bound: float) -> GateResult:
    """Pass only if there is no NaN/Inf (outputs start as NaN, so an unwritten element fails
    here), the fraction of elements outside ``atol + rtol*|ref|`` is at most ``max_err_ratio``,
    and the relative norm error is within ``rel_bound``."""
    if out.shape != ref.shape:
        return GateResult(False, 1.0, math.inf, f"output shape {tuple(out.shape)} != "
                                                f"{tuple(ref.shape)}")
    got = out.float()
    finite = torch.isfinite(got)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return GateResult(False, 1.0, math.inf, f"{bad} of {got.numel()} elements NaN/Inf "
                                                f"(unwritten or overflowed)")
    diff = (got - ref).abs()
    outside = diff > atol + rtol * ref.abs()
    err_ratio = float(outside.float().mean()) if got.numel() else 0.0
    denom = float(ref.norm())
    rel_err = float(diff.norm()) / denom if denom > 0 else float(diff.norm())
    if err_ratio > max_err_ratio:
        return GateResult(False, err_ratio, rel_err,
                          f"{err_ratio:.2%} of elements outside tolerance > {max_err_ratio:.2%}")
    if rel_err > rel_bound:
        return GateResult(False, err_ratio, rel_err,
                          f"relative error {rel_err:.2e} > bound {rel_bound:.1e}")
    return GateResult(True, err_ratio, rel_err, "")
