"""``gemmtune bench fmoe``: the tuned fused MoE vs torch's grouped-GEMM pipeline vs the floors,
per (layer shape, token count), in one run on one device.

For every shape: the tuned op (through the tables in force) and the torch backend
(``torch.moe``: argsort routing, gather, ``torch._grouped_mm``, activation, ``torch._grouped_mm``,
weighted sum) on the same inputs (a seeded uniform top-k routing); the tuned output checked
against the fp32 expert-by-expert reference; both timed in alternation under CUDA-graph replay
with the experts rotated through copies larger than L2. Should torch's pipeline fail to capture,
it is timed eagerly instead and the row says so. The floors are those of ``gemmtune bench``:
the FLOPs of every routed pair's three projections, and the bytes of the experts the routing
reaches plus activations in and out, against ceilings measured in the same run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gemmtune.bench import (capped_geomean, cpu_summary, finish_report, geomean, plot_curves,
                            write_records)
from gemmtune.device import current_device
from gemmtune.families import get_family
from gemmtune.families.fmoe import quantised
from gemmtune.families.fmoe.inputs import quantised_experts, random_inputs, rank_mask
from gemmtune.families.fmoe.op import FmoeKey, expert_map_of, problem_of
from gemmtune.kernels.problem import Scaling
from gemmtune.kernels.torch_ref import TORCH_MOE, fused_moe_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.measure.ceilings import Ceilings, Floors, floors, measure_ceilings
from gemmtune.measure.gpulock import GpuLock, gpu_label
from gemmtune.measure.timing import cold_copies, eager_us, graph_replay_us, interleaved_graph_us
from gemmtune.tables.values import QuantType

# The token counts of the targets, by range: (label, lowest, highest).
TOKEN_RANGES = (("T=1", 1, 1), ("2<=T<=256", 2, 256), ("256<T<1024", 257, 1023),
                ("T>=1024", 1024, 1 << 62))
MOE_TOKENS = tuple(1 << i for i in range(14))  # 1, 2, 4, ..., 8192
CPU_TOKENS = (1, 3)


@dataclass
class MoeBenchRow:
    name: str  # the model, or where the shape came from
    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    q_type: str  # QuantType.No: bf16 experts
    torch_us: float  # NaN where torch has no fast path for the experts (FP8 block scales)
    tuned_us: float
    speedup: float
    bf16_us: float  # FP8 experts: the bf16 op of the same shape (NaN for bf16 experts)
    vs_bf16: float
    roofline_us: float
    attainable_us: float
    efficiency: float  # roofline_us / tuned_us
    attainable_efficiency: float
    torch_attainable_efficiency: float
    torch_timing: str  # "graph"; "eager" where torch's pipeline did not capture; "none"
    rule: str
    kernel: str
    rel_err: float
    ok: bool

    @property
    def layer(self) -> str:
        return f"D={self.model_dim} I={self.inter_dim} E={self.expert} top{self.topk}"


def _floors(key: FmoeKey, expert_map: torch.Tensor, ids: torch.Tensor, c: Ceilings) -> Floors:
    """The floors of the pairs routed to local experts: their FLOPs, and the bytes of the local
    experts they reach plus activations in and out."""
    p = problem_of(key)
    local = expert_map[ids.long()]
    reached = int(torch.unique(local[local >= 0]).numel())
    pairs = int((local >= 0).sum())
    weight_bytes = p.dtype.itemsize if p.scaling is Scaling.none else 1  # FP8 experts
    flops = 2.0 * pairs * 3 * p.inter_dim * p.model_dim
    nbytes = reached * 3 * p.inter_dim * p.model_dim * weight_bytes \
        + 2 * p.tokens * p.model_dim * p.dtype.itemsize
    return floors(flops, nbytes, c)


def _time_all(fns: dict[str, Callable], sets) -> dict[str, tuple[float, str]]:
    """name -> (µs per call, how it was timed): all in alternation under CUDA-graph replay; a
    function that does not capture (it reads a device value on the host) eagerly, and says so."""
    if not sets[0][0].is_cuda:
        return {name: (eager_us(lambda f=fn: f(sets[0]), 3)[0], "cpu") for name, fn in fns.items()}
    try:
        timed = interleaved_graph_us(list(fns.values()), sets)
        return {name: (us, "graph") for name, (us, _) in zip(fns, timed)}
    except RuntimeError:
        torch.cuda.synchronize()
    found = {}
    for name, fn in fns.items():
        try:
            found[name] = (graph_replay_us(fn, sets)[0], "graph")
        except RuntimeError:
            torch.cuda.synchronize()
            found[name] = (eager_us(lambda f=fn: f(sets[0]), 20)[0], "eager")
    return found


def bench_moe_shape(name: str, key: FmoeKey, ceilings: Ceilings | None,
                    gen: torch.Generator, ep: int = 1) -> MoeBenchRow:
    """One shape: the tuned op against torch's pipeline, and for FP8 experts also against the
    bf16 op of the same shape (both through the tables in force). With ``ep`` > 1 the key's
    experts are one expert-parallel rank's: tokens are routed over ``ep`` times as many."""
    from gemmtune import fused_moe as op

    problem = problem_of(key)
    hidden, w1, w2, weight, ids = random_inputs(problem, gen, global_experts=key.expert * ep)
    mask = rank_mask(key.expert, ep, hidden.device)
    expert_map = expert_map_of(mask, w1.shape[0], hidden.device)
    fused_moe = functools.partial(op, expert_mask=mask)
    nan = float("nan")
    if problem.scaling is Scaling.none:
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map)
        bound = TOLERANCES[problem.dtype][2]
        y = fused_moe(hidden, w1, w2, weight, ids)
        fns = {"tuned": lambda s: fused_moe(hidden, s[0], s[1], weight, ids),
               "torch": lambda s: fused_moe(hidden, s[0], s[1], weight, ids, kernel=TORCH_MOE)}
        sets = cold_copies((w1, w2)) if w1.is_cuda else [(w1, w2)]
    else:
        q_type = QuantType.from_str(key.q_type)
        w1q, w2q, scales = quantised_experts(w1, w2, q_type)
        ref = quantised.reference(hidden, w1q, w2q, weight, ids, expert_map, q_type, scales)
        bound = quantised.FP8_TOLERANCE[2]

        def fp8(s, kernel=None):
            return fused_moe(hidden, s[2], s[3], weight, ids, quant_type=q_type,
                             w1_scale=scales.w1, w2_scale=scales.w2, kernel=kernel)

        y = fp8((w1, w2, w1q, w2q))
        fns = {"tuned": fp8, "bf16": lambda s: fused_moe(hidden, s[0], s[1], weight, ids)}
        if quantised.why_not_scaled_grouped_mm(hidden, w1q, w2q, problem.scaling) is None:
            fns["torch"] = functools.partial(fp8, kernel=TORCH_MOE)
        sets = cold_copies((w1, w2, w1q, w2q)) if w1.is_cuda else [(w1, w2, w1q, w2q)]
    rel = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool(torch.isfinite(y).all()) and rel <= bound
    decision = get_family("fmoe").dispatcher.decide(key)
    times = _time_all(fns, sets)
    tuned_us = times["tuned"][0]
    torch_us, how = times.get("torch", (nan, "none"))
    bf16_us = times.get("bf16", (nan, ""))[0]
    f = _floors(key, expert_map, ids, ceilings) if ceilings is not None else Floors(nan, nan)
    eff, att_eff = f.efficiencies(tuned_us)
    return MoeBenchRow(name, key.token, key.model_dim, key.inter_dim, key.expert, key.topk,
                       key.q_type, torch_us, tuned_us, torch_us / tuned_us, bf16_us,
                       bf16_us / tuned_us, f.roofline_us, f.attainable_us, eff, att_eff,
                       f.efficiencies(torch_us)[1], how, decision.rule.value,
                       decision.kernel_name, rel, ok)


def _range_line(label: str, what: str, ratios: list[float]) -> str:
    return (f"{label:<11} {len(ratios):>3} shapes: {what} geomean {geomean(ratios):.3f} "
            f"(min {min(ratios):.3f})")


def summarize(rows: list[MoeBenchRow], gpu: bool) -> list[str]:
    """Per token range: the speed-up over torch's pipeline (where torch has one) and, for FP8
    experts, over the bf16 op, as geomeans with their minimum; the attainable efficiency geomean
    (capped at 1.0) of the tuned op and of torch."""
    if not gpu:
        return cpu_summary([r.ok for r in rows])
    lines = []
    for label, lo, hi in TOKEN_RANGES:
        sel = [r for r in rows if lo <= r.token <= hi]
        if not sel:
            continue
        tuned = capped_geomean([r.attainable_efficiency for r in sel])
        with_torch = [r for r in sel if r.torch_timing != "none"]
        if with_torch:
            torch_eff = capped_geomean([r.torch_attainable_efficiency for r in with_torch])
            lines.append(_range_line(label, "speed-up over torch", [r.speedup for r in with_torch])
                         + f"; attainable efficiency tuned {tuned:.3f}, torch {torch_eff:.3f}")
        else:
            lines.append(f"{label:<11} {len(sel):>3} shapes: attainable efficiency tuned "
                         f"{tuned:.3f} (torch has no fast path for these experts)")
        fp8 = [r for r in sel if r.q_type != QuantType.No.canonical]
        if fp8:
            lines.append(_range_line(label, "FP8 over the bf16 op", [r.vs_bf16 for r in fp8]))
    eager = [r for r in rows if r.torch_timing == "eager"]
    if eager:
        lines.append(f"torch timed eagerly (its pipeline did not capture in a graph) on "
                     f"{len(eager)} shape(s): its times include host work")
    slower = [r for r in rows if r.speedup < 1.0]
    if slower:
        lines.append("slower than torch: " + ", ".join(f"{r.name} T={r.token} {r.speedup:.3f}"
                                                       for r in slower))
    slower = [r for r in rows if r.vs_bf16 < 1.0]
    if slower:
        lines.append("FP8 slower than bf16: " + ", ".join(f"{r.name} T={r.token} {r.vs_bf16:.3f}"
                                                          for r in slower))
    return lines


def _ceilings(fp8: bool) -> Ceilings:
    """The GPU's ceilings now, the FLOP/s one from a GEMM of the benched experts' type."""
    big = torch.randn(8192, 8192, device="cuda")
    if fp8:
        a, b = big.to(torch.float8_e4m3fn), big.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        c = measure_ceilings(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                             2.0 * 8192 ** 3)
    else:
        a = big.to(torch.bfloat16)
        c = measure_ceilings(lambda: a @ a, 2.0 * 8192 ** 3)
    print(f"ceilings measured now: {c.bytes_per_s / 1e9:.0f} GB/s streaming read, "
          f"{c.flops_per_s / 1e12:.1f} TFLOP/s ({'FP8' if fp8 else 'bf16'}), t_launch "
          f"{c.launch_us:.2f} us")
    return c


def run_moe_bench(shapes: list[tuple[str, FmoeKey]], out_dir: Path, title: str,
                  ep: int = 1) -> int:
    gpu = torch.cuda.is_available()
    dev = current_device()
    print(f"GPU: {torch.cuda.get_device_name()} ({dev})" if gpu else
          f"no GPU found: benchmarking on the CPU ({dev}); times are CPU wall times")
    kinds = {key.q_type != QuantType.No.canonical for _, key in shapes}  # FP8 experts or not
    with GpuLock(gpu_label(torch.cuda.current_device())) if gpu else contextlib.nullcontext():
        # The FLOP/s ceiling of each kind of experts benched (a GEMM of their type).
        ceilings = {kind: _ceilings(kind) if gpu else None for kind in kinds}
        gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
        rows = []
        for name, key in shapes:
            kind = key.q_type != QuantType.No.canonical
            rows.append(bench_moe_shape(name, key, ceilings[kind], gen, ep))
            print(f"  {name} T={key.token}: tuned {rows[-1].tuned_us:.2f} us", flush=True)
    csv_path, png_path = out_dir / "bench_fmoe.csv", out_dir / "bench_fmoe.png"
    write_records([{k: format(v, ".6g") if isinstance(v, float) else v
                    for k, v in asdict(r).items()} for r in rows], csv_path)
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:  # FP8 rows: the speed-up over the bf16 op; bf16 rows: over torch
        is_fp8 = r.q_type != QuantType.No.canonical
        series.setdefault(f"{r.layer} {r.q_type}" if is_fp8 else r.layer, []).append(
            (r.token, r.vs_bf16 if is_fp8 else r.speedup, r.attainable_efficiency))
    why_no_plot = plot_curves(series, png_path, title, "tokens")
    fp8 = True in kinds
    print(f"{'shape':<16} {'T':>5} {'torch us':>9} {'tuned us':>9} {'speedup':>7} "
          + (f"{'bf16 us':>9} {'vs bf16':>7} " if fp8 else "")
          + f"{'att us':>8} {'att':>5} {'torch':>6} {'rule':<8} kernel")
    for r in rows:
        print(f"{r.name:<16} {r.token:>5} {r.torch_us:>9.2f} {r.tuned_us:>9.2f} "
              f"{r.speedup:>7.3f} " + (f"{r.bf16_us:>9.2f} {r.vs_bf16:>7.3f} " if fp8 else "")
              + f"{r.attainable_us:>8.2f} {r.attainable_efficiency:>5.3f} "
              f"{r.torch_timing:>6} {r.rule:<8} {r.kernel}" + ("" if r.ok else "  WRONG"))
    return finish_report(summarize(rows, gpu), csv_path, png_path, why_no_plot,
                         [f"{r.name} T={r.token}" for r in rows if not r.ok])


def bench_from_args(args) -> int:
    """``gemmtune bench fmoe``: the MoE layers of ``--model`` (per ``--tp`` rank) at ``--M``
    token counts with ``--q_type`` experts (bf16 by default), or the keys of an untuned fmoe CSV
    (``--shapes``)."""
    from gemmtune.models.shapes import load_preset, untuned_rows
    from gemmtune.tables.store import read_table

    if args.dtype not in (None, "bf16"):
        raise ValueError(f"fmoe benches bf16 experts, or FP8 ones with --q_type, not "
                         f"--dtype {args.dtype}")
    q_type = QuantType.from_str(args.q_type or "No")
    if isinstance(args.ep, bool) or not isinstance(args.ep, int) or args.ep < 1:
        raise ValueError(f"--ep {args.ep}: expected a positive number of expert-parallel ranks")
    out = Path(args.output)
    if args.shapes:
        if args.q_type:
            raise ValueError("--q_type is for --model; an untuned CSV names each row's q_type")
        keys = [r.key for r in read_table(args.shapes, get_family("fmoe").schema,
                                          untuned=True).rows]
        return run_moe_bench([("csv", key) for key in keys], out, str(args.shapes), args.ep)
    tokens = args.M or (MOE_TOKENS if torch.cuda.is_available() else CPU_TOKENS)
    rows = untuned_rows(load_preset(args.model), args.tp, tokens, fmoe_q_type=q_type,
                        ep=args.ep).get("fmoe")
    if not rows:
        raise ValueError(f"{args.model} has no MoE layers: bench its GEMMs with bf16")
    experts = "bf16" if q_type is QuantType.No else f"FP8 {q_type.canonical}"
    layout = f"ep={args.ep}" if args.ep > 1 else f"tp={args.tp}"
    return run_moe_bench([(args.model + (f"-ep{args.ep}" if args.ep > 1 else ""), r.key)
                          for r in rows], out,
                         f"{args.model} {layout} fused MoE, {experts} experts", args.ep)
