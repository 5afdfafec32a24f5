"""Canonical spellings of the values that appear in tables and on the command line.

Tables store canonical strings (``torch.bfloat16``, ``ActivationType.Silu``, ``QuantType.per_Token``,
``True``). Reading accepts the seeds' spellings too (``dtypes.bf16``, ``dtypes.fp8``, ``bf16``,
``torch.half``, ``silu``, ``per_token``, ``1``); every parse is a dictionary look-up, never ``eval``.
"""

from __future__ import annotations

import enum

import torch


class BadValue(ValueError):
    """A table or command-line value that is not one of the accepted spellings."""


def _canonical_dtypes() -> dict[str, torch.dtype]:
    names = [
        "bfloat16", "float16", "float32", "float64", "int8", "int32", "uint8",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    ]
    # Older torch builds lack some of the narrow types; only offer what exists.
    return {f"torch.{n}": getattr(torch, n) for n in names if hasattr(torch, n)}


CANONICAL_DTYPES: dict[str, torch.dtype] = _canonical_dtypes()
DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in CANONICAL_DTYPES.items()}

# The seeds' and common short spellings. ``fp8`` means e4m3fn: the FP8 format Hopper computes in
# (AITER's ``dtypes.fp8`` is e4m3fnuz on MI300, which NVIDIA GPUs do not have).
_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "torch.bfloat16", "bfloat16": "torch.bfloat16",
    "fp16": "torch.float16", "f16": "torch.float16", "half": "torch.float16",
    "float16": "torch.float16", "torch.half": "torch.float16",
    "fp32": "torch.float32", "f32": "torch.float32", "float": "torch.float32",
    "float32": "torch.float32", "torch.float": "torch.float32",
    "i8": "torch.int8", "int8": "torch.int8", "i32": "torch.int32", "int32": "torch.int32",
    "u8": "torch.uint8", "uint8": "torch.uint8",
    "fp8": "torch.float8_e4m3fn", "fp8_e4m3": "torch.float8_e4m3fn",
    "float8_e4m3fn": "torch.float8_e4m3fn", "fp8_e4m3fnuz": "torch.float8_e4m3fnuz",
    "float8_e4m3fnuz": "torch.float8_e4m3fnuz",
    "bf8": "torch.float8_e5m2", "fp8_e5m2": "torch.float8_e5m2", "float8_e5m2": "torch.float8_e5m2",
    "fp4x2": "torch.float4_e2m1fn_x2", "fp4": "torch.float4_e2m1fn_x2",
    "float4_e2m1fn_x2": "torch.float4_e2m1fn_x2",
    "fp8_e8m0": "torch.float8_e8m0fnu", "e8m0": "torch.float8_e8m0fnu",
}


def parse_dtype(text: str) -> str:
    """Canonical name (``torch.bfloat16``) of a dtype spelled any accepted way."""
    raw = text.strip()
    if raw in CANONICAL_DTYPES:
        return raw
    short = raw.split(".", 1)[1] if raw.startswith(("dtypes.", "torch.")) else raw
    canonical = _DTYPE_ALIASES.get(short) or _DTYPE_ALIASES.get(raw)
    if canonical is None and f"torch.{short}" in CANONICAL_DTYPES:
        canonical = f"torch.{short}"
    if canonical is None or canonical not in CANONICAL_DTYPES:
        raise BadValue(
            f"unknown dtype {text!r}; expected one of {', '.join(CANONICAL_DTYPES)} "
            f"(or a seed spelling such as dtypes.bf16, dtypes.fp8)"
        )
    return canonical


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def to_torch_dtype(canonical: str) -> torch.dtype:
    return CANONICAL_DTYPES[parse_dtype(canonical)]


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool(text: str) -> bool:
    value = _BOOLS.get(text.strip().lower())
    if value is None:
        raise BadValue(f"expected a boolean (True/False or 1/0), got {text!r}")
    return value


class _TableEnum(str, enum.Enum):
    """A string enum whose canonical spelling is ``ClassName.member`` as in the seeds' tables."""

    @property
    def canonical(self) -> str:
        return f"{type(self).__name__}.{self.value}"

    @classmethod
    def from_str(cls, text: str) -> "_TableEnum":
        raw = text.strip()
        name = raw.split(".", 1)[1] if raw.startswith(cls.__name__ + ".") else raw
        for member in cls:
            if name == member.value or name.lower() == member.value.lower():
                return member
        for alias, member_value in cls._aliases().items():
            if name.lower() == alias:
                return cls(member_value)
        valid = ", ".join(m.canonical for m in cls)
        raise BadValue(f"unknown {cls.__name__} {text!r}; expected one of {valid}")

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {}


class ActivationType(_TableEnum):
    No = "No"
    Silu = "Silu"
    Gelu = "Gelu"
    Swiglu = "Swiglu"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"none": "No", "swish": "Silu"}


class QuantType(_TableEnum):
    No = "No"
    per_Tensor = "per_Tensor"
    per_Token = "per_Token"
    per_1x32 = "per_1x32"
    per_1x128 = "per_1x128"
    per_128x128 = "per_128x128"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"none": "No", "pertensor": "per_Tensor", "pertoken": "per_Token"}


class LibType(_TableEnum):
    """The backends, the one list of them: what a row's ``libtype`` column and ``--libtype``
    name, and the first word of every ``kernelName`` (``triton.splitk:...`` is a triton
    kernel). Stored bare (``triton``), not prefixed."""

    torch = "torch"
    cublaslt = "cublaslt"
    triton = "triton"

    @property
    def canonical(self) -> str:
        return self.value

    @classmethod
    def of_kernel(cls, name: str) -> "LibType":
        """The backend of a ``kernelName`` or of its prefix (``triton.tile:BM64...`` -> triton)."""
        return cls.from_str(name.split(":", 1)[0].split(".", 1)[0])
