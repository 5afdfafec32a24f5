"""How fast one launch can read what a decode MoE must read: the routed experts' w1 and w2, and
nothing else (a sum, no GEMM), under CUDA-graph replay with cold weights. That time, beside the
floor (bytes / streaming-read bandwidth + t_launch), says how much of a kernel's distance from
the floor any kernel pays at this size (ramp-up, tail), and how much is the kernel's own.

    PYTHONPATH=src python3 benchmarks/moe_read_probe.py [--model NAME] [--tp N] [--tokens 1,4]
        [--out DIR]

Variants: programs reading contiguous chunks of each routed expert's weights (one launch for
w1 and w2, or two), chunk sizes 64-512 KiB; torch's ``sum`` over a contiguous buffer of the
same bytes. Then each matrix alone (w1 as stage 1 reads it, w2 as stage 2 does) in the stages'
own pattern: a program per (expert, tile of rows), the rows in steps of ``BK`` columns through
``tl.dot`` (so Triton pipelines the loads, ``S`` stages), loaded plainly or through TMA. And
the reads of a 1-stage design that never waits: a program per (expert, chunk of inter_dim)
reading the chunk's w1 rows, then the same columns of w2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from gemmtune.bench import write_records
from gemmtune.families.fmoe.inputs import route
from gemmtune.kernels.problem import MoeProblem
from gemmtune.measure.ceilings import floors, measure_ceilings
from gemmtune.measure.timing import graph_replay_us
from gemmtune.models.shapes import preset_moe_shape

TOKENS = (1, 4)
BLOCK = 4096  # elements per load step: 8 KiB of bf16 per program per step


@triton.jit
def read_experts_kernel(w1_ptr, w2_ptr, experts_ptr, sink_ptr, n_experts, w1_numel, w2_numel,
                        chunks1, chunks2, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums one CHUNK of one routed expert's w1 (the first n_experts * chunks1
    programs) or w2 (the rest)."""
    pid = tl.program_id(0)
    if pid < n_experts * chunks1:
        e = tl.load(experts_ptr + pid // chunks1).to(tl.int64)
        base = w1_ptr + e * w1_numel
        start = (pid % chunks1) * CHUNK
        numel = w1_numel
    else:
        q = pid - n_experts * chunks1
        e = tl.load(experts_ptr + q // chunks2).to(tl.int64)
        base = w2_ptr + e * w2_numel
        start = (q % chunks2) * CHUNK
        numel = w2_numel
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK):
        idx = start + i + offs
        acc += tl.load(base + idx, mask=idx < numel, other=0.0).to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc))


def read_experts(w1, w2, experts, sink, chunk: int, warps: int, parts: str):
    """Sum the routed experts' weights: ``parts`` "w1+w2" in one launch, "w1" or "w2" alone."""
    n = experts.numel()
    w1_numel, w2_numel = w1[0].numel(), w2[0].numel()
    chunks1 = triton.cdiv(w1_numel, chunk) if "w1" in parts else 0
    chunks2 = triton.cdiv(w2_numel, chunk) if "w2" in parts else 0
    read_experts_kernel[(n * (chunks1 + chunks2),)](
        w1, w2, experts, sink, n, w1_numel, w2_numel, chunks1, chunks2, CHUNK=chunk,
        BLOCK=BLOCK, num_warps=warps)


@triton.jit
def read_tiles_kernel(w_ptr, w_desc, experts_ptr, sink_ptr, R, K, tiles,
                      ROWS: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """Program (expert, tile) reads rows [tile * ROWS, +ROWS) of expert e's (R, K) matrix in
    steps of BK columns, as a stage kernel does, into a dot with ones."""
    pid = tl.program_id(0)
    e = tl.load(experts_ptr + pid // tiles).to(tl.int64)
    row0 = (pid % tiles) * ROWS
    offs_r = row0 + tl.arange(0, ROWS)
    offs_k = tl.arange(0, BK)
    ptrs = w_ptr + e * R * K + offs_r[:, None].to(tl.int64) * K + offs_k[None, :]
    ones = tl.full((16, BK), 1.0, dtype=w_ptr.dtype.element_ty)
    acc = tl.zeros((16, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if TMA:
            w = w_desc.load([(e * R + row0).to(tl.int32), k0])
        else:
            w = tl.load(ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            ptrs += BK
        acc = tl.dot(ones, tl.trans(w), acc)
    tl.store(sink_ptr + pid, tl.sum(acc))


def read_tiles(w, experts, sink, rows: int, bk: int, stages: int, tma: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, R, K = w.shape
    tiles = triton.cdiv(R, rows)
    desc = TensorDescriptor.from_tensor(w.view(E * R, K), [rows, bk]) if tma else None
    read_tiles_kernel[(experts.numel() * tiles,)](
        w, desc, experts, sink, R, K, tiles, ROWS=rows, BK=bk, TMA=tma, num_warps=4,
        num_stages=stages)


@triton.jit
def read_chunk_pairs_kernel(w1_ptr, w2_ptr, experts_ptr, sink_ptr, D, I, tiles,
                            BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """Program (expert, chunk) reads what a stage-2-without-waiting design would: the chunk's
    BN gate and BN up rows of w1 (steps of BK columns), then the same BN columns of w2, every
    row of it (steps of BD rows): no program waits for another."""
    pid = tl.program_id(0)
    e = tl.load(experts_ptr + pid // tiles).to(tl.int64)
    n0 = (pid % tiles) * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    gate = w1_ptr + e * 2 * I * D + offs_n[:, None].to(tl.int64) * D + offs_k[None, :]
    up = gate + I * D
    ones = tl.full((16, BK), 1.0, dtype=w1_ptr.dtype.element_ty)
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        inside = offs_k[None, :] < D - k0
        acc = tl.dot(ones, tl.trans(tl.load(gate, mask=inside, other=0.0)), acc)
        acc = tl.dot(ones, tl.trans(tl.load(up, mask=inside, other=0.0)), acc)
        gate += BK
        up += BK
    h = acc.to(w2_ptr.dtype.element_ty)  # (16, BN)
    offs_d = tl.arange(0, BD)
    down = w2_ptr + e * D * I + offs_d[None, :].to(tl.int64) * I + offs_n[:, None]  # (BN, BD)
    total = tl.zeros((16, BD), dtype=tl.float32)
    for d0 in range(0, D, BD):
        total += tl.dot(h, tl.load(down, mask=offs_d[None, :] < D - d0, other=0.0))
        down += BD * I
    tl.store(sink_ptr + pid, tl.sum(total))


def read_chunk_pairs(w1, w2, experts, sink, bn: int, stages: int):
    E, D, I = w2.shape
    tiles = triton.cdiv(I, bn)
    read_chunk_pairs_kernel[(experts.numel() * tiles,)](
        w1, w2, experts, sink, D, I, tiles, BN=bn, BK=128, BD=128, num_warps=4,
        num_stages=stages)


TILE_VARIANTS = [(rows, bk, stages, tma) for tma in (False, True) for rows in (32, 64)
                 for bk in (128,) for stages in (3, 4, 6)] + [(128, 64, 4, False),
                                                             (128, 64, 4, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a model preset (gemmtune shapes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: one rank's experts")
    p.add_argument("--out", default="out")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = p.parse_args()
    shape, label = preset_moe_shape(args.model, args.tp)
    model_dim, inter_dim = shape.model_dim, shape.inter_dim
    n_experts, topk = shape.expert, shape.topk
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceilings = measure_ceilings(lambda: square @ square, 2 * 8192 ** 3)
    w1 = torch.randn(n_experts, 2 * inter_dim, model_dim, device="cuda").bfloat16()
    w2 = torch.randn(n_experts, model_dim, inter_dim, device="cuda").bfloat16()
    sink = torch.empty(1 << 20, device="cuda")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        # Routings of distinct experts in turn: each replay reads experts the last one did not.
        sets = []
        for _ in range(4):
            ids = route(MoeProblem(tokens, model_dim, inter_dim, n_experts, topk,
                                   torch.bfloat16), "uniform", gen)
            sets.append(torch.unique(ids))
        used = sets[0].numel()
        nbytes = used * 3 * inter_dim * model_dim * 2
        floor = floors(0.0, nbytes, ceilings).attainable_us
        timed = {}
        floor_of = {}
        for chunk in (32768, 65536, 131072, 262144):
            for warps in (4, 8):
                timed[f"one launch c{chunk // 512}K w{warps}"] = (
                    lambda s, c=chunk, w=warps: read_experts(w1, w2, s, sink, c, w, "w1+w2"))
        for chunk in (65536, 131072):
            timed[f"two launches c{chunk // 512}K w4"] = (
                lambda s, c=chunk: (read_experts(w1, w2, s, sink, c, 4, "w1"),
                                    read_experts(w1, w2, s, sink, c, 4, "w2")))
        flat = [torch.randn(nbytes // 2, device="cuda").bfloat16() for _ in range(2)]
        us = {name: graph_replay_us(fn, sets, replays=30)[0] for name, fn in timed.items()}
        us["torch sum, contiguous"] = graph_replay_us(lambda b: b.sum(dtype=torch.float32),
                                                      flat, replays=30)[0]
        for bn in (16, 32, 64):
            for stages in (3, 4):
                name = f"no-wait chunks: w1 rows + w2 columns BN{bn} S{stages}"
                us[name] = graph_replay_us(
                    lambda s, a=(bn, stages): read_chunk_pairs(w1, w2, s, sink, *a), sets,
                    replays=30)[0]
        for matrix, w in (("w1", w1), ("w2", w2)):
            alone = floors(0.0, nbytes * (2 if matrix == "w1" else 1) / 3, ceilings).attainable_us
            for tile_rows, bk, stages, tma in TILE_VARIANTS:
                name = (f"{matrix} alone, {'TMA' if tma else 'plain'} R{tile_rows} BK{bk} "
                        f"S{stages}")
                args_ = (w, tile_rows, bk, stages, tma)
                us[name] = graph_replay_us(
                    lambda s, a=args_: read_tiles(a[0], s, sink, *a[1:]), sets, replays=30)[0]
                floor_of[name] = alone
            name = f"{matrix} alone, chunks c64K w8"
            us[name] = graph_replay_us(
                lambda s, m=matrix: read_experts(w1, w2, s, sink, 32768, 8, m), sets,
                replays=30)[0]
            floor_of[name] = alone
        for name, t in us.items():
            rows.append(dict(model=label, tokens=tokens, experts=used, mbytes=nbytes / 1e6,
                             variant=name, us=round(t, 2),
                             floor_us=round(floor_of.get(name, floor), 2),
                             eff=round(floor_of.get(name, floor) / t, 3)))
    write_records(rows, Path(args.out) / f"moe_read_probe_{label}.csv")
    print(f"{ceilings.bytes_per_s / 1e9:.0f} GB/s, t_launch {ceilings.launch_us:.2f} us")
    print(f"{'T':>3} {'MB':>6} {'floor':>7} {'us':>7} {'eff':>6}  variant")
    for r in rows:
        print(f"{r['tokens']:>3} {r['mbytes']:6.1f} {r['floor_us']:7.2f} {r['us']:7.2f} "
              f"{r['eff']:6.3f}  {r['variant']}")


if __name__ == "__main__":
    main()
