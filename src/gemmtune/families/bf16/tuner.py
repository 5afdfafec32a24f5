"""``gemmtune tune bf16``: candidates and inputs for gemm_a16w16's table.

Every candidate is called exactly as dispatch calls it (the registry resolves the same
``kernelName``), so what is timed is what runs.
"""

from __future__ import annotations

import torch

from gemmtune.families._gemm_tuner import GemmCall, GemmTuner
from gemmtune.families.bf16.op import REGISTRY, SCHEMA, Bf16Key, problem_of
from gemmtune.kernels.problem import Scaling
from gemmtune.kernels.torch_ref import TORCH_LINEAR, gemm_a16w16_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class Bf16Tuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def shape(self, key: Bf16Key):
        if key.bpreshuffle:
            raise ValueError("bpreshuffle=True: no bf16 kernel here gains from a pre-packed "
                             "weight layout, so such rows are not tuned; use bpreshuffle=False")
        return problem_of(key)

    def candidates(self, key: Bf16Key, libtypes: frozenset[str]) -> list[Candidate]:
        p = self.shape(key)
        return self.gemm_candidates(p, libtypes, TORCH_LINEAR,
                                    cublaslt_scaling="" if p.scaling is Scaling.none else None)

    def prepare(self, key: Bf16Key, seed: int) -> Prepared:
        p = self.shape(key)
        gen = self.generator(seed)
        device = gen.device

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(p.dtype)

        x, w = randn(p.m, p.k), randn(p.n, p.k, scale=p.k ** -0.5)
        bias = randn(p.n) if p.has_bias else None
        sa = sb = None
        if key.scaleAB:
            sa = torch.rand(1, generator=gen, device=device) + 0.5
            sb = torch.rand(1, generator=gen, device=device) + 0.5
        inputs = GemmCall(x, w, bias, p.out_dtype, sa, sb)
        ref = gemm_a16w16_ref(x, w, bias, torch.float32, sa, sb)
        return Prepared(key, seed, inputs, ref)

    def tolerance(self, key: Bf16Key) -> tuple[float, float, float]:
        return TOLERANCES[self.shape(key).out_dtype]
