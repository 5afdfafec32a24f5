"""How close to the attainable floor can anything that reads a decode GEMM's weight get? (issue 15)

Issue 15 asks decode GEMMs (M <= 64) for a geometric mean of 0.90 of the attainable floor
(bytes over the streaming-read bandwidth, plus t_launch) and no shape below 0.75. A GEMM at M = 1
must at least read its weight once. Here, per (N, K) of the bf16 presets, the weight alone is
read by a kernel that does nothing else (each program sums a contiguous slice of it into one
float: no x, no dot, no reduction across programs), in 18 configs (programs per SM, loads per
step, warps), beside torch's M = 1 GEMM and torch's own sum. All are timed alike (CUDA-graph
replay of back-to-back calls over weight copies exceeding L2), interleaved per shape.

The best reader's efficiency is what a GEMV that reads as well as a pure read would score: a
ceiling on the issue's targets for that (N, K). Beside it, a first GEMV of that shape (M = 1,
bf16): programs over row blocks and K slices as many as the reader's, each adding its rows'
partial dot products into an fp32 buffer with atomics, then a second launch converting the
buffer to bf16 and zeroing it, with or without programmatic dependent launch, and a one-launch
GEMV whose programs take their rows' whole K (for short K); 28 configs in all, each checked
against torch's result. Prints per preset the geomean and minimum of
each column and the shapes below 0.75; writes every shape to $OUT/read_floor.csv.

With ``--weight-bytes 1`` the weights are FP8-sized (N x K bytes, read as N x K/2 bf16 elements:
a pure read costs the same for any element type) and only the readers and ``w.sum`` run: the
ceiling of the FP8 families' targets (per-token, block-scale, pre-shuffled) at M = 1, whose extra
bytes (x, the scales, the output) are under 1% of the weight's.

    PYTHONPATH=src python3 benchmarks/read_floor_probe.py [--presets llama3-8b:1,...]
        [--weight-bytes 1]
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s
from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us
from gemmtune.models.shapes import dense_projections, load_preset

PRESETS = "llama3-8b:1,llama3-70b:8,qwen3-32b:1,deepseek-v3:8"
PROGRAMS_PER_SM = (1, 2, 4, 8, 16, 32)
STEPS = ((1024, 4), (2048, 4), (8192, 8))  # (elements per load step, warps)


@triton.jit
def _read(w_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
    """Program p sums w[p * chunk : (p + 1) * chunk] (bf16, in fp32) into out[p]."""
    start = tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_release(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _gemv_parts(x_ptr, w_ptr, acc_ptr, N, K, k_per, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PDL: tl.constexpr, RELEASE_LAST: tl.constexpr):
    """Rows [pid_n * BLOCK_N, +BLOCK_N) of x @ w.T over K slice pid_k, added into acc (fp32);
    with PDL the next launch is let start before the additions, or with RELEASE_LAST after."""
    _pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * k_per
    total = tl.zeros((BLOCK_N,), tl.float32)
    for off in range(0, k_per, BLOCK_K):
        ks = k0 + off + tl.arange(0, BLOCK_K)
        inside = ks < K
        x = tl.load(x_ptr + ks, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rows[:, None] < N) & inside[None, :], other=0.0).to(tl.float32)
        total += tl.sum(w * x[None, :], axis=1)
    _pdl_release(PDL and not RELEASE_LAST)
    tl.atomic_add(acc_ptr + rows, total, mask=rows < N, sem="relaxed")
    _pdl_release(PDL and RELEASE_LAST)


@triton.jit
def _gemv_out(acc_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_wait(PDL)
    _pdl_release(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    tl.store(y_ptr + offs, tl.load(acc_ptr + offs, mask=inside).to(y_ptr.dtype.element_ty),
             mask=inside)
    tl.store(acc_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=inside)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr):
    """Rows [pid * BLOCK_N, +BLOCK_N) of x @ w.T over the whole K, stored in y's dtype: one
    launch, no reduction across programs (for short K)."""
    _pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = ks < K
        x = tl.load(x_ptr + ks, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(rows[:, None] < N) & inside[None, :], other=0.0).to(tl.float32)
        total += tl.sum(w * x[None, :], axis=1)
    _pdl_release(PDL)
    tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=rows < N)


# (rows per program, K step, programs per SM, PDL: off, on, or "last": the next launch
# let start only after the atomics) of the split GEMV; (rows, K step, PDL) of
# the whole-K one.
GEMV_CONFIGS = tuple((bn, bk, per, pdl) for bn, bk in ((2, 2048), (4, 1024), (8, 1024), (16, 512))
                     for per in (8, 32) for pdl in (False, True, "last"))
ROWS_CONFIGS = tuple((bn, bk, pdl) for bn in (1, 2, 4) for bk in (512, 1024)
                     for pdl in (False, True))


def _gemv(x: torch.Tensor, n: int, k: int, block_n: int, block_k: int, programs: int,
          pdl: bool):
    """y = x @ w.T (x (1, K) bf16) in row blocks x K slices about ``programs`` in all."""
    row_blocks = -(-n // block_n)
    splits = max(1, min(-(-k // block_k), round(programs / row_blocks)))
    k_per = -(-(-(-k // splits)) // block_k) * block_k
    splits = -(-k // k_per)
    acc = torch.zeros(n, device="cuda", dtype=torch.float32)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def gemv(w):
        _gemv_parts[(row_blocks, splits)](x, w, acc, n, k, k_per, BLOCK_N=block_n,
                                          BLOCK_K=block_k, PDL=bool(pdl),
                                          RELEASE_LAST=pdl == "last", num_warps=4,
                                          launch_pdl=bool(pdl))
        _gemv_out[(-(-n // 1024),)](acc, y, n, BLOCK=1024, PDL=bool(pdl), num_warps=4,
                                    launch_pdl=bool(pdl))
        return y
    return gemv


def _gemv_whole_k(x: torch.Tensor, n: int, k: int, block_n: int, block_k: int, pdl: bool):
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def gemv(w):
        _gemv_rows[(-(-n // block_n),)](x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                        PDL=pdl, num_warps=4, launch_pdl=pdl)
        return y
    return gemv


def _reader(programs: int, block: int, warps: int, n: int):
    chunk = -(-n // programs)
    chunk = -(-chunk // block) * block
    out = torch.empty(programs, device="cuda", dtype=torch.float32)

    def read(w):
        _read[(programs,)](w, out, n, chunk, BLOCK=block, num_warps=warps)
    return read


def shapes(presets: str) -> dict[str, list[tuple[str, int, int]]]:
    """Per preset, its distinct (N, K) (the first projection's name for each)."""
    out = {}
    for item in presets.split(","):
        name, _, tp = item.partition(":")
        seen = {}
        for p in dense_projections(load_preset(name), int(tp or 1)):
            seen.setdefault((p.N, p.K), p.name)
        out[item] = [(label, n, k) for (n, k), label in seen.items()]
    return out


def probe_shape(n: int, k: int, bandwidth: float, launch: float, weight_bytes: int = 2) -> dict:
    """``weight_bytes`` 1: an FP8-sized weight, read only (no GEMV, no torch.mm)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = n * k * weight_bytes
    copies = copies_to_exceed_l2(nbytes)
    gen = torch.Generator(device="cuda").manual_seed(n ^ k)
    cols = k * weight_bytes // 2
    weights = [torch.randn(n, cols, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(copies)]
    readers = {f"P{per}xB{block}xW{warps}": _reader(per * sms, block, warps, n * cols)
               for per in PROGRAMS_PER_SM for block, warps in STEPS}
    if weight_bytes != 2:
        return _read_only_row(n, k, nbytes, readers, weights, bandwidth, launch)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    pdl_names = {False: "", True: ".PDL", "last": ".PDLlast"}
    gemvs = {f"BN{bn}xBK{bk}xP{per}{pdl_names[pdl]}": _gemv(x, n, k, bn, bk, per * sms, pdl)
             for bn, bk, per, pdl in GEMV_CONFIGS}
    gemvs.update((f"rows.BN{bn}xBK{bk}{'.PDL' if pdl else ''}",
                  _gemv_whole_k(x, n, k, bn, bk, pdl)) for bn, bk, pdl in ROWS_CONFIGS)
    wants = [torch.mm(x, w.t()).float() for w in weights[:2]]
    wrong = {}
    for name, gemv in list(gemvs.items()):
        # Twice: a config whose sums are left dirty shows on the second.
        for w, want in zip(weights, wants):
            err = float((gemv(w).float() - want).norm() / want.norm())
            if err > 1e-2:
                wrong[name] = err
                del gemvs[name]
                break
    for name, err in wrong.items():
        print(f"{n}x{k} {name}: the GEMV is off torch's by {err:.2e}; not timed")
    fns = [lambda w, r=r: r(w) for r in readers.values()]
    fns += [lambda w, g=g: g(w) for g in gemvs.values()]
    fns.append(lambda w: torch.mm(x, w.t()))
    fns.append(lambda w: w.sum(dtype=torch.float32))
    times = [t for t, _ in interleaved_graph_us(fns, weights, rounds=9, replays=2)]
    best = min(range(len(readers)), key=lambda i: times[i])
    best_gemv = min(range(len(readers), len(readers) + len(gemvs)), key=lambda i: times[i])
    floor = nbytes / bandwidth * 1e6 + launch
    row = dict(N=n, K=k, MB=round(nbytes / 1e6, 2), floor_us=round(floor, 2),
               read_us=round(times[best], 2), read_config=list(readers)[best],
               gemv_us=round(times[best_gemv], 2),
               gemv_config=list(gemvs)[best_gemv - len(readers)],
               mm_us=round(times[-2], 2), sum_us=round(times[-1], 2),
               gemv_wrong=" ".join(f"{name}:{err:.1e}" for name, err in wrong.items()))
    row.update(eff_read=round(floor / times[best], 3),
               eff_gemv=round(floor / times[best_gemv], 3), eff_mm=round(floor / times[-2], 3),
               eff_sum=round(floor / times[-1], 3))
    del weights
    return row


def _read_only_row(n: int, k: int, nbytes: int, readers: dict, weights: list, bandwidth: float,
                   launch: float) -> dict:
    fns = [lambda w, r=r: r(w) for r in readers.values()]
    fns.append(lambda w: w.sum(dtype=torch.float32))
    times = [t for t, _ in interleaved_graph_us(fns, weights, rounds=9, replays=2)]
    best = min(range(len(readers)), key=lambda i: times[i])
    floor = nbytes / bandwidth * 1e6 + launch
    return dict(N=n, K=k, MB=round(nbytes / 1e6, 2), floor_us=round(floor, 2),
                read_us=round(times[best], 2), read_config=list(readers)[best],
                sum_us=round(times[-1], 2), eff_read=round(floor / times[best], 3),
                eff_sum=round(floor / times[-1], 3))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=PRESETS, help="NAME:TP,... (default: %(default)s)")
    parser.add_argument("--weight-bytes", type=int, choices=(1, 2), default=2,
                        help="bytes per weight element: 2 (bf16, with the GEMVs and torch.mm) or "
                             "1 (FP8-sized, the readers only)")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    bandwidth, launch = streaming_read_bytes_per_s(), launch_us()
    rows = []
    for preset, items in shapes(args.presets).items():
        for label, n, k in items:
            rows.append(dict(preset=preset, name=label,
                             **probe_shape(n, k, bandwidth, launch, args.weight_bytes)))
    stem = "read_floor" if args.weight_bytes == 2 else "read_floor_fp8"
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{torch.cuda.get_device_name()}: streaming read {bandwidth / 1e9:.0f} GB/s, t_launch "
          f"{launch:.2f} µs; attainable efficiency (floor / time) at M = 1, "
          f"{'bf16' if args.weight_bytes == 2 else 'FP8-sized weights'}")
    columns = (("eff_read", "reader"), ("eff_gemv", "gemv"), ("eff_mm", "torch.mm"),
               ("eff_sum", "w.sum"))
    columns = [(c, label) for c, label in columns if c in rows[0]]
    print(f"{'preset':<16} {'shapes':>6} "
          + " ".join(f"{label + ' geo (min)':>19}" for _, label in columns))
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        cells = " ".join(
            f"{geomean([r[c] for r in mine]):>11.3f} ({min(r[c] for r in mine):.3f})"
            for c, _ in columns)
        print(f"{preset:<16} {len(mine):>6} {cells}")
    print("shapes whose best reader is below 0.75 of the floor:")
    for r in rows:
        if r["eff_read"] < 0.75:
            print(f"  {r['preset']:<16} {r['name']:<12} {r['N']:>6}x{r['K']:<6} {r['MB']:>7} MB "
                  f"floor {r['floor_us']:>6} µs, reader {r['read_us']:>6} ({r['read_config']}), "
                  + (f"torch.mm {r['mm_us']:>6}" if "mm_us" in r else f"w.sum {r['sum_us']:>6}"))
    if args.weight_bytes != 2:
        return
    print("GEMV against torch.mm per shape (µs):")
    for r in rows:
        print(f"  {r['preset']:<16} {r['name']:<14} {r['N']:>6}x{r['K']:<6} gemv "
              f"{r['gemv_us']:>7} ({r['gemv_config']}) torch.mm {r['mm_us']:>7} "
              f"x {r['mm_us'] / r['gemv_us']:.3f}")


if __name__ == "__main__":
    main()
