"""The batched FP8/INT8 GEMM family's table (``a8w8_tuned_batched_gemm.csv``); its op and tuner
land with the batched-GEMM issue."""

from __future__ import annotations

from gemmtune.families._family import Family
from gemmtune.families._gemm import model_config_glob
from gemmtune.families.batched_bf16 import BatchedKey
from gemmtune.tables.schema import GEMM_RESULT_COLUMNS, Schema, int_columns

SCHEMA = Schema("batched_a8w8", "a8w8_tuned_batched_gemm.csv", "a8w8_untuned_batched_gemm.csv",
                int_columns("B", "M", "N", "K"), BatchedKey, GEMM_RESULT_COLUMNS, "M",
                ("kernelName",), ("GEMMTUNE_CONFIG_BATCHED_A8W8", "AITER_CONFIG_A8W8_BATCHED_GEMM"),
                model_config_glob("a8w8_tuned_batched_gemm.csv"))

FAMILY = Family("batched_a8w8", SCHEMA)
