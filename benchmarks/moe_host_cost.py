"""Host cost of one eager MoE layer's experts, on the GPU: where a decode step spends its host
time when the experts run through gemmtune.

At dims small enough that every variant is host-bound (hidden 256, inter 128, 16 experts, top 4),
each case times many back-to-back eager calls (µs per call, the device synchronised at the end
of each loop) of:
- ``plain``: fused_moe's checked path (key, plan, then the solution's Python and Triton's
  ``kernel[grid]`` launches), as every call went before its chain was recorded;
- ``fused_moe``: the op's eager hot path (one dict hit, the recorded chain replayed), and
  whether the chain was recorded (else why not);
- ``experts``: ``gemmtune.experts.experts_forward`` on a transformers Qwen3-MoE experts module
  of those dims (the router's int64 ids and bf16 weights cast for fused_moe), beside
  transformers' ``batched_mm`` and ``grouped_mm`` on the same module and inputs;
and the GPU time of one fused_moe call (graph replay) to show the host is what is timed.
Writes $OUT/moe_host_cost.csv and prints the table.

    PYTHONPATH=src python3 benchmarks/moe_host_cost.py
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path

import torch

import gemmtune
from gemmtune import quant
from gemmtune.families.fmoe import op
from gemmtune.measure.timing import graph_replay_us, host_us_per_call
from gemmtune.tables.values import ActivationType, QuantType

DIMS = dict(model_dim=256, inter_dim=128, experts=16, topk=4)
PAIR_BLOCKS = ("triton.moe1:BM16.BN64.BK128.W4.S4.PB1"
               "+triton.moe2:BM16.BN128.BK128.SK1.W4.S3.PB1")
CASES = {  # label: (tokens, quant type, kernel)
    "T=1 pair blocks": (1, QuantType.No, PAIR_BLOCKS),
    "T=8 one stage": (8, QuantType.No, "triton.moe_1stage:BN32.BK128.BD64.BI128.W4.S4"),
    "T=32 routed": (32, QuantType.No, "triton.moe1:BM16.BN64.BK128.W4.S3"
                    "+triton.moe2:BM16.BN64.BK128.SK1.W4.S3"),
    "T=1 stream": (1, QuantType.No, "triton.moe_stream:BN8.BK256.BD8.BI128.W4"),
    "T=1 fp8 token": (1, QuantType.per_Token, PAIR_BLOCKS),
    "T=1 fp8 1x128 QO1": (1, QuantType.per_1x128, "triton.moe1:BM16.BN64.BK128.W4.S4.PB1.P0"
                          ".SK1.QO1+triton.moe2:BM16.BN128.BK128.SK1.W4.S3.PB1"),
    "T=1 split stage 2": (1, QuantType.No, "triton.moe1:BM16.BN64.BK128.W4.S4.PB1"
                          "+triton.moe2:BM16.BN128.BK64.SK2.W4.S3.PB1"),
    "T=64 persistent": (64, QuantType.No, "triton.moe1:BM64.BN64.BK64.W4.S3.PB0.P1"
                        "+triton.moe2:BM64.BN128.BK64.SK1.W8.S3.PB0.P2"),
}
CALLS, LOOPS = 400, 7


def _inputs(tokens: int, q_type: QuantType):
    d, i, e, k = (DIMS[n] for n in ("model_dim", "inter_dim", "experts", "topk"))
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(e, 2 * i, d, device="cuda", generator=gen) / d ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, i, device="cuda", generator=gen) / i ** 0.5).to(torch.bfloat16)
    weight, ids = torch.topk(torch.rand(tokens, e, device="cuda", generator=gen), k, dim=1)
    scales = {}
    if q_type is not QuantType.No:
        w1, s1 = quant.quantize_experts(w1, q_type)
        w2, s2 = quant.quantize_experts(w2, q_type)
        scales = dict(w1_scale=s1, w2_scale=s2)
    return (hidden, w1, w2, weight.float(), ids.to(torch.int32)), scales, ids, weight


def op_case(label: str) -> dict:
    tokens, q_type, kernel = CASES[label]
    args, scales, _, _ = _inputs(tokens, q_type)
    checked = None if not scales else op.checked_scales(q_type, args[0], args[1], args[2],
                                                        scales["w1_scale"],
                                                        scales["w2_scale"], None, None)

    def fast():
        return op.fused_moe(*args, quant_type=q_type, kernel=kernel, **scales)

    def plain():
        return op._run(*args, ActivationType.Silu, q_type, False, None, kernel, checked)

    for _ in range(3):
        fast()
    # (bf16's tolerance: the 1-stage kernel's atomics add in no fixed order)
    torch.testing.assert_close(fast(), plain())
    gpu_us = graph_replay_us(lambda _: fast(), [None])[0]
    plain_us = host_us_per_call(plain, CALLS, LOOPS)
    fast_us = host_us_per_call(fast, CALLS, LOOPS)
    chain = op.bound_call(*args, quant_type=q_type, kernel=kernel, **scales).chain
    recorded = chain.refusal or ("yes" if not chain.declines else
                                 f"yes, {chain.declines} calls declined")
    return dict(case=label, recorded=recorded,
                plain_us=round(plain_us, 2), fused_moe_us=round(fast_us, 2),
                gpu_us=round(gpu_us, 2))


def experts_module():
    """A transformers Qwen3-MoE experts module of DIMS, random bf16 weights."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=DIMS["model_dim"], moe_intermediate_size=DIMS["inter_dim"],
        num_experts=DIMS["experts"], num_experts_per_tok=DIMS["topk"])
    module = Qwen3MoeExperts(config).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
    return module


def experts_cases() -> list[dict]:
    """experts_forward against transformers' backends on one module, per token count (the
    caller's table, ``table_of_cases``, names the kernels of CASES' bf16 rows)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    module = experts_module()
    functions = {b: ALL_EXPERTS_FUNCTIONS[b] for b in ("batched_mm", "grouped_mm")}
    functions["gemmtune"] = gemmtune.experts.experts_forward
    rows = []
    for tokens in sorted({t for t, q, _ in CASES.values() if q is QuantType.No}):
        _, _, ids, weight = _inputs(tokens, QuantType.No)
        hidden = torch.randn(tokens, DIMS["model_dim"], device="cuda").to(torch.bfloat16)
        weight = weight.to(torch.bfloat16)  # as Qwen3-MoE's router gives them, ids int64
        row = dict(case=f"experts T={tokens}")
        with torch.no_grad():
            for name, f in functions.items():
                row[f"{name}_us"] = round(host_us_per_call(
                    lambda f=f: f(module, hidden, ids, weight), CALLS, LOOPS), 2)
        rows.append(row)
    return rows


def table_of_cases(path: Path) -> None:
    """A tuned_fmoe table naming each bf16 case's kernel for its token count."""
    dev = gemmtune.current_device()
    d, i, e, k = (DIMS[n] for n in ("model_dim", "inter_dim", "experts", "topk"))
    lines = ["arch,cu_num,token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,"
             "q_dtype_w,q_type,use_g1u1,doweight_stage1,block_m,ksplit,us1,kernelName1,err1,"
             "us2,kernelName2,err2,us,run_1stage"]
    seen = set()
    for tokens, q_type, kernel in CASES.values():
        if q_type is not QuantType.No or tokens in seen or "SK2" in kernel:
            continue
        seen.add(tokens)
        first, _, second = kernel.partition("+")
        lines.append(f"{dev.arch},{dev.cu_num},{tokens},{d},{i},{e},{k},ActivationType.Silu,"
                     f"dtypes.bf16,dtypes.bf16,dtypes.bf16,QuantType.No,True,False,16,1,1.0,"
                     f"{first},0.1%,1.0,{second},0.1%,2.0,{0 if second else 1}")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [op_case(label) for label in CASES]
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "tuned_fmoe.csv"
        table_of_cases(table)
        os.environ["GEMMTUNE_CONFIG_FMOE"] = f"replace:{table}"
        gemmtune.reset()
        experts = experts_cases()
    with open(out_dir / "moe_host_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({c for r in rows + experts for c in r}))
        writer.writeheader()
        writer.writerows(rows + experts)
    print(f"{torch.cuda.get_device_name()}: host µs per eager call, {DIMS}")
    print(f"{'case':<20} {'plain':>7} {'fused_moe':>9} {'gpu':>6}  recorded")
    for r in rows:
        print(f"{r['case']:<20} {r['plain_us']:>7} {r['fused_moe_us']:>9} {r['gpu_us']:>6}  "
              f"{r['recorded']}")
    print(f"{'experts':<20} {'gemmtune':>9} {'batched_mm':>10} {'grouped_mm':>10}")
    for r in experts:
        print(f"{r['case']:<20} {r['gemmtune_us']:>9} {r['batched_mm_us']:>10} "
              f"{r['grouped_mm_us']:>10}")


if __name__ == "__main__":
    main()
