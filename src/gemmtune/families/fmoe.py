"""The fused-MoE family's table (``tuned_fmoe.csv``, the seeds' columns); its op, kernels and
tuner land with the fused-MoE issue. ``gemmtune shapes`` already writes its untuned rows."""

from __future__ import annotations

from typing import NamedTuple

from gemmtune.families._family import Family
from gemmtune.families._gemm import model_config_glob
from gemmtune.tables.schema import FMOE_RESULT_COLUMNS, Column, Kind, Schema, int_columns


class FmoeKey(NamedTuple):
    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    act_type: str  # ActivationType.Silu
    dtype: str
    q_dtype_a: str
    q_dtype_w: str
    q_type: str  # QuantType.No
    use_g1u1: int
    doweight_stage1: int


SCHEMA = Schema(
    "fmoe", "tuned_fmoe.csv", "untuned_fmoe.csv",
    int_columns("token", "model_dim", "inter_dim", "expert", "topk") + (
        Column("act_type", Kind.ACTIVATION, default="ActivationType.Silu"),
        Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_dtype_a", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_dtype_w", Kind.DTYPE, default="torch.bfloat16"),
        Column("q_type", Kind.QUANT, default="QuantType.No"),
        Column("use_g1u1", Kind.INT, default="1"),
        Column("doweight_stage1", Kind.INT, default="0"),
    ),
    FmoeKey, FMOE_RESULT_COLUMNS, "token", ("kernelName1", "kernelName2"),
    ("GEMMTUNE_CONFIG_FMOE", "AITER_CONFIG_FMOE"), model_config_glob("tuned_fmoe.csv"))

FAMILY = Family("fmoe", SCHEMA)
