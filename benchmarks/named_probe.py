"""Named kernels of an FP8 family (or bf16) timed against each other on given shapes, one run
(issue 15).

Each kernel runs through the op with ``kernel=NAME`` (checked as a table row would be), all of
a shape's kernels captured in CUDA graphs over cold copies of the operands and replayed in
alternation (``interleaved_graph_us``), so the ratios hold within the run. A name the op
refuses for a shape is reported, not fatal. Configs no tuner offers (e.g. deeper rings) run
this way:

    python3 benchmarks/named_probe.py --family a8w8 --shapes 128,7168,8192 64,7168,8192 \
        --kernels triton.wsring:BM128.BN64.S4.SK1.F1 triton.wsring:BM128.BN64.S8.SK1.F1

Prints a table per shape (µs, and each kernel's time over the first's); ``--csv`` keeps them.
``@FILE`` reads arguments from FILE, one a line (``benchmarks/named_probe_args/``; the
``named:NAME`` stage of ``gpu_session.sh`` runs ``NAME.args``).
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch

import gemmtune
from gemmtune.families import get_family
from gemmtune.measure.timing import cold_copies, interleaved_graph_us


# The op of each family, called with its bench's inputs ((xq, wq, x_scale, w_scale), the
# pre-shuffled family's wq shuffled; bf16: (x, w)), and the bench's input dtype.
OPS = {"a8w8": gemmtune.gemm_a8w8, "a8w8-blockscale": gemmtune.gemm_a8w8_blockscale,
       "a8w8-bpreshuffle": gemmtune.gemm_a8w8_bpreshuffle, "bf16": gemmtune.gemm_a16w16}
BENCH_DTYPES = {"bf16": "bf16"}


def operands(family: str, m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The family's operands (FP8; bf16 for bf16) on fresh random data, as its bench makes
    them."""
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    return get_family(family).bench(BENCH_DTYPES.get(family, "fp8")).inputs(m, n, k, gen)


def call(family: str, s: tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
    return OPS[family](*s, kernel=name)


def time_shape(family: str, shape: tuple[int, int, int], names: list[str],
               rounds: int) -> list[tuple[str, float | None, str]]:
    """(name, µs or None, why not) per kernel."""
    first = operands(family, *shape)
    sets = cold_copies(first)
    ok, results = [], {}
    for name in names:
        try:
            call(family, first, name)  # compiled and planned before the capture
            ok.append(name)
        except (ValueError, RuntimeError) as e:
            results[name] = (None, str(e).split("\n")[0][:140])
    torch.cuda.synchronize()
    fns = [lambda s, name=name: call(family, s, name) for name in ok]
    for name, (us, _) in zip(ok, interleaved_graph_us(fns, sets, rounds=rounds)):
        results[name] = (us, "")
    return [(name, *results[name]) for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     fromfile_prefix_chars="@")
    parser.add_argument("--family", choices=sorted(OPS), default="a8w8")
    parser.add_argument("--shapes", nargs="+", required=True, help="M,N,K ...")
    parser.add_argument("--kernels", nargs="+", required=True, help="kernelNames")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--csv", help="write every time here too")
    args = parser.parse_args()
    out = open(args.csv, "w", newline="") if args.csv else None
    table = csv.writer(out) if out else None
    if table:
        table.writerow(["M", "N", "K", "kernelName", "us", "why_not"])
    for text in args.shapes:
        shape = tuple(int(v) for v in text.split(","))
        rows = time_shape(args.family, shape, args.kernels, args.rounds)
        base = next((us for _, us, _ in rows if us is not None), None)
        print(f"{'x'.join(map(str, shape))}  (ratio: over the first that ran)")
        for name, us, why in rows:
            if us is None:
                print(f"  {'-':>8} {'-':>6}  {name}: {why}")
            else:
                print(f"  {us:8.2f} {us / base:6.3f}  {name}")
            if table:
                table.writerow([*shape, name, "" if us is None else f"{us:.3f}", why])
        sys.stdout.flush()
    if out:
        out.close()


if __name__ == "__main__":
    main()
