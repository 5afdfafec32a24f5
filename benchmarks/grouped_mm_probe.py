"""How fast torch's grouped GEMM (``torch._grouped_mm``, cuBLAS/CUTLASS) runs a fused MoE's two
GEMMs at prefill token counts, beside our whole op through the shipped table, in one run: what a
backend that kept our routing, gather, activation and sum but handed the GEMMs to
``_grouped_mm`` could reach.

    PYTHONPATH=src python3 benchmarks/grouped_mm_probe.py [--model NAME] [--tp N] [--out DIR]

The rows are already sorted by expert (each group a multiple of 16 rows, as a block_m 16
routing pads them); the times are the GEMMs alone under graph replay, beside the FLOPs floor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import gemmtune
from gemmtune.bench import write_records
from gemmtune.families.fmoe.inputs import route
from gemmtune.kernels.problem import MoeProblem
from gemmtune.measure.timing import interleaved_graph_us
from gemmtune.models.shapes import preset_moe_shape

TOKENS = (1024, 2048, 4096, 8192)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a model preset (gemmtune shapes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one rank's experts")
    p.add_argument("--out", default="out")
    args = p.parse_args()
    shape, label = preset_moe_shape(args.model, args.tp)
    model_dim, inter_dim, experts, topk = shape.model_dim, shape.inter_dim, shape.expert, shape.topk
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak_us = interleaved_graph_us([lambda s: square @ square], [None], rounds=5)[0][0]
    peak = 2 * 8192 ** 3 / (peak_us * 1e-6)
    w1 = torch.randn(experts, 2 * inter_dim, model_dim, device="cuda").bfloat16()
    w2 = torch.randn(experts, model_dim, inter_dim, device="cuda").bfloat16()
    rows = []
    for tokens in TOKENS:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        hidden = torch.randn(tokens, model_dim, generator=gen, device="cuda").bfloat16()
        ids = route(MoeProblem(tokens, model_dim, inter_dim, experts, topk, torch.bfloat16),
                    "uniform", gen)
        weight = torch.rand(tokens, topk, generator=gen, device="cuda")
        sizes = torch.bincount(ids.reshape(-1), minlength=experts)
        padded = (sizes + 15) // 16 * 16
        offsets = torch.cumsum(padded, 0).to(torch.int32)
        total = int(offsets[-1])
        a = torch.randn(total, model_dim, generator=gen, device="cuda").bfloat16()
        h = torch.randn(total, inter_dim, generator=gen, device="cuda").bfloat16()
        w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
        fns = [lambda s: torch._grouped_mm(a, w1t, offs=offsets),
               lambda s: torch._grouped_mm(h, w2t, offs=offsets),
               lambda s: gemmtune.fused_moe(hidden, w1, w2, weight, ids.to(torch.int32))]
        (g1, _), (g2, _), (ours, _) = interleaved_graph_us(fns, [None], rounds=10)
        pairs = tokens * topk
        flops1 = 2.0 * pairs * model_dim * 2 * inter_dim
        flops2 = 2.0 * pairs * inter_dim * model_dim
        rows.append(dict(model=label, tokens=tokens, grouped_mm1_us=round(g1, 1),
                         grouped_mm2_us=round(g2, 1), gemms_us=round(g1 + g2, 1),
                         ours_whole_us=round(ours, 1),
                         tflops1=round(flops1 / g1 / 1e6, 1), tflops2=round(flops2 / g2 / 1e6, 1),
                         peak_tflops=round(peak / 1e12, 1),
                         gemms_eff=round((flops1 + flops2) / peak * 1e6 / (g1 + g2), 3),
                         ours_eff=round((flops1 + flops2) / peak * 1e6 / ours, 3)))
        print(rows[-1], flush=True)
    write_records(rows, Path(args.out) / f"grouped_mm_probe_{label}.csv")
    print(f"{'T':>5} {'gmm1 us':>8} {'TF/s':>6} {'gmm2 us':>8} {'TF/s':>6} {'GEMMs':>8} "
          f"{'eff':>5} {'ours':>8} {'eff':>5}")
    for r in rows:
        print(f"{r['tokens']:>5} {r['grouped_mm1_us']:>8} {r['tflops1']:>6} "
              f"{r['grouped_mm2_us']:>8} {r['tflops2']:>6} {r['gemms_us']:>8} "
              f"{r['gemms_eff']:>5} {r['ours_whole_us']:>8} {r['ours_eff']:>5}")


if __name__ == "__main__":
    main()
