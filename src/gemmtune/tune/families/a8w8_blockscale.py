"""``gemmtune tune a8w8-blockscale``: candidates, inputs and timing for gemm_a8w8_blockscale's
table. Key: (M, N, K). Inputs are quantised with FP8 block scales (x per 1x128, w per 128x128);
each candidate is checked against the dequantised product in fp32.
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.ops.gemm_a8w8_blockscale import (REGISTRY, TORCH_BLOCKSCALE,
                                               gemm_a8w8_blockscale_ref)
from gemmtune.tables.schema import Family
from gemmtune.tune.families._gemm import (TOLERANCES, GemmFamily, GemmShape, number_candidates,
                                          triton_candidates)
from gemmtune.tune.family import Candidate, Prepared

OUT_DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn


class A8w8BlockscaleFamily(GemmFamily):
    family = Family.a8w8_blockscale
    registry = REGISTRY

    def shape(self, key: tuple) -> GemmShape:
        m, n, k = key
        return GemmShape(m, n, k, FP8, OUT_DTYPE, has_bias=False)

    def candidates(self, key: tuple, libtypes: frozenset[str]) -> list[Candidate]:
        m, n, k = key
        wanted = libtypes or frozenset({"torch", "triton"})
        found = []
        if "torch" in wanted:
            found.append(Candidate(TORCH_BLOCKSCALE, "torch", simplicity=0))
        if "triton" in wanted:
            found += triton_candidates(m, n, k, FP8, OUT_DTYPE, block_scales=True)
        return number_candidates(found)

    def prepare(self, key: tuple, seed: int) -> Prepared:
        m, n, k = key
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        # Activations whose magnitude varies along K as well as by token: block scales differ.
        x = torch.randn(m, k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(m, 1, generator=gen, device=device)) \
            * (1 + torch.rand(1, k, generator=gen, device=device))
        w = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
        xq, x_scale = quant.per_block_fp8(x, quant.ACT_BLOCK)
        wq, w_scale = quant.per_block_fp8(w, quant.WEIGHT_BLOCK)
        ref = gemm_a8w8_blockscale_ref(xq, wq, x_scale, w_scale, torch.float32)
        return Prepared(key, seed, (xq, wq, None, OUT_DTYPE, x_scale, w_scale), ref)

    def tolerance(self, key: tuple) -> tuple[float, float, float]:
        return TOLERANCES[OUT_DTYPE]
