"""First timing of ``gemm_w4`` (MXFP4 weights, bf16 x; issue 16) against bf16 ``F.linear`` on
the same (N, K), CUDA graphs with cold L2, a few untuned configs (no split-K yet).

    PYTHONPATH=src python3 benchmarks/w4_probe.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from gemmtune import quant
from gemmtune.kernels.triton.gemm_w4 import W4Config, gemm_w4
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (1, 14336, 4096), (16, 14336, 4096),
          (1, 4096, 14336), (16, 4096, 14336))
CONFIGS = [W4Config(16, bn, bk, w, s) for bn, bk, w, s in
           itertools.product((32, 64, 128), (128, 256), (4,), (3, 4))]


def main() -> None:
    print(f"{'M':>3} {'N':>6} {'K':>6} {'linear us':>9} {'best w4 us':>10} {'x':>6}  config")
    for m, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        wq, ws = quant.mxfp4(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        sets = cold_copies((x, w, wq, ws))
        fns = [lambda s: F.linear(s[0], s[1])]
        for cfg in CONFIGS:
            gemm_w4(x, wq, ws, config=cfg)  # compile before capture
            fns.append(lambda s, c=cfg: gemm_w4(s[0], s[2], s[3], config=c))
        times = [t for t, _ in interleaved_graph_us(fns, sets, rounds=10)]
        best = min(range(1, len(times)), key=times.__getitem__)
        print(f"{m:>3} {n:>6} {k:>6} {times[0]:>9.2f} {times[best]:>10.2f} "
              f"{times[0] / times[best]:>6.2f}  {CONFIGS[best - 1].name}", flush=True)


if __name__ == "__main__":
    main()
