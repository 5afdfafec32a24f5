"""What the GEMM families' ops share at run time: operand checks, the short dtype names of the
CLI, and the Triton JSON fallback of a shape without a table row."""

from __future__ import annotations

import functools
import warnings

import torch

from gemmtune import _env
from gemmtune.dispatch import KernelNameError, KernelRegistry
from gemmtune.kernels.triton.dispatchable import TritonKernel
from gemmtune.tables import triton_json
from gemmtune.tables.schema import GEMM_RESULT_COLUMNS, Column, Schema, int_columns
from gemmtune.tables.values import to_torch_dtype

# The dtypes --dtype names (bench, tune-triton): x's and w's dtype of a GEMM.
SHORT_DTYPES = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn, "int8": torch.int8,
}


# The outputs the scaled (FP8/INT8) GEMMs write, and the one their rows are tuned for: bf16, what
# quantised serving writes.
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TUNED_OUT_DTYPE = torch.bfloat16


def short_dtype(dtype_name: str) -> str:
    """The --dtype name (bf16, fp8, ...) of a canonical dtype name (torch.bfloat16, ...)."""
    dtype = to_torch_dtype(dtype_name)
    return next(short for short, d in SHORT_DTYPES.items() if d == dtype)


def model_config_glob(tuned_file: str) -> str:
    """Which files of ``configs/model_configs/`` hold a family's rows: any CSV whose name holds
    the shipped table's stem, as AITER names them (``dsv3_bf16_tuned_gemm.csv``,
    ``xx_a4w4_blockscale_tuned_gemm_xx.csv``)."""
    return f"*{tuned_file.removesuffix('.csv')}*.csv"


def gemm_schema(family: str, tuned_file: str, untuned_file: str, key_type: type,
                extra_key: tuple[Column, ...], env_names: tuple[str, ...]) -> Schema:
    """The table of a GEMM family: key ``M, N, K`` and ``extra_key``, the GEMM result columns."""
    return Schema(family, tuned_file, untuned_file, int_columns("M", "N", "K") + extra_key,
                  key_type, GEMM_RESULT_COLUMNS, "M", ("kernelName",), env_names,
                  model_config_glob(tuned_file))


def gemm_registry(family: str, torch_name: str, torch_backend, triton_prefixes: tuple[str, ...],
                  *, block_scales: bool = False, w_tiled: bool = False, cublaslt: str = "",
                  torch_bind=None) -> KernelRegistry:
    """The backends of a GEMM family: its torch backend by name (``torch_bind`` its ``bind``),
    Triton kernels of the given prefixes (built for block scales or not, for pre-shuffled
    weights or not), and with ``cublaslt`` ("unscaled" or "scaled") the cuBLASLt kernel of that
    kind, nvmath being loaded when a row first names one."""
    registry = KernelRegistry(family)
    registry.register_exact(torch_name, torch_backend, torch_bind)
    for prefix in triton_prefixes:
        registry.register(prefix, functools.partial(TritonKernel, block_scales=block_scales,
                                                    w_tiled=w_tiled))
    if cublaslt:
        registry.register("cublaslt", functools.partial(_cublaslt_kernel, cublaslt == "scaled"))
    return registry


def _cublaslt_kernel(scaled: bool, name: str):
    from gemmtune.kernels.cublaslt import CublasLtKernel, CublasLtScaledKernel

    return (CublasLtScaledKernel if scaled else CublasLtKernel)(name)


def check_multiply(op: str, xq: torch.Tensor, wq: torch.Tensor) -> None:
    if wq.dim() != 2 or xq.dim() < 1 or xq.shape[-1] != wq.shape[1]:
        raise ValueError(f"{op}: xq {tuple(xq.shape)} and wq {tuple(wq.shape)} do not multiply; "
                         f"expected xq (..., K) and wq (N, K)")


def check_out_dtype_and_device(op: str, xq: torch.Tensor, wq: torch.Tensor, dtype: torch.dtype,
                               out_dtypes: tuple) -> None:
    if dtype not in out_dtypes:
        raise TypeError(f"{op}: dtype {dtype} is not an output dtype; use one of "
                        f"{', '.join(str(d) for d in out_dtypes)}")
    if wq.device != xq.device:
        raise ValueError(f"{op}: xq is on {xq.device} but wq on {wq.device}")


def json_config_or(fallback: str, registry: KernelRegistry, problem, device,
                   tag: str) -> str:
    """The kernel a Triton JSON config file names for M's bucket, if there is one and it can run
    ``problem``; else ``fallback``. The per-(N, K) file decides where there is one (a bucket it
    leaves out keeps ``fallback``; a config of it that cannot run the shape warns); else the
    default file, whose configs were picked for other (N, K): one that cannot run this shape
    is passed over quietly. A broken file, or a kernel name no backend knows, warns once and is
    ignored."""
    if not _env.triton_json_enabled():
        return fallback
    m, n, k = problem.m, problem.n, problem.k
    try:
        name = triton_json.lookup(device.arch, tag, n, k, m, device.gpu)
        if name is triton_json.NO_FILE:
            return _default_config_or(fallback, registry, problem, device, tag)
        if name is None:
            return fallback
        registry.resolve_for(name, problem)
    except KernelNameError as e:
        warnings.warn(f"gemmtune: Triton JSON config for N={n} K={k} cannot run M={m}: {e}; "
                      f"using {fallback}", stacklevel=2)
        return fallback
    except (ValueError, OSError) as e:
        warnings.warn(f"gemmtune: Triton JSON config for N={n} K={k} ignored: {e}", stacklevel=2)
        return fallback
    return name


def _default_config_or(fallback: str, registry: KernelRegistry, problem, device,
                       tag: str) -> str:
    try:
        name = triton_json.lookup_default(device.arch, tag, problem.m, device.gpu)
        if name is None or name is triton_json.NO_FILE:
            return fallback
        registry.resolve(name)  # a name no backend knows: the file is wrong (warned below)
    except (KernelNameError, ValueError, OSError) as e:
        warnings.warn(f"gemmtune: default Triton JSON config of {tag} ignored: {e}", stacklevel=3)
        return fallback
    # Tuned for other (N, K): a config that cannot run this one is passed over.
    return name if registry.can_run(name, problem) else fallback
