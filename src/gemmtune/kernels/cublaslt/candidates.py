"""The algorithms the tuner times for one shape: ``enumerate_algos`` lists the heuristic's own top
algorithms, split-K values around theirs, and other tiles/stages of the heuristic's algorithm id
that ``matmul_algo_check`` accepts; ``heuristic_algos`` the heuristic's list alone."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch

from gemmtune.kernels.cublaslt._bindings import bindings, label
from gemmtune.kernels.cublaslt.algo import LtAlgo, algo_of, cap_list
from gemmtune.kernels.cublaslt.plans import current_problem

DEFAULT_LIMIT = 48  # candidates per shape handed to the tuner: a few dozen timings per shape
_SPLIT_K_MAX = 32
_MIN_K_PER_SPLIT = 128  # below this a split's partial product is too short to pay for reducing


def _split_k_values(s: int, k: int) -> list[int]:
    """Split-K values around the heuristic's ``s``, nearest first (``s`` itself excluded)."""
    near = {1, s - 2, s - 1, s + 1, s + 2, s // 2, (3 * s) // 2, 2 * s}
    ok = [v for v in near if 1 <= v <= _SPLIT_K_MAX and v != s
          and (v == 1 or k // v >= _MIN_K_PER_SPLIT)]
    return sorted(ok, key=lambda v: (abs(v - s), v))


def _tile_dims(text: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _wanted_tiles(m: int, heuristic_tiles: set[str], labels: list[str]) -> list[str]:
    """Tiles worth trying beside the heuristic's: the tile's first dimension runs along N (cuBLAS
    rows), its second along M; keep M-widths near M and the usual N-widths."""
    c0 = min(256, max(8, 1 << max(0, m - 1).bit_length()))
    widths = {max(8, c0 // 2), c0, min(256, 2 * c0)}
    out = []
    for tile in labels:
        dims = _tile_dims(tile)
        if tile in heuristic_tiles or (dims and dims[0] in (64, 128, 256) and dims[1] in widths):
            out.append(tile)
    return out


def enumerate_algos(M: int, N: int, K: int, dtype: torch.dtype, out_dtype: torch.dtype,
                    has_bias: bool, limit: int = DEFAULT_LIMIT,
                    scaling: str = "") -> list[LtAlgo]:
    """Valid algorithms for ``(M, N, K)`` on the current GPU, at most ``limit``: the heuristic's
    list first (its order), then split-K values around those of its top four (at most half of
    ``limit``), then tiles/stages of its first algorithm's id with that algorithm's other
    attributes (or a 1x1x1 cluster where its own is taken or refused), best wave fill first.
    Every one was rebuilt from its name and passed ``matmul_algo_check`` here.

    Measured on H200 (cuBLASLt 13.1, bf16): 17-39 candidates per shape; the fastest beat
    heuristic #0 by 1-13% under CUDA-graph replay (split-K 2 -> 1 at 16x4096x4096, cluster
    2x1x1 -> 1x1x1 at 128x4096x4096). ``scaling``: the FP8 scale mode (one of SCALINGS), or ""."""
    prob = current_problem(M, N, K, dtype, out_dtype, has_bias, scaling)
    seen: set[str] = set()

    def valid(algo: LtAlgo) -> float | None:
        """Waves of a new candidate rebuilt from its name; None if seen already or refused."""
        if algo.name in seen:
            return None
        seen.add(algo.name)
        try:
            return prob.check(prob.build(algo))[1]
        except ValueError:
            return None

    # The heuristic's own, kept only if its name rebuilds it (what a table row will do).
    heuristic = [a for a in map(algo_of, prob.heuristic())
                 if a is not None and valid(a) is not None]
    if not heuristic:
        return []

    out = list(heuristic[:limit])
    split_budget = max(0, min(limit - len(out), limit // 2))
    split_variants: list[LtAlgo] = []
    for h in heuristic[:4]:
        for sk in _split_k_values(h.split_k, K):
            schemes = [0] if sk == 1 else ([h.reduction] if h.reduction else [2, 1, 4])
            for red in schemes:
                cand = replace(h, split_k=sk, reduction=red)
                if valid(cand) is not None:
                    split_variants.append(cand)
                    break
    # Nearest split-K values of the best-ranked heuristic algorithms first.
    out += split_variants[:split_budget]

    h0 = heuristic[0]
    init = prob.init_algo(h0.algo_id)
    L = bindings()
    caps = L.MatmulAlgoCapAttribute
    tiles = [t for t in (label(L.MatmulTile, "TILE_", v) for v in cap_list(init, caps.TILE_IDS))
             if t is not None]
    stages = [s for s in (label(L.MatmulStages, "STAGES_", v)
                          for v in cap_list(init, caps.STAGES_IDS)) if s is not None]
    stages = [s for s in stages if s.endswith("xAUTO") or s == h0.stages]
    tile_variants: list[tuple[float, int, LtAlgo]] = []
    for tile in _wanted_tiles(M, {h.tile for h in heuristic}, tiles):
        for st in stages or [h0.stages]:
            for cluster in dict.fromkeys((h0.cluster, "1x1x1")):
                cand = replace(h0, tile=tile, stages=st, cluster=cluster)
                waves = valid(cand)
                if waves is not None:
                    fill = waves / math.ceil(waves) if waves > 0 else 0.0
                    tile_variants.append((-fill, len(tile_variants), cand))
                    break
    tile_variants.sort()
    out += [cand for _, _, cand in tile_variants[:max(0, limit - len(out))]]
    return out


def heuristic_algos(M: int, N: int, K: int, dtype: torch.dtype, out_dtype: torch.dtype,
                    has_bias: bool, scaling: str = "") -> list[LtAlgo]:
    """The heuristic's own list for this shape on the current GPU, best first (#0 is what
    cuBLASLt would pick); ``scaling``: the FP8 scale mode (one of SCALINGS), or ""."""
    prob = current_problem(M, N, K, dtype, out_dtype, has_bias, scaling)
    return [a for a in map(algo_of, prob.heuristic()) if a is not None]
