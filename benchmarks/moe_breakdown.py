"""Where a fused MoE's time goes: routing preparation, stage 1, stage 2 with the sum over slots,
and the whole op, each under CUDA-graph replay with cold weights, beside the floors.

    PYTHONPATH=src python3 benchmarks/moe_breakdown.py [--tuned CSV] [--model NAME] [--out DIR]

Stage configs come from the tuned table's row for the token count where a Triton pair won
there, else the defaults of the large-token tiles below. Floors: the bytes of the experts the
routing reaches (plus activations) at the streaming-read bandwidth, and the FLOPs at the peak of
an 8192^3 bf16 torch GEMM, both measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.problem import Activation, MoeProblem
from gemmtune.kernels.torch_ref import fused_moe_ref
from gemmtune.kernels.triton import moe_stages
from gemmtune.kernels.triton.fused_moe import ACT_CODES, TritonTwoStageMoe
from gemmtune.kernels.triton.moe_configs import MoeStage1Config, MoeStage2Config
from gemmtune.kernels.triton.moe_routing import moe_routing
from gemmtune.measure.ceilings import floors, measure_ceilings
from gemmtune.bench import write_records
from gemmtune.measure.timing import graph_replay_us

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "deepseek-v3-tp8": (7168, 256, 256, 8)}
TOKENS = (1, 16, 256, 1024, 8192)
LARGE = (MoeStage1Config(128, 128, 64, 8, 3), MoeStage2Config(128, 128, 64, 1, 8, 3))


def tuned_configs(path: str | None) -> dict[int, tuple[MoeStage1Config, MoeStage2Config]]:
    found = {}
    if path:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["kernelName2"]:
                    found[int(row["token"])] = (MoeStage1Config.from_name(row["kernelName1"]),
                                                MoeStage2Config.from_name(row["kernelName2"]))
    return found


def _peak_gemm(n: int):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tuned", default=None)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--out", default="out")
    args = p.parse_args()
    model_dim, inter_dim, experts, topk = SHAPES[args.model]
    ceilings = measure_ceilings(_peak_gemm(8192), 2 * 8192 ** 3)
    print(f"{ceilings.bytes_per_s / 1e9:.0f} GB/s, {ceilings.flops_per_s / 1e12:.0f} TFLOP/s, "
          f"t_launch {ceilings.launch_us:.2f} us")
    configs = tuned_configs(args.tuned)
    rows = []
    for tokens in TOKENS:
        stage1, stage2 = configs.get(tokens, LARGE)
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        hidden = torch.randn(tokens, model_dim, generator=gen, device="cuda").bfloat16()
        w1 = (torch.randn(experts, 2 * inter_dim, model_dim, generator=gen, device="cuda")
              / model_dim ** 0.5).bfloat16()
        w2 = (torch.randn(experts, model_dim, inter_dim, generator=gen, device="cuda")
              / inter_dim ** 0.5).bfloat16()
        ids = torch.rand(tokens, experts, generator=gen, device="cuda").topk(topk, 1).indices
        ids = ids.to(torch.int32)
        weight = torch.rand(tokens, topk, generator=gen, device="cuda")
        emap = expert_map_of(None, experts, hidden.device)
        problem = MoeProblem(tokens, model_dim, inter_dim, experts, topk, torch.bfloat16,
                             Activation.silu, False)
        kernel = TritonTwoStageMoe(f"{stage1.name}+{stage2.name}")
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
        err = float((kernel(hidden, w1, w2, weight, ids, emap, problem).float() - ref).norm()
                    / ref.norm())
        sets = [(w1, w2), (w1.clone(), w2.clone())]  # each replay reads its experts from HBM
        routing = moe_routing(ids, emap, experts, stage1.block_m)
        inter = moe_stages.run_stage1(hidden, w1, weight, routing, ACT_CODES[Activation.silu],
                                      False, stage1)
        timed = {
            "routing": lambda s: moe_routing(ids, emap, experts, stage1.block_m),
            "stage1": lambda s: moe_stages.run_stage1(hidden, s[0], weight, routing,
                                                      ACT_CODES[Activation.silu], False, stage1),
            "stage2+sum": lambda s: moe_stages.run_stage2(inter, s[1], weight, ids, emap,
                                                          routing, False, stage2, tokens,
                                                          torch.bfloat16),
            "whole": lambda s: kernel(hidden, s[0], s[1], weight, ids, emap, problem),
        }
        us = {name: graph_replay_us(fn, sets, replays=30)[0] for name, fn in timed.items()}
        used = int(torch.unique(ids).numel())
        flops = 2.0 * tokens * topk * 3 * inter_dim * model_dim
        nbytes = used * 3 * inter_dim * model_dim * 2 + 2 * tokens * model_dim * 2
        floor = floors(flops, nbytes, ceilings)
        rows.append(dict(model=args.model, tokens=tokens, **{k: round(v, 2) for k, v in us.items()},
                         floor_us=round(floor.attainable_us, 2),
                         eff=round(floor.attainable_us / us["whole"], 3), rel_err=f"{err:.1e}",
                         kernel=kernel.name))
    out = Path(args.out)
    write_records(rows, out / f"moe_breakdown_{args.model}.csv")
    print(f"{'tokens':>6} {'routing':>8} {'stage1':>8} {'st2+sum':>8} {'whole':>8} {'floor':>8} "
          f"{'eff':>5} {'err':>8}  kernel")
    for r in rows:
        print(f"{r['tokens']:>6} {r['routing']:>8} {r['stage1']:>8} {r['stage2+sum']:>8} "
              f"{r['whole']:>8} {r['floor_us']:>8} {r['eff']:>5} {r['rel_err']:>8}  {r['kernel']}")


if __name__ == "__main__":
    main()
