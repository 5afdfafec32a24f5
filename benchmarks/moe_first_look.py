"""First look at the fused-MoE kernels on a GPU: each path's time against the floor.

    PYTHONPATH=src python3 benchmarks/moe_first_look.py [--out DIR]

For three model shapes and a range of token counts:
- the default Triton two-stage pair, routing preparation included, under CUDA-graph replay;
- the torch backend (`torch._grouped_mm`), eager: it synchronises, so it cannot be captured;
- the floor: the bytes of the experts actually routed to, plus activations in and out, at the
  streaming-read bandwidth measured in the same run, with `t_launch` added.

Every result is checked against the fp32 reference. Prints a table; the CSV goes under --out.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

import gemmtune
from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.torch_ref import fused_moe_ref
from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s
from gemmtune.measure.timing import graph_replay_us

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "deepseek-v3-tp8": (7168, 256, 256, 8)}
TOKENS = (1, 16, 64, 256, 1024, 4096)


def inputs(tokens, model_dim, inter_dim, experts, topk, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, model_dim, generator=gen, device="cuda").to(torch.bfloat16)
    w1 = (torch.randn(experts, 2 * inter_dim, model_dim, generator=gen, device="cuda")
          / model_dim ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, model_dim, inter_dim, generator=gen, device="cuda")
          / inter_dim ** 0.5).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    weight = torch.rand(tokens, topk, generator=gen, device="cuda")
    return hidden, w1, w2, weight, ids


def eager_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out")
    args = p.parse_args()
    bandwidth, t_launch = streaming_read_bytes_per_s(), launch_us()
    print(f"{bandwidth / 1e9:.0f} GB/s, t_launch {t_launch:.2f} us")
    rows = []
    for model, (model_dim, inter_dim, experts, topk) in SHAPES.items():
        for tokens in TOKENS:
            hidden, w1, w2, weight, ids = inputs(tokens, model_dim, inter_dim, experts, topk,
                                                 tokens)
            emap = expert_map_of(None, experts, hidden.device)
            ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
            y = gemmtune.fused_moe(hidden, w1, w2, weight, ids)
            err = float((y.float() - ref).norm() / ref.norm())
            kernel = gemmtune.get_family("fmoe").dispatcher.plans
            name = next(iter(kernel.values())).decision.kernel_name
            gemmtune.reset()
            # Distinct weight copies so each replay reads its experts from HBM.
            sets = [(hidden, w1.clone(), w2.clone(), weight, ids) for _ in range(2)]
            triton_us = graph_replay_us(lambda s: gemmtune.fused_moe(*s), sets, replays=20)[0]
            torch_us = eager_us(lambda: gemmtune.fused_moe(hidden, w1, w2, weight, ids,
                                                           kernel="torch.moe"))
            used = int(torch.unique(ids).numel())
            nbytes = used * 3 * inter_dim * model_dim * 2 + 2 * tokens * model_dim * 2
            floor = nbytes / bandwidth * 1e6 + t_launch
            rows.append(dict(model=model, tokens=tokens, triton_us=round(triton_us, 2),
                             torch_us=round(torch_us, 2), floor_us=round(floor, 2),
                             triton_eff=round(floor / triton_us, 3),
                             torch_eff=round(floor / torch_us, 3), rel_err=f"{err:.1e}",
                             kernel=name))
            print(rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "moe_first_look.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{'model':<16} {'tokens':>6} {'triton us':>9} {'torch us':>9} {'floor us':>8} "
          f"{'eff':>5} {'torch eff':>9} {'err':>8}")
    for r in rows:
        print(f"{r['model']:<16} {r['tokens']:>6} {r['triton_us']:>9} {r['torch_us']:>9} "
              f"{r['floor_us']:>8} {r['triton_eff']:>5} {r['torch_eff']:>9} {r['rel_err']:>8}")


if __name__ == "__main__":
    main()
