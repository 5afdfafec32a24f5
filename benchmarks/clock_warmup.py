"""Does the first shape timed after an idle moment read slow? (bench: M=1 rows, timed first per
(N, K), were slower than M=16 for torch and Triton alike.)

Times FP8 6144x4096 at M=1 and M=16 with one fixed split-K config and torch's row-wise
``_scaled_mm``, interleaved as the bench does: once right after 0.5 s of idle, then again after
200 ms of GPU work, in both M orders. If idle-then-time reads slower than busy-then-time, the
timer needs a warm-up.

    PYTHONPATH=src python3 benchmarks/clock_warmup.py
"""

from __future__ import annotations

import time

import torch

from gemmtune import quant
from gemmtune.ops.gemm_a8w8 import REGISTRY, scaled_mm_torch
from gemmtune.tune.timing import copies_to_exceed_l2, interleaved_graph_us

N, K = 6144, 4096
CONFIG = "triton.splitk:BM16.BN32.BK256.SK1.W1.S5.P1"


def operand_sets(m: int, gen: torch.Generator) -> list[tuple]:
    per_token, per_channel = quant.token_channel_quantisers(torch.float8_e4m3fn)
    xq, xs = per_token(torch.randn(m, K, generator=gen, device="cuda"))
    wq, ws = per_channel(torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5)
    args = (xq, wq, xs.reshape(-1), ws.reshape(-1))
    return [(xq, wq.clone(), args[2], args[3]) for _ in range(copies_to_exceed_l2(wq.numel()))]


def busy(ms: float) -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    triton_kernel = REGISTRY.resolve(CONFIG)
    fns = [lambda s: scaled_mm_torch(s[0], s[1], None, torch.bfloat16, s[2], s[3]),
           lambda s: triton_kernel(s[0], s[1], None, torch.bfloat16, s[2], s[3])]
    sets = {m: operand_sets(m, gen) for m in (1, 16)}
    for fn in fns:
        for m in (1, 16):
            fn(sets[m][0])
    torch.cuda.synchronize()
    print(f"{'order':<8} {'state':<6} {'M':>3} {'torch us':>9} {'triton us':>9}")
    for order in ((1, 16), (16, 1)):
        for state in ("idle", "busy"):
            for m in order:
                if state == "idle":
                    time.sleep(0.5)
                else:
                    busy(200)
                (t, _), (tr, _) = interleaved_graph_us(fns, sets[m])
                print(f"{str(order):<8} {state:<6} {m:>3} {t:>9.2f} {tr:>9.2f}")


if __name__ == "__main__":
    main()
