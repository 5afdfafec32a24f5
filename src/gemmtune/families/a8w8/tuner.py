"""``gemmtune tune a8w8``: candidates and inputs for gemm_a8w8's table.

Candidates run with per-token activation and per-channel weight scales (the layout of FP8/INT8
serving); the kernels take per-tensor scales through the same path. Beside the shared GEMM
candidates, on a Hopper GPU the register-direct Gluon kernel's (FP8, M <= 64). Each candidate
is checked against the dequantised product in fp32.
"""

from __future__ import annotations

from gemmtune.families._gemm_tuner import (GemmCall, GemmTuner, eight_bit, gluon_candidates,
                                           number_candidates, rowwise_scaled_inputs)
from gemmtune.families.a8w8.op import REGISTRY, SCHEMA, TUNED_OUT_DTYPE, A8w8Key, problem_of
from gemmtune.kernels.torch_ref import TORCH_SCALED_MM
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A8w8Tuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def shape(self, key: A8w8Key):
        return eight_bit("a8w8", problem_of(key))

    def candidates(self, key: A8w8Key, libtypes: frozenset[str]) -> list[Candidate]:
        p = self.shape(key)
        # cuBLASLt timed with per-row scales; a row's check also plans per-tensor ones.
        found = self.gemm_candidates(p, libtypes, TORCH_SCALED_MM, cublaslt_scaling="outer")
        if "triton" in self.wanted(libtypes):
            found += gluon_candidates(p, self.registry)
        return number_candidates(found)

    def prepare(self, key: A8w8Key, seed: int) -> Prepared:
        xq, wq, x_scale, w_scale, ref = rowwise_scaled_inputs(self.shape(key),
                                                              self.generator(seed))
        return Prepared(key, seed, GemmCall(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale),
                        ref)

    def tolerance(self, key: A8w8Key) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]
