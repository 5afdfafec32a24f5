"""Can a decode GEMM at M = 16-64 match cuBLASLt by streaming w through TMA? (issue 15, item 1)

At M = 16-64 cuBLASLt's FP8 rows beat every Triton candidate on 56 of the presets' 78 a8w8
shapes (0.857x, docs/benchmarks.md, session 19). Their algorithm (id 66, tiles of 64-128 w rows
x 16-64 x rows, no split of K, stages "AUTO") runs one output tile per program and still reads
w at 2.5 TB/s: its w arrives through TMA into a pipeline as deep as shared memory allows. The
split-K kernel's w arrives through ``cp.async`` issued by its threads, 16-64 KiB in flight per
program.

This probe times the swapped dot (w's rows as the warpgroup MMA's M, x's rows as its N) with
both operands loaded through host TMA descriptors and pipelined ``STAGES`` deep, in two
schedules:

- ``grid``: a program per (output tile, split of K), as the split-K kernel;
- ``stream``: one or two programs per SM, each taking an equal contiguous run of the flattened
  (tile, K step) iterations (stream-K): every SM streams the same number of w bytes whatever
  the tile count, and a tile cut between programs is summed by the last to finish (partials in
  program order: deterministic).

Beside: the op through the shipped a8w8 table (cuBLASLt or Triton, whichever the row names),
the split-K config the pre-shuffled table names for the shape (on row-major w) and
``torch._scaled_mm``. Per-token and per-channel scales, bf16 out; every variant is checked
against the fp32 reference before it is timed (interleaved CUDA-graph replays over weight copies
exceeding L2).

    PYTHONPATH=src python3 benchmarks/streamk_probe.py [--out DIR] [--m 16,32,64]   # GPU
    python3 benchmarks/streamk_probe.py --ptx      # CPU: compile for sm_90, show the pipeline
    TRITON_INTERPRET=1 python3 benchmarks/streamk_probe.py --check    # CPU: every variant right
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton._epilogue import store_tile

# (N, K): the a8w8 presets' shapes cuBLASLt wins at M = 16-64, and two wide ones it does not.
SHAPES = ((256, 7168), (1280, 8192), (1536, 7168), (3072, 1536), (4096, 512), (4096, 4096),
          (4096, 14336), (4608, 7168), (5120, 8192), (6144, 4096), (7168, 2048), (7168, 8192),
          (8192, 1024), (8192, 3584), (28672, 4096), (128256, 4096))
# Bytes of pipeline buffers per SM (H100: 227 KiB per block; the epilogue's transpose and the
# partials' sum take up to ~30 KiB more).
SMEM_BUDGET = 176 * 1024
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _cta_barrier(token):
    """``bar.sync 0`` (what ``tl.debug_barrier`` emits): as inline asm because Triton 3.6 does
    not pipeline a loop that holds a ``tl.debug_barrier`` (one stage of shared memory, found by
    compiling both for sm_90). ``token``: any int32 scalar."""
    if INTERPRETED:  # the interpreter runs no asm
        tl.debug_barrier()
    else:
        tl.inline_asm_elementwise("bar.sync 0;\n mov.u32 $0, 0;", "=r,r", [token],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _finish_tile(acc_t, tile, index, parts, part_ptr, count_ptr, y_ptr, scale_a_ptr,
                 scale_b_ptr, M, N, stride_ym, stride_yn, SLOTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``index`` of the ``parts`` that share output tile ``tile`` is done with its run
    of K: store the tile if it is the only one, else leave its partial and let the last to
    arrive sum them in program order."""
    acc = tl.trans(acc_t)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    if parts == 1:
        store_tile(acc, offs_m, offs_n, rows, cols, y_ptr, y_ptr, scale_a_ptr, scale_b_ptr,
                   M, N, stride_ym, stride_yn, 0, False, 2, 2)
    else:
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_parts = part_ptr + tile.to(tl.int64) * SLOTS * (BLOCK_M * BLOCK_N)
        tl.store(tile_parts + index * (BLOCK_M * BLOCK_N) + local, acc)
        # Every thread's store before one thread's release (as sum_splits_and_store does).
        _cta_barrier(index)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            slot = tl.arange(0, SLOTS)
            every = tl.load(tile_parts + slot[:, None, None] * (BLOCK_M * BLOCK_N)
                            + local[None, :, :], mask=(slot < parts)[:, None, None], other=0.0,
                            cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            store_tile(tl.sum(every, axis=0), offs_m, offs_n, rows, cols, y_ptr, y_ptr,
                       scale_a_ptr, scale_b_ptr, M, N, stride_ym, stride_yn, 0, False, 2, 2)


@triton.jit(do_not_specialize=["M", "N", "K", "chunk", "SPLIT_K"])
def tma_swapped_kernel(x_desc, w_desc, y_ptr, scale_a_ptr, scale_b_ptr, part_ptr, count_ptr,
                       M, N, K, chunk, SPLIT_K, stride_ym, stride_yn,
                       STREAM: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    k_steps = tl.cdiv(K, BLOCK_K)
    if STREAM:
        start = pid * chunk
        end = tl.minimum(start + chunk, tl.cdiv(N, BLOCK_N) * k_steps)
    else:
        tile0 = pid // SPLIT_K
        split = pid % SPLIT_K
        start = tile0 * k_steps + split * k_steps // SPLIT_K
        end = tile0 * k_steps + (split + 1) * k_steps // SPLIT_K
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # One flat loop over this program's (tile, K step) iterations, so the pipeline runs on
    # across the tiles it finishes (a loop per tile would drain it at each).
    for i in tl.range(start, end, num_stages=STAGES):
        tile = i // k_steps
        kk = i - tile * k_steps
        w = w_desc.load([tile * BLOCK_N, kk * BLOCK_K])
        x = x_desc.load([0, kk * BLOCK_K])
        acc_t = tl.dot(w, x.T, acc_t)
        if (kk == k_steps - 1) | (i == end - 1):
            if STREAM:
                first = tile * k_steps // chunk
                parts = ((tile + 1) * k_steps - 1) // chunk - first + 1
                index = pid - first
            else:
                parts = SPLIT_K
                index = split
            _finish_tile(acc_t, tile, index, parts, part_ptr, count_ptr, y_ptr, scale_a_ptr,
                         scale_b_ptr, M, N, stride_ym, stride_yn, SLOTS, BLOCK_M, BLOCK_N)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


class Variant(NamedTuple):
    stream: bool
    block_n: int
    block_k: int
    programs_per_sm: int  # stream only
    split_k: int  # grid only
    stages: int

    @property
    def name(self) -> str:
        head = f"stream.P{self.programs_per_sm}" if self.stream else f"grid.SK{self.split_k}"
        return f"{head}.BN{self.block_n}.BK{self.block_k}.S{self.stages}"


class Launch(NamedTuple):
    """One variant's grid and its constants for one (M, N, K)."""

    grid: int
    chunk: int
    slots: int
    block_m: int


def plan(v: Variant, m: int, n: int, k: int, sms: int) -> Launch:
    tiles = triton.cdiv(n, v.block_n)
    k_steps = triton.cdiv(k, v.block_k)
    block_m = max(16, triton.next_power_of_2(m))
    if not v.stream:
        return Launch(tiles * v.split_k, 0, triton.next_power_of_2(v.split_k), block_m)
    chunk = triton.cdiv(tiles * k_steps, sms * v.programs_per_sm)
    # A tile's k_steps iterations meet at most ceil(k_steps / chunk) + 1 programs' runs.
    slots = triton.next_power_of_2(triton.cdiv(k_steps, chunk) + 1)
    return Launch(triton.cdiv(tiles * k_steps, chunk), chunk, slots, block_m)


def variants(m: int, n: int, k: int, sms: int) -> list[Variant]:
    found = []
    block_m = max(16, triton.next_power_of_2(m))
    for bn in (64, 128):
        for bk in (128, 256):
            stage_bytes = (bn + block_m) * bk
            k_steps = triton.cdiv(k, bk)
            for per_sm in (1, 2):
                stages = min(12, SMEM_BUDGET // per_sm // stage_bytes)
                if stages >= 2:
                    found.append(Variant(True, bn, bk, per_sm, 0, stages))
            tiles = triton.cdiv(n, bn)
            splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16) if s <= k_steps]
            first = next((i for i, s in enumerate(splits) if tiles * s >= sms), len(splits) - 1)
            for split in splits[first:first + 2]:
                for stages in (4, 8):
                    if stages * stage_bytes <= SMEM_BUDGET // 2:
                        found.append(Variant(False, bn, bk, 0, split, stages))
    return found


class Runner:
    """Launches one variant on (x, w) with its own workspace (the counters left zero)."""

    def __init__(self, v: Variant, m: int, n: int, k: int, sms: int, device):
        self.v = v
        self.launch = plan(v, m, n, k, sms)
        tiles = triton.cdiv(n, v.block_n)
        self.parts = torch.empty(tiles * self.launch.slots * self.launch.block_m * v.block_n,
                                 dtype=torch.float32, device=device)
        self.counts = torch.zeros(tiles, dtype=torch.int32, device=device)

    def __call__(self, x, w, x_scale, w_scale, y):
        from triton.tools.tensor_descriptor import TensorDescriptor

        v, ln = self.v, self.launch
        x_desc = TensorDescriptor.from_tensor(x, [ln.block_m, v.block_k])
        w_desc = TensorDescriptor.from_tensor(w, [v.block_n, v.block_k])
        m, k = x.shape
        tma_swapped_kernel[(ln.grid,)](
            x_desc, w_desc, y, x_scale, w_scale, self.parts, self.counts,
            m, w.shape[0], k, ln.chunk, v.split_k, y.stride(0), y.stride(1),
            STREAM=v.stream, SLOTS=ln.slots, BLOCK_M=ln.block_m, BLOCK_N=v.block_n,
            BLOCK_K=v.block_k, STAGES=v.stages, num_warps=4)
        return y


def ptx() -> None:
    """Compile one variant of each schedule for sm_90 and show what pipelines the loads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for stream in (True, False):
        signature = {"x_desc": "tensordesc<fp8e4nv[16, 128]>",
                     "w_desc": "tensordesc<fp8e4nv[64, 128]>", "y_ptr": "*bf16",
                     "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "part_ptr": "*fp32",
                     "count_ptr": "*i32"}
        constexprs = dict(STREAM=stream, SLOTS=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, STAGES=8)
        names = tma_swapped_kernel.fn.__code__.co_varnames[
            :tma_swapped_kernel.fn.__code__.co_argcount]
        signature = {n: signature.get(n, "constexpr" if n in constexprs else "i32")
                     for n in names}
        kernel = triton.compile(ASTSource(fn=tma_swapped_kernel, signature=signature,
                                          constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32))
        text = kernel.asm["ptx"]
        print(f"stream={stream}: shared {kernel.metadata.shared} B,",
              {op: text.count(op) for op in ("cp.async.bulk.tensor", "mbarrier.try_wait",
                                             "wgmma.mma_async", "atom.global", "bar.sync")})


def check_on_cpu() -> None:
    """Every variant of a few ragged shapes against the fp32 reference, in the interpreter."""
    assert INTERPRETED, "run with TRITON_INTERPRET=1"
    gen = torch.Generator().manual_seed(0)
    for m, n, k, sms in ((5, 200, 384, 3), (16, 130, 1024, 7), (33, 64, 272, 2)):
        w = (torch.randn(n, k, generator=gen) / 8).to(torch.float8_e4m3fn)
        x = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
        xs, ws = torch.rand(m, 1, generator=gen) + 0.5, torch.rand(n, 1, generator=gen) + 0.5
        ref = (x.float() @ w.float().T) * xs * ws.T
        for v in variants(m, n, k, sms):
            run = Runner(v, m, n, k, sms, "cpu")
            for _ in range(2):  # the second launch finds the counters left zero
                y = run(x, w, xs, ws, torch.full((m, n), float("nan"), dtype=torch.bfloat16))
                err = float((y.float() - ref).norm() / ref.norm())
                assert err < 1e-2, (m, n, k, v.name, err)
        print(f"{m}x{n}x{k} on {sms} SMs: {len(variants(m, n, k, sms))} variants right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--m", default="16,32,64")
    parser.add_argument("--ptx", action="store_true", help="compile for sm_90 (no GPU needed)")
    parser.add_argument("--check", action="store_true",
                        help="check every variant in the interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.ptx:
        ptx()
        return
    if args.check:
        check_on_cpu()
        return
    from preshuffle_probe import best_by_kind, print_ratios, write_rows

    from gemmtune.families.a8w8 import gemm_a8w8
    from gemmtune.kernels.torch_ref import scaled_mm_torch
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us
    from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s

    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # The attainable floor as `gemmtune bench` counts it; at M <= 64 an FP8 GEMM's bytes bound
    # it (its FLOPs would take a fifth of the time at the tensor cores' peak).
    read_bytes_per_s, t_launch = streaming_read_bytes_per_s(), launch_us()
    print(f"streaming read {read_bytes_per_s / 1e9:.0f} GB/s, t_launch {t_launch:.2f} us")
    shuffled_rows = _table_kernels("a8w8_bpreshuffle")
    rows = []
    for n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen, device="cuda") / 8).to(torch.float8_e4m3fn)
        copies = [w] + [w.clone() for _ in range(copies_to_exceed_l2(n * k) - 1)]
        w_scale = torch.rand(n, 1, generator=gen, device="cuda") + 0.5
        for m in (int(s) for s in args.m.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            x_scale = torch.rand(m, 1, generator=gen, device="cuda") + 0.5
            ref = (x.float() @ w.float().T) * x_scale * w_scale.T
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def right(out) -> bool:
                return float((out.float() - ref).norm() / ref.norm()) < 1e-2

            fns, entries = [], []
            for v in variants(m, n, k, sms):
                run = Runner(v, m, n, k, sms, "cuda")
                try:
                    got = run(x, w, x_scale, w_scale, torch.full_like(y, float("nan")))
                except triton.runtime.errors.OutOfResources as e:
                    print(f"{m}x{n}x{k} {v.name}: {e}", flush=True)
                    continue
                if right(got):
                    fns.append(lambda c, run=run: run(x, c, x_scale, w_scale, y))
                    entries.append(("stream" if v.stream else "grid", v.name))
                else:
                    print(f"{m}x{n}x{k} {v.name}: wrong, left out", flush=True)
            table = gemm_a8w8(x, w, x_scale, w_scale)
            if right(table):
                fns.append(lambda c: gemm_a8w8(x, c, x_scale, w_scale))
                entries.append(("table", "table"))
            name = shuffled_rows.get((m, n, k))
            # Only the pre-shuffled table's split-K rows run on the row-major weight as well.
            if name is not None and name.startswith("triton.splitk:") and right(
                    gemm_a8w8(x, w, x_scale, w_scale, kernel=name)):
                fns.append(lambda c, name=name: gemm_a8w8(x, c, x_scale, w_scale, kernel=name))
                entries.append(("splitk", name))
            fns.append(lambda c: scaled_mm_torch(x, c, None, torch.bfloat16, x_scale,
                                                 w_scale.T))
            entries.append(("scaled_mm", "scaled_mm"))
            times = [t for t, _ in interleaved_graph_us(fns, copies, rounds=9, replays=2)]
            best = best_by_kind(entries, times)
            floor = (m * k + n * k + 2 * m * n) / read_bytes_per_s * 1e6 + t_launch
            rec = {"M": m, "N": n, "K": k, "floor_us": floor}
            for kind, (t, label) in best.items():
                rec[f"{kind}_us"], rec[f"{kind}_cfg"] = t, label
            rows.append(rec)
            print(f"{m:>3}x{n}x{k}: floor {rec['floor_us']:6.2f} | "
                  + " | ".join(f"{kind} {t:7.2f}" for kind, (t, _) in sorted(best.items()))
                  + f" | {best.get('stream', (0, '-'))[1]}", flush=True)
    write_rows(rows, args.out / "streamk_probe.csv")
    print_ratios(rows, "time / shipped table's time, geomean (below 1: faster than the table)",
                 {kind: (f"{kind}_us", "table_us")
                  for kind in ("stream", "grid", "splitk", "scaled_mm")})
    for m in sorted({r["M"] for r in rows}):
        print_ratios([r for r in rows if r["M"] == m], f"M = {m}: time / table's",
                     {kind: (f"{kind}_us", "table_us") for kind in ("stream", "grid")})
    print_ratios(rows, "attainable efficiency (floor / time), geomean",
                 {kind: ("floor_us", f"{kind}_us") for kind in ("stream", "grid", "table")})


def _table_kernels(stem: str) -> dict[tuple[int, int, int], str]:
    """{(M, N, K): kernelName} of a shipped table."""
    path = Path(__file__).parent.parent / "src/gemmtune/configs" / f"{stem}_tuned_gemm.csv"
    with open(path, newline="") as f:
        return {(int(r["M"]), int(r["N"]), int(r["K"])): r["kernelName"]
                for r in csv.DictReader(f)}


if __name__ == "__main__":
    main()
