"""Issue 16 end to end: a Llama-architecture model in Hugging Face transformers with real
dimensions (llama3-8b, ``LAYERS`` decoder layers, random weights), every Linear (the lm_head
too) made MXFP4 by ``gemmtune.patch_linear(model, quant="mxfp4")``, against the bf16 model:
one decode step at batch 1 against a static KV cache, each as a captured CUDA graph, replayed
in alternation (``ROUNDS`` rounds of ``GRAPH_REPLAYS``); speed-up = bf16 ms / MXFP4 ms, the
median over the rounds of each round's ratio.

First the a16w4 rows the decode step needs (the Hugging Face layout's projections and the
lm_head at M = batch, both weight layouts) are tuned where the tables in force have none of
this GPU model (``gemmtune tune a16w4`` into $OUT/e2e_mxfp4_tuned.csv, an overlay for this
run), so that ``patch_linear`` picks each weight's layout from them.

Two more models have their sibling projections fused (``gemmtune.fuse_siblings``: q, k and v
as one GEMM, gate and up as one, as serving engines store them), timed in the same rounds: the
MXFP4 one, and the bf16 one through ``patch_linear`` (the tuned bf16 op), so that what fusing
gains and what MXFP4 gains show apart; the issue's baseline stays the bf16 model as Hugging
Face writes it.

Each model's GEMMs are also timed alone: the Linear layers' calls of one step, recorded with
their inputs and replayed in order as one CUDA graph; beside "the step less the step without
GEMMs" this tells whether the difference is the GEMM kernels' own time or work around them.

A third model, its Linear layers doing no work (an uninitialised output), times the rest of
the step (attention, norms, rotary embedding, sampling-free logits): what no GEMM can shorten.

Checks: the MXFP4 model's logits against the same model with each weight replaced by its
dequantised MXFP4 value in bf16 (``F.linear``): within 2e-2 relative (bf16 sums in another
order); and how far MXFP4 moves the logits from the bf16 model's (reported).

    PYTHONPATH=src python3 benchmarks/e2e_hf_mxfp4.py [--no-tune] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from torch import nn

import gemmtune
from gemmtune import quant

from e2e_hf import (MODELS, DecodePoint, capture, graph_of, ms_per_call, rel_err,
                    tune_into_overlay, tuned_here, use_overlay)

NAME = "llama3-8b"
LAYERS = 8
ROUNDS = 31
GRAPH_REPLAYS = 20


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=LAYERS, max_position_embeddings=8192,
                         rope_theta=500000.0, **MODELS[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def weight_shapes(name: str) -> list[tuple[int, int]]:
    """(N, K) of every Linear of the Hugging Face layout (q, k, v, o, gate, up, down, lm_head)
    and of the fused siblings (qkv, gate_up)."""
    d = MODELS[name]
    h, hd, inter = d["hidden_size"], d["head_dim"], d["intermediate_size"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    return sorted({(q, h), (kv, h), (h, q), (inter, h), (h, inter), (d["vocab_size"], h),
                   (q + 2 * kv, h), (2 * inter, h)})


def tune_missing(name: str, batch: int, out_dir: Path) -> None:
    """The a16w4 rows at M = ``batch`` that the tables in force lack for this GPU model (both
    layouts), tuned into $OUT/e2e_mxfp4_tuned.csv, made an overlay of the a16w4 table for this
    run."""
    from gemmtune.families.a16w4.op import DISPATCH, A16w4Key

    tuned = out_dir / "e2e_mxfp4_tuned.csv"
    use_overlay("GEMMTUNE_CONFIG_A16W4", tuned)  # an earlier run's, before looking for gaps
    missing = [(n, k, packed) for n, k in weight_shapes(name) for packed in (False, True)
               if not tuned_here(DISPATCH, A16w4Key(batch, n, k, "torch.bfloat16", packed))]
    tune_into_overlay("a16w4", "GEMMTUNE_CONFIG_A16W4", "M,N,K,dtype,packed\n",
                      [f"{batch},{n},{k},torch.bfloat16,{packed}\n" for n, k, packed in missing],
                      tuned, "--timeout", "60")


class _NoGemm(nn.Linear):
    """A Linear that multiplies nothing (its output uninitialised): the step without GEMMs."""

    def forward(self, x):
        return x.new_empty(*x.shape[:-1], self.out_features)


def linear_calls(point, model) -> list[tuple[nn.Module, torch.Tensor]]:
    """The Linear layers' calls of one eager step, in order, each with its input (the same
    tensor object where siblings read the same input, so that a fused group still computes
    once)."""
    calls = []

    def record(module, args, kwargs):
        calls.append((module, args[0] if args else kwargs["input"]))

    hooks = [module.register_forward_pre_hook(record, with_kwargs=True)
             for module in model.modules()
             if isinstance(module, (nn.Linear, gemmtune.Mxfp4Linear))]
    try:
        point.rewind()
        point.step(model)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def gemms_alone_graph(calls: list[tuple[nn.Module, torch.Tensor]]) -> torch.cuda.CUDAGraph:
    """The recorded calls replayed in order, as one CUDA graph."""
    def run():
        for module, x in calls:
            module(x)
    return graph_of(run)[0]


def dequantised(model):
    """``model`` with every Linear's weight replaced by its MXFP4 value in bf16, in place."""
    for module in model.modules():
        if type(module) is nn.Linear:
            wq, ws = quant.mxfp4(module.weight.float())
            module.weight.data.copy_(quant.dequant_mxfp4(wq, ws).to(module.weight.dtype))
    return model


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_tune:
        tune_missing(NAME, args.batch, out_dir)
    bf16 = build(NAME)
    mxfp4 = build(NAME)
    layers = gemmtune.patch_linear(mxfp4, quant="mxfp4")
    packed = sum(getattr(m, "weight_packed", False) for m in mxfp4.modules())
    example = torch.ones(args.batch, 1, dtype=torch.long, device="cuda")
    fused = build(NAME)
    gemmtune.patch_linear(fused, quant="mxfp4")
    groups = gemmtune.fuse_siblings(fused, example)
    bf16_fused = build(NAME)
    gemmtune.patch_linear(bf16_fused)
    gemmtune.fuse_siblings(bf16_fused, example)
    reference = dequantised(build(NAME))
    point = DecodePoint(bf16, args.batch)
    logits = {}
    for label, model in (("bf16", bf16), ("bf16 fused", bf16_fused), ("mxfp4", mxfp4),
                         ("mxfp4 fused", fused), ("reference", reference)):
        point.rewind()
        logits[label] = point.step(model).clone()
    for label in ("mxfp4", "mxfp4 fused"):
        kernel_err = rel_err(logits[label], logits["reference"])
        if kernel_err > 2e-2:
            raise RuntimeError(f"{label} logits off the dequantised-weight model's by "
                               f"{kernel_err:.2e}")
    del reference
    no_gemm = build(NAME)
    for module in no_gemm.modules():
        if type(module) is nn.Linear:
            module.__class__ = _NoGemm
    bf16_err = rel_err(logits["bf16 fused"], logits["bf16"])
    if bf16_err > 2e-2:
        raise RuntimeError(f"bf16 fused logits off the bf16 model's by {bf16_err:.2e}")
    graphs = {label: capture(point, model)[0] for label, model in (
        ("bf16", bf16), ("bf16 fused", bf16_fused), ("mxfp4", mxfp4), ("mxfp4 fused", fused),
        ("no GEMM", no_gemm))}
    ratios = {"mxfp4": [], "mxfp4 fused": [], "bf16 fused": []}
    alone = {f"{label} GEMMs alone": gemms_alone_graph(linear_calls(point, model))
             for label, model in (("bf16", bf16), ("mxfp4", mxfp4), ("mxfp4 fused", fused))}
    graphs.update(alone)
    times = {label: [] for label in graphs}
    fused_over_fused = []
    for i in range(ROUNDS):
        order = list(graphs) if i % 2 == 0 else list(reversed(graphs))
        for label in order:
            times[label].append(ms_per_call(point, graphs[label].replay, GRAPH_REPLAYS))
        for label, each in ratios.items():
            each.append(times["bf16"][-1] / times[label][-1])
        fused_over_fused.append(times["bf16 fused"][-1] / times["mxfp4 fused"][-1])
    kinds = sorted({"+".join(name.split(".")[-1] for name in group) for group in groups})
    print(f"{torch.cuda.get_device_name()}, {NAME}, {LAYERS} layers, {layers} Linear layers "
          f"MXFP4 ({packed} packed), decode batch {args.batch}, CUDA graphs; fused: "
          f"{len(groups)} groups ({', '.join(kinds)})")
    rest = statistics.median(times["no GEMM"])
    bf16_ms = statistics.median(times["bf16"])
    print(f"bf16 {bf16_ms:.3f} ms; the step without GEMMs {rest:.3f} ms, so the GEMMs take "
          f"{bf16_ms - rest:.3f} ms in bf16")
    for label, each in ratios.items():
        ms = statistics.median(times[label])
        print(f"{label} {ms:.3f} ms (GEMMs {ms - rest:.3f} ms): speed-up over bf16 "
              f"{statistics.median(each):.3f} (rounds {min(each):.3f}-{max(each):.3f}); logits "
              f"vs the dequantised-weight model {rel_err(logits[label], logits['reference']):.1e}, "
              f"vs bf16 {rel_err(logits[label], logits['bf16']):.1e}")
    print(f"mxfp4 fused over bf16 fused: {statistics.median(fused_over_fused):.3f} (rounds "
          f"{min(fused_over_fused):.3f}-{max(fused_over_fused):.3f})")
    for label in alone:
        print(f"{label}: {statistics.median(times[label]):.3f} ms (one graph of the step's "
              f"Linear calls in order)")


if __name__ == "__main__":
    main()
