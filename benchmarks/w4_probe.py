"""MXFP4 GEMMs on the GPU (issue 16): ``gemm_w4``'s configs (``gemm_w4.candidates``: K split
for decode included) with bf16 x and with MXFP4 x, against bf16 ``F.linear`` and the FP8
per-token op (``gemm_a8w8``, its shipped rows) on the same (N, K), in one run: CUDA graphs, cold
L2, the best config per shape.

    PYTHONPATH=src python3 benchmarks/w4_probe.py [--shapes M,N,K ...]

Session 22 timed six shapes with twelve unsplit configs: 0.45-0.60x F.linear.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gemmtune import quant
from gemmtune.families.a8w8 import gemm_a8w8
from gemmtune.kernels.triton.gemm_w4 import candidates, gemm_w4, launch_gemm_w4
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (1, 14336, 4096), (16, 14336, 4096),
          (1, 4096, 14336), (16, 4096, 14336), (1, 2880, 2880), (16, 2880, 2880),
          (64, 4096, 4096), (1024, 4096, 4096))


def _shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.split(","))
    return m, n, k


def time_shape(m: int, n: int, k: int) -> str:
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    x = torch.randn(m, k, device="cuda")
    wq, ws = quant.mxfp4(w)
    xq4, xs4 = quant.mxfp4(x)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    xq8, xs8 = quant.per_token_fp8(x)
    wq8, ws8 = quant.per_channel_fp8(w)
    sets = cold_copies((x16, w16, wq, ws, xq4, xs4, xq8, xs8, wq8, ws8))
    configs = candidates(m, n, k, torch.bfloat16)
    a4_configs = candidates(m, n, k, torch.uint8)
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    fns = [lambda s: F.linear(s[0], s[1]),
           lambda s: gemm_a8w8(s[6], s[8], s[7], s[9])]
    for c in configs:
        gemm_w4(x16, wq, ws, config=c)  # compiled before the capture
        fns.append(lambda s, c=c: launch_gemm_w4(s[0], s[2], None, out16, None, s[3], c))
    for c in a4_configs:
        launch_gemm_w4(xq4, wq, None, out16, xs4, ws, c)
        fns.append(lambda s, c=c: launch_gemm_w4(s[4], s[2], None, out16, s[5], s[3], c))
    fns[1](sets[0])  # the FP8 op planned before the capture
    times = [t for t, _ in interleaved_graph_us(fns, sets, rounds=10)]
    linear, fp8 = times[0], times[1]
    w4 = times[2:2 + len(configs)]
    a4 = times[2 + len(configs):]
    best16, best4 = min(range(len(w4)), key=w4.__getitem__), min(range(len(a4)),
                                                                   key=a4.__getitem__)
    return (f"{m:>5} {n:>6} {k:>6} {linear:>9.2f} {fp8:>8.2f} {w4[best16]:>9.2f} "
            f"{linear / w4[best16]:>6.2f} {a4[best4]:>9.2f} {linear / a4[best4]:>6.2f}  "
            f"{configs[best16].name} | {a4_configs[best4].name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", type=_shape, default=list(SHAPES))
    args = parser.parse_args()
    print(f"{'M':>5} {'N':>6} {'K':>6} {'linear':>9} {'fp8 op':>8} {'a16w4':>9} {'x':>6} "
          f"{'a4w4':>9} {'x':>6}  best configs (µs; x = F.linear / it)")
    for m, n, k in args.shapes:
        print(time_shape(m, n, k), flush=True)


if __name__ == "__main__":
    main()
