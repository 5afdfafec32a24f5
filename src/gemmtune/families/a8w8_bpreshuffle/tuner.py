"""``gemmtune tune a8w8-bpreshuffle``: candidates and inputs for gemm_a8w8_bpreshuffle's table.

Inputs as ``gemm_a8w8``'s tuner makes them (``rowwise_scaled_inputs``), the weight then
pre-shuffled; each candidate is checked against the dequantised product of the row-major weight in
fp32. Candidates: the torch backend, the register-direct Gluon kernel's configs (FP8 on Hopper, M <=
64: ``gemm_frag.candidates``; not the TMA ring's, which reads rows), and the split-K, tile and GEMV
configs the a8w8 tuner would try that read the tiled weight (block_k a multiple of 128, no row
prefetch).
"""

from __future__ import annotations


from gemmtune import quant
from gemmtune.families._gemm_tuner import (GemmCall, GemmTuner, eight_bit, gluon_candidates,
                                           number_candidates, rowwise_scaled_inputs)
from gemmtune.families.a8w8_bpreshuffle.op import (REGISTRY, SCHEMA, TUNED_OUT_DTYPE,
                                                   BpreshuffleKey, problem_of)
from gemmtune.kernels.preshuffle import why_not_shufflable
from gemmtune.kernels.torch_ref import TORCH_UNSHUFFLED
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A8w8BpreshuffleTuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def shape(self, key: BpreshuffleKey):
        p = eight_bit("a8w8_bpreshuffle", problem_of(key))
        why = why_not_shufflable(p.n, p.k, p.dtype)
        if why is not None:
            raise ValueError(f"M={p.m} N={p.n} K={p.k}: {why}")
        return p

    def candidates(self, key: BpreshuffleKey, libtypes: frozenset[str]) -> list[Candidate]:
        p = self.shape(key)
        # The a8w8 tuner's Triton space, less what cannot read the pre-shuffled weight (the
        # registry has only the kernels built for it; no persistent TMA kernel, no cuBLASLt).
        found = [c for c in self.gemm_candidates(p, libtypes, TORCH_UNSHUFFLED)
                 if c.libtype != "triton" or self.registry.can_run(c.name, p)]
        if "triton" in self.wanted(libtypes):
            found += gluon_candidates(p, self.registry)
        return number_candidates(found)

    def prepare(self, key: BpreshuffleKey, seed: int) -> Prepared:
        xq, wq, x_scale, w_scale, ref = rowwise_scaled_inputs(self.shape(key),
                                                              self.generator(seed))
        return Prepared(key, seed, GemmCall(xq, quant.shuffle_weight(wq), None, TUNED_OUT_DTYPE,
                                            x_scale, w_scale), ref)

    def tolerance(self, key: BpreshuffleKey) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]
