"""``gemmtune tune bf16``: candidates, inputs and timing for gemm_a16w16's table.

Key: (M, N, K, bias, dtype, outdtype, scaleAB, bpreshuffle). Every candidate is called exactly as
dispatch calls it (the registry resolves the same ``kernelName``), so what is timed is what runs.
"""

from __future__ import annotations

import torch

from gemmtune.kernels.torch_ref import TORCH_LINEAR, gemm_a16w16_ref
from gemmtune.ops.gemm_a16w16 import REGISTRY
from gemmtune.tables.schema import Family
from gemmtune.tables.values import to_torch_dtype
from gemmtune.tune.families._gemm import (TOLERANCES, GemmFamily, GemmShape,
                                          cublaslt_candidates, number_candidates,
                                          triton_candidates)
from gemmtune.tune.family import Candidate, Prepared

__all__ = ["Bf16Family", "TOLERANCES"]

class Bf16Family(GemmFamily):
    family = Family.bf16
    registry = REGISTRY

    @staticmethod
    def _unpack(key: tuple):
        m, n, k, has_bias, dtype, out_dtype, scaled, preshuffled = key
        if preshuffled:
            raise ValueError("bpreshuffle=True: no bf16 kernel here gains from a pre-packed "
                             "weight layout, so such rows are not tuned; use bpreshuffle=False")
        return m, n, k, has_bias, to_torch_dtype(dtype), to_torch_dtype(out_dtype), scaled

    def candidates(self, key: tuple, libtypes: frozenset[str]) -> list[Candidate]:
        m, n, k, has_bias, dtype, out_dtype, scaled = self._unpack(key)
        wanted = libtypes or frozenset({"torch", "triton", "cublaslt"})
        gpu = torch.cuda.is_available()
        found = []
        if "torch" in wanted:
            found.append(Candidate(TORCH_LINEAR, "torch", simplicity=0))
        if "cublaslt" in wanted and gpu and not scaled:
            found += cublaslt_candidates(m, n, k, dtype, out_dtype, has_bias)
        if "triton" in wanted:
            found += triton_candidates(m, n, k, dtype, out_dtype)
        return number_candidates(found)

    def prepare(self, key: tuple, seed: int) -> Prepared:
        m, n, k, has_bias, dtype, out_dtype, scaled = self._unpack(key)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        x, w = randn(m, k), randn(n, k, scale=k ** -0.5)
        bias = randn(n) if has_bias else None
        sa = sb = None
        if scaled:
            sa = torch.rand(1, generator=gen, device=device) + 0.5
            sb = torch.rand(1, generator=gen, device=device) + 0.5
        inputs = (x, w, bias, out_dtype, sa, sb)
        ref = gemm_a16w16_ref(x, w, bias, torch.float32, sa, sb)
        return Prepared(key, seed, inputs, ref)

    def shape(self, key: tuple) -> GemmShape:
        m, n, k, has_bias, dtype, out_dtype, _ = self._unpack(key)
        return GemmShape(m, n, k, dtype, out_dtype, has_bias)

    def tolerance(self, key: tuple) -> tuple[float, float, float]:
        return TOLERANCES[to_torch_dtype(key[5])]
