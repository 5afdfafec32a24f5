"""``gemmtune tune a8w8``: candidates, inputs and timing for gemm_a8w8's table.

Key: (M, N, K, q_dtype_w). Candidates run with per-token activation and per-channel weight
scales (the layout of FP8/INT8 serving); the kernels take per-tensor scales through the same
path. Each candidate is checked against the dequantised product in fp32.
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.ops.gemm_a8w8 import REGISTRY, TORCH_SCALED_MM, gemm_a8w8_ref
from gemmtune.tables.schema import Family
from gemmtune.tables.values import to_torch_dtype
from gemmtune.tune.families._gemm import (TOLERANCES, GemmFamily, GemmShape,
                                          cublaslt_candidates, number_candidates,
                                          triton_candidates)
from gemmtune.tune.family import Candidate, Prepared

# The output the tuner times: bf16, what FP8/INT8 serving writes.
OUT_DTYPE = torch.bfloat16
_Q_DTYPES = (torch.float8_e4m3fn, torch.int8)


class A8w8Family(GemmFamily):
    family = Family.a8w8
    registry = REGISTRY

    @staticmethod
    def _unpack(key: tuple) -> tuple[int, int, int, torch.dtype]:
        m, n, k, q_dtype = key
        dtype = to_torch_dtype(q_dtype)
        if dtype not in _Q_DTYPES:
            raise ValueError(f"q_dtype_w={q_dtype}: a8w8 tunes "
                             f"{' and '.join(str(d) for d in _Q_DTYPES)} weights")
        return m, n, k, dtype

    def shape(self, key: tuple) -> GemmShape:
        m, n, k, dtype = self._unpack(key)
        return GemmShape(m, n, k, dtype, OUT_DTYPE, has_bias=False)

    def candidates(self, key: tuple, libtypes: frozenset[str]) -> list[Candidate]:
        m, n, k, dtype = self._unpack(key)
        wanted = libtypes or frozenset({"torch", "triton", "cublaslt"})
        found = []
        if "torch" in wanted:
            found.append(Candidate(TORCH_SCALED_MM, "torch", simplicity=0))
        if "cublaslt" in wanted and torch.cuda.is_available():
            # Timed with per-row scales; a row's check also plans per-tensor ones.
            found += cublaslt_candidates(m, n, k, dtype, OUT_DTYPE, False, scaling="outer")
        if "triton" in wanted:
            found += triton_candidates(m, n, k, dtype, OUT_DTYPE)
        return number_candidates(found)

    def prepare(self, key: tuple, seed: int) -> Prepared:
        m, n, k, dtype = self._unpack(key)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        per_token, per_channel = quant.token_channel_quantisers(dtype)
        # Activations with a few outlier tokens (as in LLMs): per-token scales then differ.
        x = torch.randn(m, k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(m, 1, generator=gen, device=device))
        w = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
        xq, x_scale = per_token(x)
        wq, w_scale = per_channel(w)
        x_scale, w_scale = x_scale.reshape(-1), w_scale.reshape(-1)
        ref = gemm_a8w8_ref(xq, wq, x_scale, w_scale, None, torch.float32)
        return Prepared(key, seed, (xq, wq, None, OUT_DTYPE, x_scale, w_scale), ref)

    def tolerance(self, key: tuple) -> tuple[float, float, float]:
        return TOLERANCES[OUT_DTYPE]
