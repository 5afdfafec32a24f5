"""Does a pre-shuffled FP8 weight layout make decode GEMMs faster in Triton? (issue 15, item 2)

The `a8w8_bpreshuffle` family would pack each FP8 weight once into the layout our decode kernels
read fastest. Before building it, this measures what a layout buys the two decode designs,
with everything else equal: one kernel whose only variable is where each weight element lies.

Layouts of w (N, K) fp8, N % 16 == 0 and K % 128 == 0:
- ``row``: as stored (row-major).
- ``tile``: 16 rows x 128 bytes tiles, each contiguous (2 KiB), the tiles of a 16-row band
  consecutive along K: a program's step is BLOCK_N / 16 contiguous runs of 16 x BLOCK_K bytes.
- ``frag``: the order of an mma.sync m16n8k32 A fragment (w's rows as the MMA's M): per 16 x 32
  tile, lane l of a warp holds 16 contiguous bytes, rows l // 4 and l // 4 + 8, columns
  (l % 4) * 4 + {0..3} and + 16. Read here element by element (4 contiguous bytes at most);
  what it could give a kernel that loads fragments straight into registers (Gluon, CUTLASS)
  this probe cannot show.

Kernels (fp32 atomics sum the K splits into y (M, N); a probe, not a product):
- ``dot``: y.T tile = w tile (BLOCK_N, BLOCK_K) @ x tile.T, the swapped split-K dot's shape;
- ``gemv``: M = 1 on the CUDA cores, products kept in w's layout and reduced once at the end.
Each is timed at a few (BLOCK_N, BLOCK_K, split) per layout (best kept) beside torch._scaled_mm,
as CUDA-graph replays over weight copies exceeding L2, interleaved; every variant's result is
checked against the fp32 reference first.

    PYTHONPATH=src python3 benchmarks/preshuffle_probe.py [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/preshuffle_probe.py --check  # CPU
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

LAYOUTS = {"row": 0, "tile": 1, "frag": 2}
# Narrow or long-K decode weights, where the swapped dot is furthest from the floor (session 17),
# and two wide ones.
SHAPES = ((1280, 8192), (2048, 8192), (1536, 7168), (576, 7168), (4096, 14336), (5120, 25600),
          (16384, 4096), (7168, 2048))
MS = (1, 16, 32, 64)


def shuffle(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w`` (N, K) in ``layout``, as a flat tensor of the same bytes."""
    n, k = w.shape
    if layout == "row":
        return w.contiguous().view(-1)
    if layout == "tile":  # (N/16, K/128, 16, 128)
        return w.view(n // 16, 16, k // 128, 128).permute(0, 2, 1, 3).contiguous().view(-1)
    # frag: n = band*16 + rh*8 + g, k = kt*32 + ch*16 + t*4 + b; stored (band, kt, g, t, ch, rh, b)
    v = w.view(torch.uint8).view(n // 16, 2, 8, k // 32, 2, 4, 4)  # band, rh, g, kt, ch, t, b
    return v.permute(0, 3, 2, 5, 4, 1, 6).contiguous().view(-1).view(w.dtype)


@triton.jit
def _w_offsets(offs_n, ks, K, LAYOUT: tl.constexpr):
    """Element offsets of w[offs_n, ks] (a (BLOCK_N, BLOCK_K) tile) in the layout."""
    n = offs_n.to(tl.int64)[:, None]
    k = ks.to(tl.int64)[None, :]
    if LAYOUT == 0:
        return n * K + k
    elif LAYOUT == 1:
        n_part = (n // 16) * 16 * K + (n % 16) * 128
        k_part = (k // 128) * 2048 + k % 128
        return n_part + k_part
    else:
        n_part = (n // 16) * 16 * K + (n % 8) * 64 + ((n % 16) // 8) * 4
        k_part = (k // 32) * 512 + ((k % 16) // 4) * 16 + ((k % 32) // 16) * 8 + k % 4
        return n_part + k_part


@triton.jit
def _probe_kernel(x_ptr, w_ptr, y_ptr, M, N, K, steps_per_split,
                  LAYOUT: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        products = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for step in range(split * steps_per_split, (split + 1) * steps_per_split):
        ks = step * BLOCK_K + offs_k
        w = tl.load(w_ptr + _w_offsets(offs_n, ks, K, LAYOUT))  # N, K multiples of the blocks
        if DOT:
            x = tl.load(x_ptr + offs_m[:, None] * K + ks[None, :], mask=offs_m[:, None] < M,
                        other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            x = tl.load(x_ptr + ks)
            products += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if DOT:
        tl.atomic_add(y_ptr + offs_m[None, :] * N + offs_n[:, None], acc,
                      mask=offs_m[None, :] < M, sem="relaxed")
    else:
        tl.atomic_add(y_ptr + offs_n, tl.sum(products, axis=1), sem="relaxed")


class Variant:
    def __init__(self, layout: str, dot: bool, block_n: int, block_k: int, split: int, m: int,
                 n: int, k: int):
        self.layout, self.dot = layout, dot
        self.block_n, self.block_k, self.split = block_n, block_k, split
        self.block_m = max(16, triton.next_power_of_2(m)) if dot else 1
        self.steps = k // block_k // split
        self.grid = (n // block_n, split)
        self.name = (f"{'dot' if dot else 'gemv'}.{layout}.BN{block_n}.BK{block_k}.SK{split}")

    def __call__(self, x, w, y):
        y.zero_()
        m, k = x.shape
        _probe_kernel[self.grid](x, w, y, m, y.shape[-1], k, self.steps, LAYOUTS[self.layout],
                                 self.dot, self.block_m, self.block_n, self.block_k,
                                 num_warps=4, num_stages=4 if self.dot else 1)
        return y


def variants(m: int, n: int, k: int, sms: int) -> list[Variant]:
    found = []
    for layout in LAYOUTS:
        for dot, block_n, block_k in ((True, 64, 128), (True, 64, 256), (True, 128, 128),
                                      (False, 16, 512), (False, 16, 1024), (False, 32, 512)):
            if not dot and m != 1:
                continue
            if n % block_n or k % block_k:
                continue
            tiles, steps = n // block_n, k // block_k
            for per_sm in (1, 4):  # splits for about one or four programs per SM
                split = max(1, min(steps, -(-per_sm * sms // tiles)))
                while steps % split:
                    split -= 1
                found.append(Variant(layout, dot, block_n, block_k, split, m, n, k))
    return list({v.name: v for v in found}.values())


def checked(v: Variant, x, w_by_layout, ref) -> bool:
    """The variant's result within 1e-2 of the reference (the wgmma dots accumulate FP8 with
    reduced precision over a split: up to 4e-3 at long K, session 18)."""
    y = torch.full_like(ref, float("nan"))
    v(x, w_by_layout[v.layout], y)
    return bool(torch.isfinite(y).all()) and float((y - ref).norm() / ref.norm()) < 1e-2


def check_fragment_order(w: torch.Tensor) -> None:
    """``frag`` is PTX's m16n8k32 A-fragment order: lane l's 16 bytes are a0..a3 = rows
    (l // 4, l // 4 + 8) x columns (l % 4) * 4 + {0..3}, then the same 16 columns on."""
    tile = shuffle(w, "frag").view(torch.uint8)[:512].view(32, 16)
    u8 = w.view(torch.uint8)
    for lane in (0, 1, 5, 31):
        g, c = lane // 4, (lane % 4) * 4
        want = torch.cat([u8[g, c:c + 4], u8[g + 8, c:c + 4], u8[g, c + 16:c + 20],
                          u8[g + 8, c + 16:c + 20]])
        assert torch.equal(tile[lane], want), lane


def check_on_cpu() -> None:
    """The three layouts' addressing against a plain matmul, in the interpreter, small sizes."""
    gen = torch.Generator().manual_seed(0)
    n, k = 32, 256
    w = (torch.randn(n, k, generator=gen) / 4).to(torch.float8_e4m3fn)
    check_fragment_order(w)
    shuffled = {layout: shuffle(w, layout) for layout in LAYOUTS}
    for layout in ("tile", "frag"):  # a layout that moved nothing would pass below trivially
        assert not torch.equal(shuffled[layout].view(torch.uint8),
                               shuffled["row"].view(torch.uint8))
    for m in (1, 5):
        x = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
        ref = x.float() @ w.float().T
        for layout in LAYOUTS:
            for dot, block_n in ((True, 16), (False, 16), (False, 32)):
                if not dot and m != 1:
                    continue
                v = Variant(layout, dot, block_n, 128, 2, m, n, k)
                assert checked(v, x, shuffled, ref), v.name
        print(f"m={m}: every layout matches the reference")


def best_by_kind(entries, times) -> dict:
    """{kind: (µs, name)} of the fastest entry of each kind; ``entries`` (kind, name) pairs in
    the order of ``times``."""
    best = {}
    for (kind, name), t in zip(entries, times):
        if kind not in best or t < best[kind][0]:
            best[kind] = (t, name)
    return best


def write_rows(rows: list[dict], path: Path) -> None:
    fields = sorted({f for r in rows for f in r}, key=lambda f: (f not in ("M", "N", "K"), f))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def print_ratios(rows: list[dict], title: str, pairs: dict[str, tuple[str, str]]) -> None:
    """Per label, the geometric mean (min, max) over the rows of field / baseline field."""
    print(f"\n{title}")
    for label, (field, base) in pairs.items():
        ratios = [r[field] / r[base] for r in rows if field in r and base in r]
        if ratios:
            gm = statistics.geometric_mean(ratios)
            print(f"  {label}: {gm:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
                  f"{len(ratios)} shapes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--check", action="store_true", help="check the addressing (CPU)")
    args = parser.parse_args()
    if args.check:
        check_on_cpu()
        return
    from gemmtune.kernels.torch_ref import scaled_mm_torch
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen, device="cuda") / 8).to(torch.float8_e4m3fn)
        copies = copies_to_exceed_l2(n * k)
        weights = [{layout: shuffle(w.clone() if i else w, layout) for layout in LAYOUTS}
                   for i in range(copies)]
        for m in MS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            ref = x.float() @ w.float().T
            y = torch.empty(m, n, device="cuda")
            one = torch.ones(1, device="cuda")
            good = [v for v in variants(m, n, k, sms) if checked(v, x, weights[0], ref)]
            fns = [lambda ws, v=v: v(x, ws[v.layout], y) for v in good]
            fns.append(lambda ws: scaled_mm_torch(x, ws["row"].view(n, k), None, torch.bfloat16,
                                                  one, one))
            times = [t for t, _ in interleaved_graph_us(fns, weights, rounds=9, replays=2)]
            best = best_by_kind([(("dot" if v.dot else "gemv", v.layout), v.name) for v in good],
                                times)
            rec = {"M": m, "N": n, "K": k, "scaled_mm_us": times[-1]}
            for (kind, layout), (t, name) in best.items():
                rec[f"{kind}_{layout}_us"], rec[f"{kind}_{layout}_cfg"] = t, name
            rows.append(rec)
            print(f"{m:>3}x{n}x{k}: scaled_mm {times[-1]:7.2f} us | " + " | ".join(
                f"{kind}.{layout} {t:7.2f}" for (kind, layout), (t, _) in sorted(best.items())),
                flush=True)
    write_rows(rows, args.out / "preshuffle_probe.csv")
    print_ratios(rows, "layout / row time, geomean over shapes (below 1: the layout is faster)",
                 {f"{kind}.{layout}": (f"{kind}_{layout}_us", f"{kind}_row_us")
                  for kind in ("dot", "gemv") for layout in ("tile", "frag")})


if __name__ == "__main__":
    main()
