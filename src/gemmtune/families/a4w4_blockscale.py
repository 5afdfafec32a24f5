"""The MXFP4 block-scale GEMM family's table (``a4w4_blockscale_tuned_gemm.csv``); its op and
tuner land with the MXFP4 issue. Until then ``gemmtune tables`` and ``lookup`` show its rows."""

from __future__ import annotations

from typing import NamedTuple

from gemmtune.families._family import Family
from gemmtune.families._gemm import gemm_schema


class A4w4Key(NamedTuple):
    M: int
    N: int
    K: int


SCHEMA = gemm_schema(
    "a4w4_blockscale", "a4w4_blockscale_tuned_gemm.csv", "a4w4_blockscale_untuned_gemm.csv",
    A4w4Key, (), ("GEMMTUNE_CONFIG_A4W4_BLOCKSCALE", "GEMMTUNE_CONFIG_GEMM_A4W4",
                  "AITER_CONFIG_GEMM_A4W4"))

FAMILY = Family("a4w4_blockscale", SCHEMA)
