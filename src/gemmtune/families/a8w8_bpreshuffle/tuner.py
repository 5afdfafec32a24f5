"""``gemmtune tune a8w8-bpreshuffle``: candidates and inputs for gemm_a8w8_bpreshuffle's table.

Inputs as ``gemm_a8w8``'s tuner makes them (per-token activations with outlier tokens,
per-channel weights), the weight then pre-shuffled; each candidate is checked against the
dequantised product of the row-major weight in fp32. Candidates: the torch backend, and the
split-K, tile and GEMV configs the a8w8 tuner would try that read the tiled weight (block_k a
multiple of 128, no row prefetch).
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.dispatch import KernelNameError
from gemmtune.families._gemm_tuner import GemmCall, GemmTuner
from gemmtune.families._scaled_op import Q_DTYPES
from gemmtune.families.a8w8_bpreshuffle.op import (REGISTRY, SCHEMA, TUNED_OUT_DTYPE,
                                                   BpreshuffleKey, problem_of)
from gemmtune.kernels.preshuffle import why_not_shufflable
from gemmtune.kernels.torch_ref import TORCH_UNSHUFFLED, gemm_a8w8_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tune.family import Candidate, Prepared


class A8w8BpreshuffleTuner(GemmTuner):
    schema = SCHEMA
    registry = REGISTRY
    problem_of = staticmethod(problem_of)

    def shape(self, key: BpreshuffleKey):
        p = problem_of(key)
        if p.dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype_w={key.q_dtype_w}: a8w8_bpreshuffle tunes "
                             f"{' and '.join(str(d) for d in Q_DTYPES)} weights")
        why = why_not_shufflable(p.n, p.k, p.dtype)
        if why is not None:
            raise ValueError(f"M={p.m} N={p.n} K={p.k}: {why}")
        return p

    def candidates(self, key: BpreshuffleKey, libtypes: frozenset[str]) -> list[Candidate]:
        p = self.shape(key)
        # The a8w8 tuner's Triton space, less what cannot read the tiled weight (the registry
        # has only the kernels built for it; no persistent TMA kernel, no cuBLASLt).
        return [c for c in self.gemm_candidates(p, libtypes, TORCH_UNSHUFFLED)
                if c.libtype != "triton" or self._reads_tiled(c.name, p)]

    def _reads_tiled(self, name: str, problem) -> bool:
        try:
            self.registry.resolve_for(name, problem)
        except KernelNameError:
            return False
        return True

    def prepare(self, key: BpreshuffleKey, seed: int) -> Prepared:
        p = self.shape(key)
        gen = self.generator(seed)
        device = gen.device
        per_token, per_channel = quant.token_channel_quantisers(p.dtype)
        x = torch.randn(p.m, p.k, generator=gen, device=device) \
            * (1 + 4 * torch.rand(p.m, 1, generator=gen, device=device))
        w = torch.randn(p.n, p.k, generator=gen, device=device) * p.k ** -0.5
        xq, x_scale = per_token(x)
        wq, w_scale = per_channel(w)
        x_scale, w_scale = x_scale.reshape(-1), w_scale.reshape(-1)
        ref = gemm_a8w8_ref(xq, wq, x_scale, w_scale, None, torch.float32)
        return Prepared(key, seed, GemmCall(xq, quant.shuffle_weight(wq), None, TUNED_OUT_DTYPE,
                                            x_scale, w_scale), ref)

    def tolerance(self, key: BpreshuffleKey) -> tuple[float, float, float]:
        return TOLERANCES[TUNED_OUT_DTYPE]
