"""What the MXFP4-weight kernel modules (``gemm_w4``, ``gemm_w4frag``, ``gemm_w4xa``,
``gemm_w4deq``) share: the operands' checks (also ``gemm_a16w4``'s), their validating launchers'
common path, and the word-aligned operands of the Gluon kernels that read 32-bit words."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from gemmtune.kernels import mxfp4

_X_DTYPES = (torch.bfloat16, torch.float16)
# What the Gluon kernels write with MXFP4 x (gemm_a4w4_blockscale's outputs)
_OUT_DTYPES_OF_MXFP4_X = (torch.bfloat16, torch.float16, torch.float32)


def check_operands(op: str, x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
    """x (..., K) bf16 or fp16; wq (N, K // 2) and w_scale (N, K // 32) uint8 on x's device;
    bias (N,) on it: ValueError or TypeError saying what is wrong otherwise."""
    if x.dim() < 1 or wq.dim() != 2 or w_scale.dim() != 2:
        raise ValueError(f"{op}: expected x (..., K), wq (N, K // 2) and w_scale (N, K // 32); "
                         f"got {tuple(x.shape)}, {tuple(wq.shape)}, {tuple(w_scale.shape)}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{op}: bias must be a tensor (N,) or None, got {type(bias).__name__}")
    K = x.shape[-1]
    if K % mxfp4.BLOCK:
        raise ValueError(f"{op}: K={K} is not a multiple of {mxfp4.BLOCK}, the MXFP4 block; pad "
                         f"x and the weight with zeros along K before quantising")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{op}: x is {x.dtype}; MXFP4-weight GEMMs take bf16 or fp16 "
                        f"activations (the output is in x's dtype)")
    if wq.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise TypeError(f"{op}: wq and w_scale must be uint8 (as gemmtune.quant.mxfp4 makes "
                        f"them), got {wq.dtype} and {w_scale.dtype}")
    N = wq.shape[0]
    if wq.shape[1] * 2 != K or tuple(w_scale.shape) != (N, K // mxfp4.BLOCK):
        raise ValueError(f"{op}: x's K={K} needs wq (N, {K // 2}) and w_scale "
                         f"(N, {K // mxfp4.BLOCK}); got {tuple(wq.shape)} and "
                         f"{tuple(w_scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.device != x.device):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)} on {bias.device}; "
                         f"expected ({N},) on {x.device}")
    if wq.device != x.device or w_scale.device != x.device:
        raise ValueError(f"{op}: x is on {x.device}, wq on {wq.device}, w_scale on "
                         f"{w_scale.device}: put them on one device")


def validated_launch(op: str, launch: Callable, default_config: Callable, why_not: Callable,
                     x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, config, out: torch.Tensor | None) -> torch.Tensor:
    """``op``'s validating launcher: x (M, K) and the operands checked (``check_operands``),
    ``out`` (M, N) in x's dtype with unit column stride or None (made here), ``config`` (or
    ``default_config(M, N, K, dtype)``) checked by the module's ``why_not_supported``
    (``why_not(config, M, N, K, dtype, out_dtype)``: whether it fits and can run here); then
    ``launch(x, wq, bias, out, None, w_scale, config)`` unless the output is empty."""
    if x.dim() != 2:
        raise ValueError(f"{op}: expected x (M, K), got {tuple(x.shape)}")
    check_operands(op, x, wq, w_scale, bias)
    M, K = x.shape
    N = wq.shape[0]
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"{op}: out must be ({M}, {N}) {x.dtype} with unit column stride; got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    config = config or default_config(M, N, K, x.dtype)
    why = why_not(config, M, N, K, x.dtype, x.dtype)
    if why is not None:
        raise ValueError(f"{op}: {config.name} cannot run (M={M}, N={N}, K={K}): {why}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not M or not N:
        return out
    return launch(x, wq, bias, out, None, w_scale, config)


def check_scaled_call(op: str, x: torch.Tensor, out_dtype, scale_a, scale_b) -> None:
    """A kernel module's validating launcher called as every one is (``scale_b`` w's scales,
    ``scale_a`` None for bf16/fp16 x, the output in x's dtype): ValueError or TypeError
    otherwise."""
    if scale_b is None or scale_a is not None:
        raise ValueError(f"{op}: an MXFP4 weight brings its own scales (scale_b: w_scale) and "
                         f"bf16/fp16 x none (scale_a None); MXFP4 x is gemm_a4w4_blockscale's")
    if out_dtype not in (None, x.dtype):
        raise TypeError(f"{op}: the output is in x's dtype ({x.dtype}), not {out_dtype}")


def scaled_launcher(op: str, gemm: Callable) -> Callable:
    """``gemm`` (a module's validating launcher, ``gemm(x, wq, w_scale, bias, config, out)``)
    called as every kernel module's validating launcher is: ``(x, w, bias, out_dtype, scale_a,
    scale_b, config=None, out=None)``, w the codes, scale_b their scales, scale_a None, the
    output in x's dtype."""
    def launch_scaled(x, w, bias, out_dtype, scale_a, scale_b, config=None, out=None):
        check_scaled_call(op, x, out_dtype, scale_a, scale_b)
        return gemm(x, w, scale_b, bias, config, out)

    launch_scaled.__name__ = launch_scaled.__qualname__ = f"{op}_scaled"
    return launch_scaled


class WordOperands(NamedTuple):
    """A launch's operands as the word-reading Gluon kernels (``gemm_w4frag``, ``gemm_w4xa``)
    take them (``word_operands``)."""

    x: torch.Tensor
    w: torch.Tensor
    w_scales: torch.Tensor
    x_scales: torch.Tensor  # MXFP4 x's, or w_scales (unused) for bf16 x
    bias: torch.Tensor | None
    M: int
    N: int
    K: int
    copied_w: bool  # w or its scales copied here: a kernel that reads w before its PDL wait
    # must then launch without PDL (``_splits.launch_mode``)

    def args(self, out: torch.Tensor, parts: torch.Tensor, counters: torch.Tensor) -> tuple:
        """The kernels' arguments up to the strides: x, w, w's and x's scales, out, bias (or
        out), the split partials and counters, M, N, K and the row strides."""
        bias = self.bias
        return (self.x, self.w, self.w_scales, self.x_scales, out,
                bias if bias is not None else out, parts, counters, self.M, self.N, self.K,
                self.x.stride(0), self.w.stride(0), self.w_scales.stride(0),
                self.x_scales.stride(0), out.stride(0), bias.stride(0) if bias is not None else 0)


def _aligned_scales(scales: torch.Tensor) -> torch.Tensor:
    scales = scales.contiguous()
    return scales.clone() if scales.data_ptr() % 16 else scales


def word_operands(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  scale_a: torch.Tensor | None, scale_b: torch.Tensor) -> WordOperands:
    """x (M, K) bf16, or with ``scale_a`` (x's scales) MXFP4 codes (M, K // 2); w the codes
    (N, K // 2), scale_b their scales: x and w are read as 32-bit words, and a row's scale
    bytes of a group as one word, so rows a whole number of words apart and 16-byte aligned
    (a copy otherwise), which a recording's 16-byte alignment check (_replay) then covers."""
    x_mxfp4 = scale_a is not None
    per_word = 4 if x_mxfp4 else 2  # x's elements (code bytes or bf16) a word
    x = x if x.stride(1) == 1 and x.stride(0) % per_word == 0 else x.contiguous()
    aligned_w = w if w.stride(1) == 1 and w.stride(0) % 4 == 0 else w.contiguous()
    x = x.clone() if x.data_ptr() % 16 else x
    aligned_w = aligned_w.clone() if aligned_w.data_ptr() % 16 else aligned_w
    w_scales = _aligned_scales(scale_b)
    x_scales = _aligned_scales(scale_a) if x_mxfp4 else w_scales
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    K = x.shape[1] * 2 if x_mxfp4 else x.shape[1]
    return WordOperands(x, aligned_w, w_scales, x_scales, bias, x.shape[0], w.shape[0], K,
                        aligned_w is not w or w_scales is not scale_b)


def why_not_gluon_x(kernel: str, dtype: torch.dtype) -> str | None:
    """Why a Gluon MXFP4 kernel (``kernel``, its words: its MMA is bf16) cannot take x of
    ``dtype`` (bf16, or MXFP4 codes as uint8), or None."""
    if dtype not in (torch.bfloat16, torch.uint8):
        return (f"x of {dtype}: the {kernel} takes bf16 x or MXFP4 x (uint8 codes; its MMA is "
                f"bf16); use a triton.w4 config")
    return None


def why_not_gluon_call(kernel: str, dtype: torch.dtype, out_dtype: torch.dtype,
                       packed_only: bool = False) -> str | None:
    """Why a Gluon MXFP4 kernel (``kernel``, its words) cannot write ``out_dtype`` for x of
    ``dtype`` (bf16 x: x's dtype; MXFP4 x, uint8: bf16, fp16 or fp32) or cannot run in this
    process, or None; the backends it names instead are for its weight layouts
    (``packed_only``: packed weights alone)."""
    # Here, not at the top: _swapped holds Gluon pieces, which the Triton MXFP4 modules that
    # import this one (gemm_w4, gemm_w4deq: they run in the interpreter on the CPU) never need.
    from gemmtune.kernels.triton._swapped import why_not_here

    if dtype == torch.uint8:
        if out_dtype not in _OUT_DTYPES_OF_MXFP4_X:
            return f"with MXFP4 x the kernel writes bf16, fp16 or fp32, not {out_dtype}"
    elif out_dtype != dtype:
        return f"the {kernel} writes x's dtype ({dtype}), not {out_dtype}"
    backend = "dequant_mm" if dtype == torch.uint8 else "dequant_linear"
    # triton.w4 reads weights as quantised only, triton.w4deq either layout
    instead = (f"a triton.w4deq config or torch.unpack_{backend}" if packed_only else
               f"a triton.w4 config or torch.{backend} (packed weights: a triton.w4deq config "
               f"or torch.unpack_{backend})")
    return why_not_here(kernel, instead)
