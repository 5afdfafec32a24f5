"""Timing that matches deployment: CUDA-graph replay over rotating inputs, median of replays."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

L2_BYTES_H100 = 50 * 2**20


def l2_bytes() -> int:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", L2_BYTES_H100))
    return L2_BYTES_H100


def copies_to_exceed_l2(bytes_per_set: int, l2: int | None = None, cap: int = 64,
                        max_total_bytes: int = 4 << 30) -> int:
    """How many input sets to rotate through so that each call reads its operands cold from HBM
    (twice the L2 size in all): at least 2, at most ``cap``, and no more than fit in
    ``max_total_bytes`` (a large-M prefill shape is cold anyway: its operands dwarf L2)."""
    l2 = l2 if l2 is not None else l2_bytes()
    wanted = -(-2 * l2 // max(1, bytes_per_set))
    affordable = max(1, max_total_bytes // max(1, bytes_per_set))
    return max(2, min(cap, wanted, affordable))


def copies_for_each(byte_counts: Sequence[int], l2: int | None = None, cap: int = 64,
                    max_total_bytes: int = 4 << 30) -> int:
    """How many sets of several ops' operands to rotate through (each op reading only its own
    ``byte_counts[i]`` of a set) so that every op reads its operands cold: as many as the op
    with the fewest bytes needs (``copies_to_exceed_l2``), no more than all the sets fit in
    ``max_total_bytes``, at least 2. Sizing by the sum instead would leave a small op's
    operands in L2 (an 8 MiB MXFP4 weight beside a 32 MiB bf16 one: 2 sets, all 16 MiB
    cached)."""
    wanted = max(copies_to_exceed_l2(b, l2, cap, max_total_bytes) for b in byte_counts)
    return max(2, min(wanted, max_total_bytes // max(1, sum(byte_counts))))


def cold_copies(first: tuple[torch.Tensor, ...],
                per_op: Sequence[Sequence[int]] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """``first`` and clones of its tensors, as many sets as ``copies_to_exceed_l2`` says: a call
    rotating through them reads its operands from HBM. ``per_op``: where several ops share the
    sets, the indices of each op's tensors in ``first`` (``copies_for_each`` then sizes them, so
    that each op's own operands exceed L2)."""
    if per_op is not None:
        copies = copies_for_each([sum(first[i].numel() * first[i].element_size() for i in op)
                                  for op in per_op])
    else:
        copies = copies_to_exceed_l2(sum(t.numel() * t.element_size() for t in first))
    return [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]


def graph_replay_us(fn: Callable, inputs: Sequence, replays: int = 20) -> tuple[float, float]:
    """Median and spread ((p90-p10)/median) of the GPU time per call of ``fn(inp)``, captured once
    per input set into one CUDA graph (several passes over them for short calls: ``_capture``)
    and replayed: no host launch cost, cold operands when the input sets together exceed L2.
    ``fn`` must be warm (compiled, planned) before the capture."""
    return interleaved_graph_us([fn], inputs, rounds=1, replays=replays)[0]


def interleaved_graph_us(fns: Sequence[Callable], inputs: Sequence, rounds: int = 25,
                         replays: int = 2) -> list[tuple[float, float]]:
    """Like ``graph_replay_us`` for several functions compared with each other: one graph each,
    replayed in alternation (``rounds`` x ``replays``), so clock and power drift during the
    measurement hits all of them alike instead of whichever ran last. Measured on H100: timing
    the same 4096x28672x4096 GEMM twice one after the other differed by 11%; alternating in
    blocks of 10 replays still left up to 7% between two graphs of the same torch kernel on
    multi-ms shapes (bench, 2026-11-26), so the blocks are short (2 replays) and every other
    round runs the functions in reverse order (ABBA): drift within a round cancels too."""
    captured = [_capture(fn, inputs) for fn in fns]
    times: list[list[float]] = [[] for _ in captured]
    for r in range(rounds):
        order = list(zip(captured, times))
        for (graph, calls), per_fn in (order if r % 2 == 0 else order[::-1]):
            for _ in range(replays):
                per_fn.append(_replay_us(graph) / calls)
    return [_median_spread(t) for t in times]


# A graph's own launch costs a few µs (about 5.8 on the H100: two traced MoE calls in one graph
# run 2.9 µs per call closer together than the graph's time per call, docs/benchmarks.md).
# Where calls are short and the input sets few (large weights rotate through 2 copies), the
# graph repeats its pass over the sets until it holds MIN_CALLS_PER_GRAPH calls, as a model's
# graph holds many ops; long calls keep one pass (their outputs would multiply the memory).
MIN_CALLS_PER_GRAPH = 20
SHORT_CALL_US = 200.0


def _capture(fn: Callable, inputs: Sequence) -> tuple[torch.cuda.CUDAGraph, int]:
    """``fn`` over every input set, captured in one graph, and the calls the graph holds: one
    pass, or as many passes as make MIN_CALLS_PER_GRAPH calls where a call is shorter than
    SHORT_CALL_US."""
    fn(inputs[0])
    torch.cuda.synchronize()
    graph = _graph_of(fn, inputs, passes=1)
    passes = -(-MIN_CALLS_PER_GRAPH // len(inputs))
    if passes > 1 and _replay_us(graph) / len(inputs) < SHORT_CALL_US:
        return _graph_of(fn, inputs, passes), passes * len(inputs)
    return graph, len(inputs)


_REEMITTED: dict = {}  # warnings' once-per-place registry for what a capture re-emits


class EmptyGraphError(RuntimeError):
    """``fn`` put no GPU work into its graph: it ran eagerly or on another stream at capture, and
    its replays would take no time at all."""


def _graph_of(fn: Callable, inputs: Sequence, passes: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            for _ in range(passes):
                for inp in inputs:
                    fn(inp)
    for warning in caught:
        # torch only warns on capturing an empty graph; timing its replays would report a
        # candidate that does nothing as the fastest.
        if "CUDA Graph is empty" in str(warning.message):
            raise EmptyGraphError(
                "the call put no GPU work into its CUDA graph (it ran eagerly, or on a stream "
                "other than the capturing one): not timed, as its replays would take no time")
        # The others as they were, shown once per place as the default filter would have.
        warnings.warn_explicit(warning.message, warning.category, warning.filename,
                               warning.lineno, registry=_REEMITTED)
    graph.replay()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """µs of one replay of ``graph``, between two CUDA events."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def host_us_per_call(fn: Callable, calls: int = 2000, loops: int = 5) -> float:
    """Median over ``loops`` of the wall time per call of ``calls`` back-to-back eager calls, the
    device synchronised at the end of each loop: for small GEMMs this is the host cost."""
    for _ in range(50):
        fn()
    _sync()
    per_loop = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        per_loop.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_loop)


def eager_us(fn: Callable, iters: int, warmup: int = 1) -> tuple[float, float]:
    """Median and spread of the time of single eager calls of ``fn``: on the GPU between CUDA
    events around each call (for ops that synchronise with the host, which no graph captures),
    ``iters`` of them; on the CPU (the interpreter) by the wall clock, ``iters // 10`` (at least
    3), since an interpreted kernel takes a thousand times longer."""
    for _ in range(max(1, warmup)):
        fn()
    _sync()
    times = []
    for _ in range(max(3, iters if torch.cuda.is_available() else iters // 10)):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return _median_spread(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_spread(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    median = statistics.median(ordered)
    p10 = ordered[len(ordered) // 10]
    p90 = ordered[-1 - len(ordered) // 10]
    return median, (p90 - p10) / median if median > 0 else 0.0


def events_us(fn: Callable, reps: int) -> float:
    """Mean µs per call of ``reps`` back-to-back calls of ``fn`` between two CUDA events (wall
    time on the CPU), after one warm-up call: for large kernels, where launch gaps do not count."""
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps
