"""Does a cheaper E2M1 decode speed up ``triton.w4frag``? (issue 16)

The kernel's loop is mostly the decode: per iteration of a warp (16 words of codes a thread),
the SASS of ``BM8.BK128.SK3.P1.R1.L1`` holds 160 PRMT, 72 LOP3 and 20 SHF among its 404
instructions, all on the ALU pipe, which issues a warp instruction every other cycle: about 15
µs of a 1 x 28672 x 4096 GEMM's 31 on an H200 (docs/benchmarks.md, session 35).

``--decode bits`` times the packed configs with each 32-bit word's bits placed (here, on the
host) so that 4 registers of bf16 pairs come out of 7 ALU instructions and 4 integer
multiplies (the FMA pipe): each code's 3 magnitude bits land on bf16 bits 6-8 (the exponent's
low two and the mantissa's top bit: the value times 2^-126, a subnormal for 0 and 0.5) and its
sign on bit 15 by a mask, a shift and a mask, or two shifts and two masks; ``mul.rn.bf16x2`` by
2^126 makes them the values. ``--decode prmt`` (the kernel as it is) times the same configs on
the same shapes. Each config's output is checked against the dequantised reference.

    PYTHONPATH=src python3 benchmarks/w4_decode_probe.py --decode bits [--shapes M,N,K ...]
        [--configs NAME ...] [--csv FILE]

Run both decodes (two processes: the kernel compiles with one decode per process) and compare
each config's time over ``F.linear``'s, timed in the same run.
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gemmtune import quant
from gemmtune.kernels import mxfp4
from gemmtune.kernels.triton import gemm_w4frag
from gemmtune.kernels.triton.gemm_w4frag import W4FragConfig, _halves
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = ("1,4096,4096", "8,4096,4096", "1,6144,4096", "1,28672,4096", "8,28672,4096",
          "1,4096,14336", "16,4096,4096", "16,28672,4096", "1,128256,4096")
CONFIGS = ("triton.w4frag:BM8.BK128.SK9.P1.R1.L1", "triton.w4frag:BM8.BK128.SK12.P1.R1.L1",
           "triton.w4frag:BM8.BK128.SK6.P1.R1.L1", "triton.w4frag:BM8.BK128.SK3.P1.R1.L1",
           "triton.w4frag:BM8.BK128.SK2.P1.R1.L1", "triton.w4frag:BM8.BK128.SK1.P1.R0.L1",
           "triton.w4frag:BM16.BK256.SK1.P1.R0.L1", "triton.w4frag:BM16.BK128.SK9.P1.R1.L1",
           "triton.w4frag:BM16.BK256.SK9.P1.R1.L1")

# Where each code of a word puts its 3 magnitude bits (from the bit given) and its sign bit:
# register i of the decode holds codes 2 i (low half) and 2 i + 1 (high half), as the PRMT
# decode's registers do.
PLACES = ((6, 15), (22, 31), (3, 12), (19, 28), (0, 14), (16, 30), (9, 13), (25, 29))

# $4 a word so placed -> $0-$3 bf16 pairs: register 0 the word masked; 1 shifted left 3; 2 the
# magnitudes shifted left 6, the signs left 1; 3 the magnitudes right 3, the signs left 2
# (left shifts as multiplies: the FMA pipe, not the ALU's); then times 2^126 (0x7E80).
BITS_TO_BF16_ASM = gl.constexpr("""{
.reg .b32 a, b, t, c;
mov.b32 c, 0x7E807E80;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, c;
mul.lo.u32 a, $4, 8;
and.b32 t, a, 0x81C081C0;
mul.rn.bf16x2 $1, t, c;
mul.lo.u32 a, $4, 64;
mul.lo.u32 b, $4, 2;
and.b32 t, a, 0x01C001C0;
lop3.b32 t, t, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $2, t, c;
shr.b32 a, $4, 3;
mul.lo.u32 b, $4, 4;
and.b32 t, a, 0x01C001C0;
lop3.b32 t, t, b, 0x80008000, 0xF8;
mul.rn.bf16x2 $3, t, c;
}""")


@gluon.jit
def bits_to_bf16(words, tables):
    """``gemm_w4frag.e2m1_to_bf16`` for words whose bits are placed by ``place_bits``."""
    r = gl.inline_asm_elementwise(BITS_TO_BF16_ASM, "=r,=r,=r,=r,r", [words],
                                  dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    codes = gl.join(gl.join(_halves(r[0]), _halves(r[1])), gl.join(_halves(r[2]), _halves(r[3])))
    codes = gl.permute(codes, [0, 1, 4, 3, 2])
    return gl.reshape(codes, [words.shape[0], 8 * words.shape[1]])


def place_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes (N, K // 2) uint8 with each 32-bit word's 8 codes moved to ``PLACES``."""
    words = codes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for i, (magnitude, sign) in enumerate(PLACES):
        code = (words >> (4 * i)) & 15
        out |= ((code & 7) << magnitude) | ((code >> 3) << sign)
    return (out - ((out >> 31) << 32)).to(torch.int32).view(torch.uint8).reshape(codes.shape)


def time_shape(m: int, n: int, k: int, configs: list[W4FragConfig], bits: bool) -> list:
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    wq, ws = quant.mxfp4(w)
    w16 = mxfp4.dequantize(wq, ws).to(torch.bfloat16)
    wp = mxfp4.prepack(wq)
    wp = place_bits(wp) if bits else wp
    fitting = [c for c in configs if gemm_w4frag.why_not_fits(c, m, n, k, torch.bfloat16) is None]
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    want = F.linear(x.float(), w16.float())
    for c in fitting:
        gemm_w4frag.launch_gemm_w4frag(x, wp, None, out, None, ws, c)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (c.name, m, n, k, err)
    sets = cold_copies((x, w16, wp, ws), per_op=((0, 1), (0, 2, 3)))
    fns = [lambda s: F.linear(s[0], s[1])] + [
        lambda s, c=c: gemm_w4frag.launch_gemm_w4frag(s[0], s[2], None, out, None, s[3], c)
        for c in fitting]
    times = [t for t, _ in interleaved_graph_us(fns, sets, rounds=10)]
    return [("F.linear", times[0])] + [(c.name, t) for c, t in zip(fitting, times[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", choices=("prmt", "bits"), required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    bits = args.decode == "bits"
    if bits:  # before the first compile: the kernel's global, read when it compiles
        gemm_w4frag.e2m1_to_bf16 = bits_to_bf16
    configs = [W4FragConfig.from_name(name) for name in args.configs]
    assert all(c.packed for c in configs), "the placed bits are the packed layout's words'"
    rows = []
    for text in args.shapes:
        m, n, k = (int(v) for v in text.split(","))
        times = time_shape(m, n, k, configs, bits)
        linear = times[0][1]
        best = min(times[1:], key=lambda nt: nt[1])
        print(f"{m:>3} x {n:>6} x {k:>6}  F.linear {linear:8.2f}  best {best[1]:8.2f} "
              f"({linear / best[1]:.2f}x)  {best[0]}", flush=True)
        rows += [(m, n, k, args.decode, name, f"{t:.3f}", f"{linear:.3f}") for name, t in times]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            table = csv.writer(f)
            table.writerow(["M", "N", "K", "decode", "kernel", "us", "linear_us"])
            table.writerows(rows)


if __name__ == "__main__":
    main()
