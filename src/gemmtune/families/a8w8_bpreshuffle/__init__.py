"""The pre-shuffled FP8/INT8 GEMM family: ``gemm_a8w8_bpreshuffle`` (``op``) on weights packed
once by ``gemmtune.quant.shuffle_weight``, its tuner (``tuner``), and how the bench runs it
(the torch column puts the weight back in rows first: it is the reference, not a fast path;
``benchmarks/bpreshuffle_vs_a8w8.py`` compares the op with ``gemm_a8w8`` on the same weight)."""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._family import BenchOp, Family
from gemmtune.families._gemm import SHORT_DTYPES, short_dtype
from gemmtune.families.a8w8_bpreshuffle.op import (DISPATCH, SCHEMA, TUNED_OUT_DTYPE,
                                                   BpreshuffleKey, gemm_a8w8_bpreshuffle)
from gemmtune.kernels.preshuffle import why_not_shufflable
from gemmtune.kernels.torch_ref import (TORCH_UNSHUFFLED, gemm_a8w8_ref,
                                        unshuffled_scaled_mm_torch)
from gemmtune.tables.values import DTYPE_NAMES

BENCH_DTYPES = ("fp8", "int8")


def gemm_key(m: int, n: int, k: int, dtype: str = "fp8", bias: bool = False) -> BpreshuffleKey:
    """The key has no bias column: the op takes none."""
    return BpreshuffleKey(m, n, k, DTYPE_NAMES[SHORT_DTYPES[dtype]])


def bench_op(dtype: str) -> BenchOp:
    """Per-token activations x per-channel weights, bf16 output, the weight pre-shuffled."""
    per_token, per_channel = quant.token_channel_quantisers(SHORT_DTYPES[dtype])

    def inputs(m, n, k, gen):
        device = gen.device
        xq, xs = per_token(torch.randn(m, k, generator=gen, device=device))
        wq, ws = per_channel(torch.randn(n, k, generator=gen, device=device) / k ** 0.5)
        return xq, quant.shuffle_weight(wq), xs.reshape(-1), ws.reshape(-1)

    return BenchOp(
        "a8w8_bpreshuffle" if dtype == "fp8" else "a8w8_bpreshuffle_int8", 1, TUNED_OUT_DTYPE, 1,
        inputs,
        torch=lambda a: unshuffled_scaled_mm_torch(a[0], a[1], None, TUNED_OUT_DTYPE, a[2], a[3]),
        tuned=lambda a: gemm_a8w8_bpreshuffle(*a),
        reference=lambda a: gemm_a8w8_ref(a[0], quant.unshuffle_weight(a[1]), a[2], a[3],
                                          out_dtype=torch.float32),
        table_key=lambda m, n, k: gemm_key(m, n, k, dtype),
        torch_kernel=TORCH_UNSHUFFLED)


FAMILY = Family(
    "a8w8_bpreshuffle", SCHEMA, DISPATCH,
    tuner="gemmtune.families.a8w8_bpreshuffle.tuner:A8w8BpreshuffleTuner", bench=bench_op,
    bench_dtypes=BENCH_DTYPES, gemm_key=gemm_key,
    why_not_gemm=lambda n, k, dtype: why_not_shufflable(n, k, SHORT_DTYPES[dtype]),
    dtype_of_key=lambda key: short_dtype(key.q_dtype_w))
