"""``gemmtune tune a4w4-blockscale``: candidates and inputs for gemm_a4w4_blockscale's table.

x (per token row) and w are drawn in fp32 with magnitudes that vary along K (every block its own
scale) and quantised to MXFP4, w packed for a key with ``packed`` (``quant.prepack_mxfp4``);
each candidate is checked against the fp32 product of the two dequantised operands, and timed
with their 4-bit bytes.
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._gemm_tuner import GemmCall, GemmTuner, mxfp4_candidates
from gemmtune.families.a4w4_blockscale.op import (REGISTRY, SCHEMA, TUNED_OUT_DTYPE, A4w4Key,
                                                  problem_of)
from gemmtune.kernels.mxfp4 import BLOCK, why_not_packable, why_not_quantisable
from gemmtune.kernels.torch_ref import TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM, gemm_a4w4_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A4w4BlockscaleTuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def candidates(self, key: A4w4Key, libtypes: frozenset[str]) -> list[Candidate]:
        return mxfp4_candidates(self.shape(key), self.wanted(libtypes),
                                TORCH_UNPACK_DEQUANT_MM if key.packed else TORCH_DEQUANT_MM,
                                REGISTRY)

    def prepare(self, key: A4w4Key, seed: int) -> Prepared:
        p = self.shape(key)
        why = why_not_quantisable(p.k) or (why_not_packable(p.k) if key.packed else None)
        if why is not None:
            raise ValueError(why)
        gen = self.generator(seed)
        device = gen.device
        blocks = torch.logspace(-2, 1, p.k // BLOCK, device=device).repeat_interleave(BLOCK)
        x = torch.randn(p.m, p.k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(p.m, 1, generator=gen, device=device))
        w = torch.randn(p.n, p.k, generator=gen, device=device) * blocks * p.k ** -0.5
        (xq, x_scale), (wq, w_scale) = quant.mxfp4(x), quant.mxfp4(w)
        ref = gemm_a4w4_ref(xq, wq, x_scale, w_scale, torch.float32)
        if key.packed:
            wq, w_scale = quant.prepack_mxfp4(wq, w_scale)
        return Prepared(key, seed, GemmCall(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale),
                        ref)

    def tolerance(self, key: A4w4Key) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]

    def metrics(self, key: A4w4Key, us: float) -> tuple[float, float]:
        """TFLOP/s and GB/s, both operands at 4.25 bits an element (codes and scales)."""
        s = self.shape(key)
        nbytes = (s.m + s.n) * (s.k // 2 + s.k // BLOCK) + s.m * s.n * 2
        return 2.0 * s.m * s.n * s.k / us / 1e6, nbytes / us / 1e3
