"""The seven table families: their files, key columns and result columns.

A family's key is ``arch, cu_num`` (the device) followed by its shape columns; the rest are results.
Column names are the seeds' (AITER's) names; the few places where seeds spell a column differently
(``gfx`` for ``arch``, ``errRatio`` for ``err_ratio``, ``kernelId`` for ``solidx``) are aliases.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from gemmtune.tables.values import ActivationType, BadValue, QuantType, parse_bool, parse_dtype


class Kind(enum.Enum):
    INT = "integer"
    FLOAT = "number"
    BOOL = "boolean"
    DTYPE = "dtype"
    ACTIVATION = "ActivationType"
    QUANT = "QuantType"
    TEXT = "text"
    NAME = "kernel name"  # non-empty text


_INTEGRAL_FLOAT = re.compile(r"[+-]?\d+\.0*")


def _parse_int(text: str) -> int:
    raw = text.strip()
    try:
        return int(raw)
    except ValueError:
        # Seeds sometimes write integers as "16.0"; accept exactly that form, nothing like 1e30.
        if _INTEGRAL_FLOAT.fullmatch(raw):
            return int(raw.split(".")[0])
        raise BadValue(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    raw = text.strip().rstrip("%")
    try:
        return float(raw)
    except ValueError:
        raise BadValue(f"expected a number, got {text!r}") from None


def _parse_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise BadValue("is empty; a row must name the kernel it dispatches to")
    return name


_PARSERS = {
    Kind.INT: _parse_int,
    Kind.FLOAT: _parse_float,
    Kind.BOOL: parse_bool,
    Kind.DTYPE: parse_dtype,
    Kind.ACTIVATION: lambda t: ActivationType.from_str(t).canonical,
    Kind.QUANT: lambda t: QuantType.from_str(t).canonical,
    Kind.TEXT: lambda t: t.strip(),
    Kind.NAME: lambda t: _parse_name(t),
}


def format_value(kind: Kind, value: object) -> str:
    if kind is Kind.FLOAT:
        return format(float(value), ".10g")
    return str(value)


@dataclass(frozen=True)
class Column:
    """One CSV column. ``default`` is the text used when the column is absent (None: required)."""

    name: str
    kind: Kind
    default: str | None = None
    aliases: tuple[str, ...] = ()

    def parse(self, text: str) -> object:
        return _PARSERS[self.kind](text)


class Family(str, enum.Enum):
    bf16 = "bf16"
    a8w8 = "a8w8"
    a8w8_blockscale = "a8w8_blockscale"
    a4w4_blockscale = "a4w4_blockscale"
    batched_bf16 = "batched_bf16"
    batched_a8w8 = "batched_a8w8"
    fmoe = "fmoe"

    @classmethod
    def from_str(cls, text: str) -> "Family":
        name = text.strip().replace("-", "_").lower()
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(f.value for f in cls)
            raise BadValue(f"unknown family {text!r}; expected one of {valid}") from None


ARCH = Column("arch", Kind.TEXT, default="", aliases=("gfx",))
CU_NUM = Column("cu_num", Kind.INT)
DEVICE_COLUMNS = (ARCH, CU_NUM)

# How and where a row was measured (DESIGN: Tables). Optional: the seeds' tables lack them.
MEASUREMENT_COLUMNS = (
    Column("timing", Kind.TEXT, default=""),  # e.g. "graph.coldL2": CUDA-graph replay, cold L2
    Column("spread", Kind.FLOAT, default="0"),  # (p90 - p10) / median of the timed replays
    Column("env", Kind.TEXT, default=""),  # torch/triton/CUDA versions the row was tuned with
)

GEMM_RESULT_COLUMNS = (
    Column("libtype", Kind.TEXT, default=""),
    Column("solidx", Kind.INT, default="0", aliases=("kernelId",)),
    Column("splitK", Kind.INT, default="0"),
    Column("us", Kind.FLOAT),
    Column("kernelName", Kind.NAME),
    Column("err_ratio", Kind.FLOAT, default="0", aliases=("errRatio",)),
    Column("tflops", Kind.FLOAT, default="0"),
    Column("bw", Kind.FLOAT, default="0"),
) + MEASUREMENT_COLUMNS

FMOE_RESULT_COLUMNS = (
    Column("block_m", Kind.INT, default="0"),
    Column("ksplit", Kind.INT, default="0"),
    Column("us1", Kind.FLOAT, default="0"),
    Column("kernelName1", Kind.NAME),
    Column("err1", Kind.FLOAT, default="0"),
    Column("us2", Kind.FLOAT, default="0"),
    Column("kernelName2", Kind.TEXT, default=""),
    Column("err2", Kind.FLOAT, default="0"),
    Column("us", Kind.FLOAT),
    Column("run_1stage", Kind.INT, default="0"),
    Column("tflops", Kind.FLOAT, default="0"),
    Column("bw", Kind.FLOAT, default="0"),
) + MEASUREMENT_COLUMNS


def _ints(*names: str) -> tuple[Column, ...]:
    return tuple(Column(n, Kind.INT) for n in names)


@dataclass(frozen=True)
class Schema:
    family: Family
    tuned_file: str  # default file name of the tuned table (shipped in configs/)
    untuned_file: str  # file name of the shapes-to-tune table written by capture/shapes
    key: tuple[Column, ...]  # shape columns, after the device columns
    result: tuple[Column, ...]
    m_column: str  # the token-count column that look-up pads
    kernel_columns: tuple[str, ...]  # result columns naming the kernels a row dispatches to
    env_names: tuple[str, ...]  # overlay variables, GEMMTUNE_* first, then the seeds' aliases
    model_config_glob: str  # which files of configs/model_configs/ belong to this family

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.key)

    @property
    def m_index(self) -> int:
        return self.key_names.index(self.m_column)

    @property
    def tuned_columns(self) -> tuple[Column, ...]:
        return DEVICE_COLUMNS + self.key + self.result


_GEMM_KEY = _ints("M", "N", "K")

SCHEMAS: dict[Family, Schema] = {
    s.family: s
    for s in (
        Schema(
            Family.bf16, "bf16_tuned_gemm.csv", "bf16_untuned_gemm.csv",
            _GEMM_KEY + (
                Column("bias", Kind.BOOL, default="False"),
                Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
                Column("outdtype", Kind.DTYPE, default="torch.bfloat16"),
                Column("scaleAB", Kind.BOOL, default="False"),
                Column("bpreshuffle", Kind.BOOL, default="False"),
            ),
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_BF16", "GEMMTUNE_CONFIG_GEMM_BF16", "AITER_CONFIG_GEMM_BF16"),
            "bf16_tuned_gemm*.csv",
        ),
        Schema(
            Family.a8w8, "a8w8_tuned_gemm.csv", "a8w8_untuned_gemm.csv",
            _GEMM_KEY + (Column("q_dtype_w", Kind.DTYPE, default="torch.float8_e4m3fn"),),
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_A8W8", "GEMMTUNE_CONFIG_GEMM_A8W8", "AITER_CONFIG_GEMM_A8W8"),
            "a8w8_tuned_gemm*.csv",
        ),
        Schema(
            Family.a8w8_blockscale, "a8w8_blockscale_tuned_gemm.csv",
            "a8w8_blockscale_untuned_gemm.csv", _GEMM_KEY,
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_A8W8_BLOCKSCALE", "GEMMTUNE_CONFIG_GEMM_A8W8_BLOCKSCALE",
             "AITER_CONFIG_GEMM_A8W8_BLOCKSCALE"),
            "a8w8_blockscale_tuned_gemm*.csv",
        ),
        Schema(
            Family.a4w4_blockscale, "a4w4_blockscale_tuned_gemm.csv",
            "a4w4_blockscale_untuned_gemm.csv", _GEMM_KEY,
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_A4W4_BLOCKSCALE", "GEMMTUNE_CONFIG_GEMM_A4W4",
             "AITER_CONFIG_GEMM_A4W4"),
            "a4w4_blockscale_tuned_gemm*.csv",
        ),
        Schema(
            Family.batched_bf16, "bf16_tuned_batched_gemm.csv", "bf16_untuned_batched_gemm.csv",
            _ints("B", "M", "N", "K"),
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_BATCHED_BF16", "AITER_CONFIG_BF16_BATCHED_GEMM"),
            "bf16_tuned_batched_gemm*.csv",
        ),
        Schema(
            Family.batched_a8w8, "a8w8_tuned_batched_gemm.csv", "a8w8_untuned_batched_gemm.csv",
            _ints("B", "M", "N", "K"),
            GEMM_RESULT_COLUMNS, "M", ("kernelName",),
            ("GEMMTUNE_CONFIG_BATCHED_A8W8", "AITER_CONFIG_A8W8_BATCHED_GEMM"),
            "a8w8_tuned_batched_gemm*.csv",
        ),
        Schema(
            Family.fmoe, "tuned_fmoe.csv", "untuned_fmoe.csv",
            _ints("token", "model_dim", "inter_dim", "expert", "topk") + (
                Column("act_type", Kind.ACTIVATION, default="ActivationType.Silu"),
                Column("dtype", Kind.DTYPE, default="torch.bfloat16"),
                Column("q_dtype_a", Kind.DTYPE, default="torch.bfloat16"),
                Column("q_dtype_w", Kind.DTYPE, default="torch.bfloat16"),
                Column("q_type", Kind.QUANT, default="QuantType.No"),
                Column("use_g1u1", Kind.INT, default="1"),
                Column("doweight_stage1", Kind.INT, default="0"),
            ),
            FMOE_RESULT_COLUMNS, "token", ("kernelName1", "kernelName2"),
            ("GEMMTUNE_CONFIG_FMOE", "AITER_CONFIG_FMOE"),
            "*tuned_fmoe*.csv",
        ),
    )
}


def schema_for(family: Family | str) -> Schema:
    return SCHEMAS[family if isinstance(family, Family) else Family.from_str(family)]
