"""Where a fused MoE's time goes: routing preparation, stage 1, stage 2 with the sum over slots,
and the whole op, each under CUDA-graph replay with cold weights, beside the floors.

    PYTHONPATH=src python3 benchmarks/moe_breakdown.py [--tuned CSV] [--model NAME] [--out DIR]

Configs come from the tuned table's row for the token count: a Triton pair is broken into its
parts, a 1-stage row is timed whole (its parts are one launch); without a row, the large-token
tiles below. Floors: the bytes of the experts the
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
from gemmtune.kernels.triton.fused_moe import (ACT_CODES, TritonGroupedMmMoe, TritonOneStageMoe,
                                              TritonTwoStageMoe, route)
from gemmtune.kernels.triton.moe_configs import GROUPED_MM_NAME, MoeStage1Config, MoeStage2Config
from gemmtune.kernels.triton.moe_routing import moe_routing
from gemmtune.measure.ceilings import floors, measure_ceilings
from gemmtune.bench import write_records
from gemmtune.measure.timing import graph_replay_us

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "deepseek-v3-tp8": (7168, 256, 256, 8)}
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 8192)
LARGE = (MoeStage1Config(128, 128, 64, 8, 3), MoeStage2Config(128, 128, 64, 1, 8, 3))


def tuned_kernels(path: str | None) -> dict[int, object]:
    """token -> the Triton solution of its row (rows torch won are left out)."""
    found = {}
    if path:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["kernelName2"]:
                    found[int(row["token"])] = TritonTwoStageMoe(
                        f"{row['kernelName1']}+{row['kernelName2']}")
                elif int(row["run_1stage"]):
                    found[int(row["token"])] = TritonOneStageMoe(row["kernelName1"])
                elif row["kernelName1"] == GROUPED_MM_NAME:
                    found[int(row["token"])] = TritonGroupedMmMoe()
    return found


def _stage_calls(kernel: TritonTwoStageMoe, hidden, w1, weight, ids, emap, experts) -> dict:
    """The parts of a two-stage solution, each timed alone: stage 2 over a routing and an
    intermediate made once."""
    stage1, stage2 = kernel.stage1, kernel.stage2
    tokens = hidden.shape[0]
    act = ACT_CODES[Activation.silu]
    routing = route(stage1, ids, emap, experts)
    inter = moe_stages.run_stage1(hidden, w1, weight, ids, emap, routing, act, False, stage1)
    parts = {} if routing.pair_blocks else {  # pair blocks: nothing prepared
        "routing": lambda s: moe_routing(ids, emap, experts, stage1.block_m)}
    return {
        **parts,
        "stage1": lambda s: moe_stages.run_stage1(hidden, s[0], weight, ids, emap, routing, act,
                                                  False, stage1),
        "stage2+sum": lambda s: moe_stages.run_stage2(inter, s[1], weight, ids, emap, routing,
                                                      False, stage2, tokens, torch.bfloat16),
    }


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
    tuned = tuned_kernels(args.tuned)
    rows = []
    for tokens in TOKENS:
        kernel = tuned.get(tokens) or TritonTwoStageMoe(f"{LARGE[0].name}+{LARGE[1].name}")
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
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
        err = float((kernel(hidden, w1, w2, weight, ids, emap, problem).float() - ref).norm()
                    / ref.norm())
        sets = [(w1, w2), (w1.clone(), w2.clone())]  # each replay reads its experts from HBM
        timed = {"whole": lambda s: kernel(hidden, s[0], s[1], weight, ids, emap, problem)}
        if isinstance(kernel, TritonTwoStageMoe):
            timed.update(_stage_calls(kernel, hidden, w1, weight, ids, emap, experts))
        us = {name: graph_replay_us(fn, sets, replays=30)[0] for name, fn in timed.items()}
        us = {part: us.get(part, float("nan")) for part in ("routing", "stage1", "stage2+sum",
                                                            "whole")}
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
