"""gemmtune: every GEMM-family op at the speed of the best kernel for its exact shape.

Capture the shapes a workload runs, tune each across backends, store the winners in CSV tables,
and dispatch from those tables at run time. See README.md for the workflow.
"""

from gemmtune import quant
from gemmtune.device import DeviceId, current_device
from gemmtune.experts import patch_moe, register_when_loaded
from gemmtune.dispatch import format_misses, report_misses, reset
from gemmtune.families import Family, all_families, get_family, register_family
from gemmtune.families.a4w4_blockscale.op import gemm_a4w4_blockscale
from gemmtune.families.a8w8.op import gemm_a8w8
from gemmtune.families.a8w8_blockscale.op import gemm_a8w8_blockscale
from gemmtune.families.a8w8_bpreshuffle.op import gemm_a8w8_bpreshuffle
from gemmtune.families.a16w4.op import gemm_a16w4
from gemmtune.families.bf16.op import gemm_a16w16
from gemmtune.families.fmoe.op import fused_moe
from gemmtune.nn import Mxfp4Linear, TunedLinear, patch_linear
from gemmtune.siblings import fuse_siblings

__version__ = "0.1.0"

register_when_loaded()  # experts_implementation="gemmtune" in transformers (gemmtune.experts)


def precompile(families: list[str] | None = None, workers: int | None = None, progress=None,
               warm: bool = True):
    """Build every Triton kernel the tables in force name for this GPU into Triton's cache, in
    ``workers`` processes, so that this process's first calls load them instead of compiling
    (``gemmtune precompile``); with ``warm`` (default) also pay Triton's once-per-process
    start here. Returns a report (``.summary()``, ``.failed``). Imported when called: the
    tuning code it uses stays out of the run-time path."""
    from gemmtune.prebuild import precompile as build

    return build(families, workers, progress, warm)


__all__ = [
    "gemm_a16w16", "gemm_a8w8", "gemm_a8w8_blockscale", "gemm_a8w8_bpreshuffle", "gemm_a16w4",
    "gemm_a4w4_blockscale",
    "fused_moe", "report_misses",
    "format_misses",
    "reset", "TunedLinear", "Mxfp4Linear", "patch_linear", "fuse_siblings", "patch_moe", "current_device", "DeviceId", "quant",
    "Family", "all_families", "get_family", "register_family", "precompile",
]
