"""What the MXFP4-weight kernel modules (``gemm_w4``, ``gemm_w4frag``, ``gemm_w4deq``) share:
the operands' checks (also ``gemm_a16w4``'s) and their validating launchers' common path."""

from __future__ import annotations

from typing import Callable

import torch

from gemmtune.kernels import mxfp4

_X_DTYPES = (torch.bfloat16, torch.float16)


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
