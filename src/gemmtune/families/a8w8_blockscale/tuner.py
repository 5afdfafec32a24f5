"""``gemmtune tune a8w8-blockscale``: candidates and inputs for gemm_a8w8_blockscale's table.
Inputs are quantised with FP8 block scales (x per 1x128, w per 128x128); each candidate is
checked against the dequantised product in fp32. Beside the shared GEMM candidates, on a Hopper
GPU the Gluon decode kernels' with steps of 128 (M <= 64).
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._gemm_tuner import (GemmCall, GemmTuner, gluon_candidates,
                                           number_candidates)
from gemmtune.families.a8w8_blockscale.op import (REGISTRY, SCHEMA, TUNED_OUT_DTYPE,
                                                  BlockscaleKey, problem_of)
from gemmtune.kernels.torch_ref import TORCH_BLOCKSCALE, gemm_a8w8_blockscale_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A8w8BlockscaleTuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def candidates(self, key: BlockscaleKey, libtypes: frozenset[str]) -> list[Candidate]:
        p = self.shape(key)
        found = self.gemm_candidates(p, libtypes, TORCH_BLOCKSCALE, block_scales=True)
        if "triton" in self.wanted(libtypes):
            found += gluon_candidates(p, self.registry)
        return number_candidates(found)

    def prepare(self, key: BlockscaleKey, seed: int) -> Prepared:
        p = self.shape(key)
        gen = self.generator(seed)
        device = gen.device
        # Activations whose magnitude varies along K as well as by token: block scales differ.
        x = torch.randn(p.m, p.k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(p.m, 1, generator=gen, device=device)) \
            * (1 + torch.rand(1, p.k, generator=gen, device=device))
        w = torch.randn(p.n, p.k, generator=gen, device=device) * p.k ** -0.5
        xq, x_scale = quant.per_block_fp8(x, quant.ACT_BLOCK)
        wq, w_scale = quant.per_block_fp8(w, quant.WEIGHT_BLOCK)
        ref = gemm_a8w8_blockscale_ref(xq, wq, x_scale, w_scale, torch.float32)
        return Prepared(key, seed, GemmCall(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale),
                        ref)

    def tolerance(self, key: BlockscaleKey) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]
