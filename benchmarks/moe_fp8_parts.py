"""Where an FP8 fused MoE's decode time goes: each launch of a two-stage FP8 solution timed alone
and in the chains the op makes, under CUDA-graph replay with cold weights, beside the bf16 op and
a chain of empty launches (the fixed cost of a launch in a graph, with and without PDL).

    PYTHONPATH=src python3 benchmarks/moe_fp8_parts.py --model deepseek-v3-tp8 --tokens 1 \\
        --q_type per_Token [--kernel 'triton.moe1:...+triton.moe2:...' | --table CSV] [--out DIR]

Without ``--kernel`` the solution is the one a tuned fmoe table (``--table``, by default the
shipped one) holds for this shape.

Parts (µs): quant_x (the activations' quantiser), stage1_chain (quant_x, stage 1, the
intermediate's quantiser), quant_inter (the intermediate's quantiser alone, on an intermediate
made once), stage2_chain (stage 2 and the sum), sum (alone), whole (the op), bf16 (the bf16 op
through the shipped table), empty_N / empty_pdl_N (N empty launches). Stage 1's kernel is about
stage1_chain - quant_x - quant_inter; stage 2's about stage2_chain - sum.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

import gemmtune
from gemmtune.families.fmoe.inputs import quantised_experts, random_inputs
from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.problem import Activation, MoeProblem, Scaling
from gemmtune.kernels.triton import moe_stages
from gemmtune.kernels.triton.fused_moe import ACT_CODES, TritonTwoStageMoe, route
from gemmtune.kernels.triton.moe_common import let_next_start, wait_for_inputs
from gemmtune.measure.timing import cold_copies, graph_replay_us
from gemmtune.tables.values import QuantType

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "deepseek-v3-tp8": (7168, 256, 256, 8)}
SCALINGS = {"per_Token": Scaling.rowwise, "per_1x128": Scaling.block, "per_Tensor": Scaling.tensor}
EMPTY_CHAIN = 5


@triton.jit
def _empty(x_ptr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    let_next_start(PDL)
    if tl.program_id(0) < 0:  # never: a launch that does nothing
        tl.store(x_ptr, 0.0)


def _empty_chain(launches: int, pdl: bool):
    x = torch.zeros(1, device="cuda")

    def chain(_):
        for _ in range(launches):
            _empty[(132,)](x, PDL=pdl, launch_pdl=pdl)
    return chain


def parts(model: str, tokens: int, q_type: str, kernel_name: str) -> dict[str, float]:
    d, i, e, topk = SHAPES[model]
    problem = MoeProblem(tokens, d, i, e, topk, torch.bfloat16, Activation.silu, False,
                         SCALINGS[q_type])
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, w1, w2, weight, ids = random_inputs(problem, gen)
    w1q, w2q, scales = quantised_experts(w1, w2, QuantType.from_str(q_type))
    emap = expert_map_of(None, e, hidden.device)
    kernel = TritonTwoStageMoe(kernel_name)
    act = ACT_CODES[Activation.silu]
    routing = route(kernel.stage1, ids, emap, e)
    inter = moe_stages.run_stage1(hidden, w1q, weight, ids, emap, routing, act, False,
                                  kernel.stage1, scales=scales, scaling=problem.scaling)
    # The intermediate's quantiser as this solution runs it: of gate and up sums (2I wide, the
    # activation applied there) after a split stage 1.
    split = kernel.stage1.split_k > 1
    inter_f32 = torch.randn(routing.sorted_ids.numel(), 2 * i if split else i, device="cuda")
    routed = moe_stages._routed_rows(routing, ids, emap)
    partial = moe_stages.run_stage2(inter, w2q, weight, ids, emap, routing, False,
                                    kernel.stage2, tokens, hidden.dtype, with_sum=False,
                                    scales=scales)
    out = torch.empty_like(hidden)
    sets = cold_copies((w1q, w2q, w1, w2))
    calls = {
        "quant_x": lambda s: moe_stages._quantised(hidden, problem.scaling, None, False),
        "stage1_chain": lambda s: moe_stages.run_stage1(
            hidden, s[0], weight, ids, emap, routing, act, False, kernel.stage1, scales=scales,
            scaling=problem.scaling),
        "quant_inter": lambda s: moe_stages._quantised(inter_f32, problem.scaling, None, False,
                                                       routed, act if split else None),
        "stage2_chain": lambda s: moe_stages.run_stage2(
            inter, s[1], weight, ids, emap, routing, False, kernel.stage2, tokens,
            hidden.dtype, scales=scales),
        "sum": lambda s: moe_stages.run_sum(partial, ids, emap, out),
        "whole": lambda s: gemmtune.fused_moe(hidden, s[0], s[1], weight, ids,
                                              quant_type=q_type, w1_scale=scales.w1,
                                              w2_scale=scales.w2, kernel=kernel_name),
        "bf16": lambda s: gemmtune.fused_moe(hidden, s[2], s[3], weight, ids),
        f"empty_{EMPTY_CHAIN}": _empty_chain(EMPTY_CHAIN, False),
        f"empty_pdl_{EMPTY_CHAIN}": _empty_chain(EMPTY_CHAIN, True),
    }
    found = {}
    for name, call in calls.items():
        call(sets[0])  # compile and plan outside the capture
        torch.cuda.synchronize()
        found[name] = graph_replay_us(call, sets, replays=50)[0]
    return found


def tuned_kernel(table: Path, model: str, tokens: int, q_type: str) -> str:
    """The two-stage solution ``table`` holds for this shape (bf16 activations, SiLU)."""
    d, i, e, topk = SHAPES[model]
    with open(table, newline="") as f:
        for row in csv.DictReader(f):
            if (int(row["token"]), int(row["model_dim"]), int(row["inter_dim"]),
                    int(row["expert"]), int(row["topk"]), row["q_type"]) == \
                    (tokens, d, i, e, topk, f"QuantType.{q_type}") and row["kernelName2"]:
                return f"{row['kernelName1']}+{row['kernelName2']}"
    raise SystemExit(f"{table}: no two-stage row for {model} T={tokens} {q_type}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), required=True)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--q_type", choices=sorted(SCALINGS), default="per_Token")
    p.add_argument("--kernel", help="the two-stage FP8 solution to take apart")
    p.add_argument("--table", type=Path,
                   default=Path(gemmtune.__file__).parent / "configs" / "tuned_fmoe.csv",
                   help="without --kernel: the tuned fmoe table to take it from")
    p.add_argument("--out", default="out")
    args = p.parse_args()
    kernel = args.kernel or tuned_kernel(args.table, args.model, args.tokens, args.q_type)
    found = parts(args.model, args.tokens, args.q_type, kernel)
    print(f"{args.model} T={args.tokens} {args.q_type} {kernel}")
    print("  " + "  ".join(f"{name} {us:.2f}" for name, us in found.items()))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "moe_fp8_parts.jsonl", "a") as f:
        f.write(json.dumps({"model": args.model, "tokens": args.tokens, "q_type": args.q_type,
                            "kernel": kernel, **found}) + "\n")


if __name__ == "__main__":
    main()
