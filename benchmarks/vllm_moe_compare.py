"""Our fused MoE against vLLM's Triton fused-MoE kernel, in one process, on one GPU.

    PYTHONPATH=src python3 benchmarks/vllm_moe_compare.py --vllm-dir DIR [--model NAME]
        [--tokens 1,2,...] [--tuned CSV] [--out DIR]
    PYTHONPATH=src TRITON_INTERPRET=1 python3 benchmarks/vllm_moe_compare.py --vllm-dir DIR --smoke

``DIR`` is vLLM's ``vllm/model_executor/layers/fused_moe`` folder, taken from a vLLM wheel
(``pip download vllm --no-deps``, unzip) and kept out of the repository. Nothing of vLLM is
imported as a package: its ``@triton.jit`` kernels (``fused_moe_kernel`` and the helpers it
calls) and its ``get_default_config`` are cut out of ``fused_moe.py`` by name and loaded from a
scratch module under ``--out``, beside stand-ins for the few vLLM globals they read. Its config
for the shape is chosen as vLLM chooses it: ``configs/E=..,N=..,device_name=...json`` at the
nearest token count, else ``get_default_config``. Its block assignment is vLLM's too: none (one
pair per block) where ``T * topk * 4 <= E``, else the same grouping by expert as ours (our routing
preparation makes vLLM's ``sorted_token_ids``/``expert_ids``/``num_tokens_post_padded`` layout).

Timed together (graph replay, alternating, weights rotated through copies larger than L2):
- ours: ``gemmtune.fused_moe`` through the tables (routing preparation included);
- vLLM GEMMs: its two kernel launches alone, without its routing, activation or sum (the issue's
  target: ours below this);
- vLLM whole: the two launches plus the activation and the sum over slots as torch ops (silu,
  mul, sum: three launches);
- vLLM lean: the two launches plus one launch for the activation (a Triton ``silu(gate) * up``,
  as vLLM's own ``silu_and_mul`` op) and one for the sum: the issue's "two GEMM kernels plus
  activation and sum", launch for launch as vLLM runs them.
Every output is checked against the fp32 reference. ``--smoke`` runs one tiny fp32 case through
both on the interpreter: the plumbing, not the speed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemmtune
from gemmtune.dispatch import use_tables
from gemmtune.families.fmoe.inputs import random_inputs
from gemmtune.families.fmoe.op import SCHEMA, expert_map_of
from gemmtune.kernels.problem import MoeProblem
from gemmtune.kernels.torch_ref import fused_moe_ref
from gemmtune.kernels.triton.moe_routing import moe_routing
from gemmtune.kernels.triton.moe_common import SILU, gated_activation
from gemmtune.bench import write_records
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "deepseek-v3-tp8": (7168, 256, 256, 8)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WANTED = ("fused_moe_kernel", "get_default_config")
STAND_INS = '''
import types
import torch
import triton
import triton.language as tl

next_power_of_2 = triton.next_power_of_2
envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
current_platform = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True)
'''


def load_vllm(vllm_dir: Path, scratch: Path):
    """vLLM's kernel and default-config rule, cut out of its fused_moe.py with the functions
    they call, into a scratch module."""
    source = (vllm_dir / "fused_moe.py").read_text()
    functions = {node.name: node for node in ast.parse(source).body
                 if isinstance(node, ast.FunctionDef)}
    needed, todo = [], list(WANTED)
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.append(name)
        todo += [n.id for n in ast.walk(functions[name])
                 if isinstance(n, ast.Name) and n.id in functions and n.id not in needed]
    parts = [STAND_INS]
    for name in sorted(needed, key=lambda n: functions[n].lineno):
        node = functions[name]
        # A function's source segment leaves out its decorators: @triton.jit goes back on.
        jit = any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)
        parts.append(("@triton.jit\n" if jit else "") + ast.get_source_segment(source, node))
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "_vllm_fused_moe_cut.py"
    path.write_text("\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("_vllm_fused_moe_cut", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_config(vllm, vllm_dir: Path, tokens: int, experts: int, inter_dim: int,
                model_dim: int, topk: int) -> tuple[dict, str]:
    """vLLM's config for the shape and where it came from (its JSON, or its default)."""
    device = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    path = vllm_dir / "configs" / f"E={experts},N={inter_dim},device_name={device}.json"
    if path.exists():
        table = {int(m): config for m, config in json.loads(path.read_text()).items()}
        return dict(table[min(table, key=lambda m: abs(m - tokens))]), path.name
    return dict(vllm.get_default_config(tokens, experts, inter_dim, model_dim, topk, None,
                                        None)), "default"


class VllmMoe:
    """vLLM's two GEMM launches over one routing, as its fused_experts makes them, with the
    activation and the sum over slots between and after as torch ops."""

    def __init__(self, vllm, config: dict, hidden, w1, w2, weight, ids):
        self.vllm, self.w1, self.w2 = vllm, w1, w2
        self.hidden, self.weight, self.ids = hidden, weight, ids
        tokens, self.topk = ids.shape
        experts, self.inter_dim = w1.shape[0], w2.shape[2]
        self.config = {**config, "SPLIT_K": 1}
        self.block_k = self.config.pop("BLOCK_SIZE_K")
        block_m = self.config["BLOCK_SIZE_M"]
        self.naive = tokens * self.topk * 4 <= experts
        if self.naive:  # vLLM's low-latency path: one pair per block, no grouping
            self.sorted_ids = None
            self.block_expert = ids.reshape(-1)
            self.rows_used = torch.full((1,), ids.numel() * block_m, dtype=torch.int32,
                                        device=ids.device)
        else:
            routing = moe_routing(ids, expert_map_of(None, experts, ids.device), experts,
                                  block_m, sentinels=True)  # vLLM's kernel masks by them
            self.sorted_ids, self.block_expert = routing.sorted_ids, routing.block_expert
            self.rows_used = routing.rows_used
        pairs = ids.numel()
        self.inter1 = torch.empty(tokens, self.topk, 2 * self.inter_dim, dtype=hidden.dtype,
                                  device=hidden.device)
        self.act = torch.empty(pairs, self.inter_dim, dtype=hidden.dtype, device=hidden.device)
        self.out2 = torch.empty(tokens, self.topk, w2.shape[1], dtype=hidden.dtype,
                                device=hidden.device)
        self.compute_type = {torch.bfloat16: vllm.tl.bfloat16, torch.float16: vllm.tl.float16,
                             torch.float32: vllm.tl.float32}[hidden.dtype]

    def _gemm(self, a, b, c, mul_weight: bool, top_k: int) -> None:
        block_m, block_n = self.config["BLOCK_SIZE_M"], self.config["BLOCK_SIZE_N"]
        if self.sorted_ids is None:
            em = self.ids.numel() * block_m
        else:
            em = self.sorted_ids.numel()
            if a.shape[0] < block_m:
                em = min(em, a.shape[0] * top_k * block_m)
        grid = (self.vllm.triton.cdiv(em, block_m) * self.vllm.triton.cdiv(b.shape[1], block_n),)
        self.vllm.fused_moe_kernel[grid](
            a, b, c, None, None, None, self.weight, self.sorted_ids, self.block_expert,
            self.rows_used, b.shape[1], b.shape[2], em, self.ids.numel(),
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
            c.stride(1), c.stride(2), 0, 0, 0, 0, 0, 0, 0, 0, 0,
            MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k, compute_type=self.compute_type,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
            per_channel_quant=False, naive_block_assignment=self.sorted_ids is None,
            HAS_BIAS=False, BLOCK_SIZE_K=self.block_k, SWAP_AB=False, USE_TD=False,
            **self.config)

    def gemms(self, weights) -> None:
        """Both GEMM launches alone (stage 2 reads the last activation: the same work)."""
        w1, w2 = weights
        self._gemm(self.hidden, w1, self.inter1, False, self.topk)
        self._gemm(self.act, w2, self.out2, True, 1)

    def lean(self, weights) -> torch.Tensor:
        w1, w2 = weights
        self._gemm(self.hidden, w1, self.inter1, False, self.topk)
        pairs = self.act.shape[0]
        silu_and_mul_kernel[(pairs, triton.cdiv(self.inter_dim, ACT_BLOCK))](
            self.inter1, self.act, self.inter_dim, ACT=SILU, BLOCK=ACT_BLOCK)
        self._gemm(self.act, w2, self.out2, True, 1)
        return self.out2.sum(dim=1)

    def whole(self, weights) -> torch.Tensor:
        w1, w2 = weights
        self._gemm(self.hidden, w1, self.inter1, False, self.topk)
        h = self.inter1.view(-1, 2 * self.inter_dim)
        torch.mul(F.silu(h[:, :self.inter_dim]), h[:, self.inter_dim:], out=self.act)
        self._gemm(self.act, w2, self.out2, True, 1)
        return self.out2.sum(dim=1)


ACT_BLOCK = 1024


@triton.jit
def silu_and_mul_kernel(h_ptr, out_ptr, I, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = silu(h[row, :I]) * h[row, I:]: the activation in one launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < I
    act = gated_activation(tl.load(h_ptr + row * 2 * I + cols, mask=inside, other=0.0),
                           tl.load(h_ptr + row * 2 * I + I + cols, mask=inside, other=0.0),
                           ACT)
    tl.store(out_ptr + row * I + cols, act.to(out_ptr.dtype.element_ty), mask=inside)


def inputs(tokens, model_dim, inter_dim, experts, topk, dtype, device, seed):
    """The tuner's random inputs of the shape (``families.fmoe.inputs``), seeded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p = MoeProblem(tokens, model_dim, inter_dim, experts, topk, dtype)
    hidden, w1, w2, weight, ids = random_inputs(p, gen)
    return hidden, w1, w2, weight, ids


def rel_err(y, ref) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def smoke(vllm, vllm_dir: Path) -> None:
    """One tiny fp32 case through vLLM's kernel and ours, against the reference (both block
    assignments of vLLM: grouped and one pair per block)."""
    for experts in (4, 64):  # 5 tokens x 2: grouped with 4 experts, one pair a block with 64
        hidden, w1, w2, weight, ids = inputs(5, 32, 16, experts, 2, torch.float32, "cpu", 0)
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, experts, "cpu"))
        config, source = vllm_config(vllm, vllm_dir, 5, experts, 16, 32, 2)
        config.update(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)  # the interpreter's
        theirs = VllmMoe(vllm, config, hidden, w1, w2, weight, ids)
        ours = gemmtune.fused_moe(hidden, w1, w2, weight, ids,
                                  kernel="triton.moe1:BM16.BN16.BK16.W4.S1"
                                         "+triton.moe2:BM16.BN16.BK16.SK1.W4.S1")
        print(f"E={experts} ({'one pair a block' if theirs.naive else 'grouped'}, {source}): "
              f"vLLM rel_err {rel_err(theirs.whole((w1, w2)), ref):.1e}, lean "
              f"{rel_err(theirs.lean((w1, w2)), ref):.1e}, ours "
              f"{rel_err(ours, ref):.1e}")


def compare(vllm, vllm_dir: Path, model: str, token_counts) -> list[dict]:
    model_dim, inter_dim, experts, topk = SHAPES[model]
    rows = []
    for tokens in token_counts:
        hidden, w1, w2, weight, ids = inputs(tokens, model_dim, inter_dim, experts, topk,
                                             torch.bfloat16, "cuda", tokens)
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, experts, "cuda"))
        config, source = vllm_config(vllm, vllm_dir, tokens, experts, inter_dim, model_dim,
                                     topk)
        theirs = VllmMoe(vllm, config, hidden, w1, w2, weight, ids)
        sets = cold_copies((w1, w2))

        def ours(weights):
            return gemmtune.fused_moe(hidden, weights[0], weights[1], weight, ids)

        ours_err = rel_err(ours((w1, w2)), ref)
        theirs_err = rel_err(theirs.whole((w1, w2)), ref)
        lean_err = rel_err(theirs.lean((w1, w2)), ref)
        plans = gemmtune.get_family("fmoe").dispatcher.plans.values()
        plan = next(p for p in plans if p.decision.key.token == tokens)  # this call's
        (ours_us, _), (gemms_us, _), (lean_us, _), (whole_us, _) = interleaved_graph_us(
            [ours, theirs.gemms, theirs.lean, theirs.whole], sets)
        rows.append(dict(model=model, tokens=tokens, ours_us=round(ours_us, 2),
                         vllm_gemms_us=round(gemms_us, 2), vllm_lean_us=round(lean_us, 2),
                         vllm_whole_us=round(whole_us, 2),
                         vs_gemms=round(gemms_us / ours_us, 3),
                         vs_lean=round(lean_us / ours_us, 3),
                         vs_whole=round(whole_us / ours_us, 3),
                         ours_err=f"{ours_err:.1e}", vllm_err=f"{theirs_err:.1e}",
                         vllm_lean_err=f"{lean_err:.1e}",
                         vllm_config=source, vllm_naive=theirs.naive,
                         vllm_block_m=config["BLOCK_SIZE_M"],
                         ours_kernel=plan.decision.kernel_name))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-dir", type=Path, required=True,
                   help="vLLM's vllm/model_executor/layers/fused_moe folder")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--tuned", type=Path, default=None,
                   help="dispatch from this tuned_fmoe.csv alone (default: the tables in force)")
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--smoke", action="store_true", help="a tiny fp32 check on the interpreter")
    args = p.parse_args()
    if not (args.vllm_dir / "fused_moe.py").is_file():
        p.error(f"--vllm-dir {args.vllm_dir}: no fused_moe.py there")
    vllm = load_vllm(args.vllm_dir, args.out)
    if args.smoke:
        smoke(vllm, args.vllm_dir)
        return
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.tuned is not None:
        with use_tables(SCHEMA, [args.tuned]):
            rows = compare(vllm, args.vllm_dir, args.model, token_counts)
    else:
        rows = compare(vllm, args.vllm_dir, args.model, token_counts)
    write_records(rows, args.out / f"vllm_moe_{args.model}.csv")
    print(f"{'T':>5} {'ours':>9} {'vLLM GEMMs':>10} {'vLLM lean':>10} {'vLLM whole':>10} "
          f"{'x GEMMs':>8} {'x lean':>8} {'x whole':>8}  vLLM config")
    for r in rows:
        print(f"{r['tokens']:>5} {r['ours_us']:>9} {r['vllm_gemms_us']:>10} "
              f"{r['vllm_lean_us']:>10} {r['vllm_whole_us']:>10} {r['vs_gemms']:>8} "
              f"{r['vs_lean']:>8} {r['vs_whole']:>8}  "
              f"{r['vllm_config']} BM{r['vllm_block_m']}{' one-pair' if r['vllm_naive'] else ''}")


if __name__ == "__main__":
    main()
