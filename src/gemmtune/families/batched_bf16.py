"""The batched bf16 GEMM family's table (``bf16_tuned_batched_gemm.csv``); its op and tuner
land with the batched-GEMM issue."""

from __future__ import annotations

from typing import NamedTuple

from gemmtune.families._family import Family
from gemmtune.families._gemm import model_config_glob
from gemmtune.tables.schema import GEMM_RESULT_COLUMNS, Schema, int_columns


class BatchedKey(NamedTuple):
    B: int
    M: int
    N: int
    K: int


SCHEMA = Schema("batched_bf16", "bf16_tuned_batched_gemm.csv", "bf16_untuned_batched_gemm.csv",
                int_columns("B", "M", "N", "K"), BatchedKey, GEMM_RESULT_COLUMNS, "M",
                ("kernelName",), ("GEMMTUNE_CONFIG_BATCHED_BF16", "AITER_CONFIG_BF16_BATCHED_GEMM"),
                model_config_glob("bf16_tuned_batched_gemm.csv"))

FAMILY = Family("batched_bf16", SCHEMA)
