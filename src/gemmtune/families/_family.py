"""What a family is: everything gemmtune knows about one op family, in one object.

A family is its table (``schema``, with the key NamedTuple), its op's dispatcher (backends and
default rule), its tuner, how the bench runs it, and the Triton JSON tags of its dtypes. The CLI,
the bench, capture and dispatch reach a family only through this object and the registry
(``gemmtune.families``), so adding a family adds its module and one registry line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gemmtune.dispatch import Dispatcher
from gemmtune.tables.schema import Schema


class Comparison(NamedTuple):
    """Another op the bench times beside a family's, on the same shape in the same run (a
    quantised family against bf16 ``F.linear``): ``inputs(m, n, k, gen)`` its arguments, the
    weight at ``w_index`` (copied to keep it cold); ``run`` calls it."""

    label: str
    inputs: Callable[[int, int, int, torch.Generator], tuple]
    w_index: int
    run: Callable[[tuple], Any]


@dataclass(frozen=True)
class BenchOp:
    """One family as the bench runs it on (M, N, K) GEMMs in one dtype. ``inputs(m, n, k, gen)``
    gives a call's arguments, the weight at ``w_index`` (the operand copied to keep it cold);
    ``torch``, ``tuned`` and ``reference`` run on those arguments; ``table_key(m, n, k)`` is the
    key the tuned op looks up."""

    label: str  # file stem of the bench's CSV and PNG
    in_bytes: int  # per element of x and w
    out_dtype: torch.dtype  # the correctness bound is the tuner's for this output dtype
    w_index: int
    inputs: Callable[[int, int, int, torch.Generator], tuple]
    torch: Callable[[tuple], torch.Tensor]
    tuned: Callable[[tuple], torch.Tensor]
    reference: Callable[[tuple], torch.Tensor]  # fp32
    table_key: Callable[[int, int, int], tuple]
    torch_kernel: str  # the table's name for the torch backend (what the torch column runs)
    # (M, N, K) -> True where the torch column runs the fp32 reference, not a fast kernel.
    torch_is_reference: Callable[[int, int, int], bool] = lambda m, n, k: False
    # Bytes per element of w, and of x, where they differ from ``in_bytes`` (MXFP4: 4 bits and
    # a scale byte per 32)
    w_bytes: float | None = None
    x_bytes: float | None = None
    comparisons: tuple[Comparison, ...] = ()  # timed beside torch and the tuned op
    # The dtype the tuned kernels' tensor cores multiply in, where the torch column's own GEMM
    # is not the peak (MXFP4: a dequantise in torch, then bf16): the peak probe is F.linear in it
    math_dtype: torch.dtype | None = None
    # Other table names of what the torch column runs (the torch backend of another weight
    # layout: the same computation after an unpacking)
    torch_aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """One op family. Only ``name`` and ``schema`` are required: a family whose op has not
    landed yet still has a table that ``gemmtune tables`` and ``lookup`` show."""

    name: str  # bf16, a8w8_blockscale; the CLI also takes it with dashes (a8w8-blockscale)
    schema: Schema
    dispatcher: Dispatcher | None = None
    # The tuner: a TuneFamily class, or "module:Class" imported when asked for (the tuner
    # imports the tuning engine, which the run-time path of an op must not).
    tuner: type | str | None = None
    # dtype (short name: bf16, fp16, fp8, ...) -> how the bench runs the op in it.
    bench: Callable[[str], BenchOp] | None = None
    bench_dtypes: tuple[str, ...] = ()  # the first is the default
    # (M, N, K, dtype short name, bias=False) -> the key of that GEMM: bench, tune-triton and
    # model shapes (a key without a bias column ignores it).
    gemm_key: Callable[..., tuple] | None = None
    # (N, K, dtype short name) -> why the family has no GEMM of that weight shape, or None
    # (a pre-shuffled weight must tile): model shapes leave such rows out
    why_not_gemm: Callable[[int, int, str], str | None] | None = None
    # key -> the keys of the same GEMM with the weight in the family's other layouts (a16w4's
    # packed MXFP4), which model shapes list after it: tables choose a layout per weight
    other_layouts: Callable[[tuple], tuple[tuple, ...]] | None = None
    # input dtype -> TAG of its Triton JSON config files ({arch}-GEMM-{TAG}-N=..-K=...json)
    triton_json_tags: Mapping[torch.dtype, str] = field(default_factory=dict)
    # tune-triton tunes this family's tags only where --family names it: another family owns
    # the same dtypes without it (a8w8-blockscale beside a8w8 for fp8)
    triton_json_by_name_only: bool = False
    # key -> the dtype short name its bench runs in (``--run_config`` of a table)
    dtype_of_key: Callable[[tuple], str] | None = None
    # A bench that is not one of GEMMs (fmoe): "module:function" taking ``gemmtune bench``'s
    # arguments and returning its exit code, imported when asked for (it measures: the run-time
    # path must not import it).
    bench_runner: str | None = None

    def __post_init__(self):
        if self.schema.family != self.name:
            raise ValueError(f"family {self.name!r} has the schema of {self.schema.family!r}")
        if self.bench is not None and not self.bench_dtypes:
            raise ValueError(f"family {self.name!r}: a bench needs bench_dtypes")

    def refuses_gemm(self, n: int, k: int, dtype: str) -> str | None:
        """Why the family has no GEMM of an (N, K) weight in ``dtype`` (``why_not_gemm``), or
        None: model shapes and the bench leave such weights out."""
        return None if self.why_not_gemm is None else self.why_not_gemm(n, k, dtype)

    @property
    def cli_name(self) -> str:
        return self.name.replace("_", "-")

    def tuner_class(self) -> type:
        """The TuneFamily class the tuner's workers build (a top-level class: picklable)."""
        if self.tuner is None:
            raise ValueError(f"{self.cli_name} has no tuner")
        if not isinstance(self.tuner, str):
            return self.tuner
        module, _, attr = self.tuner.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def benchable(self) -> bool | None:
        """True if ``gemmtune bench`` runs this family (None if not: the CLI's filter)."""
        return True if self.bench is not None or self.bench_runner is not None else None

    def run_bench_runner(self, args) -> int:
        module, _, attr = self.bench_runner.partition(":")
        return getattr(importlib.import_module(module), attr)(args)

    def bench_op(self, dtype: str | None = None) -> BenchOp:
        """How the bench runs this family in ``dtype`` (default: its first bench dtype)."""
        if self.bench is None:
            raise ValueError(f"{self.cli_name} has no bench")
        dtype = dtype or self.bench_dtypes[0]
        if dtype not in self.bench_dtypes:
            *rest, last = self.bench_dtypes
            accepted = f"{', '.join(rest)} or {last}" if rest else f"{last} only"
            raise ValueError(f"{self.cli_name} benches --dtype {accepted}, not {dtype}")
        return self.bench(dtype)
