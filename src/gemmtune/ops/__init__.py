"""Public ops, each dispatched per shape through its family's tuned table."""

from gemmtune.ops._dispatch import Decision, Miss, format_misses, report_misses, reset
from gemmtune.ops.gemm_a8w8 import gemm_a8w8
from gemmtune.ops.gemm_a8w8_blockscale import gemm_a8w8_blockscale
from gemmtune.ops.gemm_a16w16 import gemm_a16w16

__all__ = ["gemm_a16w16", "gemm_a8w8", "gemm_a8w8_blockscale", "report_misses", "format_misses", "reset", "Decision", "Miss"]
