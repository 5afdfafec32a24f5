"""Where does ``triton.frag``'s time go against the register-direct probe it came from? (issue 15)

The first tune of the register-direct kernel (session 20, call 3) ran 1.3-2.8x slower than
``benchmarks/gluon_frag_probe.py``'s kernel on the same shapes, though their K loops then
compiled to the same loads, byte shuffles and MMAs. What differed was around the loop: the
tuned configs launch with PDL, and a split of K ends in a deterministic sum (partials stored, a
counter, the last program loads them all) where the probe adds into a zeroed fp32 output
atomically (plus a memset launch). This times, in one run per shape (interleaved CUDA-graph
replays over weight copies exceeding L2), with one step ahead, BK 128 and 256 and the splits
that give 1, 2 and 4 programs per SM:

- ``frag.P0`` / ``frag.P1``: gemm_frag on ``gemmtune.quant.shuffle_weight``'s layout without
  and with PDL;
- ``probe``: the probe's kernel on its fragment order, same step and split;

every result checked against the fp32 reference first.

    PYTHONPATH=src python3 benchmarks/frag_split_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from gluon_frag_probe import Variant as ProbeVariant
from preshuffle_probe import shuffle, write_rows

CASES = ((16, 576, 7168), (16, 1280, 8192), (16, 4096, 512), (16, 7168, 2048),
         (16, 28672, 4096), (16, 4096, 14336), (1, 576, 7168), (1, 1280, 8192),
         (64, 1280, 8192), (64, 7168, 2048))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    from gemmtune import quant
    from gemmtune.kernels.triton._splits import split_for
    from gemmtune.kernels.triton.gemm_frag import MAX_SPLIT_K, FragConfig, block_m_for, gemm_frag
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, n, k in CASES:
        gen = torch.Generator(device="cuda").manual_seed(n + k + m)
        w = (torch.randn(n, k, generator=gen, device="cuda") / 8).to(torch.float8_e4m3fn)
        # gemm_frag's layout and the probe's fragment order, per copy
        copies = [{"frag": quant.shuffle_weight(c), "probe": shuffle(c, "frag").view(n, k)}
                  for c in [w] + [w.clone() for _ in range(copies_to_exceed_l2(n * k) - 1)]]
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones(1, device="cuda")
        ref = x.float() @ w.float().T
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        y32 = torch.empty(m, n, device="cuda")
        fns, names = [], []
        bm = block_m_for(m)
        for bk in (128, 256):
            tiles = triton.cdiv(n, 64)
            splits = sorted({split_for(tiles, k // bk, per_sm * sms, MAX_SPLIT_K)
                             for per_sm in (1, 2, 4)})
            for split in splits:
                for pdl in (0, 1):
                    cfg = FragConfig(bm, bk, split, 1, pdl)
                    got = gemm_frag(x, copies[0]["frag"], None, torch.bfloat16, one, one, cfg,
                                    out=torch.full_like(y, float("nan")), w_tiled=True)
                    if float((got.float() - ref).norm() / ref.norm()) < 1e-2:
                        fns.append(lambda c, cfg=cfg: gemm_frag(x, c["frag"], None,
                                                                torch.bfloat16, one, one, cfg,
                                                                out=y, w_tiled=True))
                        names.append(f"frag.P{pdl}.BK{bk}.SK{split}")
                    else:
                        print(f"{m}x{n}x{k} {cfg.name}: wrong", flush=True)
                if k // bk % split == 0 and m <= 64:
                    v = ProbeVariant(True, bk, split, m, n, k)
                    got = v(x, copies[0]["probe"], y32)
                    if float((got.float() - ref).norm() / ref.norm()) < 1e-2:
                        fns.append(lambda c, v=v: v(x, c["probe"], y32))
                        names.append(f"probe.BK{bk}.SK{split}")
        times = [t for t, _ in interleaved_graph_us(fns, copies, rounds=9, replays=2)]
        rec = {"M": m, "N": n, "K": k}
        for kind in ("frag.P0", "frag.P1", "probe"):
            found = [(t, nm) for t, nm in zip(times, names) if nm.startswith(kind + ".")]
            if found:
                rec[f"{kind}_us"], rec[f"{kind}_cfg"] = min(found)
        rows.append(rec)
        print(f"{m:>3}x{n}x{k}: " + " | ".join(
            f"{kind} {rec[f'{kind}_us']:7.2f} {rec[f'{kind}_cfg']}"
            for kind in ("frag.P0", "frag.P1", "probe") if f"{kind}_us" in rec), flush=True)
        for t, nm in sorted(zip(times, names)):
            print(f"      {nm:28s} {t:8.2f}", flush=True)
    write_rows(rows, args.out / "frag_split_probe.csv")


if __name__ == "__main__":
    main()
