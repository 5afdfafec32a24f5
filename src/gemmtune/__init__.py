"""gemmtune: every GEMM-family op at the speed of the best kernel for its exact shape.

Capture the shapes a workload runs, tune each across backends, store the winners in CSV tables,
and dispatch from those tables at run time. See README.md for the workflow.
"""

from gemmtune import quant
from gemmtune.device import DeviceId, current_device
from gemmtune.nn import TunedLinear, patch_linear
from gemmtune.ops import (format_misses, gemm_a8w8, gemm_a8w8_blockscale, gemm_a16w16,
                          report_misses, reset)

__version__ = "0.1.0"

__all__ = [
    "gemm_a16w16", "gemm_a8w8", "gemm_a8w8_blockscale", "report_misses", "format_misses", "reset", "TunedLinear", "patch_linear",
    "current_device", "DeviceId", "quant",
]
