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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gemmtune.bench import (capped_geomean, cpu_summary, finish_report, geomean, plot_curves,
                            write_records)
from gemmtune.device import current_device
from gemmtune.families import get_family
from gemmtune.families.fmoe.inputs import random_inputs
from gemmtune.families.fmoe.op import FmoeKey, expert_map_of, problem_of
from gemmtune.kernels.torch_ref import TORCH_MOE, fused_moe_ref
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.measure.ceilings import Ceilings, Floors, floors, measure_ceilings
from gemmtune.measure.gpulock import GpuLock, gpu_label
from gemmtune.measure.timing import cold_copies, eager_us, graph_replay_us, interleaved_graph_us

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
    torch_us: float
    tuned_us: float
    speedup: float
    roofline_us: float
    attainable_us: float
    efficiency: float  # roofline_us / tuned_us
    attainable_efficiency: float
    torch_attainable_efficiency: float
    torch_timing: str  # "graph", or "eager" where torch's pipeline did not capture
    rule: str
    kernel: str
    rel_err: float
    ok: bool

    @property
    def layer(self) -> str:
        return f"D={self.model_dim} I={self.inter_dim} E={self.expert} top{self.topk}"


def _floors(key: FmoeKey, ids: torch.Tensor, c: Ceilings) -> Floors:
    p = problem_of(key)
    reached = int(torch.unique(ids).numel())
    itemsize = p.dtype.itemsize
    flops = 2.0 * p.tokens * p.topk * 3 * p.inter_dim * p.model_dim
    nbytes = (reached * 3 * p.inter_dim * p.model_dim + 2 * p.tokens * p.model_dim) * itemsize
    return floors(flops, nbytes, c)


def _time_pair(tuned, torch_fn, sets) -> tuple[float, float, str]:
    """(torch µs, tuned µs, how torch was timed)."""
    if not sets[0][0].is_cuda:
        return eager_us(lambda: torch_fn(sets[0]), 3)[0], eager_us(lambda: tuned(sets[0]), 3)[0], \
            "cpu"
    try:
        (torch_us, _), (tuned_us, _) = interleaved_graph_us([torch_fn, tuned], sets)
        return torch_us, tuned_us, "graph"
    except RuntimeError:  # torch's pipeline read a device value on the host: no capture
        torch.cuda.synchronize()
        tuned_us = graph_replay_us(tuned, sets)[0]
        return eager_us(lambda: torch_fn(sets[0]), 20)[0], tuned_us, "eager"


def bench_moe_shape(name: str, key: FmoeKey, ceilings: Ceilings | None,
                    gen: torch.Generator) -> MoeBenchRow:
    from gemmtune import fused_moe

    hidden, w1, w2, weight, ids = random_inputs(problem_of(key), gen)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, w1.shape[0],
                                                                    hidden.device))
    y = fused_moe(hidden, w1, w2, weight, ids)
    rel = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool(torch.isfinite(y).all()) and rel <= TOLERANCES[problem_of(key).dtype][2]
    decision = get_family("fmoe").dispatcher.decide(key)
    sets = cold_copies((w1, w2)) if w1.is_cuda else [(w1, w2)]
    torch_us, tuned_us, how = _time_pair(
        lambda s: fused_moe(hidden, s[0], s[1], weight, ids),
        lambda s: fused_moe(hidden, s[0], s[1], weight, ids, kernel=TORCH_MOE), sets)
    nan = float("nan")
    f = _floors(key, ids, ceilings) if ceilings is not None else Floors(nan, nan)
    eff, att_eff = f.efficiencies(tuned_us)
    return MoeBenchRow(name, key.token, key.model_dim, key.inter_dim, key.expert, key.topk,
                       torch_us, tuned_us, torch_us / tuned_us, f.roofline_us, f.attainable_us,
                       eff, att_eff, f.efficiencies(torch_us)[1], how, decision.rule.value,
                       decision.kernel_name, rel, ok)


def summarize(rows: list[MoeBenchRow], gpu: bool) -> list[str]:
    """Per token range: the speed-up geomean (and its minimum) and the attainable efficiency
    geomean (capped at 1.0) of the tuned op and of torch."""
    if not gpu:
        return cpu_summary([r.ok for r in rows])
    lines = []
    for label, lo, hi in TOKEN_RANGES:
        sel = [r for r in rows if lo <= r.token <= hi]
        if sel:
            tuned = capped_geomean([r.attainable_efficiency for r in sel])
            torch_eff = capped_geomean([r.torch_attainable_efficiency for r in sel])
            lines.append(
                f"{label:<11} {len(sel):>3} shapes: speed-up geomean "
                f"{geomean([r.speedup for r in sel]):.3f} (min {min(r.speedup for r in sel):.3f})"
                f"; attainable efficiency tuned {tuned:.3f}, torch {torch_eff:.3f}")
    eager = [r for r in rows if r.torch_timing == "eager"]
    if eager:
        lines.append(f"torch timed eagerly (its pipeline did not capture in a graph) on "
                     f"{len(eager)} shape(s): its times include host work")
    slower = [r for r in rows if r.speedup < 1.0]
    if slower:
        lines.append("slower than torch: " + ", ".join(f"{r.name} T={r.token} {r.speedup:.3f}"
                                                       for r in slower))
    return lines


def run_moe_bench(shapes: list[tuple[str, FmoeKey]], out_dir: Path, title: str) -> int:
    gpu = torch.cuda.is_available()
    dev = current_device()
    print(f"GPU: {torch.cuda.get_device_name()} ({dev})" if gpu else
          f"no GPU found: benchmarking on the CPU ({dev}); times are CPU wall times")
    with GpuLock(gpu_label(torch.cuda.current_device())) if gpu else contextlib.nullcontext():
        ceilings = None
        if gpu:
            big = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
            ceilings = measure_ceilings(lambda: big @ big, 2.0 * 8192 ** 3)
            print(f"ceilings measured now: {ceilings.bytes_per_s / 1e9:.0f} GB/s streaming read, "
                  f"{ceilings.flops_per_s / 1e12:.1f} TFLOP/s, t_launch "
                  f"{ceilings.launch_us:.2f} us")
            del big
        gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
        rows = [bench_moe_shape(name, key, ceilings, gen) for name, key in shapes]
    csv_path, png_path = out_dir / "bench_fmoe.csv", out_dir / "bench_fmoe.png"
    write_records([{k: format(v, ".6g") if isinstance(v, float) else v
                    for k, v in asdict(r).items()} for r in rows], csv_path)
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        series.setdefault(r.layer, []).append((r.token, r.speedup, r.attainable_efficiency))
    why_no_plot = plot_curves(series, png_path, title, "tokens")
    print(f"{'shape':<16} {'T':>5} {'torch us':>9} {'tuned us':>9} {'speedup':>7} "
          f"{'att us':>8} {'att':>5} {'torch':>6} {'rule':<8} kernel")
    for r in rows:
        print(f"{r.name:<16} {r.token:>5} {r.torch_us:>9.2f} {r.tuned_us:>9.2f} "
              f"{r.speedup:>7.3f} {r.attainable_us:>8.2f} {r.attainable_efficiency:>5.3f} "
              f"{r.torch_timing:>6} {r.rule:<8} {r.kernel}" + ("" if r.ok else "  WRONG"))
    return finish_report(summarize(rows, gpu), csv_path, png_path, why_no_plot,
                         [f"{r.name} T={r.token}" for r in rows if not r.ok])


def bench_from_args(args) -> int:
    """``gemmtune bench fmoe``: the MoE layers of ``--model`` (per ``--tp`` rank) at ``--M``
    token counts, or the keys of an untuned fmoe CSV (``--shapes``)."""
    from gemmtune.models.shapes import load_preset, untuned_rows
    from gemmtune.tables.store import read_table

    if args.dtype not in (None, "bf16"):
        raise ValueError(f"fmoe benches bf16 experts only (quantised experts land later), not "
                         f"--dtype {args.dtype}")
    out = Path(args.output)
    if args.shapes:
        keys = [r.key for r in read_table(args.shapes, get_family("fmoe").schema,
                                          untuned=True).rows]
        return run_moe_bench([("csv", key) for key in keys], out, str(args.shapes))
    tokens = args.M or (MOE_TOKENS if torch.cuda.is_available() else CPU_TOKENS)
    rows = untuned_rows(load_preset(args.model), args.tp, tokens).get("fmoe")
    if not rows:
        raise ValueError(f"{args.model} has no MoE layers: bench its GEMMs with bf16")
    return run_moe_bench([(args.model, r.key) for r in rows], out,
                         f"{args.model} tp={args.tp} fused MoE, bf16")
