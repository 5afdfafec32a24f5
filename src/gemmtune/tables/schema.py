"""What a table is made of: typed columns, the device and result columns every family shares,
and ``Schema``, which each family fills in with its own key columns (``gemmtune.families``).

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


# The largest size a key column takes: what an int32 index (Triton's program ids, cuBLASLt's
# layouts) can address. M = 10^12 in a table is a typo, not a shape.
MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class Column:
    """One CSV column. ``default`` is the text used when the column is absent (None: required).
    ``low``/``high``: the range an integer column's values must lie in (None: unbounded)."""

    name: str
    kind: Kind
    default: str | None = None
    aliases: tuple[str, ...] = ()
    low: int | None = None
    high: int | None = None

    def parse(self, text: str) -> object:
        value = _PARSERS[self.kind](text)
        why = self.why_not(value)
        if why:
            raise BadValue(why)
        return value

    def why_not(self, value: object) -> str | None:
        """Why ``value`` is outside this column's range, naming both; None if it is inside."""
        if self.low is None and self.high is None:
            return None
        low = self.low if self.low is not None else "-inf"
        high = self.high if self.high is not None else "inf"
        if (self.low is not None and value < self.low) or \
                (self.high is not None and value > self.high):
            return f"{self.name}={value} is out of range: expected {low} <= {self.name} <= {high}"
        return None


ARCH = Column("arch", Kind.TEXT, default="", aliases=("gfx",))
CU_NUM = Column("cu_num", Kind.INT)
# The GPU model (H100-80GB-HBM3): rows of one arch and SM count may hold several models' rows of
# one shape. Tables written before it existed load with "" (any model of that arch, cu_num).
GPU = Column("gpu", Kind.TEXT, default="")
DEVICE_COLUMNS = (ARCH, CU_NUM, GPU)

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


def int_columns(*names: str) -> tuple[Column, ...]:
    """Required size columns of a key (``M``, ``N``, ``K``, ...): integers from 1 to MAX_SIZE."""
    return tuple(Column(n, Kind.INT, low=1, high=MAX_SIZE) for n in names)


@dataclass(frozen=True)
class Schema:
    """One family's table: its files, columns and overlay variables. ``key_type`` is the family's
    NamedTuple of key values, one field per key column in order: rows, look-ups and dispatch
    decisions carry keys of that type, read by column name, never decoded by index."""

    family: str  # the family's name (``bf16``, ``a8w8_blockscale``): capture folders, messages
    tuned_file: str  # default file name of the tuned table (shipped in configs/)
    untuned_file: str  # file name of the shapes-to-tune table written by capture/shapes
    key: tuple[Column, ...]  # shape columns, after the device columns
    key_type: type  # NamedTuple with the key columns' names as fields
    result: tuple[Column, ...]
    m_column: str  # the token-count column that look-up pads
    kernel_columns: tuple[str, ...]  # result columns naming the kernels a row dispatches to
    env_names: tuple[str, ...]  # overlay variables, GEMMTUNE_* first, then the seeds' aliases
    model_config_glob: str  # which files of configs/model_configs/ belong to this family

    def __post_init__(self):
        fields = getattr(self.key_type, "_fields", None)
        if fields != self.key_names:
            raise ValueError(f"{self.family}: key_type fields {fields} must be the key columns "
                             f"{self.key_names}, in order")
        if self.m_column not in self.key_names:
            raise ValueError(f"{self.family}: m_column {self.m_column!r} is not a key column")

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.key)

    @property
    def m_index(self) -> int:
        """Where the token-count column sits in a key (look-up pads it, the tuner sorts by it)."""
        return self.key_names.index(self.m_column)

    @property
    def tuned_columns(self) -> tuple[Column, ...]:
        return DEVICE_COLUMNS + self.key + self.result

    def make_key(self, values) -> tuple:
        """The family's key from values in column order."""
        return self.key_type(*values)

    def why_not_key(self, key) -> str | None:
        """The first key value outside its column's range, said with the range; or None."""
        for column, value in zip(self.key, key):
            why = column.why_not(value)
            if why:
                return why
        return None

    def describe_key(self, key) -> str:
        """``M=16 N=4096 K=4096 ...``: how messages and logs show a key."""
        return " ".join(f"{n}={v}" for n, v in zip(self.key_names, key))
