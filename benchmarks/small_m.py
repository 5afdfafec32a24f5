"""Why is M = 1 slower than M = 16 with the same split-K config? (H100, 2026-11-26: FP8
6144x4096, BM16.BN32.BK256.SK1.W1.S5.P1: 16.9 µs at M = 1, 12.1 µs at M = 16, whichever is timed
first; idle before timing made no difference.)

Times one config over M = 1..16 and variants that each change one thing: the x scale mode
(one value is per-tensor, more are per-row), PDL off, bf16 instead of FP8.

    PYTHONPATH=src python3 benchmarks/small_m.py
"""

from __future__ import annotations

import torch

from gemmtune import quant
from gemmtune.kernels.triton.gemm_splitk import SplitKConfig, launch_gemm_splitk
from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

N, K = 6144, 4096
FP8 = SplitKConfig(16, 32, 256, 1, 1, 5, 1)


def variant(m: int, config: SplitKConfig, dtype=torch.float8_e4m3fn, x_scale="token"):
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, K, generator=gen, device="cuda")
    w = torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5
    if dtype == torch.float8_e4m3fn:
        per_token, per_channel = quant.token_channel_quantisers(dtype)
        (xq, xs), (wq, ws) = per_token(x), per_channel(w)
        xs = xs.reshape(-1) if x_scale == "token" else xs.reshape(-1)[:1].clone()
        ws = ws.reshape(-1)
    else:
        xq, wq, xs, ws = x.to(dtype), w.to(dtype), None, None
    out = torch.empty(m, N, dtype=torch.bfloat16, device="cuda")
    sets = [wq.clone() for _ in range(copies_to_exceed_l2(wq.numel() * wq.element_size()))]
    return lambda w_: launch_gemm_splitk(xq, w_, None, out, xs, ws, config), sets


def main() -> None:
    cases = [(f"fp8 M={m}", variant(m, FP8)) for m in (1, 2, 4, 8, 16)]
    cases += [("fp8 M=16 per-tensor x scale", variant(16, FP8, x_scale="tensor")),
              ("fp8 M=1 PDL off", variant(1, SplitKConfig(16, 32, 256, 1, 1, 5, 0))),
              ("fp8 M=16 PDL off", variant(16, SplitKConfig(16, 32, 256, 1, 1, 5, 0))),
              ("bf16 M=1 BK128", variant(1, SplitKConfig(16, 32, 128, 1, 2, 5, 1),
                                         torch.bfloat16)),
              ("bf16 M=16 BK128", variant(16, SplitKConfig(16, 32, 128, 1, 2, 5, 1),
                                          torch.bfloat16))]
    for _, (fn, sets) in cases:
        fn(sets[0])
    torch.cuda.synchronize()
    for name, (fn, sets) in cases:
        (us, spread), = interleaved_graph_us([fn], sets, rounds=40)
        print(f"{name:<30} {us:8.2f} us  (spread {spread:.3f})")


if __name__ == "__main__":
    main()
