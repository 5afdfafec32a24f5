"""Does the order in which programs read an FP8 weight's tiles cost bandwidth? (issue 15)

The decode GEMMs read w (N x K bytes) as tiles of R rows x 128 bytes of K, every program
stepping along K in lockstep with the others: at each moment all SMs read the same 128 bytes of
K from rows 4 KB (K bytes) apart, a few address bits in common. Split-K programs start at
different Ks; unsplit ones do not. This reads the weight alone, nothing else, in the GEMMs'
patterns on a few shapes, all timed alike (CUDA-graph replay over copies exceeding L2,
interleaved per shape):

- ``tiles``: programs of R rows x K/S bytes (S splits), each stepping 128 bytes of K a load;
- ``tiles+rot``: the same, each program starting its run at its own step (an even spread over
  the programs) and wrapping around: the same bytes, the Ks spread over the SMs;
- ``flat``: (unsplit) each program's slab, contiguous in memory, read front to back.

The loads are plain, UNROLL steps a loop iteration. ``tiles`` and ``tiles+rot`` move the same
bytes in the same loads and differ only in their order; ``flat`` loads 4096 bytes at a time
(as many as ``tiles`` only at R = 32), so compare it with R32 rows. N must be a multiple of 128
and K of 128 x UNROLL; a (rows, splits) whose steps UNROLL does not divide is skipped, and
said so.

    PYTHONPATH=src python3 benchmarks/read_order_probe.py [--shapes 4096,4096 ...]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from gemmtune.measure.ceilings import launch_us, streaming_read_bytes_per_s
from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

BLOCK_K = 128
UNROLL = 8


@triton.jit
def _tiles(w_ptr, out_ptr, K, steps_per, ROWS: tl.constexpr, ROTATE: tl.constexpr,
           UNROLL: tl.constexpr):
    """Program (n, s) sums rows [n * ROWS, +ROWS) over K steps [s * steps_per, +steps_per), a
    (ROWS, 128) block a step; ``ROTATE``: starting at its own step of the run."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    programs = tl.num_programs(0) * tl.num_programs(1)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    base = w_ptr + rows[:, None].to(tl.int64) * K + tl.arange(0, 128)[None, :]
    lo = split * steps_per
    shift = 0
    if ROTATE:
        shift = (pid_n * tl.num_programs(1) + split) * steps_per // programs
    acc = tl.zeros([ROWS, 128], tl.int32)
    for i in range(0, steps_per, UNROLL):
        for u in tl.static_range(UNROLL):
            k = lo + (shift + i + u) % steps_per
            acc += tl.load(base + k * 128).to(tl.int32)
    tl.store(out_ptr + pid_n * tl.num_programs(1) + split, tl.sum(acc))


@triton.jit
def _flat(w_ptr, out_ptr, slab, UNROLL: tl.constexpr):
    """Program p sums bytes [p * slab, +slab) front to back, 4096 a load."""
    base = w_ptr + tl.program_id(0).to(tl.int64) * slab + tl.arange(0, 4096)
    acc = tl.zeros([4096], tl.int32)
    for off in range(0, slab, 4096 * UNROLL):
        for u in tl.static_range(UNROLL):
            acc += tl.load(base + off + u * 4096).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def variants(n: int, k: int, sms: int) -> dict:
    """name -> fn(w): every (rows, splits) that makes one wave or about one, each order."""
    if n % 128 or k % (BLOCK_K * UNROLL):
        raise SystemExit(f"{n} x {k}: N must be a multiple of 128 and K of {BLOCK_K * UNROLL}")
    k_steps = k // BLOCK_K
    out = torch.empty(2 * sms, device="cuda", dtype=torch.float32)  # a float a program
    found = {}
    for rows in (16, 32, 64, 128):
        tiles = n // rows
        for splits in (1, 2, 3, 4, 5, 6, 8):
            programs = tiles * splits
            if programs > 2 * sms or programs * 2 < sms:
                continue
            if k_steps % (splits * UNROLL):
                print(f"  {n} x {k}: R{rows} S{splits} skipped ({k_steps} steps, {splits} "
                      f"splits of {UNROLL}-step loads)")
                continue
            steps = k_steps // splits
            for rot in (0, 1):
                name = f"tiles R{rows} S{splits}{' +rot' if rot else ''} ({programs} progs)"
                found[name] = (lambda w, rows=rows, splits=splits, steps=steps, rot=rot:
                               _tiles[(n // rows, splits)](w, out, k, steps, ROWS=rows,
                                                           ROTATE=rot, UNROLL=UNROLL,
                                                           num_warps=4))
            if splits == 1 and (rows * k) % (4096 * UNROLL) == 0:
                found[f"flat R{rows} ({programs} progs)"] = (
                    lambda w, rows=rows: _flat[(n // rows,)](w, out, rows * k, UNROLL=UNROLL,
                                                             num_warps=4))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096,4096", "6144,4096", "4096,14336",
                                                    "7168,8192"])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth, launch = streaming_read_bytes_per_s(), launch_us()
    print(f"streaming read {bandwidth / 1e9:.0f} GB/s, t_launch {launch:.2f} us, {sms} SMs")
    for shape in args.shapes:
        n, k = map(int, shape.split(","))
        floor = n * k / bandwidth * 1e6 + launch
        weights = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int8).view(
            torch.uint8) for _ in range(copies_to_exceed_l2(n * k))]
        fns = variants(n, k, sms)
        for fn in fns.values():
            fn(weights[0])
        torch.cuda.synchronize()
        times = interleaved_graph_us(list(fns.values()), weights, rounds=args.rounds)
        print(f"\n{n} x {k} (FP8 bytes), floor {floor:.2f} us")
        for name, (us, _) in sorted(zip(fns, times), key=lambda t: t[1][0]):
            print(f"  {us:8.2f} us  {floor / us:5.3f}  {name}")


if __name__ == "__main__":
    main()
