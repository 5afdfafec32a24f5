"""Does a deep TMA ring on every SM beat cuBLASLt's FP8 decode GEMMs at M = 16-64? (issue 15)

Nsight Compute on 16 x 4096 x 4096 (docs/benchmarks.md, session 21): cuBLASLt's row (algo 66,
tile 64x16) runs 64 programs of 384 threads, one per SM on 64 of the 132 SMs, each with 181 KiB
of shared memory as a TMA pipeline, and reads at 47% of DRAM peak; the split-K kernel (one warp
per program) and the register-direct ``triton.frag`` (157 registers, 3 programs per SM) at
20-34%, issue- and latency-bound. A swapped dot fed as cuBLASLt feeds its one (w's 64 rows as
the MMA's M, x's rows its N, both through TMA into a ring of STAGES slots of shared memory,
one mbarrier per slot) but with K split so that every SM streams, ought to read at the rate
cuBLASLt reaches per SM on all of them. Session 20's TMA probe (``streamk_probe.py``) pipelined
with Triton's ``num_stages`` and finished tiles inside the loop; here the ring is explicit (Gluon)
and the loop holds only the wait, the MMA (from zero, added into fp32 each step, as
``triton.frag``) and the slot's refill. The end is ``triton.frag``'s (``_finish_tile``: scales,
bias, the deterministic split sum).

Per shape and M: ring configs (steps of 128 or 256 bytes of K, 4-12 slots as shared
memory allows, K split for 1 or 2 programs per SM) beside the op through the shipped a8w8 table
and ``torch._scaled_mm``; each checked against the fp32 reference before it is timed
(interleaved CUDA-graph replays over weight copies exceeding L2).

    PYTHONPATH=src python3 benchmarks/gluon_ring_probe.py [--out DIR] [--m 16,32,64]   # GPU
    python3 benchmarks/gluon_ring_probe.py --ptx      # CPU: compile for sm_90, show the loop

Every split config also runs as two launches ("2L"): the ring stores its partials and lets the
next launch start (PDL); a plain Triton kernel, already resident, waits for it, then sums each
tile's partials (all loads in flight at once) and scales and stores it: one round trip after the
ring ends instead of the one-launch end's chain (fence, counter, partials, scales).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gemmtune.kernels.triton._ring_launch import descriptors
from gemmtune.kernels.triton._swapped import finish_tile, partials_per_load
from gemmtune.kernels.triton.gemm_ring import ring_tile

BLOCK_N = 64  # w rows per program: the MMA's M, one warpgroup
SMEM_BYTES = 200 * 1024  # of the 227 KiB a block may take, the rest for the end's conversion
SHAPES = ((4096, 4096), (6144, 4096), (1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584),
          (1536, 7168), (576, 7168), (5120, 8192), (10240, 5120), (4096, 14336), (3072, 1536))


@gluon.jit(do_not_specialize=["M"])
def ring_kernel(w_desc, x_desc, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, part_ptr, count_ptr,
                M, N, K, stride_ym, stride_yn, stride_bias,
                HAS_BIAS: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
                SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, PER_LOAD: gl.constexpr, PARTIAL_ONLY: gl.constexpr,
                RELEASE: gl.constexpr):
    """``gemm_ring_kernel`` with the probe's other ends: PARTIAL_ONLY stores the split's partial
    and sums nothing; RELEASE lets the launch after it (``sum_kernel``) start at once (PDL)."""
    if RELEASE:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    acc, pid_n, split, pid_m = ring_tile(w_desc, x_desc, M, K, scale_a_ptr, scale_b_ptr, 0,
                                         SPLIT_K, 64, BLOCK_M, BLOCK_K, STAGES, False)
    if PARTIAL_ONLY:
        out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])
        local = gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))[:, None] \
            + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))[None, :] * 64
        tile = pid_m * gl.num_programs(0) + pid_n
        gl.store(part_ptr + (tile * SPLIT_K + split).to(gl.int64) * (64 * BLOCK_M) + local,
                 gl.convert_layout(acc, out_layout))
    else:
        finish_tile(acc, pid_n, split, pid_m, y_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                    part_ptr, count_ptr, M, N, stride_ym, stride_yn, stride_bias, HAS_BIAS,
                    SCALE_A, SCALE_B, SPLIT_K, 64, BLOCK_M, PER_LOAD, False)


@triton.jit
def sum_kernel(part_ptr, y_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_ym, stride_yn,
               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """The second launch of a ``2L`` ring: tile ``pid``'s SPLIT_K partials summed in split order
    (all loads issued before the first add), scaled per row of x and of w, stored. Launched with
    PDL: its programs wait, already resident, for the ring's last store."""
    tile = tl.program_id(0)
    n_tiles = tl.cdiv(N, 64)
    pid_n = tile % n_tiles
    pid_m = tile // n_tiles
    local = tl.arange(0, 64)[:, None] + tl.arange(0, BLOCK_M)[None, :] * 64
    base = part_ptr + tile.to(tl.int64) * (SPLIT_K * 64 * BLOCK_M) + local
    cols = pid_n * 64 + tl.arange(0, 64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.extra.cuda.gdc_wait()
    total = tl.zeros((64, BLOCK_M), tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(base + s * (64 * BLOCK_M))
    total = total * tl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)[None, :] \
        * tl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)[:, None]
    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None] * stride_yn,
             total.to(y_ptr.dtype.element_ty), mask=(rows < M)[None, :] & (cols < N)[:, None])


class Ring(NamedTuple):
    block_m: int
    block_k: int
    stages: int
    split_k: int
    # "sum": triton.frag's end, one launch; "nosum" (timing only: the output is wrong): the
    # partials stored, nothing summed; "2L": the partials stored, summed by sum_kernel (PDL)
    end: str = "sum"

    @property
    def name(self) -> str:
        return (f"ring.BM{self.block_m}.BK{self.block_k}.S{self.stages}.SK{self.split_k}"
                + ("" if self.end == "sum" else f".{self.end}"))


def ring_variants(m: int, n: int, k: int, sms: int) -> list[Ring]:
    block_m = next(b for b in (16, 32, 64) if b >= min(m, 64))
    found = {}
    for bk in (128, 256):
        k_steps = triton.cdiv(k, bk)
        most = SMEM_BYTES // ((64 + block_m) * bk)
        tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m)
        for per_sm in (1, 2, 4):
            split = max(1, min(k_steps, 32, round(per_sm * sms / tiles)))
            for stages in (4, 8, 12):
                stages = min(stages, most // per_sm, k_steps // split or 1)
                if stages >= 2:
                    found[Ring(block_m, bk, stages, split)] = None
    return list(found)


def ring_call(x, w, y, x_scale, w_scale, v: Ring, counters=None):
    """y = (x @ w.T) * x_scale * w_scale through ``ring_kernel`` (x, w FP8; per-row scales)."""
    from gemmtune.kernels.triton._splits import workspace

    m, k = x.shape
    n = w.shape[0]
    w_desc, x_desc = descriptors(x, w, BLOCK_N, v.block_m, v.block_k)
    n_tiles, m_tiles = triton.cdiv(n, 64), triton.cdiv(m, v.block_m)
    parts, counters, _ = workspace(x, y, n_tiles * m_tiles, 64 * v.block_m,
                                   max(v.split_k, 2 if v.end != "sum" else 1), counters, False)
    ring_kernel[(n_tiles, v.split_k, m_tiles)](
        w_desc, x_desc, y, y, x_scale, w_scale, parts, counters, m, n, k, y.stride(0),
        y.stride(1), 0, HAS_BIAS=False, SCALE_A=2, SCALE_B=2, SPLIT_K=v.split_k,
        BLOCK_M=v.block_m, BLOCK_K=v.block_k, STAGES=v.stages,
        PER_LOAD=partials_per_load(v.split_k, 64, v.block_m, 4), PARTIAL_ONLY=v.end != "sum",
        RELEASE=v.end == "2L", num_warps=4)
    if v.end == "2L":
        sum_kernel[(n_tiles * m_tiles,)](parts, y, x_scale, w_scale, m, n, y.stride(0),
                                         y.stride(1), SPLIT_K=v.split_k, BLOCK_M=v.block_m,
                                         num_warps=4, launch_pdl=True)
    return y


def show_ptx() -> None:
    """Compile two variants for sm_90 and count what the loop holds (no GPU needed)."""
    import inspect

    from triton.backends.compiler import GPUTarget

    names = inspect.signature(ring_kernel.fn).parameters
    for v in (Ring(16, 128, 8, 4), Ring(64, 256, 4, 2), Ring(16, 128, 8, 4, "2L")):
        constexprs = dict(HAS_BIAS=False, SCALE_A=2, SCALE_B=2, SPLIT_K=v.split_k,
                          BLOCK_M=v.block_m, BLOCK_K=v.block_k, STAGES=v.stages,
                          PER_LOAD=partials_per_load(v.split_k, 64, v.block_m, 4),
                          PARTIAL_ONLY=v.end != "sum", RELEASE=v.end == "2L")
        w_layout = gl.NVMMASharedLayout.get_default_for([64, v.block_k], gl.float8e4nv)
        x_layout = gl.NVMMASharedLayout.get_default_for([v.block_m, v.block_k], gl.float8e4nv)
        descs = {"w_desc": f"tensordesc<fp8e4nv[64, {v.block_k}],{w_layout!r}>",
                 "x_desc": f"tensordesc<fp8e4nv[{v.block_m}, {v.block_k}],{x_layout!r}>"}
        pointers = {"y_ptr": "*bf16", "bias_ptr": "*bf16", "scale_a_ptr": "*fp32",
                    "scale_b_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32"}
        signature = {p: descs.get(p) or pointers.get(p) or
                     ("constexpr" if p in constexprs else "i32") for p in names}
        kernel = triton.compile(gluon._runtime.GluonASTSource(
            fn=ring_kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 128))
        text = kernel.asm["ptx"]
        counts = {op: text.count(op) for op in ("cp.async.bulk.tensor", "mbarrier.try_wait",
                                                "wgmma.mma_async", "bar.sync", "ld.global",
                                                "st.local", "ld.local")}
        print(v.name, f"shared {kernel.metadata.shared} B,", counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--m", default="16,32,64")
    parser.add_argument("--ptx", action="store_true", help="compile for sm_90 only (CPU)")
    parser.add_argument("--shapes", default="",
                        help="N,K;N,K;... instead of the presets' (default: %(default)r)")
    parser.add_argument("--nosum", action="store_true",
                        help="also time each split config without its split sum, and print "
                             "every variant's time")
    args = parser.parse_args()
    if args.ptx:
        show_ptx()
        return
    from preshuffle_probe import write_rows

    from gemmtune.families.a8w8 import gemm_a8w8
    from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth, t_launch = streaming_read_bytes_per_s(), launch_us()
    print(f"streaming read {bandwidth / 1e9:.0f} GB/s, t_launch {t_launch:.2f} us", flush=True)
    rows = []
    shapes = [tuple(int(v) for v in item.split(",")) for item in args.shapes.split(";")] \
        if args.shapes else SHAPES
    for n, k in shapes:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen, device="cuda") / 8).to(torch.float8_e4m3fn)
        copies = [w] + [w.clone() for _ in range(copies_to_exceed_l2(n * k) - 1)]
        w_scale = torch.rand(n, generator=gen, device="cuda") + 0.5
        for m in (int(s) for s in args.m.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            x_scale = torch.rand(m, generator=gen, device="cuda") + 0.5
            ref = (x.float() @ w.float().T) * x_scale[:, None] * w_scale[None, :]
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            fns = [lambda c: gemm_a8w8(x, c, x_scale, w_scale),
                   lambda c: torch._scaled_mm(x, c.T, scale_a=x_scale[:, None],
                                              scale_b=w_scale[None, :],
                                              out_dtype=torch.bfloat16)]
            names = ["table", "scaled_mm"]
            for v in ring_variants(m, n, k, sms):
                try:
                    got = ring_call(x, w, torch.full_like(y, float("nan")), x_scale, w_scale, v)
                    again = ring_call(x, w, torch.full_like(y, float("nan")), x_scale, w_scale,
                                      v)
                except Exception as e:  # a variant that does not build: say so, go on
                    print(f"{m}x{n}x{k} {v.name}: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                err = float((got.float() - ref).norm() / ref.norm())
                if err < 1e-2 and torch.equal(got, again):
                    fns.append(lambda c, v=v: ring_call(x, c, y, x_scale, w_scale, v))
                    names.append(v.name)
                else:
                    print(f"{m}x{n}x{k} {v.name}: wrong ({err:.2e})", flush=True)
                    continue
                if v.split_k > 1:
                    two = v._replace(end="2L")
                    got = ring_call(x, w, torch.full_like(y, float("nan")), x_scale, w_scale, two)
                    err = float((got.float() - ref).norm() / ref.norm())
                    if err < 1e-2:
                        fns.append(lambda c, v=two: ring_call(x, c, y, x_scale, w_scale, v))
                        names.append(two.name)
                    else:
                        print(f"{m}x{n}x{k} {two.name}: wrong ({err:.2e})", flush=True)
                if args.nosum and v.split_k > 1:
                    bare = v._replace(end="nosum")
                    fns.append(lambda c, v=bare: ring_call(x, c, y, x_scale, w_scale, v))
                    names.append(bare.name)
            times = [t for t, _ in interleaved_graph_us(fns, copies, rounds=9, replays=2)]
            floor = ((m * k + n * k) + 2 * m * n) / bandwidth * 1e6 + t_launch
            summed = [(t, nm) for t, nm in zip(times[2:], names[2:])
                      if not nm.endswith((".nosum", ".2L"))]
            two = [(t, nm) for t, nm in zip(times[2:], names[2:]) if nm.endswith(".2L")]
            best2 = min(two) if two else (float("nan"), "-")
            best = min(summed) if summed else (float("nan"), "-")
            if args.nosum:
                for t, nm in sorted(zip(times, names)):
                    print(f"      {nm:34s} {t:8.2f}", flush=True)
            rec = dict(M=m, N=n, K=k, floor_us=round(floor, 2), table_us=round(times[0], 2),
                       scaled_mm_us=round(times[1], 2), ring_us=round(best[0], 2),
                       ring_cfg=best[1], table_over_ring=round(times[0] / best[0], 3),
                       ring2_us=round(best2[0], 2), ring2_cfg=best2[1],
                       table_over_best=round(times[0] / min(best[0], best2[0]), 3))
            rows.append(rec)
            print(f"{m:>3}x{n:>5}x{k:<5} floor {floor:6.2f} | table {times[0]:7.2f} "
                  f"(eff {floor / times[0]:.2f}) | scaled_mm {times[1]:7.2f} | ring "
                  f"{best[0]:7.2f} (eff {floor / best[0]:.2f}) {best[1]} | two launches "
                  f"{best2[0]:7.2f} {best2[1]}", flush=True)
    write_rows(rows, args.out / "gluon_ring_probe.csv")
    import math
    for m in sorted({r["M"] for r in rows}):
        for column, label in (("table_over_ring", "ring, one launch"),
                              ("table_over_best", "ring, best of one and two launches")):
            mine = [r[column] for r in rows if r["M"] == m and r[column] == r[column]]
            if mine:
                geo = math.exp(sum(math.log(v) for v in mine) / len(mine))
                print(f"M = {m}: table / {label} geomean {geo:.3f} (faster on "
                      f"{sum(v > 1 for v in mine)} of {len(mine)})")


if __name__ == "__main__":
    main()
