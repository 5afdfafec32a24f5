"""End to end in Hugging Face transformers, MoE: Mixtral- and Qwen3-MoE-architecture models with
real dimensions (``LAYERS`` decoder layers, random weights, nothing downloaded), their experts
through ``experts_implementation="gemmtune"`` against transformers' ``grouped_mm`` and
``batched_mm`` backends, in one run.

Each backend is its own model object with the same weights (built again with the same seed).
Points and timing are benchmarks/e2e_hf.py's: decode against a static KV cache at batch 1, 8
and 32 and a ``PREFILL``-token prefill, eagerly (one synchronised step per round) and as a
captured CUDA graph, the backends in an order rotated each round; a speed-up is the median over
the rounds of the round's ratio. Logits of gemmtune and batched_mm against grouped_mm's.
Prints gemmtune's speed-up over each backend and over the faster of the two.

``--experts``: what a CUDA-graph decode step could gain from the experts at all. One more model
runs experts that do nothing (they return their input): its step is the rest of every
backend's (attention, router, norms, embedding, lm_head: transformers' own). At each decode
point the first layer's experts, on the inputs the model's router gave them, also run alone as
a CUDA graph through each backend; their floor is the bytes of the experts the routing picks
(each read once) over the streaming bandwidth measured in the same run, plus t_launch. The
step's ceiling is the faster backend's step over the rest with every layer's experts at that
floor.

    PYTHONPATH=src python3 benchmarks/e2e_hf_moe.py [--models mixtral-8x7b,qwen3-30b-a3b]
        [--fp8] [--experts]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NamedTuple

import torch

import gemmtune
from e2e_hf import BATCHES, PREFILL, DecodePoint, PrefillPoint, capture, rel_err, time_point, \
    write_rows

LAYERS = 2
BACKENDS = ("grouped_mm", "batched_mm", "gemmtune")
MODELS = {
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936)),
}
# bf16: the experts' sums in another order, and through random weights (nothing trained) a
# near tie among a token's top-8 of 128 experts in the second layer picked the other way: Qwen3
# at batch 32 measured 1.8e-2 and 2.2e-2 (the latter with batched_mm bit-equal to grouped_mm),
# docs/benchmarks.md session 16. A broken kernel is off by O(1).
LOGITS_BOUND = 3e-2
FP8 = "gemmtune_fp8"  # --fp8: gemmtune with its experts quantised (FP8 per channel / token)
NO_EXPERTS = "no_experts"  # --experts: experts that return their input (the rest of a step)
# FP8's own error through two layers of random weights (nothing trained keeps it low) is
# reported; only an error this large stops the run, as broken rather than imprecise.
FP8_LOGITS_BOUND = 0.5


def build(name: str, backend: str):
    """The model with this experts backend; ``gemmtune_fp8``: gemmtune's with its routed
    experts quantised to FP8 (``patch_moe(quant="fp8")``)."""
    import transformers

    config_class, dims = MODELS[name]
    config = getattr(transformers, config_class)(num_hidden_layers=LAYERS,
                                                 max_position_embeddings=8192, **dims)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    if backend == FP8:
        return gemmtune.patch_moe(model, quant="fp8")
    if backend == NO_EXPERTS:
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(NO_EXPERTS, lambda module, hidden_states, *routing:
                                  hidden_states)
    model.set_experts_implementation(backend)
    return model


class ExpertsCeiling(NamedTuple):
    """What one layer's experts take and could take, per decode point."""

    experts_us: dict  # backend -> µs per call of the first layer's experts, graph replay
    floor_us: float  # the routed experts' bytes over the streaming bandwidth, plus t_launch
    distinct: int  # experts the routing picks


def routed_inputs(point, model) -> tuple:
    """The first layer's experts' inputs (hidden, top_k_index, top_k_weights) in a step."""
    experts = model.model.layers[0].mlp.experts
    seen = []
    handle = experts.register_forward_pre_hook(
        lambda module, args: seen.append(tuple(a.clone() for a in args)))
    try:
        point.rewind()
        point.step(model)
    finally:
        handle.remove()
    return seen[0]


def experts_ceiling(point, model, bandwidth: float, launch: float) -> ExpertsCeiling:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from gemmtune.measure.timing import interleaved_graph_us

    experts = model.model.layers[0].mlp.experts
    inputs = routed_inputs(point, model)
    functions = {b: ALL_EXPERTS_FUNCTIONS[b] for b in BACKENDS[:2]}
    functions["gemmtune"] = gemmtune.experts.experts_forward
    fns = [lambda args, f=f: f(experts, *args) for f in functions.values()]
    for fn in fns:  # planned, compiled
        fn(inputs)
    torch.cuda.synchronize()
    times = interleaved_graph_us(fns, [inputs], rounds=15, replays=2)
    distinct = int(torch.unique(inputs[1]).numel())
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) \
        * experts.gate_up_proj.element_size()
    floor = distinct * per_expert / bandwidth * 1e6 + launch
    return ExpertsCeiling({b: t for b, (t, _) in zip(functions, times)}, floor, distinct)


@torch.no_grad()
def run_model(name: str, fp8: bool = False, experts: bool = False) -> list[dict]:
    variants = {backend: build(name, backend) for backend in BACKENDS}
    first = list(variants["grouped_mm"].parameters())
    if fp8:
        variants[FP8] = build(name, FP8)
    if experts:
        variants[NO_EXPERTS] = build(name, NO_EXPERTS)
    for backend in BACKENDS[1:]:
        if not all(torch.equal(a, b) for a, b in zip(first, variants[backend].parameters())):
            raise RuntimeError(f"{name}: the {backend} build has other weights")
    model = variants["grouped_mm"]
    points = [(f"decode b={b}", DecodePoint(model, b)) for b in BATCHES]
    points.append((f"prefill {PREFILL}", PrefillPoint(model)))
    if experts:
        from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s

        bandwidth, launch = streaming_read_bytes_per_s(), launch_us()
    rows = []
    for label, point in points:
        # batched_mm copies each token's experts' weights (a prefill of 512 Mixtral tokens:
        # 240 GB); transformers runs it for decoding only.
        timed_here = {b: v for b, v in variants.items()
                      if label.startswith("decode") or b != "batched_mm"}
        logits, graphs = {}, {}
        for backend, variant in timed_here.items():
            point.rewind()
            logits[backend] = point.step(variant).clone()
            graphs[backend] = capture(point, variant)[0]
        errors = {b: rel_err(logits[b], logits["grouped_mm"]) for b in logits
                  if b not in ("grouped_mm", NO_EXPERTS)}
        if errors["gemmtune"] > max(LOGITS_BOUND, 3 * errors.get("batched_mm", 0)):
            raise RuntimeError(f"{name} {label}: gemmtune's logits off grouped_mm's by "
                               f"{errors['gemmtune']:.2e} (batched_mm's by "
                               f"{errors.get('batched_mm', float('nan')):.2e})")
        if errors.get(FP8, 0) > FP8_LOGITS_BOUND:
            raise RuntimeError(f"{name} {label}: gemmtune's FP8 logits off grouped_mm's by "
                               f"{errors[FP8]:.2e}: not FP8's error, something broken")
        # Base gemmtune: each ratio is gemmtune's time over a backend's, per round.
        timed = time_point(point, timed_here, graphs, base="gemmtune")
        row = dict(model=name, point=label)
        for kind in ("eager", "graph"):
            row[f"{kind}_ms"] = round(timed[kind, "gemmtune"][0], 4)
            over = {b: 1 / timed[kind, b][1] for b in BACKENDS[:2] if b in timed_here}
            row.update((f"{kind}_x_{b}", round(over[b], 3) if b in over else "")
                       for b in BACKENDS[:2])
            row[f"{kind}_x_faster"] = round(min(over.values()), 3)
        row.update((f"logits_err_{b}", f"{errors[b]:.1e}" if b in errors else "")
                   for b in BACKENDS[1:])
        if fp8:  # FP8 experts: per-round ratios to gemmtune's bf16, medians to the others
            for kind in ("eager", "graph"):
                faster = min(timed[kind, b][0] for b in BACKENDS[:2] if b in timed_here)
                fp8_ms = timed[kind, FP8][0]
                row[f"fp8_{kind}_ms"] = round(fp8_ms, 4)
                row[f"fp8_{kind}_x_gemmtune"] = round(timed[kind, FP8][1], 3)
                row[f"fp8_{kind}_x_faster"] = round(faster / fp8_ms, 3)
            row["logits_err_fp8"] = f"{errors[FP8]:.1e}"
        if experts and label.startswith("decode"):
            row.update(ceiling_columns(experts_ceiling(point, model, bandwidth, launch),
                                       timed, timed_here))
        rows.append(row)
        del graphs
    del variants, model
    torch.cuda.empty_cache()
    return rows


def ceiling_columns(ceiling: ExpertsCeiling, timed: dict, timed_here: dict) -> dict:
    """The step's ceiling under CUDA graphs: the faster backend's step over the rest (the step
    with experts doing nothing) with every layer's experts at their floor; beside it, each
    backend's step less its layers' experts timed alone (what the rest would be if the experts
    cost in the step what they cost alone)."""
    faster = min(timed["graph", b][0] for b in BACKENDS[:2] if b in timed_here) * 1e3
    rest = timed["graph", NO_EXPERTS][0] * 1e3
    columns = {f"experts_us_{b}": round(t, 1) for b, t in ceiling.experts_us.items()}
    columns.update((f"step_less_experts_us_{b}", round(
        timed["graph", b][0] * 1e3 - LAYERS * t, 1)) for b, t in ceiling.experts_us.items()
        if b in timed_here)
    columns.update(experts_floor_us=round(ceiling.floor_us, 1), experts_distinct=ceiling.distinct,
                   step_rest_us=round(rest, 1),
                   graph_ceiling_x_faster=round(faster / (rest + LAYERS * ceiling.floor_us), 3))
    return columns


def report_ceilings(rows: list[dict]) -> None:
    print("CUDA-graph decode: one layer's experts alone (µs, graph replay), their floor, the "
          "step with experts doing nothing (rest), each step less its experts timed alone, and "
          "the step's ceiling over the faster backend")
    print(f"{'model':<14} {'point':<12} {'grouped':>8} {'batched':>8} {'gemmtune':>8} "
          f"{'floor':>7} {'picked':>6} {'rest':>7} {'g-less':>7} {'b-less':>7} {'t-less':>7} "
          f"{'ceiling':>7}")
    for r in rows:
        if "experts_floor_us" in r:
            print(f"{r['model']:<14} {r['point']:<12} {r['experts_us_grouped_mm']:>8} "
                  f"{r['experts_us_batched_mm']:>8} {r['experts_us_gemmtune']:>8} "
                  f"{r['experts_floor_us']:>7} {r['experts_distinct']:>6} "
                  f"{r['step_rest_us']:>7} {r['step_less_experts_us_grouped_mm']:>7} "
                  f"{r['step_less_experts_us_batched_mm']:>7} "
                  f"{r['step_less_experts_us_gemmtune']:>7} {r['graph_ceiling_x_faster']:>7}")


def report_fp8(rows: list[dict]) -> None:
    print("FP8 experts (patch_moe(quant='fp8')): their speed-up over gemmtune's bf16 (gt) and "
          "the faster of grouped_mm and batched_mm (f)")
    print(f"{'model':<14} {'point':<12} {'eager ms':>8} {'x gt':>6} {'x f':>6} {'graph ms':>8} "
          f"{'x gt':>6} {'x f':>6}  logits err")
    for r in rows:
        cells = " ".join(f"{r[f'fp8_{kind}_ms']:>8.3f} {r[f'fp8_{kind}_x_gemmtune']:>6} "
                         f"{r[f'fp8_{kind}_x_faster']:>6}" for kind in ("eager", "graph"))
        print(f"{r['model']:<14} {r['point']:<12} {cells}  {r['logits_err_fp8']}")


def report(rows: list[dict], out_dir: Path) -> None:
    models = "_".join(dict.fromkeys(r["model"] for r in rows))
    write_rows(rows, out_dir / f"e2e_hf_moe_{models}.csv")  # a run per model keeps each
    print(f"{torch.cuda.get_device_name()}, {LAYERS} layers, gemmtune's speed-up over "
          f"transformers' grouped_mm (g), batched_mm (b) and the faster of them (f)")
    print(f"{'model':<14} {'point':<12} {'eager ms':>8} {'x g':>6} {'x b':>6} {'x f':>6} "
          f"{'graph ms':>8} {'x g':>6} {'x b':>6} {'x f':>6}  logits err (gemmtune, batched)")
    for r in rows:
        cells = " ".join(f"{r[f'{kind}_ms']:>8.3f} " + " ".join(
            f"{r[f'{kind}_x_{b}']:>6}" for b in ("grouped_mm", "batched_mm", "faster"))
            for kind in ("eager", "graph"))
        print(f"{r['model']:<14} {r['point']:<12} {cells}  {r['logits_err_gemmtune']}, "
              f"{r['logits_err_batched_mm'] or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--fp8", action="store_true",
                        help="also gemmtune with its experts quantised to FP8 (per channel)")
    parser.add_argument("--experts", action="store_true",
                        help="also each backend's experts alone and the step's ceiling")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    gemmtune.experts.register()
    rows = [row for name in args.models.split(",")
            for row in run_model(name, args.fp8, args.experts)]
    report(rows, out_dir)
    if args.fp8:
        report_fp8(rows)
    if args.experts:
        report_ceilings(rows)


if __name__ == "__main__":
    main()
