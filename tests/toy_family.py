"""A throw-away op family that lives in tests/ only: ``toy_gemm(x, w) = x @ w.T`` with two torch
backends, its own key, table files and overlay variable. ``test_register_family.py`` registers it
with ``gemmtune.register_family`` and nothing else, to show that the CLI, capture and dispatch
serve a family the package has never heard of.

Its tuner is ``toy_tuner.ToyTuner``, beside it.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from gemmtune.dispatch import Dispatcher, KernelRegistry
from gemmtune.families import BenchOp, Family
from gemmtune.kernels.problem import GemmProblem
from gemmtune.tables.schema import GEMM_RESULT_COLUMNS, Column, Kind, Schema, int_columns
from gemmtune.tables.values import DTYPE_NAMES, to_torch_dtype

TOY_MM = "torch.mm"  # the family default
TOY_MATMUL_T = "torch.matmul_t"  # the same product computed as (w @ x.T).T
SHORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ToyKey(NamedTuple):
    M: int
    N: int
    K: int
    dtype: str  # canonical dtype name of x and w (torch.float32)


SCHEMA = Schema(
    "toy", "toy_tuned_gemm.csv", "toy_untuned_gemm.csv",
    int_columns("M", "N", "K") + (Column("dtype", Kind.DTYPE, default="torch.float32"),),
    ToyKey, GEMM_RESULT_COLUMNS, "M", ("kernelName",), ("GEMMTUNE_CONFIG_TOY",),
    "toy_tuned_gemm*.csv")

# kernel name -> calls in this process: which backend dispatch really ran.
CALLS: Counter = Counter()


def toy_mm(x, w, out=None):  # x (M, K), w (N, K) -> (M, N)
    CALLS[TOY_MM] += 1
    return torch.mm(x, w.t(), out=out)


def toy_matmul_t(x, w, out=None):  # x (M, K), w (N, K) -> (M, N)
    CALLS[TOY_MATMUL_T] += 1
    y = torch.matmul(w, x.t()).t()  # (N, M) transposed
    return y if out is None else out.copy_(y)


def toy_ref(x, w):
    """fp32 reference of ``x @ w.T``."""
    return x.float() @ w.float().t()


REGISTRY = KernelRegistry("toy")
REGISTRY.register_exact(TOY_MM, toy_mm)
REGISTRY.register_exact(TOY_MATMUL_T, toy_matmul_t)


def problem_of(key: ToyKey) -> GemmProblem:
    dtype = to_torch_dtype(key.dtype)
    return GemmProblem(key.M, key.N, key.K, dtype, dtype)


def _to_table_key(raw: tuple) -> ToyKey:
    m, n, k, _w_k, dtype, _w_dtype, _device = raw
    return ToyKey(m, n, k, DTYPE_NAMES[dtype])


DISPATCH = Dispatcher(SCHEMA, REGISTRY, _to_table_key, problem_of, lambda key, device: TOY_MM)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"toy_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply; "
                         f"expected x (M, K) and w (N, K)")
    if x.dtype != w.dtype or x.dtype not in SHORT_DTYPES.values():
        raise TypeError(f"toy_gemm: x is {x.dtype} and w {w.dtype}; expected both float32 or "
                        f"both bfloat16")


def toy_gemm(x: torch.Tensor, w: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    """``x (M, K) @ w (N, K).T`` with the kernel the toy table names for this shape."""
    device = x.get_device()
    key = (x.shape[0], w.shape[0], x.shape[-1], w.shape[-1], x.dtype, w.dtype, device)
    return DISPATCH.plan_for(key, device, kernel, _check, (x, w)).run(x, w)


def toy_inputs(m: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(m, k, generator=gen, device=gen.device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=gen.device) / k ** 0.5).to(dtype)
    return x, w


# canonical dtype name (a key's dtype) -> its short name (--dtype of the bench)
SHORT_OF_KEY = {DTYPE_NAMES[d]: short for short, d in SHORT_DTYPES.items()}


def gemm_key(m: int, n: int, k: int, dtype: str, bias: bool = False) -> ToyKey:
    return ToyKey(m, n, k, DTYPE_NAMES[SHORT_DTYPES[dtype]])


def bench_op(dtype: str) -> BenchOp:
    torch_dtype = SHORT_DTYPES[dtype]
    return BenchOp(
        "toy", torch_dtype.itemsize, torch_dtype, 1,
        lambda m, n, k, gen: toy_inputs(m, n, k, torch_dtype, gen),
        torch=lambda a: torch.mm(a[0], a[1].t()), tuned=lambda a: toy_gemm(*a),
        reference=lambda a: toy_ref(*a), table_key=lambda m, n, k: gemm_key(m, n, k, dtype),
        torch_kernel=TOY_MM)


# The tuner is imported by name when asked for, as the built-in families' are: running the op
# never loads the tuning engine.
FAMILY = Family("toy", SCHEMA, DISPATCH, tuner="toy_tuner:ToyTuner", bench=bench_op,
                bench_dtypes=tuple(SHORT_DTYPES), gemm_key=gemm_key,
                dtype_of_key=lambda key: SHORT_OF_KEY[key.dtype])
