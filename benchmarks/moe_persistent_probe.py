"""The persistent TMA stages at prefill token counts, part by part, beside each part's own floor:
where the two-stage solution's time goes once its GEMMs are persistent.

    PYTHONPATH=src python3 benchmarks/moe_persistent_probe.py [--model NAME] [--tp N]
        [--tokens 1024,2048,4096,8192] [--out DIR]

Parts, each under CUDA-graph replay with cold weights, in one interleaved measurement per token
count: the routing preparation; stage 1 (plain, persistent, persistent with its tile loop
flattened); stage 2's GEMM alone (the same three); the sum over slots alone. Floors: a
part's FLOPs at the peak of an 8192^3 bf16 torch GEMM and its bytes (the routed experts'
weights, activations, intermediates and partial products it reads and writes) at the streaming
bandwidth, both measured in the same run. A variant that does not compile here is reported and
left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gemmtune.bench import write_records
from gemmtune.families.fmoe.inputs import route
from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.problem import MoeProblem
from gemmtune.kernels.triton import moe_stages
from gemmtune.kernels.triton.moe_configs import MoeStage1Config, MoeStage2Config
from gemmtune.kernels.triton.moe_routing import moe_routing
from gemmtune.measure.ceilings import floors, measure_ceilings
from gemmtune.measure.timing import cold_copies, interleaved_graph_us
from gemmtune.models.shapes import preset_moe_shape

BLOCK_M = 128
STAGE1 = {"plain": MoeStage1Config(BLOCK_M, 128, 64, 8, 3),
          "P1": MoeStage1Config(BLOCK_M, 128, 64, 8, 4, persistent=1),
          "P2 flattened": MoeStage1Config(BLOCK_M, 128, 64, 8, 4, persistent=2)}
STAGE2 = {"plain": MoeStage2Config(BLOCK_M, 256, 64, 1, 8, 3),
          "P1": MoeStage2Config(BLOCK_M, 256, 64, 1, 8, 4, persistent=1),
          "P2 flattened": MoeStage2Config(BLOCK_M, 256, 64, 1, 8, 4, persistent=2)}


def _parts(hidden, w1, w2, weight, ids, emap, experts) -> dict:
    """name -> (call on a (w1, w2) set, FLOPs, bytes)."""
    tokens, model_dim = hidden.shape
    inter_dim = w2.shape[2]
    pairs = ids.numel()
    used = int(torch.unique(ids).numel())
    routing = moe_routing(ids, emap, experts, BLOCK_M)
    rows = int(routing.rows_used.item())
    inter = moe_stages.run_stage1(hidden, w1, weight, ids, emap, routing, 0, False,
                                  STAGE1["plain"])
    partial = moe_stages.run_stage2(inter, w2, weight, ids, emap, routing, False,
                                    STAGE2["plain"], tokens, hidden.dtype, with_sum=False)
    out = torch.empty_like(hidden)
    item = hidden.element_size()
    flops1 = 2.0 * pairs * model_dim * 2 * inter_dim
    bytes1 = (used * 2 * inter_dim * model_dim + tokens * model_dim + rows * inter_dim) * item
    flops2 = 2.0 * pairs * inter_dim * model_dim
    bytes2 = (used * model_dim * inter_dim + rows * inter_dim + pairs * model_dim) * item
    parts = {"routing": (lambda s: moe_routing(ids, emap, experts, BLOCK_M), 0.0,
                         pairs * 4.0)}
    for name, config in STAGE1.items():
        parts[f"stage1 {name}"] = (
            lambda s, c=config: moe_stages.run_stage1(hidden, s[0], weight, ids, emap, routing,
                                                      0, False, c),
            flops1, bytes1)
    for name, config in STAGE2.items():
        parts[f"stage2 {name}"] = (
            lambda s, c=config: moe_stages.run_stage2(inter, s[1], weight, ids, emap, routing,
                                                      False, c, tokens, hidden.dtype,
                                                      with_sum=False),
            flops2, bytes2)
    parts["sum"] = (lambda s: moe_stages.run_sum(partial, ids, emap, out), 0.0,
                    (pairs + tokens) * model_dim * item)
    return parts


def _compiling(parts: dict, first_set) -> dict:
    """The parts that compile and run here; the others reported."""
    kept = {}
    for name, part in parts.items():
        try:
            part[0](first_set)
            torch.cuda.synchronize()
            kept[name] = part
        except Exception as exc:  # a variant this Triton cannot build: reported, not timed
            print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a model preset (gemmtune shapes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one rank's experts")
    p.add_argument("--tokens", default="1024,2048,4096,8192")
    p.add_argument("--out", default="out")
    args = p.parse_args()
    shape, label = preset_moe_shape(args.model, args.tp)
    model_dim, inter_dim, experts, topk = shape.model_dim, shape.inter_dim, shape.expert, shape.topk
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceilings = measure_ceilings(lambda: square @ square, 2 * 8192 ** 3)
    print(f"{label}: {ceilings.bytes_per_s / 1e9:.0f} GB/s, "
          f"{ceilings.flops_per_s / 1e12:.0f} TFLOP/s")
    w1 = (torch.randn(experts, 2 * inter_dim, model_dim, device="cuda")
          / model_dim ** 0.5).bfloat16()
    w2 = (torch.randn(experts, model_dim, inter_dim, device="cuda") / inter_dim ** 0.5).bfloat16()
    sets = cold_copies((w1, w2))
    emap = expert_map_of(None, experts, w1.device)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        hidden = torch.randn(tokens, model_dim, generator=gen, device="cuda").bfloat16()
        ids = route(MoeProblem(tokens, model_dim, inter_dim, experts, topk, torch.bfloat16),
                    "uniform", gen)
        weight = torch.rand(tokens, topk, generator=gen, device="cuda")
        parts = _compiling(_parts(hidden, w1, w2, weight, ids, emap, experts), sets[0])
        timed = interleaved_graph_us([part[0] for part in parts.values()], sets, rounds=5)
        for (name, (_, flops, nbytes)), (us, spread) in zip(parts.items(), timed):
            floor = floors(flops, nbytes, ceilings).roofline_us
            rows.append(dict(model=label, tokens=tokens, part=name, us=round(us, 2),
                             spread=round(spread, 3), floor_us=round(floor, 2),
                             eff=round(floor / us, 3), tflops=round(flops / us / 1e6, 1),
                             gbs=round(nbytes / us / 1e3)))
    write_records(rows, Path(args.out) / f"moe_persistent_probe_{label}.csv")
    print(f"{'tokens':>6} {'part':<18} {'us':>9} {'floor':>9} {'eff':>6} {'TF/s':>6} "
          f"{'GB/s':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['part']:<18} {r['us']:>9} {r['floor_us']:>9} {r['eff']:>6} "
              f"{r['tflops']:>6} {r['gbs']:>6}")


if __name__ == "__main__":
    main()
