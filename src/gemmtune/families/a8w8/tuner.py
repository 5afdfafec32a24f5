"""``gemmtune tune a8w8``: candidates and inputs for gemm_a8w8's table.

Candidates run with per-token activation and per-channel weight scales (the layout of FP8/INT8
serving); the kernels take per-tensor scales through the same path. Each candidate is checked
against the dequantised product in fp32.
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.families._gemm_tuner import GemmCall, GemmTuner
from gemmtune.families._scaled_op import Q_DTYPES
from gemmtune.families.a8w8.op import REGISTRY, SCHEMA, TUNED_OUT_DTYPE, A8w8Key, problem_of
from gemmtune.kernels.torch_ref import TORCH_SCALED_MM, gemm_a8w8_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A8w8Tuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def shape(self, key: A8w8Key):
        p = problem_of(key)
        if p.dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype_w={key.q_dtype_w}: a8w8 tunes "
                             f"{' and '.join(str(d) for d in Q_DTYPES)} weights")
        return p

    def candidates(self, key: A8w8Key, libtypes: frozenset[str]) -> list[Candidate]:
        # cuBLASLt timed with per-row scales; a row's check also plans per-tensor ones.
        return self.gemm_candidates(self.shape(key), libtypes, TORCH_SCALED_MM,
                                    cublaslt_scaling="outer")

    def prepare(self, key: A8w8Key, seed: int) -> Prepared:
        p = self.shape(key)
        gen = self.generator(seed)
        device = gen.device
        per_token, per_channel = quant.token_channel_quantisers(p.dtype)
        # Activations with a few outlier tokens (as in LLMs): per-token scales then differ.
        x = torch.randn(p.m, p.k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(p.m, 1, generator=gen, device=device))
        w = torch.randn(p.n, p.k, generator=gen, device=device) * p.k ** -0.5
        xq, x_scale = per_token(x)
        wq, w_scale = per_channel(w)
        x_scale, w_scale = x_scale.reshape(-1), w_scale.reshape(-1)
        ref = gemm_a8w8_ref(xq, wq, x_scale, w_scale, None, torch.float32)
        return Prepared(key, seed, GemmCall(xq, wq, None, TUNED_OUT_DTYPE, x_scale, w_scale),
                        ref)

    def tolerance(self, key: A8w8Key) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]
