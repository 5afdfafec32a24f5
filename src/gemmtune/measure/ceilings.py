"""The ceilings a time is judged against, measured in the same run as the times (DESIGN:
Performance), and the floors they give a call.

- streaming-read bandwidth: a ``sum`` over a buffer far larger than L2 (a GEMM's weight read is a
  streaming read; a copy's read+write rate would overstate the floor by ~25%);
- peak throughput: a large GEMM of the benchmarked dtype through torch;
- ``t_launch``: the time per call of the smallest kernel (a one-element copy) replayed
  back-to-back in a CUDA graph, 0.9-1.0 µs on an H100 (docs/benchmarks.md): what even a perfect
  kernel pays per call.

The roofline floor of a call is max(FLOPs / peak, bytes / bandwidth); its attainable floor adds
``t_launch``. A time below the attainable floor is possible only where a kernel overlaps the one
before it (programmatic dependent launch), so reports flag it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gemmtune.measure.timing import events_us

# One-element copies per graph when measuring t_launch: enough that the graph's own launch is
# amortised, few enough to capture quickly.
LAUNCH_PROBE_CALLS = 200


@dataclass(frozen=True)
class Ceilings:
    bytes_per_s: float  # streaming read
    flops_per_s: float  # a large GEMM in the benchmarked dtype
    launch_us: float  # t_launch


@dataclass(frozen=True)
class Floors:
    roofline_us: float  # max(FLOPs / peak, bytes / bandwidth)
    attainable_us: float  # roofline_us + t_launch

    def efficiencies(self, us: float) -> tuple[float, float]:
        """(roofline floor / us, attainable floor / us)."""
        return self.roofline_us / us, self.attainable_us / us


def floors(flops: float, nbytes: float, c: Ceilings) -> Floors:
    roofline = max(flops / c.flops_per_s, nbytes / c.bytes_per_s) * 1e6
    return Floors(roofline, roofline + c.launch_us)


def streaming_read_bytes_per_s() -> float:
    """Bytes per second of a ``sum`` over 2 GiB of bf16 on the GPU."""
    nbytes = 2 << 30
    buf = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
    read_us = _fastest(lambda: buf.sum(dtype=torch.float32), 10)
    return nbytes / (read_us * 1e-6)


def _fastest(fn, reps: int, tries: int = 3) -> float:
    """The fastest of ``tries`` timings: a GPU still ramping its clocks up from idle (345 MHz
    seen on the H100 before a run) makes the first one slow, and a ceiling must not be low."""
    return min(events_us(fn, reps) for _ in range(tries))


def launch_us(calls: int = LAUNCH_PROBE_CALLS, replays: int = 20) -> float:
    """``t_launch``: µs per one-element copy, ``calls`` of them captured in one CUDA graph,
    median over ``replays`` replays."""
    src = torch.ones(1, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    per_replay = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_replay.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(per_replay)


def measure_ceilings(peak_gemm: Callable[[], object], peak_flops: float) -> Ceilings:
    """All three ceilings of the GPU, now. ``peak_gemm`` runs one large GEMM of the benchmarked
    dtype through torch on random data (zeros run faster), doing ``peak_flops`` FLOPs. There are
    none on the CPU: a ceiling there would say nothing of the GPU a table is for."""
    bandwidth = streaming_read_bytes_per_s()
    gemm_us = _fastest(peak_gemm, 10)
    return Ceilings(bandwidth, peak_flops / (gemm_us * 1e-6), launch_us())
