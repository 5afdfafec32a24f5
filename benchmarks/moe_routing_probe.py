"""What the routing preparation of a fused MoE costs, launch by launch, with 4, 8 and 16 warps:
the whole preparation (one launch up to 1024 pairs, three above) and, where it takes three, each
launch alone, under CUDA-graph replay, for the three MoE models' expert counts.

    PYTHONPATH=src python3 benchmarks/moe_routing_probe.py [--tokens 16,64,256,1024,8192]
        [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from gemmtune.bench import write_records
from gemmtune.families.fmoe.inputs import route
from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.problem import MoeProblem
from gemmtune.kernels.triton import moe_routing as routing_mod
from gemmtune.measure.timing import interleaved_graph_us

MODELS = {"mixtral-8x7b": (8, 2), "qwen3-30b-a3b": (128, 8), "deepseek-v3-tp8": (256, 8)}
WARPS = (4, 8, 16)


def _launches(ids, emap, experts: int, block_m: int, warps: int) -> dict:
    """The three launches of a many-pair preparation, each alone (over buffers made once)."""
    pairs = ids.numel()
    span = routing_mod.PAIRS_PER_PROGRAM
    programs = triton.cdiv(pairs, span)
    bins = triton.next_power_of_2(experts + 1)
    r = routing_mod.moe_routing(ids, emap, experts, block_m)
    counts = torch.empty((programs, bins), dtype=torch.int32, device=ids.device)
    offsets = torch.empty_like(counts)
    real_ends = torch.empty(bins, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    # The count and offsets launches once over the real pairs: each launch is timed on what the
    # one before it really leaves (a place over zero offsets would scatter nowhere real).
    routing_mod.moe_count_kernel[(programs,)](flat, emap, counts, pairs, experts,
                                              EXPERTS_POW2=bins, SPAN=span)
    routing_mod.moe_offsets_kernel[(1,)](counts, offsets, real_ends, r.rows_used, r.expert_ends,
                                         programs, BLOCK_M=block_m, EXPERTS_POW2=bins,
                                         PROGRAMS_STEP=16)
    return {
        f"count W{warps}": lambda s: routing_mod.moe_count_kernel[(programs,)](
            flat, emap, counts, pairs, experts, EXPERTS_POW2=bins, SPAN=span, num_warps=warps),
        f"offsets W{warps}": lambda s: routing_mod.moe_offsets_kernel[(1,)](
            counts, offsets, real_ends, r.rows_used, r.expert_ends, programs,
            BLOCK_M=block_m, EXPERTS_POW2=bins, PROGRAMS_STEP=16, num_warps=warps),
        f"place W{warps}": lambda s: routing_mod.moe_place_kernel[(programs,)](
            flat, emap, r.sorted_ids, r.block_expert, r.block_rows, offsets, counts, real_ends,
            pairs, experts, BLOCK_M=block_m, EXPERTS_POW2=bins, SPAN=span, num_warps=warps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,64,256,1024,8192")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--out", default="out")
    args = p.parse_args()
    rows = []
    for model, (experts, topk) in MODELS.items():
        emap = expert_map_of(None, experts, torch.device("cuda"))
        for tokens in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            # Only the routing's counts matter here: the dims are placeholders.
            ids = route(MoeProblem(tokens, 1, 1, experts, topk, torch.bfloat16), "uniform", gen)
            fns = {f"whole W{w}": (lambda s, w=w: routing_mod.moe_routing(
                ids, emap, experts, args.block_m, num_warps=w)) for w in WARPS}
            if ids.numel() > routing_mod.PAIRS_PER_PROGRAM:
                for w in WARPS:
                    fns.update(_launches(ids, emap, experts, args.block_m, w))
            for fn in fns.values():
                fn(None)
            torch.cuda.synchronize()
            timed = interleaved_graph_us(list(fns.values()), [None], rounds=10)
            for name, (us, spread) in zip(fns, timed):
                rows.append(dict(model=model, tokens=tokens, pairs=ids.numel(), part=name,
                                 us=round(us, 2), spread=round(spread, 3)))
    write_records(rows, Path(args.out) / "moe_routing_probe.csv")
    for model in MODELS:
        print(model)
        for tokens in sorted({r["tokens"] for r in rows}):
            here = [r for r in rows if r["model"] == model and r["tokens"] == tokens]
            print(f"  T={tokens:<5} " + "  ".join(f"{r['part']} {r['us']}" for r in here))


if __name__ == "__main__":
    main()
