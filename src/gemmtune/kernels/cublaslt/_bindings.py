"""nvmath-python's low-level cuBLASLt bindings, loaded on first use (so the package imports on
machines without nvmath or a GPU), the ABI-stable enum values the backend passes, and helpers that
set and name cuBLASLt attributes through numpy scalars."""

from __future__ import annotations

import torch

INSTALL_HINT = "pip install nvmath-python (a dependency of gemmtune on Linux)"

# ABI-stable enum values from library_types.h / cublas_api.h / cublasLt.h.
CUDA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14,
              torch.float8_e4m3fn: 28}  # cudaDataType_t
CUDA_R_32F = 0
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
OP_T = 1  # cublasOperation_t CUBLAS_OP_T
EPILOGUE_BIAS = 4  # cublasLtEpilogue_t CUBLASLT_EPILOGUE_BIAS
REDUCTION_SCHEMES = (0, 1, 2, 4)  # NONE, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE

_L = None


def bindings():
    """nvmath-python's ``cublasLt`` bindings; ImportError naming the extra when missing."""
    global _L
    if _L is None:
        try:
            from nvmath.bindings import cublasLt
        except ImportError as e:
            raise ImportError(
                f"the cublaslt backend needs nvmath-python's low-level bindings, which did not "
                f"import ({e}); install them with `{INSTALL_HINT}`") from e
        _L = cublasLt
    return _L


def nvmath_missing() -> str | None:
    """Why the bindings cannot be used here, or None."""
    try:
        bindings()
    except ImportError as e:
        return str(e)
    return None


def numpy():
    import numpy as np

    return np


def scalar(dtype, value=0):
    """A one-element numpy array: the host buffer cuBLASLt reads an attribute from."""
    return numpy().array([value], dtype=dtype)


def set_attr(setter, dtype_of, obj: int, attr, value) -> None:
    """Set one scalar attribute, sized by its own dtype query (some attributes are uint16)."""
    buf = scalar(dtype_of(attr), value)
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


def enum_value(enum_cls, prefix: str, label: str, what: str) -> int:
    """The value of ``prefix + label`` in one of nvmath's cuBLASLt enums, or ValueError."""
    try:
        return int(enum_cls[prefix + label])
    except KeyError:
        raise ValueError(f"{what} {label!r} is not a {enum_cls.__name__} of the installed "
                         f"nvmath-python/cuBLASLt") from None


def label(enum_cls, prefix: str, value: int) -> str | None:
    """The name of ``value`` without ``prefix`` (``64x8`` for ``TILE_64x8``), or None."""
    try:
        return enum_cls(value).name[len(prefix):]
    except ValueError:
        return None  # a value newer than nvmath's enum: it cannot be named, so it is skipped
