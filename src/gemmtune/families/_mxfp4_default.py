"""The kernel an MXFP4 family runs for a shape its table has no row for: up to
``triton.w4frag``'s largest M, that register-direct decode kernel's default config for the
weight's layout, where it can run (Hopper, x of a dtype it takes); else the family's torch
backend for the layout, which dequantises the whole weight on every call: right for every
shape, but at decode sizes ~100x the decode kernel's time (H200, docs/benchmarks.md,
session 42)."""

from __future__ import annotations

import dataclasses

from gemmtune.dispatch import KernelRegistry
from gemmtune.families._mxfp4_layout import TorchBackends
from gemmtune.kernels.problem import GemmProblem


def default_kernel_name(registry: KernelRegistry, torch_names: TorchBackends,
                        problem: GemmProblem) -> str:
    """The kernelName ``registry`` runs ``problem`` with when no row names one."""
    # Imported here, not at the top: importing a Triton kernel module fixes, for the process,
    # whether its kernels are interpreted (TRITON_INTERPRET)
    from gemmtune.kernels.triton import gemm_w4frag

    torch_name = torch_names.of(problem.preshuffled)
    if problem.m > gemm_w4frag.MAX_M:
        return torch_name
    config = dataclasses.replace(
        gemm_w4frag.default_config(problem.m, problem.n, problem.k, problem.dtype),
        packed=int(problem.preshuffled))
    return config.name if registry.can_run(config.name, problem) else torch_name
