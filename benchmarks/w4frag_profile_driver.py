"""Launches ``triton.w4frag`` configs of the working tree and of an earlier revision (as
``w4frag_ab`` loads it), a few times each, for a profiler to attribute (ncu):
old config, then new, per (shape, config), ``--repeat`` launches each.

    ncu --kernel-name regex:gemm_w4frag --csv ... python3 benchmarks/w4frag_profile_driver.py \
        --rev HEAD 1,28672,4096:triton.w4frag:BM8.BK128.SK2.P1.R0.L1 ...
"""

from __future__ import annotations

import argparse

import torch

from gemmtune import quant
from gemmtune.kernels.triton import gemm_w4frag

from w4frag_ab import module_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("runs", nargs="+", help="M,N,K:CONFIG")
    args = parser.parse_args()
    old = module_at(args.rev)
    for run in args.runs:
        shape, name = run.split(":", 1)
        m, n, k = (int(v) for v in shape.split(","))
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        wq, ws = quant.mxfp4(w)
        stored = quant.prepack_mxfp4(wq, ws)[0] if ".L1" in name else wq
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        for module in (old, gemm_w4frag):
            cfg = module.W4FragConfig.from_name(name)
            for _ in range(args.repeat):
                module.launch_gemm_w4frag(x, stored, None, y, None, ws, cfg)
        torch.cuda.synchronize()
        print(run, flush=True)


if __name__ == "__main__":
    main()
