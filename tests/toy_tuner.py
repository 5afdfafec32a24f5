"""``gemmtune tune toy``: the toy family's tuner (tests only), imported by name when asked for.

The engine's workers are spawned and unpickle ``ToyTuner`` by module name; they inherit the
parent's sys.path, which pytest has extended with this folder.
"""

from __future__ import annotations

import statistics
import time

import torch

from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tables.values import to_torch_dtype
from gemmtune.tune.family import Candidate, FamilyTuner, Prepared
from toy_family import (REGISTRY, SCHEMA, TOY_MATMUL_T, TOY_MM, ToyKey, problem_of, toy_inputs,
                        toy_ref)


class ToyTuner(FamilyTuner):
    schema = SCHEMA
    timing_label = "wall"

    def candidates(self, key: ToyKey, libtypes: frozenset[str]) -> list[Candidate]:
        if libtypes and "torch" not in libtypes:
            return []
        return [Candidate(TOY_MM, "torch", simplicity=0, solidx=0),
                Candidate(TOY_MATMUL_T, "torch", solidx=1)]

    def prepare(self, key: ToyKey, seed: int) -> Prepared:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        x, w = toy_inputs(key.M, key.N, key.K, to_torch_dtype(key.dtype), gen)
        return Prepared(key, seed, (x, w), toy_ref(x, w))

    def run(self, name: str, prepared: Prepared) -> torch.Tensor:
        # Resolved by name from the op's own registry: what is checked is what dispatch runs.
        kernel = REGISTRY.resolve_for(name, problem_of(prepared.key))
        x, w = prepared.inputs
        out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
        kernel(x, w, out=out)
        return out

    def tolerance(self, key: ToyKey) -> tuple[float, float, float]:
        return TOLERANCES[to_torch_dtype(key.dtype)]

    def time(self, name: str, prepared: Prepared, iters: int, warmup: int) -> tuple[float, float]:
        kernel = REGISTRY.resolve(name)
        x, w = prepared.inputs
        for _ in range(warmup):
            kernel(x, w)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            kernel(x, w)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
        median = statistics.median(times)
        return median, (max(times) - min(times)) / median
