"""cuBLASLt backend: ``y = x @ w.T (+ bias)`` with a named cuBLASLt algorithm: bf16/fp16 inputs
(gemm_a16w16: ``CublasLtKernel``), and FP8 e4m3 inputs with fp32 scales per tensor or per row of
x and w (gemm_a8w8: ``CublasLtScaledKernel``; cuBLASLt's SCALAR_32F and OUTER_VEC_32F scale
modes, both checked on H100 with cuBLASLt 13.1 by benchmarks/cublaslt_fp8_probe.py).

The layers, bottom up:
- ``_bindings``: nvmath-python's low-level bindings (a dependency of gemmtune on Linux),
  imported lazily so the package imports on machines without nvmath or a GPU; enum values.
- ``algo``: ``LtAlgo``, an algorithm's nine attributes as a ``kernelName``
  (``cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0``), and ``algo_of``.
- ``plans``: descriptors per shape and plans per (shape, algorithm), built once; the
  workspaces (one per device and stream) and the per-thread descriptors that make calls safe
  from several streams and threads at once (its docstring says what is shared and what not).
- ``candidates``: ``enumerate_algos``, the algorithms the tuner times for a shape.
- ``kernels``: the callables table rows resolve to, checked with a ``GemmProblem``.

Calls may run concurrently on different streams and from different threads, CUDA-graph capture
included; the limits are in ``plans``' docstring (32 MiB of workspace per stream; graphs
replayed concurrently must be captured on different streams).
"""

from gemmtune.kernels.cublaslt._bindings import INSTALL_HINT, bindings, nvmath_missing
from gemmtune.kernels.cublaslt.algo import KERNEL_PREFIX, LtAlgo, algo_of
from gemmtune.kernels.cublaslt.candidates import DEFAULT_LIMIT, enumerate_algos, heuristic_algos
from gemmtune.kernels.cublaslt.kernels import (
    CublasLtKernel,
    CublasLtScaledKernel,
    algo_bytes,
    heuristic_kernels,
)
from gemmtune.kernels.cublaslt.plans import (
    SCALINGS,
    WORKSPACE_BYTES,
    clear_plans,
    get_plan,
    why_not_types,
)

__all__ = [
    "CublasLtKernel", "CublasLtScaledKernel", "LtAlgo", "algo_of", "KERNEL_PREFIX",
    "enumerate_algos", "heuristic_algos", "heuristic_kernels", "algo_bytes", "DEFAULT_LIMIT",
    "get_plan", "clear_plans", "why_not_types", "SCALINGS", "WORKSPACE_BYTES",
    "bindings", "nvmath_missing", "INSTALL_HINT",
]
