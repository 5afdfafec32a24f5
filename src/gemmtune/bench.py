"""``gemmtune bench FAMILY``: tuned vs torch vs the floors, per shape, in one run on one device.

For every shape: torch's default (the family's torch backend) and the tuned op (through the
tables in force) are timed the same way, in alternation (CUDA-graph replay over weight copies
larger than L2, i.e. cold weights as in decode); the tuned output is checked against an fp32
reference; and both times are set against two floors (DESIGN: Performance), with the ceilings
measured in the same run (``measure.ceilings``): the plain roofline, max(FLOPs / peak, bytes /
bandwidth), and the attainable floor, the roofline plus ``t_launch``. Efficiency = floor / time,
reported for both; a time below the attainable floor (possible only where a kernel overlaps the
one before it) is flagged, and geomeans count each efficiency as at most 1.0.
"""

from __future__ import annotations

import contextlib
import csv
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from gemmtune.device import current_device
from gemmtune.dispatch import use_tables
from gemmtune.families import BenchOp, Family
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.measure.ceilings import Ceilings, Floors, floors, measure_ceilings
from gemmtune.measure.gpulock import GpuLock, gpu_label
from gemmtune.measure.timing import copies_for_each, interleaved_graph_us
from gemmtune.tables.lookup import Rule
from gemmtune.tables.store import read_table, write_table

class BenchShape(NamedTuple):
    """One GEMM the bench runs: ``name`` (the projection, or where the shape came from)."""

    name: str
    M: int
    N: int
    K: int


@dataclass
class BenchRow:
    name: str
    M: int
    N: int
    K: int
    torch_us: float
    tuned_us: float
    speedup: float
    roofline_us: float  # max(FLOPs / peak, bytes / bandwidth)
    attainable_us: float  # roofline_us + t_launch
    efficiency: float  # roofline_us / tuned_us
    attainable_efficiency: float  # attainable_us / tuned_us
    torch_efficiency: float  # roofline_us / torch_us
    torch_attainable_efficiency: float
    rule: str
    kernel: str
    rel_err: float
    ok: bool
    torch_is_reference: bool = False  # torch's column ran the fp32 reference, not cuBLAS
    # The tuned op dispatched to the torch backend itself: both columns ran one function, so the
    # speed-up is 1 but for the spread between two CUDA graphs of the same kernel.
    same_kernel: bool = False
    # The family's comparisons (BenchOp.comparisons), timed in the same run: label -> us
    compared_us: dict[str, float] = field(default_factory=dict)

    def times_over(self, label: str) -> float:
        """How many times faster the tuned op ran than comparison ``label``."""
        return self.compared_us[label] / self.tuned_us

    @property
    def below_floor(self) -> bool:
        """Faster than the attainable floor: the launch overlapped the kernel before (PDL)."""
        return self.tuned_us < self.attainable_us


def _peak_gemm(op: BenchOp):
    """A large GEMM through torch in ``op``'s dtype (``F.linear`` in its ``math_dtype`` where it
    has one), and its FLOPs: the peak-throughput probe."""
    n = 8192
    gen = torch.Generator(device="cuda").manual_seed(1)
    if op.math_dtype is not None:
        x, w = (torch.randn(n, n, generator=gen, device="cuda").to(op.math_dtype)
                for _ in range(2))
        return (lambda: torch.nn.functional.linear(x, w)), 2.0 * n ** 3
    args = op.inputs(n, n, n, gen)
    return (lambda: op.torch(args)), 2.0 * n ** 3


def floors_of(m: int, n: int, k: int, op: BenchOp, c: Ceilings) -> Floors:
    x_bytes = op.in_bytes if op.x_bytes is None else op.x_bytes
    w_bytes = op.in_bytes if op.w_bytes is None else op.w_bytes
    nbytes = m * k * x_bytes + n * k * w_bytes + m * n * op.out_dtype.itemsize
    return floors(2.0 * m * n * k, nbytes, c)


def _time_columns(op: BenchOp, args: tuple,
                  compared: list[tuple]) -> tuple[float, float, list[float]]:
    """Times of torch, the tuned op and each comparison (``compared``: each one's arguments,
    in ``op.comparisons`` order), in one interleaved run over cold copies of every weight."""
    runs = [op.torch, op.tuned] + [c.run for c in op.comparisons]
    if not args[0].is_cuda:
        def wall(fn):
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

        times = [wall(lambda: op.torch(args)), wall(lambda: op.tuned(args))] + [
            wall(lambda c=c, a=a: c.run(a)) for c, a in zip(op.comparisons, compared)]
        return times[0], times[1], times[2:]
    operands = [(args, op.w_index)] + [(a, c.w_index) for c, a in zip(op.comparisons, compared)]
    # Enough sets that each op's own weight (not all of them together) exceeds L2.
    copies = copies_for_each([a[i].numel() * a[i].element_size() for a, i in operands])
    sets = [tuple(a[:i] + (a[i].clone(),) + a[i + 1:] for a, i in operands)
            for _ in range(copies)]
    slots = [0, 0] + list(range(1, len(compared) + 1))  # torch and tuned share the op's operands
    fns = [lambda s, run=run, slot=slot: run(s[slot]) for run, slot in zip(runs, slots)]
    times = [t for t, _ in interleaved_graph_us(fns, sets)]
    return times[0], times[1], times[2:]


def bench_shape(shape: BenchShape, family: Family, op: BenchOp, ceilings: Ceilings | None,
                gen: torch.Generator) -> BenchRow:
    """One shape: the tuned op checked against the fp32 reference, both columns timed, and the
    floors from ``ceilings`` (None on the CPU: the floors then are NaN)."""
    name, m, n, k = shape.name, shape.M, shape.N, shape.K
    args = op.inputs(m, n, k, gen)
    y = op.tuned(args)
    ref = op.reference(args)
    rel = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    ok = bool(torch.isfinite(y).all()) and rel <= TOLERANCES[op.out_dtype][2]  # the tuner's
    decision = family.dispatcher.decide(op.table_key(m, n, k))
    compared = [c.inputs(m, n, k, gen) for c in op.comparisons]
    for c, a in zip(op.comparisons, compared):
        c.run(a)  # compiled and planned before any capture
    torch_us, tuned_us, compared_us = _time_columns(op, args, compared)
    nan = float("nan")
    f = floors_of(m, n, k, op, ceilings) if ceilings is not None else Floors(nan, nan)
    eff, att_eff = f.efficiencies(tuned_us)
    torch_eff, torch_att_eff = f.efficiencies(torch_us)
    return BenchRow(name, m, n, k, torch_us, tuned_us, torch_us / tuned_us, f.roofline_us,
                    f.attainable_us, eff, att_eff, torch_eff, torch_att_eff, decision.rule.value,
                    decision.kernel_name, rel, ok, op.torch_is_reference(m, n, k),
                    same_kernel=decision.kernel_name in (op.torch_kernel, *op.torch_aliases),
                    compared_us={c.label: t for c, t in zip(op.comparisons, compared_us)})


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def capped_geomean(efficiencies: list[float]) -> float:
    """Geomean of efficiencies counted as at most 1.0: a row faster than its floor (PDL overlap)
    must not hide another row's shortfall."""
    return geomean([min(1.0, e) for e in efficiencies])


M_RANGES = (("M<=64", 1, 64), ("64<M<1024", 65, 1023), ("M>=1024", 1024, 1 << 62))
# The issues' floor for every shape: the tuned op at least this fraction of torch's speed.
SLOWER_THAN_TORCH = 0.98


CPU_NOTE = ("CPU: each time is the wall time of one call of a tiny GEMM or MoE, to show that "
            "the op runs and is right, not how fast; speed-ups, ceilings and floors are GPU "
            "measures and are left out")


def cpu_summary(ok: list[bool]) -> list[str]:
    """What a CPU bench says: how many results were right, and that its times are no measure."""
    bad = ok.count(False)
    return [f"{len(ok)} shape(s) checked against the fp32 reference: "
            + (f"{bad} WRONG" if bad else "all within the bound"), CPU_NOTE]


def finish_report(summary: list[str], csv_path: Path, png_path: Path, why_no_plot: str | None,
                  wrong: list[str]) -> int:
    """The end of a bench's printout (summary, files written, wrong results) and its exit code:
    1 if any result was wrong."""
    for line in summary:
        print(line)
    print(f"wrote {csv_path}" + (f" and {png_path}" if why_no_plot is None else f"; {why_no_plot}"))
    if wrong:
        print(f"WRONG results: {', '.join(wrong)}")
    return 1 if wrong else 0


def summarize(rows: list[BenchRow], gpu: bool = True) -> list[str]:
    """Per M range: speed-up geomean and both efficiencies' geomeans (each capped at 1.0), for
    the tuned op and torch. Shapes whose torch column ran the fp32 reference are left out of the
    speed-up and of torch's efficiencies (neither says anything about cuBLAS there) and counted
    apart. Then the family's comparisons (``compared_summary``) and, if any: the shapes no row
    served (``untuned_summary``), the rows faster than their attainable floor, the shapes below
    0.98x torch."""
    if not gpu:
        return cpu_summary([r.ok for r in rows])
    lines = []
    for label, lo, hi in M_RANGES:
        sel = [r for r in rows if lo <= r.M <= hi]
        if not sel:
            continue
        fast = [r for r in sel if not r.torch_is_reference]
        against = (f"speed-up geomean {geomean([r.speedup for r in fast]):.3f} "
                   f"(min {min(r.speedup for r in fast):.3f})" if fast
                   else "no shape with a fast torch kernel")
        apart = (f"; {len(sel) - len(fast)} with torch = reference left out of speed-up and "
                 f"torch efficiency" if len(fast) < len(sel) else "")
        torch_eff = (f"{capped_geomean([r.torch_efficiency for r in fast]):.3f} / "
                     f"{capped_geomean([r.torch_attainable_efficiency for r in fast]):.3f}"
                     if fast else "n/a")
        lines.append(
            f"{label:<11} {len(sel):>4} shapes: {against}; efficiency (roofline / attainable) "
            f"tuned {capped_geomean([r.efficiency for r in sel]):.3f} / "
            f"{capped_geomean([r.attainable_efficiency for r in sel]):.3f}, torch "
            f"{torch_eff}{apart}")
    lines += compared_summary(rows)
    lines += untuned_summary(rows)
    below_floor = [r for r in rows if r.below_floor]
    if below_floor:
        lines.append("faster than the attainable floor (launch overlapped; counted as 1.0): "
                     + ", ".join(f"{r.name} {r.M}x{r.N}x{r.K} {r.tuned_us:.2f} < "
                                 f"{r.attainable_us:.2f} us" for r in below_floor))
    slower = [r for r in rows if r.speedup < SLOWER_THAN_TORCH and not r.torch_is_reference]
    if slower:
        noise = sum(r.same_kernel for r in slower)
        lines.append(f"below {SLOWER_THAN_TORCH}x torch: {len(slower)} shape(s), "
                     + ", ".join(f"{r.name} {r.M}x{r.N}x{r.K} {r.speedup:.3f}"
                                 + (" (torch's own kernel in both columns)" if r.same_kernel
                                    else "") for r in slower)
                     + (f"; {noise} of them measurement spread" if noise else ""))
    return lines


# Shapes the untuned line names before it only counts the rest
_UNTUNED_NAMED = 6


def untuned_summary(rows: list[BenchRow]) -> list[str]:
    """The shapes no table row served (the family's default kernel ran them, whatever it is on
    this GPU), if any: a bench of untuned shapes says little about the tuned op."""
    untuned = [r for r in rows if r.rule == Rule.default.value]
    if not untuned:
        return []
    named = ", ".join(f"{r.name} {r.M}x{r.N}x{r.K} ({r.kernel})"
                      for r in untuned[:_UNTUNED_NAMED])
    more = f" and {len(untuned) - _UNTUNED_NAMED} more" if len(untuned) > _UNTUNED_NAMED else ""
    return [f"no row: {len(untuned)} of {len(rows)} shape(s) ran the family's default kernel: "
            f"{named}{more}; tune them (gemmtune shapes, then gemmtune tune) for tuned numbers"]


def _record(r: BenchRow) -> dict:
    """A row as the CSV has it: each comparison's time and how many times faster the tuned op
    was, as columns of their own."""
    record = {**asdict(r), "below_floor": r.below_floor}
    for label, us in record.pop("compared_us").items():
        record[f"{label} us"] = us
        record[f"x {label}"] = r.times_over(label)
    return {k: format(v, ".6g") if isinstance(v, float) else v for k, v in record.items()}


# The issues' ranges for the comparisons (decode at M <= 16, prefill from 1024)
COMPARED_RANGES = (("M<=16", 1, 16), ("16<M<1024", 17, 1023), ("M>=1024", 1024, 1 << 62))


def op_labels(rows: list[BenchRow]) -> list[str]:
    """The comparisons' labels (every row has the same)."""
    return list(rows[0].compared_us) if rows else []


def compared_summary(rows: list[BenchRow]) -> list[str]:
    """Per comparison and M range: how many times faster the tuned op ran (geomean, min,
    max)."""
    lines = []
    for label in op_labels(rows):
        for name, lo, hi in COMPARED_RANGES:
            sel = [r.times_over(label) for r in rows if lo <= r.M <= hi]
            if sel:
                lines.append(f"{name:<11} {len(sel):>4} shapes: {geomean(sel):.3f}x {label} "
                             f"geomean (min {min(sel):.3f}, max {max(sel):.3f})")
    return lines


def write_csv(rows: list[BenchRow], path: Path) -> None:
    write_records([_record(r) for r in rows], path)


def write_records(records: list[dict], path: Path) -> None:
    """``records`` (dicts with the same keys, in order) as a CSV at ``path``, folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def plot(rows: list[BenchRow], path: Path, title: str) -> str | None:
    """Speed-up and attainable-floor efficiency against M, one line per (N, K)."""
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in sorted(rows, key=lambda r: (r.N, r.K, r.M)):
        series.setdefault(f"N={r.N} K={r.K}", []).append((r.M, r.speedup,
                                                          r.attainable_efficiency))
    return plot_curves(series, path, title, "M (tokens)")


def plot_curves(series: dict[str, list[tuple[int, float, float]]], path: Path, title: str,
                xlabel: str) -> str | None:
    """Two panels, one line per series of (x, speed-up, attainable efficiency): speed-up over
    torch and efficiency against x (log2). Returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install gemmtune[plot]); no plot written"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for label, points in series.items():
        points = sorted(points)
        xs = [x for x, _, _ in points]
        ax1.plot(xs, [speedup for _, speedup, _ in points], marker="o", label=label)
        ax2.plot(xs, [eff for _, _, eff in points], marker="o", label=label)
    for ax, ylabel in ((ax1, "speed-up over torch"),
                       (ax2, "efficiency (attainable floor / time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    top = max(eff for points in series.values() for _, _, eff in points)
    ax2.set_ylim(0, max(1.05, 1.05 * top))
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _measure_all(shapes: list[BenchShape], family: Family, op: BenchOp,
                 gpu: bool) -> list[BenchRow]:
    ceilings = None
    if gpu:
        ceilings = measure_ceilings(*_peak_gemm(op))
        print(f"ceilings measured now: {ceilings.bytes_per_s / 1e9:.0f} GB/s streaming read, "
              f"{ceilings.flops_per_s / 1e12:.1f} TFLOP/s, t_launch {ceilings.launch_us:.2f} us")
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    return [bench_shape(shape, family, op, ceilings, gen) for shape in shapes]


def run_bench(shapes: list[BenchShape], family: Family, op: BenchOp, out_dir: Path,
              title: str) -> int:
    gpu = torch.cuda.is_available()
    dev = current_device()
    print(f"GPU: {torch.cuda.get_device_name()} ({dev})" if gpu else
          f"no GPU found: benchmarking on the CPU ({dev}); GPU table rows do not apply, times are "
          f"CPU wall times")
    # No tuner may time on this GPU meanwhile (nor this bench disturb one).
    with GpuLock(gpu_label(torch.cuda.current_device())) if gpu else contextlib.nullcontext():
        rows = _measure_all(shapes, family, op, gpu)
    slow = [f"{r.M}x{r.N}x{r.K}" for r in rows if r.torch_is_reference]
    if slow and gpu:
        print(f"torch column = the dequantised fp32 reference (no fast torch kernel takes the "
              f"shape; speed-ups there are not against cuBLAS): {', '.join(slow)}")
    csv_path = out_dir / f"bench_{op.label}.csv"
    png_path = out_dir / f"bench_{op.label}.png"
    write_csv(rows, csv_path)
    why_no_plot = plot(rows, png_path, title)
    labels = op_labels(rows)
    print(f"{'shape':<14} {'M':>5} {'N':>6} {'K':>6} {'torch us':>9} {'tuned us':>9} "
          f"{'speedup':>7} {'roof us':>8} {'att us':>7} {'eff':>5} {'att':>5} "
          + "".join(f"{'x ' + label:>11} " for label in labels) + f"{'rule':<8} kernel")
    for r in rows:
        flag = ("" if r.ok else "  WRONG") + ("  <floor" if r.below_floor else "")
        print(f"{r.name:<14} {r.M:>5} {r.N:>6} {r.K:>6} {r.torch_us:>9.2f} {r.tuned_us:>9.2f} "
              f"{r.speedup:>7.3f} {r.roofline_us:>8.2f} {r.attainable_us:>7.2f} "
              f"{r.efficiency:>5.3f} {r.attainable_efficiency:>5.3f} "
              + "".join(f"{r.times_over(label):>11.3f} " for label in labels)
              + f"{r.rule:<8} {r.kernel}{flag}")
    return finish_report(summarize(rows, gpu), csv_path, png_path, why_no_plot,
                         [f"{r.name} M={r.M}" for r in rows if not r.ok])


def run_config(family: Family, table: Path, out_dir: Path) -> int:
    """``gemmtune tune FAMILY --run_config -i TABLE``: the op as production runs it, dispatched
    from ``table`` alone (no shipped rows, no overlays), on each of its rows' shapes."""
    if family.bench is None or family.dtype_of_key is None:
        raise ValueError(f"{family.cli_name} has no bench: --run_config cannot run it")
    rows = read_table(table, family.schema).rows
    if not rows:
        raise ValueError(f"{table}: no rows to run")
    by_dtype: dict[str, set[tuple[int, int, int]]] = {}
    other_layouts = [r for r in rows if getattr(r.key, "packed", False)]
    dispatch_from = table
    if other_layouts:
        # Out of the dispatch table too: with packed rows there, the bench would store the
        # weights packed (as patch_linear would) and run those rows instead.
        dispatch_from = out_dir / f"{table.stem}.as_quantised.csv"
        out_dir.mkdir(parents=True, exist_ok=True)
        write_table(dispatch_from, family.schema,
                    [r for r in rows if not getattr(r.key, "packed", False)])
        print(f"{table}: {len(other_layouts)} row(s) for packed weights left out: the "
              f"{family.cli_name} bench runs weights as quantised (dispatching from "
              f"{dispatch_from})")
    for r in rows:
        if not getattr(r.key, "packed", False):
            by_dtype.setdefault(family.dtype_of_key(r.key), set()).add(
                (r.key.M, r.key.N, r.key.K))
    for dtype in sorted(set(by_dtype) - set(family.bench_dtypes)):
        print(f"{table}: {len(by_dtype.pop(dtype))} row shape(s) in {dtype} left out: the "
              f"{family.cli_name} bench runs {', '.join(family.bench_dtypes)}")
    status = 0
    with use_tables(family.schema, [dispatch_from]):
        for dtype, gemms in sorted(by_dtype.items()):
            op = family.bench_op(dtype)
            shapes = sorted((BenchShape("row", m, n, k) for m, n, k in gemms),
                            key=lambda s: (s.N, s.K, s.M))
            status |= run_bench(shapes, family, op, out_dir, f"{table} (run_config, {dtype})")
    return status
