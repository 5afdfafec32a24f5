"""Argument checks that the quantised GEMM ops share: xq (..., K) against wq (N, K), the output
dtype, one device. Each error names the op and what it expected."""

from __future__ import annotations

import torch


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
