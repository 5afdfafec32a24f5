"""How fast the fused MoE's row quantiser (``moe_quant.quant_rows``: one FP8 scale per row) runs
a decode step's activations, by warps and by how much of the row a program holds: each variant
a single launch timed under CUDA-graph replay (median of 50 replays of a graph of 20 launches).

    PYTHONPATH=src python3 benchmarks/quant_rows_probe.py [--out DIR]

Rows: (tokens, width) of qwen3-30b-a3b (2048), mixtral (4096) and deepseek-v3 (7168) at 1 and 8
tokens. Columns: ``default`` (what quant_rows launches), ``wN`` (the whole row in registers,
N warps), ``passes_B`` (the row in two passes of B values, 4 warps), ``chunksC`` (C programs
a row, each measuring all of it and dividing 1/C, 16 warps), ``before`` (one program a row,
warps by width: quant_rows without chunks) and ``empty`` (a launch that does nothing: the
floor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from gemmtune.kernels.triton import _checks, moe_quant
from gemmtune.measure.timing import graph_replay_us

WIDTHS = (2048, 4096, 7168)
TOKENS = (1, 8)
WARPS = (4, 8, 16, 32)
PASS_BLOCKS = (1024, 2048)
CHUNKS = (2, 4, 8)


@triton.jit
def _empty(x_ptr):
    if tl.program_id(0) < 0:  # never: a launch that does nothing
        tl.store(x_ptr, 0.0)


def _variant(x, q, scale, num_warps: int, block_d: int, chunks: int = 1):
    """quant_rows' launch with its warps, block and chunks chosen here."""
    rows, dim = x.shape
    one_tile = block_d >= dim

    def call(_):
        _checks.start(moe_quant.quant_rows_kernel, (rows, 1, chunks), False,
                      launch_pdl=moe_quant.PDL)(
            x, q, scale, scale, scale, dim, dim, x.stride(0), x.stride(1), q.stride(0), 1, 0,
            FP8_MAX=moe_quant.FP8_MAX, AMAX_FLOOR=moe_quant.AMAX_FLOOR, SCALE_GIVEN=False,
            WRITE_Q=True, ROUTED=0, ROUTED_BLOCK_M=1, GATED=False, ACT=0, PDL=moe_quant.PDL,
            ONE_TILE=one_tile, BLOCK_D=block_d, CHUNKS=chunks, num_warps=num_warps)
    return call


def probe(tokens: int, width: int) -> dict[str, float]:
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(tokens, width, device="cuda", dtype=torch.float8_e4m3fn)
    scale = torch.empty(tokens, device="cuda")
    whole = triton.next_power_of_2(width)
    calls = {"default": lambda _: moe_quant.quant_rows(x)}
    calls.update({f"w{w}": _variant(x, q, scale, w, whole) for w in WARPS})
    calls.update({f"passes_{b}": _variant(x, q, scale, 4, b) for b in PASS_BLOCKS if b < width})
    calls.update({f"chunks{c}": _variant(x, q, scale, 16, whole, c) for c in CHUNKS})
    calls["before"] = _variant(x, q, scale, min(16, max(4, whole // 512)), whole)
    calls["empty"] = lambda _: _empty[(1,)](x)
    found = {}
    for name, call in calls.items():
        call(None)  # compile outside the capture
        torch.cuda.synchronize()
        found[name] = graph_replay_us(call, [None], replays=50)[0]
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "quant_rows_probe.jsonl", "a") as f:
        for tokens in TOKENS:
            for width in WIDTHS:
                found = probe(tokens, width)
                print(f"T={tokens} D={width}: "
                      + "  ".join(f"{name} {us:.2f}" for name, us in found.items()))
                f.write(json.dumps({"tokens": tokens, "width": width, **found}) + "\n")


if __name__ == "__main__":
    main()
