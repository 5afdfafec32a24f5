"""``gemmtune tune a16w4``: candidates and inputs for gemm_a16w4's table.

The weight is drawn in fp32 with magnitudes that vary along K (every block its own scale),
quantised to MXFP4 and, for a key with ``packed``, packed (``quant.prepack_mxfp4``); x is drawn in
the key's dtype. Each candidate is checked against the fp32
product of x and the dequantised weight, and timed with the weight's 4-bit bytes.
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._gemm_tuner import GemmCall, GemmTuner, mxfp4_candidates
from gemmtune.families.a16w4.op import REGISTRY, SCHEMA, A16w4Key, problem_of
from gemmtune.kernels.mxfp4 import BLOCK, why_not_packable, why_not_quantisable
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_LINEAR,
                                        gemm_a16w4_ref)
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A16w4Tuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def candidates(self, key: A16w4Key, libtypes: frozenset[str]) -> list[Candidate]:
        return mxfp4_candidates(self.shape(key), self.wanted(libtypes),
                                TORCH_UNPACK_DEQUANT_LINEAR if key.packed else TORCH_DEQUANT_LINEAR,
                                REGISTRY)

    def prepare(self, key: A16w4Key, seed: int) -> Prepared:
        p = self.shape(key)
        why = why_not_quantisable(p.k) or (why_not_packable(p.k) if key.packed else None)
        if why is not None:
            raise ValueError(why)
        gen = self.generator(seed)
        device = gen.device
        x = torch.randn(p.m, p.k, generator=gen, device=device).to(p.dtype)
        blocks = torch.logspace(-2, 1, p.k // BLOCK, device=device).repeat_interleave(BLOCK)
        w = torch.randn(p.n, p.k, generator=gen, device=device) * blocks * p.k ** -0.5
        wq, w_scale = quant.mxfp4(w)
        ref = gemm_a16w4_ref(x, wq, w_scale, None, torch.float32)
        if key.packed:
            wq, w_scale = quant.prepack_mxfp4(wq, w_scale)
        return Prepared(key, seed, GemmCall(x, wq, None, p.dtype, None, w_scale), ref)

    def tolerance(self, key: A16w4Key) -> tuple[float, float, float]:
        return TOLERANCES[self.shape(key).dtype]

    def metrics(self, key: A16w4Key, us: float) -> tuple[float, float]:
        """TFLOP/s and GB/s, the weight at its 4.25 bits an element (codes and scales)."""
        s = self.shape(key)
        nbytes = s.m * s.k * 2 + s.n * s.k // 2 + s.n * s.k // BLOCK + s.m * s.n * 2
        return 2.0 * s.m * s.n * s.k / us / 1e6, nbytes / us / 1e3
