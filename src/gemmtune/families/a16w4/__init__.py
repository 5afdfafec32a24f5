"""The MXFP4-weight GEMM family (bf16 or fp16 x, MXFP4 w): ``gemm_a16w4`` (``op``). Its tuner
and bench come with issue 16's GPU work; until then its rows are written by hand or by
``gemmtune tune`` of another machine, and a shape without a row runs the torch backend."""

from __future__ import annotations

from gemmtune.families._family import Family
from gemmtune.families.a16w4.op import DISPATCH, SCHEMA, A16w4Key, gemm_a16w4

FAMILY = Family("a16w4", SCHEMA, DISPATCH)

__all__ = ["A16w4Key", "FAMILY", "gemm_a16w4"]
