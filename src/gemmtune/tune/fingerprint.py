"""The environment a row was tuned in, stored in its ``env`` column."""

from __future__ import annotations

import functools

import torch


@functools.cache
def fingerprint() -> str:
    parts = [f"torch{torch.__version__}"]
    try:
        import triton

        parts.append(f"triton{triton.__version__}")
    except ImportError:
        pass
    if torch.version.cuda:
        parts.append(f"cuda{torch.version.cuda}")
    if torch.cuda.is_available():
        parts.append(f"driver{_driver_version()}")
    return ";".join(parts)


def _driver_version() -> str:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        return "?"
