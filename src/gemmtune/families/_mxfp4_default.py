"""The kernel an MXFP4 family runs for a shape its table has no row for, on a Hopper where it
can run (x of a dtype it takes; the call's tensors on that GPU): up to ``triton.w4frag``'s
largest M, that register-direct decode kernel's default config; above, ``triton.w4deq``'s (the
weight dequantised to bf16 by PTX, then cuBLAS), the config most prefill rows name. Each reads
the weight in its layout. Else (fp16 x, the CPU, other GPUs, empty GEMMs) the family's torch
backend for the layout: right for every shape, but it dequantises the whole weight in several
passes on every call, ~100x the decode kernel's time at decode sizes (H200,
docs/benchmarks.md, session 42)."""

from __future__ import annotations

import dataclasses

from gemmtune.device import DeviceId
from gemmtune.dispatch import KernelRegistry
from gemmtune.families._mxfp4_layout import TorchBackends
from gemmtune.kernels.problem import GemmProblem

_HOPPER = "sm_90"  # what the Gluon decode kernels and the PTX decode are written for


def default_kernel_name(registry: KernelRegistry, torch_names: TorchBackends,
                        problem: GemmProblem, device: DeviceId) -> str:
    """The kernelName ``registry`` runs ``problem`` with on ``device`` (the call's tensors')
    when no row names one."""
    torch_name = torch_names.of(problem.preshuffled)
    # Empty GEMMs launch nothing (dispatch resolves their default unchecked); the kernels'
    # checks ask only whether this process runs on a Hopper, not whether the call's tensors
    # are on it.
    if min(problem.m, problem.n, problem.k) < 1 or device.arch != _HOPPER:
        return torch_name
    try:
        # Imported here, not at the top: importing a Triton kernel module fixes, for the
        # process, whether its kernels are interpreted (TRITON_INTERPRET)
        from gemmtune.kernels.triton import gemm_w4deq, gemm_w4frag
    except ImportError:  # a Triton without Gluon: the torch backend still runs every shape
        return torch_name
    packed = int(problem.preshuffled)
    if problem.m <= gemm_w4frag.MAX_M:
        config = dataclasses.replace(
            gemm_w4frag.default_config(problem.m, problem.n, problem.k, problem.dtype,
                                       num_sms=device.cu_num or None),
            packed=packed)
    else:
        config = gemm_w4deq.W4DeqConfig(8, 512, 4, packed, asm=1)
    return config.name if registry.can_run(config.name, problem) else torch_name
