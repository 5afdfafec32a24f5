"""Where a one-launch MoE kernel's time goes inside its launch (the 1-stage kernel, or the
streaming kernel when ``--config`` names one): every program's start, the end of its stage-2
wait and its end, from the GPU's global timer, on cold weights.

    PYTHONPATH=src python3 benchmarks/moe_one_stage_timeline.py [--model NAME] [--tp N]
        [--tokens 1,2] [--config NAME] [--out DIR]

Per token count it prints, in µs from the first program's start: when stage-1 programs start
and end (10th, 50th, 90th percentile, last), when stage-2 programs start, finish waiting and
end, and the kernel's span. The config is the shipped table's row for the count unless named
(or, where that row is not a 1-stage one, FALLBACK).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
import triton

from gemmtune.bench import write_records
from gemmtune.families.fmoe.inputs import route
from gemmtune.families.fmoe.op import expert_map_of
from gemmtune.kernels.problem import MoeProblem
from gemmtune.kernels.triton import moe_one_stage, moe_stream
from gemmtune.kernels.triton.moe_configs import STREAM_PREFIX, MoeOneStageConfig, MoeStreamConfig
from gemmtune.measure.timing import interleaved_graph_us
from gemmtune.models.shapes import preset_moe_shape

SHIPPED = Path(__file__).resolve().parent.parent / "src/gemmtune/configs/tuned_fmoe.csv"
REPEATS = 20  # launches per token count; the median of each statistic is printed
FALLBACK = MoeOneStageConfig(32, 128, 128, 128, 4, 4)  # where the shipped row is not 1-stage


def shipped_config(tokens: int, model_dim: int, inter_dim: int):
    with open(SHIPPED, newline="") as f:
        for row in csv.DictReader(f):
            if ((int(row["token"]), int(row["model_dim"]), int(row["inter_dim"]))
                    == (tokens, model_dim, inter_dim) and int(row["run_1stage"])):
                return config_of(row["kernelName1"])
    return None


def percentiles(values: torch.Tensor) -> list[float]:
    q = torch.tensor([0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    return [round(v, 2) for v in torch.quantile(values.double(), q).tolist()]


def timeline(trace: torch.Tensor, stage1_programs: int) -> dict:
    """µs from the first start: percentiles of stage-1 starts and ends, of stage-2 starts, wait
    ends and ends (programs that waited), and the span."""
    t = (trace - trace[:, 0].min()).double() / 1e3
    one, two = t[:stage1_programs], t[stage1_programs:]
    waited = two[:, 1] > 0
    return {"stage1_start": percentiles(one[:, 0]), "stage1_end": percentiles(one[:, 2]),
            "stage2_start": percentiles(two[:, 0]),
            "stage2_waited": percentiles(two[waited, 1]) if waited.any() else [],
            "stage2_end": percentiles(two[:, 2]), "span": round(float(t[:, 2].max()), 2)}


# Each one-launch kernel's launcher (taking ``trace``) and grid size, by config type.
KERNELS = {MoeOneStageConfig: (moe_one_stage.moe_one_stage, moe_one_stage.programs),
           MoeStreamConfig: (moe_stream.moe_stream, moe_stream.programs)}


def launch(config, *args, **kwargs):
    run, _ = KERNELS[type(config)]
    return run(*args, config, **kwargs)


def config_of(name: str):
    return (MoeStreamConfig if name.startswith(STREAM_PREFIX) else MoeOneStageConfig
            ).from_name(name)


def graph_gap(x, weight, ids, emap, config, copies, n: int) -> dict:
    """Two calls captured in one CUDA graph, both traced, medians over replays: each call's span
    and the time from the first's last program end to the second's first program start (what
    the launch between them costs, PDL included)."""
    traces = [torch.zeros(n, 3, dtype=torch.int64, device="cuda") for _ in copies]

    def both():
        for (w1, w2), trace in zip(copies, traces):
            launch(config, x, w1, w2, weight, ids, emap, 0, False, trace=trace)
    both()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both()
    spans, gaps = [], []
    for _ in range(REPEATS):
        graph.replay()
        torch.cuda.synchronize()
        first, second = (t.cpu() for t in traces)
        spans.append([round(float(t[:, 2].max() - t[:, 0].min()) / 1e3, 2)
                      for t in (first, second)])
        gaps.append(float(second[:, 0].min() - first[:, 2].max()) / 1e3)
    return {"graph_spans": _median(spans), "graph_gap_us": round(_median(gaps), 2)}


def _median(values: list):
    """The median of numbers, or the element-wise median of equally long lists."""
    if isinstance(values[0], list):
        return [_median([v[i] for v in values if v]) for i in range(len(values[0]))]
    return sorted(values)[len(values) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a model preset (gemmtune shapes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one rank's experts")
    p.add_argument("--tokens", default="1,2")
    p.add_argument("--config", default=None,
                   help="a triton.moe_1stage:... or triton.moe_stream:... name")
    p.add_argument("--out", default="out")
    args = p.parse_args()
    shape, label = preset_moe_shape(args.model, args.tp)
    model_dim, inter_dim, experts, topk = shape.model_dim, shape.inter_dim, shape.expert, shape.topk
    sets = [(torch.randn(experts, 2 * inter_dim, model_dim, device="cuda").bfloat16(),
             torch.randn(experts, model_dim, inter_dim, device="cuda").bfloat16())
            for _ in range(2)]  # alternate: each launch reads its experts from HBM
    emap = expert_map_of(None, experts, "cuda")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        config = (config_of(args.config) if args.config
                  else shipped_config(tokens, model_dim, inter_dim) or FALLBACK)
        x = torch.randn(tokens, model_dim, device="cuda").bfloat16()
        weight = torch.rand(tokens, topk, device="cuda")
        n = KERNELS[type(config)][1](tokens, topk, inter_dim, model_dim, config)
        stage1 = tokens * topk * triton.cdiv(inter_dim, config.block_n)
        problem = MoeProblem(tokens, model_dim, inter_dim, experts, topk, torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        runs = []
        for r in range(REPEATS + 2):
            ids = route(problem, "uniform", gen)
            trace = torch.zeros(n, 3, dtype=torch.int64, device="cuda")
            w1, w2 = sets[r % 2]
            launch(config, x, w1, w2, weight, ids, emap, 0, False, trace=trace)
            torch.cuda.synchronize()
            if r >= 2:  # the first two compile and warm up
                runs.append(timeline(trace.cpu(), stage1))
        median = {k: _median([run[k] for run in runs]) for k in runs[0]}
        rows.append(dict(model=label, tokens=tokens, config=config.name,
                         programs=n, stage1_programs=stage1, **{k: str(v) for k, v in
                                                                 median.items()}))
        copies = [(w1, w2) for w1, w2 in sets]
        (graph_us, _), = interleaved_graph_us(
            [lambda c: launch(config, x, c[0], c[1], weight, ids, emap, 0, False)],
            copies)
        rows[-1].update(graph_us=round(graph_us, 2),
                        **graph_gap(x, weight, ids, emap, config, copies, n))
        print(f"T={tokens} {config.name}: {n} programs ({stage1} stage 1); graph replay "
              f"{graph_us:.2f} µs per call; two calls in one graph: spans "
              f"{rows[-1]['graph_spans']} µs, from the first call's last program to the "
              f"second's first {rows[-1]['graph_gap_us']} µs; the timeline (eager), µs from "
              f"the first start, p10/p50/p90/last")
        for k, v in median.items():
            print(f"  {k:>14}: {v}")
    write_records(rows, Path(args.out) / f"moe_one_stage_timeline_{label}.csv")


if __name__ == "__main__":
    main()
