"""What every Triton GEMM family checks the same way: the hardware limits a config must respect
(block sizes, warps, stages, registers, shared memory), the launchers' argument validation, and
the dot precision a launch asks for.

Each family's ``why_not_fits`` chains these with its own constraints; each validating launcher
(``gemm_tile``, ``gemm_splitk``) starts with ``validate_gemm_args``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch
import triton

# Hopper (sm_90) allows 227 KiB of shared memory per block; the largest of the GPUs we tune for.
SMEM_LIMIT_BYTES = 227 * 1024
# The fp32 accumulator lives in registers: BM*BN/(32*num_warps) of them per thread. A thread has at
# most 255, and the operand fragments and addresses need the rest; above 128 ptxas starts spilling.
MAX_ACC_REGS_PER_THREAD = 128
# Programs along grid axis 0, whose program id is an int32.
MAX_PROGRAMS = 2**31 - 1
# SMs to size grids for where there is no GPU to ask (the interpreter): H100 SXM's, the GPU the
# shipped tables were tuned on, so CPU tests see the choices made there.
REFERENCE_SMS = 132

VALID_WARPS = (1, 2, 4, 8)
MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16
MAX_BLOCK = 256
MAX_STAGES = 8

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Quantised inputs: they need scales, and their output defaults to bf16.
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)


# bytes: the row pitch and base address of a TMA-described tensor
TMA_ALIGN = 16


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether 2-D ``t`` is as TMA takes it: dense rows that do not overlap (an expanded,
    stride-0 operand does), 16-byte aligned pitch and base."""
    return (t.stride(-1) == 1 and t.stride(0) >= t.shape[1]
            and (t.stride(0) * t.element_size()) % TMA_ALIGN == 0
            and t.data_ptr() % TMA_ALIGN == 0)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """2-D ``t`` as TMA takes it (``tma_aligned``); a copy where it is not (a fresh copy is
    aligned where its row's bytes are a multiple of 16, which the kernels' ``why_not_fits`` ask
    of K)."""
    return t if tma_aligned(t) else t.clone(memory_format=torch.contiguous_format)


@functools.cache
def interpreted() -> bool:
    """Whether our kernels run in Triton's interpreter. Under TRITON_INTERPRET=1 triton.jit
    returns an InterpretedFunction, which runs on CPU tensors; the setting is read at
    decoration, so a probe decorated at the first question answers for the kernel modules,
    which are imported on first use. (Not at this module's import: a tuner worker imports it
    with the package, before it sets the variable.)"""
    def probe():
        pass
    return not isinstance(triton.jit(probe), triton.runtime.JITFunction)


@functools.lru_cache(maxsize=16)
def device_sms(index: int) -> int:
    """SMs of CUDA device ``index``, asked once: what a launch sizes its grid by."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | None = None) -> int:
    """SMs of ``device`` (default: the current CUDA device); REFERENCE_SMS without a GPU."""
    if device is not None and device.type != "cuda":
        return REFERENCE_SMS
    if not torch.cuda.is_available():
        return REFERENCE_SMS
    index = device.index if device is not None and device.index is not None \
        else torch.cuda.current_device()
    return device_sms(index)


# An SM's 32-bit registers (sm_90), handed to warps in steps of 8 a thread
REGISTERS_PER_SM = 65536


def registers_to_share(threads: int, programs: int) -> int:
    """Registers a thread may take so that ``programs`` programs of ``threads`` threads share an
    SM (``maxnreg``)."""
    return REGISTERS_PER_SM // (threads * programs) // 8 * 8


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def smem_bytes(config, dtype: torch.dtype) -> int:
    """Shared memory the software pipeline holds: ``num_stages`` copies of one x and one w tile."""
    return config.num_stages * (config.block_m * config.block_k
                                + config.block_k * config.block_n) * dtype.itemsize


def why_not_blocks(config) -> str | None:
    """The first of block_m, block_n, block_k that tl.dot cannot tile with, or None."""
    for field in ("block_m", "block_n", "block_k"):
        v = getattr(config, field)
        if not is_pow2(v) or not MIN_BLOCK <= v <= MAX_BLOCK:
            return f"{field}={v} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    return None


def why_not_warps_stages(config) -> str | None:
    if config.num_warps not in VALID_WARPS:
        return f"num_warps={config.num_warps} must be one of {VALID_WARPS}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} must be in [1, {MAX_STAGES}]"
    return None


def why_not_dot_k(config, dtype: torch.dtype) -> str | None:
    """Hopper's 8-bit dot takes K tiles of 32 or more (triton's ``min_dot_size``; the
    interpreter does not check it, the GPU compile fails)."""
    if dtype.itemsize == 1 and config.block_k < 32:
        return f"block_k={config.block_k}: {dtype} dots need block_k >= 32"
    return None


def why_not_promote(config, dtype: torch.dtype) -> str | None:
    """``promote_k`` (configs that have it): 0, or for FP8 inputs on a wgmma dot a multiple of 32
    (one wgmma's K) that divides block_k. Hopper's FP8 wgmma accumulates with reduced precision
    (about 14 mantissa bits, DeepSeek-V3 report), and Triton lets it run over the whole K by
    default (``max_num_imprecise_acc`` 2^30 on sm_90): every ``promote_k`` elements of K the
    kernel adds its partial sum into a true fp32 accumulator instead, as cuBLAS without fast
    accumulation and DeepGEMM (every 128) do. Triton takes wgmma only for block_m a multiple of
    64 and num_warps a multiple of 4; smaller dots run mma.sync, which converts FP8 to fp16 and
    accumulates in fp32 (exact products, no promotion needed, and the setting is ignored). In a
    swapped dot (y.T = w @ x.T) w's rows, block_n, are the MMA's M."""
    promote_k = getattr(config, "promote_k", 0)
    if promote_k == 0:
        return None
    if dtype != torch.float8_e4m3fn:
        return f"promote_k={promote_k} applies to float8_e4m3fn inputs only, not {dtype}; use 0"
    if promote_k < 0 or promote_k % 32 or config.block_k % promote_k:
        return (f"promote_k={promote_k} must be a multiple of 32 that divides "
                f"block_k={config.block_k}")
    # A swapped dot (split-K's swap_ab) computes y.T: w's block_n rows are the MMA's M.
    mma_m, field = ((config.block_n, "block_n") if getattr(config, "swap_ab", 0)
                    else (config.block_m, "block_m"))
    if mma_m % 64 or config.num_warps % 4:
        return (f"promote_k={promote_k} applies to wgmma dots only ({field} a multiple of 64, "
                f"num_warps of 4); {field}={mma_m} with num_warps={config.num_warps} "
                f"runs mma.sync, which accumulates FP8 products in fp32 already: use 0")
    return None


def accumulator_registers(config) -> int:
    """fp32 registers per thread that the accumulator takes; a promoted FP8 dot keeps a second
    one of the same size for the tensor cores' partial sums."""
    per_copy = config.block_m * config.block_n // (32 * config.num_warps)
    return per_copy * (2 if getattr(config, "promote_k", 0) else 1)


def why_not_resources(config, dtype: torch.dtype) -> str | None:
    """Registers of the accumulator, then shared memory of the pipeline; None when both fit."""
    acc_regs = accumulator_registers(config)
    if acc_regs > MAX_ACC_REGS_PER_THREAD:
        return (f"accumulator needs {acc_regs} registers per thread (> {MAX_ACC_REGS_PER_THREAD}); "
                f"use smaller blocks or more warps")
    smem = smem_bytes(config, dtype)
    if smem > SMEM_LIMIT_BYTES:
        return (f"shared memory {smem} B > {SMEM_LIMIT_BYTES} B; "
                f"reduce block sizes or num_stages")
    return None


def why_not_dtypes(dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """The input or output dtype a Triton GEMM kernel does not take, or None."""
    if dtype not in INPUT_DTYPES:
        return f"input dtype {dtype} is not one of {[str(d) for d in INPUT_DTYPES]}"
    if out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype} is not one of {[str(d) for d in OUT_DTYPES]}"
    return None


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's ``input_precision`` for ``dtype`` operands, read at each launch (the setting can
    change between calls): fp32 operands use tf32 only where torch itself would, so results match
    torch.mm. 16-bit and fp8 operands ignore it; "tf32" is Triton's default for them."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _check_scale(name: str, s: torch.Tensor, device: torch.device, length: int,
                 per: str) -> None:
    """A scale is one fp32 value (per tensor) or ``length`` contiguous ones (one per ``per``)."""
    if s.numel() not in (1, length) or s.dtype != torch.float32 or s.device != device or \
            (s.numel() > 1 and not s.is_contiguous()):
        raise ValueError(f"{name}: expected one float32 value (per tensor) or {length} "
                         f"contiguous ones (one per {per}) on {device}, got shape "
                         f"{tuple(s.shape)} {s.dtype} on {s.device}; pass e.g. "
                         f"torch.tensor([s], dtype=torch.float32, device={str(device)!r})")


def validate_gemm_args(
    kernel_name: str,
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None,  # (N,)
    out_dtype: torch.dtype | None,
    scale_a: torch.Tensor | None,  # (1,) fp32
    scale_b: torch.Tensor | None,  # (1,) fp32
    out: torch.Tensor | None,  # (M, N)
    block_scales: bool = False,
) -> tuple[int, int, int, torch.dtype, torch.Tensor]:
    """Check the operands of ``y = (x @ w.T) * scale_a * scale_b + bias`` for a Triton kernel;
    return ``(M, N, K, out_dtype, out)`` with ``out_dtype`` defaulted (``x.dtype``, bf16 for fp8
    inputs) and ``out`` allocated when not given. Errors start with ``kernel_name``."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{kernel_name}: expected x (M, K) and w (N, K), got x {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}; reshape batched inputs to 2-D first")
    M, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"{kernel_name}: x is (M={M}, K={K}) but w is (N={N}, K={Kw}); "
                         f"w must be (N, K) (pass w, not w.T)")
    if x.dtype != w.dtype or x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{kernel_name}: x {x.dtype} and w {w.dtype} must share one dtype of "
                        f"{[str(d) for d in INPUT_DTYPES]}")
    if w.device != x.device:
        raise ValueError(f"{kernel_name}: x is on {x.device} but w is on {w.device}; "
                         f"move both to one device")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"{kernel_name}: tensors on {x.device} need TRITON_INTERPRET=1, set "
                         f"before gemmtune's triton kernels are imported; or move them to a "
                         f"CUDA device")
    if (scale_a is None) != (scale_b is None):
        raise ValueError(f"{kernel_name}: pass both scale_a and scale_b or neither")
    if block_scales:
        validate_block_scales(kernel_name, x, w, scale_a, scale_b)
    elif scale_a is not None:
        _check_scale("scale_a", scale_a, x.device, M, "row of x")
        _check_scale("scale_b", scale_b, x.device, N, "row of w")
    elif x.dtype in QUANT_DTYPES:
        raise ValueError(f"{kernel_name}: {x.dtype} inputs need scale_a and scale_b; "
                         f"pass torch.ones(1, device=...) for unscaled values")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if x.dtype in QUANT_DTYPES else x.dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{kernel_name}: out_dtype {out_dtype} not supported; "
                        f"use one of {[str(d) for d in OUT_DTYPES]}")
    if bias is not None:
        if bias.shape != (N,) or not bias.is_floating_point() or bias.device != x.device:
            raise ValueError(f"{kernel_name}: bias must be a float (N={N},) tensor on "
                             f"{x.device}, got shape {tuple(bias.shape)} {bias.dtype} on "
                             f"{bias.device}")
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or out.device != x.device:
        raise ValueError(f"{kernel_name}: out must be ({M}, {N}) {out_dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return M, N, K, out_dtype, out


def why_not_block_scaled(config, dtype: torch.dtype) -> str | None:
    """What keeps ``config`` from an FP8 block-scaled GEMM (scales per 128 of K), or None."""
    if dtype != torch.float8_e4m3fn:
        return f"block scales need float8_e4m3fn inputs, not {dtype}"
    if 128 % config.block_k:
        return (f"block_k={config.block_k} must divide 128, the K extent of one block scale "
                f"(one K step must lie in one block)")
    if getattr(config, "promote_k", 0):
        return ("promote_k must be 0 with block scales: each K step's dot already starts from "
                "zero and is added into the fp32 accumulator once scaled")
    return None


def validate_block_scales(kernel_name: str, x: torch.Tensor, w: torch.Tensor,
                          x_scale: torch.Tensor, w_scale: torch.Tensor) -> None:
    """x (M, K) and w (N, K) float8_e4m3fn; x_scale (M, ceil(K/128)) and w_scale
    (ceil(N/128), ceil(K/128)), contiguous fp32 on x's device (``gemmtune.quant.per_block_fp8``
    with ACT_BLOCK and WEIGHT_BLOCK makes them)."""
    if x.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{kernel_name}: block scales need float8_e4m3fn x and w, got {x.dtype} "
                        f"and {w.dtype}; quantise with gemmtune.quant.per_block_fp8")
    m, k = x.shape[-2] if x.dim() >= 2 else 1, x.shape[-1]
    n = w.shape[0]
    kb = -(-k // 128)
    for name, s, want in (("x_scale", x_scale, (m, kb)), ("w_scale", w_scale, (-(-n // 128), kb))):
        if (not isinstance(s, torch.Tensor) or tuple(s.shape) != want
                or s.dtype != torch.float32 or s.device != x.device or not s.is_contiguous()):
            got = (f"{tuple(s.shape)} {s.dtype} on {s.device}" if isinstance(s, torch.Tensor)
                   else type(s).__name__)
            raise ValueError(f"{kernel_name}: {name} must be a contiguous float32 {want} on "
                             f"{x.device} (one scale per 1x128 of x / 128x128 of w), got {got}")


def fitting_config(kernel_name: str, config, default_config, why_not_fits,
                   M: int, N: int, K: int, dtype: torch.dtype, block_scales: bool = False,
                   why_not_block_scaled=why_not_block_scaled):
    """``config``, or the family's ``default_config`` when None (with block_k 128 for block
    scales where its own does not suit them); ValueError if ``config`` breaks one of the
    family's ``why_not_fits`` constraints or, with ``block_scales``, its
    ``why_not_block_scaled``. A default fits every shape its family takes (tests check it): where
    it does not, the family does not take the shape, which the error says."""
    if config is None:
        config = default_config(M, N, K, dtype)
        if block_scales and why_not_block_scaled(config, dtype):
            config = dataclasses.replace(config, block_k=128)
        problem = why_not_fits(config, M, N, K, dtype)
        if problem is not None:
            raise ValueError(f"{kernel_name}: {problem}")
        return config
    problem = why_not_fits(config, M, N, K, dtype)
    if problem is not None:
        raise ValueError(f"{kernel_name}: {config.name} does not fit (M={M}, N={N}, K={K}, "
                         f"{dtype}): {problem}")
    if block_scales and (problem := why_not_block_scaled(config, dtype)):
        raise ValueError(f"{kernel_name}: {config.name}: {problem}")
    return config


def validated_launch(kernel_name: str, launch, default_config, why_not_fits,
                     x, w, bias, out_dtype, scale_a, scale_b, config, out, block_scales,
                     why_not_block_scaled=why_not_block_scaled):
    """What each family's validating launcher (``gemm_tile``, ``gemm_splitk``, ``gemm_gemv``)
    does: check the arguments, settle the config, then ``launch`` (the family's launch-only
    function). ``why_not_block_scaled``: the family's own, where its steps differ."""
    M, N, K, out_dtype, out = validate_gemm_args(kernel_name, x, w, bias, out_dtype, scale_a,
                                                 scale_b, out, block_scales)
    config = fitting_config(kernel_name, config, default_config, why_not_fits, M, N, K, x.dtype,
                            block_scales, why_not_block_scaled)
    if M == 0 or N == 0:
        return out
    return launch(x, w, bias, out, scale_a, scale_b, config, block_scales=block_scales)


class _LaunchObserver(threading.local):
    """Per thread, what sees each launch ``start`` makes: set by ``_chain`` while it records a
    call's chain of launches, as ``record(kernel, grid, launch, *args, **kwargs)``."""

    record = None


LAUNCHES = _LaunchObserver()


def start(kernel, grid: tuple, warmup: bool, launch_pdl: bool = False):
    """``kernel[grid]``, or with ``warmup`` Triton's compile-without-launch for the same
    arguments: the tuner compiles candidates in several processes at once, outside the lock that
    keeps their GPU timings apart, so compiles stop being the serial cost of tuning.
    ``launch_pdl`` launches with programmatic dependent launch (only asked for where supported:
    the interpreter takes no such option). While a chain is recorded (``LAUNCHES.record``) the
    launch is handed to it as well."""
    launch = functools.partial(kernel.warmup, grid=grid) if warmup else kernel[grid]
    if launch_pdl:
        launch = functools.partial(launch, launch_pdl=True)
    record = LAUNCHES.record
    if record is None or warmup:
        return launch
    return functools.partial(record, kernel, grid, launch)
